package flow_test

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestRepliesMissingAtALossyPodTapAreNoVerdict: the scenario's first
// connection got replies on the uplink and none at its Pod's eth0 tap:
// lost on the node (REPLY no, replies_lost_on_node). When that Pod's tap
// lost frames (its ring's kernel_drops, CaptureLost), its silence proves
// nothing: the ring may have dropped the replies the client got, and a
// reply the client got would read as REPLY no. The flow is then judged by
// what was seen, as before the node-loss rule: the uplink's replies.
func TestRepliesMissingAtALossyPodTapAreNoVerdict(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "netfilter-reply-lost-on-node.json"))
	if err != nil {
		t.Fatal(err)
	}
	// Without a loss: the scenario's own verdict.
	e := s.Run(nil)
	var lost int
	for _, f := range e.Flows() {
		if f.RepliesLostOnNode > 0 {
			lost++
			if f.Reply {
				t.Errorf("flow %d: replies lost on the node, yet REPLY yes", f.ID)
			}
		}
	}
	if lost != 1 {
		t.Fatalf("want one flow with replies lost on the node without a capture loss, got %d", lost)
	}
	e = s.Run(nil)
	e.CaptureLost(obs.PointPod)
	for _, f := range e.Flows() {
		if f.RepliesLostOnNode > 0 || !f.Reply {
			t.Errorf("flow %d (%s): the Pod's tap lost frames, yet replies_lost_on_node %d, reply %v: %s", f.ID, f.Client, f.RepliesLostOnNode, f.Reply, f.Reason)
		}
	}
}

// TestReplyAtALossyPodTapIsAReply: a reply the client's Pod's eth0 tap saw
// come in reached the client, whatever else that tap lost. In the
// scenario a netdev chain at the uplink's ingress drops every other answer
// of flow 1 before the netfilter observer, which sees only the others:
// once the Pod's tap lost frames its replies must not be weighed against
// that observer (as many dropped as it saw: REPLY no). Flow 2, whose
// answers were all dropped, stays REPLY no.
func TestReplyAtALossyPodTapIsAReply(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "kernel-drops-replies-before-observers-pod.json"))
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	e.CaptureLost(obs.PointPod)
	flows := e.Flows()
	if len(flows) != 2 {
		t.Fatalf("want 2 flows, got %d", len(flows))
	}
	for _, f := range flows {
		if want := f.Client.Port() == 40000; f.Reply != want {
			t.Errorf("flow %d (%s): the Pod's tap lost frames, reply %v, want %v: %s", f.ID, f.Client, f.Reply, want, f.Reason)
		}
	}
}

// TestNodeSynAckLostNeedsALosslessUplink: a node process's SYN-ACK is
// judged lost on the node by the ACK that no point saw; once the uplink's
// tap lost frames, its silence proves nothing (its ring may have dropped
// the ACK): the flow keeps the reply the uplink saw.
func TestNodeSynAckLostNeedsALosslessUplink(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "netfilter-node-synack-lost.json"))
	if err != nil {
		t.Fatal(err)
	}
	lost := 0
	for _, f := range s.Run(nil).Flows() {
		if f.RepliesLostOnNode > 0 {
			lost++
		}
	}
	if lost != 1 {
		t.Fatalf("want one flow with its SYN-ACK lost on the node without a capture loss, got %d", lost)
	}
	e := s.Run(nil)
	e.CaptureLost(obs.PointUplink)
	for _, f := range e.Flows() {
		if f.RepliesLostOnNode > 0 || !f.Reply {
			t.Errorf("flow %d (%s): the uplink's tap lost frames, yet replies_lost_on_node %d, reply %v: %s", f.ID, f.Client, f.RepliesLostOnNode, f.Reply, f.Reason)
		}
	}
}

// TestConnectAloneAfterLostWatches: a socket seen at its connect() alone
// (no SYN_SENT, no first packet at its egress) failed before any packet,
// unless the kernel observers lost socket watches during the run
// (kernel_learn_errors, WatchesLost): then its first packet may have gone
// untied to it, and the reason says so rather than blame the kernel.
func TestConnectAloneAfterLostWatches(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "node-client-no-route.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, lost := range []bool{false, true} {
		e := s.Run(nil)
		if lost {
			e.WatchesLost()
		}
		flows := e.Flows()
		if len(flows) == 0 {
			t.Fatal("no flows")
		}
		for _, f := range flows {
			blamed := strings.Contains(f.Reason, "kernel_learn_errors")
			if blamed != lost {
				t.Errorf("watches lost %v: flow %d (%s %s): %s", lost, f.ID, f.Proto, f.Service, f.Reason)
			}
		}
	}
}

// TestRedirectBeforeReadySaysSo: a request the tc head saw with the VIP
// and no later point saw, answered by its backend, is a redirect at tc:
// the uplink's tap never saw it. When the flow began before every tap was
// open (a run's first flows), the reason says that the uplink's silence
// may be its tap's, not assert the redirect alone.
func TestRedirectBeforeReadySaysSo(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "tc-redirect-bpf-snat.json"))
	if err != nil {
		t.Fatal(err)
	}
	s.Config.Ready = flowtest.At(1000) // after every observation
	redirected := 0
	for _, f := range s.Run(nil).Flows() {
		if f.RewrittenAt != flow.PlaceTC {
			continue
		}
		redirected++
		if !strings.Contains(f.Reason, "began before pathtrace was in place") {
			t.Errorf("flow %d (%s) began before the taps were in place, yet its reason does not say so: %s", f.ID, f.Client, f.Reason)
		}
	}
	if redirected != 1 {
		t.Errorf("%d flows redirected at tc, want the scenario's one", redirected)
	}
}
