package main

import (
	"fmt"
	"strings"
	"testing"
)

// TestObserverRowsFoldManyPlaces: an observer with one status at more than
// maxSameRows places takes one row naming how many; fewer keep a row each,
// in first-seen order; a different status is never folded in.
func TestObserverRowsFoldManyPlaces(t *testing.T) {
	var statuses []observerStatus
	for i := range 5 {
		statuses = append(statuses, observerStatus{Observer: "af_packet pod", Where: fmt.Sprintf("eth0 in pod%d", i), Attached: true})
	}
	statuses = append(statuses,
		observerStatus{Observer: "af_packet pod", Where: "eth0 in gone", Error: "interface gone"},
		observerStatus{Observer: "af_packet uplink", Where: "bond0", Attached: true},
		observerStatus{Observer: "tcx ingress head", Where: "veth1", Error: "no tc program"},
		observerStatus{Observer: "tcx ingress head", Where: "veth2", Error: "no tc program"})
	var got []string
	for _, r := range observerRows(statuses) {
		got = append(got, r.observer+" | "+r.where+" | "+r.status)
	}
	want := []string{
		"af_packet pod | 5 places, e.g. eth0 in pod0 (all in --output json) | attached",
		"af_packet pod | eth0 in gone | not attached: interface gone",
		"af_packet uplink | bond0 | attached",
		"tcx ingress head | veth1 | not attached: no tc program",
		"tcx ingress head | veth2 | not attached: no tc program",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("rows:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
