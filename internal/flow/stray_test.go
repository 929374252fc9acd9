package flow_test

import (
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
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

// TestStrayRepliesOfAReusedPortGoToTheLaterFlow: a DNS resolver's socket
// per query reuses its client port; the first query is answered, the
// second (2 s later, another socket) is answered from another port of the
// backend: those answers are the second flow's stray replies, not the
// first's, which was answered and long done.
func TestStrayRepliesOfAReusedPortGoToTheLaterFlow(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "udp-port-reused-new-socket.json"))
	if err != nil {
		t.Fatal(err)
	}
	stray := netip.MustParseAddrPort("10.244.20.31:5354")
	client := netip.MustParseAddrPort("10.244.8.23:51000")
	var kept []obs.Observation
	for _, o := range s.Observations {
		// The second query's replies: answered from another port instead.
		if o.Time.After(flowtest.At(2010.2)) && o.Dst == client {
			if o.Point == obs.PointUplink || o.Point == obs.PointPod {
				o.Src = stray
				kept = append(kept, o)
			}
			continue
		}
		kept = append(kept, o)
	}
	s.Observations = kept
	e := s.Run(nil)
	e.Stopping(flowtest.At(2100)) // the run ends: what nothing claimed is told
	fs := e.Flows()
	if len(fs) != 2 {
		t.Fatalf("got %d flows, want 2: %+v", len(fs), fs)
	}
	first, second := fs[0], fs[1]
	if first.StrayReplies != nil {
		t.Errorf("the first (answered) flow got stray replies %+v", *first.StrayReplies)
	}
	if second.StrayReplies == nil || second.StrayReplies.From != stray {
		t.Errorf("the second flow's stray replies = %+v, want from %s", second.StrayReplies, stray)
	}
	if !first.Reply || second.Reply {
		t.Errorf("reply: first %v, second %v; want true, false", first.Reply, second.Reply)
	}
}

// TestUnclaimedAtTheEndCounted: what still waits for a flow when the run
// stops is counted as unmatched, as it would be had it expired: a run whose
// last seconds are quiet left it in no flow and in no count. Here the
// datagrams a socket LB after the observers sent to a second backend, as a
// kernel whose egress observer did not report them left them.
func TestUnclaimedAtTheEndCounted(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "socket-udp-lb-after-observers-per-datagram.json"))
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	for _, o := range s.Observations {
		if o.Point != obs.PointSockEgress || o.Kind != obs.SockSendmsg {
			e.Add(o)
		}
	}
	if n := e.Summary().Unmatched; n != 0 {
		t.Errorf("unmatched %d while the run goes on, want 0: they may still find their flow", n)
	}
	e.Stopping(flowtest.At(400))
	// Two datagrams to 10.244.20.32:5353 and their answers, each seen at
	// pod, host, nf_before (both ways), nf_after and the uplink (both
	// ways), and conntrack's entry.
	for range 3 {
		if n := e.Summary().Unmatched; n != 19 {
			t.Fatalf("unmatched %d after the run stopped, want 19", n)
		}
	}
}
