package flow_test

import (
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

// TestStrayRepliesAtTheEnd: answers from another port that are still within
// the reorder window when the run stops are told with their flow, once,
// however often the report is asked for.
func TestStrayRepliesAtTheEnd(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-udp-stray-replies.json")
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	for _, o := range s.Observations {
		if o.Time.After(flowtest.At(200)) {
			break // the stray answers are the last observations
		}
		e.Add(o)
	}
	e.Stopping(flowtest.At(200))
	for range 3 {
		e.Summary()
		e.Flows()
	}
	var got *flow.StrayReplies
	for _, f := range e.Flows() {
		if f.Client.String() == "10.244.8.23:51000" {
			got = f.StrayReplies
		}
	}
	if got == nil || got.From.String() != "10.244.20.31:5354" || got.Packets != 2 || got.Point != "uplink" {
		t.Fatalf("stray replies %+v, want 2 packets from 10.244.20.31:5354 counted at the uplink", got)
	}
}
