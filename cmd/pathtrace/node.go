package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// observerStatus is one observer or tap: attached, or why not.
type observerStatus struct {
	Observer string `json:"observer"`
	Where    string `json:"where"`
	Point    string `json:"point,omitempty"`
	Hook     string `json:"hook,omitempty"`
	Prio     int32  `json:"priority,omitempty"`
	Attached bool   `json:"attached"`
	Error    string `json:"error,omitempty"`
	Note     string `json:"note,omitempty"`
}

func observerStatuses(atts []probe.Attachment) []observerStatus {
	out := make([]observerStatus, 0, len(atts))
	for _, a := range atts {
		s := observerStatus{Observer: a.Observer, Where: a.Where, Attached: a.Err == nil, Note: a.Note, Prio: a.Prio}
		if a.Point != 0 {
			s.Point = a.Point.String()
		}
		if a.Prio != 0 {
			s.Hook = a.Hook.String()
		}
		if a.Err != nil {
			s.Error = a.Err.Error()
		}
		out = append(out, s)
	}
	return out
}

// nodeJSON is the node object with the observers appended, "type":"node" first.
func nodeJSON(node *discover.NodeInfo, atts []probe.Attachment) json.RawMessage {
	b, err := json.Marshal(node)
	if err != nil {
		b = []byte(`{"type":"node"}`)
	}
	o, _ := json.Marshal(observerStatuses(atts))
	b = bytes.TrimSuffix(bytes.TrimSpace(b), []byte("}"))
	return append(append(append(b, `,"observers":`...), o...), '}')
}

func writeNodeTable(w io.Writer, node *discover.NodeInfo, atts []probe.Attachment) {
	node.Table(w)
	fmt.Fprintln(w, "\nOBSERVERS")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  OBSERVER\tWHERE\tSTATUS")
	for _, r := range observerRows(observerStatuses(atts)) {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", r.observer, r.where, r.status)
	}
	tw.Flush()
	fmt.Fprintln(w)
}

type observerRow struct{ observer, where, status string }

// maxSameRows is how many places of one observer with one status the table
// lists one by one; beyond, one row stands for them all (a node of a hundred
// Pods has a hundred of each Pod-side observer). The JSON lists every one.
const maxSameRows = 3

// observerRows renders the statuses as table rows, in order, folding the
// places of an observer that share a status into one row when they are many.
func observerRows(statuses []observerStatus) []observerRow {
	var rows []observerRow
	type key struct{ observer, status string }
	groups := map[key][]string{}
	var order []key
	for _, s := range statuses {
		status := "attached"
		if s.Prio != 0 {
			status = fmt.Sprintf("attached (%s priority %d)", s.Hook, s.Prio)
		}
		if !s.Attached {
			status = "not attached: " + s.Error
		}
		if s.Note != "" {
			status += " (" + s.Note + ")"
		}
		k := key{s.Observer, status}
		if groups[k] == nil {
			order = append(order, k)
		}
		groups[k] = append(groups[k], s.Where)
	}
	for _, k := range order {
		places := groups[k]
		if len(places) > maxSameRows {
			rows = append(rows, observerRow{k.observer, fmt.Sprintf("%d places, e.g. %s (all in --output json)", len(places), places[0]), k.status})
			continue
		}
		for _, where := range places {
			rows = append(rows, observerRow{k.observer, where, k.status})
		}
	}
	return rows
}
