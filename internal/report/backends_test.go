package report

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestBackendsSummary: ten flows to a Service of three backends, one
// answering, one refusing, one unreachable: the summary says per backend
// how many flows reached it and how they were answered, and marks the two
// that never answered, so that the failing backend is read in one line
// rather than picked out of the rows.
func TestBackendsSummary(t *testing.T) {
	backends := []string{"10.244.20.31:3000", "10.244.20.31:3001", "10.244.20.77:3000"}
	var flows []flow.Flow
	for i := range 10 {
		f := flow.Flow{ID: i + 1, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.244.8.23:%d", 40000+i)),
			Service: netip.MustParseAddrPort("10.120.0.90:80"), Backend: netip.MustParseAddrPort(backends[i%3]),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip t pre -> b"}
		switch i % 3 {
		case 0:
			f.Reply = true
		case 1:
			f.Refused = true
		case 2:
			f.ICMPError = &flow.ICMPError{Message: "ICMP destination unreachable (code 1: host unreachable)", From: netip.MustParseAddr("10.244.8.1"), Point: "pod"}
		}
		flows = append(flows, f)
	}
	flows = append(flows, flow.Flow{ID: 11, Proto: "tcp", Service: netip.MustParseAddrPort("10.120.0.90:80"), RewrittenAt: flow.PlaceNowhere})
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: 11}, nil, Run{})
	out := b.String()
	_, summary, _ := strings.Cut(out, "REWRITTEN AT  FLOWS")
	for _, want := range []string{
		"10.244.20.31:3000  4      yes 4\n",
		"10.244.20.31:3001  3      rst 3  <- no flow got a reply\n",
		"10.244.20.77:3000  3      icmp 3  <- no flow got a reply\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
	// Rewritten flows whose backend no point saw (a NodePort redirected
	// back out of the uplink with BPF SNAT) are counted with their
	// answers, a refusal among them included.
	b.Reset()
	w = NewWriter(&b, FormatTable)
	unseen := []flow.Flow{flows[0], flows[10]}
	for i, refused := range []bool{false, true, true} {
		unseen = append(unseen, flow.Flow{ID: 12 + i, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("192.168.77.1:%d", 50000+i)),
			Service: netip.MustParseAddrPort("192.168.77.2:30081"), RewrittenAt: flow.PlaceTC, By: "tcx ingress rf (id 8) on the uplink",
			Reply: true, Refused: refused})
	}
	w.Flows(unseen)
	w.Summary(flow.Summary{Flows: 5}, nil, Run{})
	if _, s, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS"); !strings.Contains(s, "(unseen)           3      yes 1, rst 2\n") {
		t.Errorf("summary lacks the flows whose backend was unseen:\n%s", s)
	}
	if strings.Count(summary, "BACKEND") != 1 {
		t.Errorf("want one BACKEND table in the summary:\n%s", summary)
	}
	// No flow reached a backend: no such table.
	b.Reset()
	w = NewWriter(&b, FormatTable)
	w.Flows(flows[10:])
	w.Summary(flow.Summary{Flows: 1}, nil, Run{})
	if _, summary, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS"); strings.Contains(summary, "BACKEND") {
		t.Errorf("a BACKEND table without backends:\n%s", summary)
	}
}

// TestBackendsSummaryRepliesLostOnNode: a backend that answered every flow
// while the node lost the replies on their way to the client (REPLY no,
// replies_lost_on_node) is not marked as one that got no reply, the mark
// of a refusing or unreachable backend: its count says "lost" and the mark
// says where the replies went.
func TestBackendsSummaryRepliesLostOnNode(t *testing.T) {
	vlan := uint16(200)
	var flows []flow.Flow
	for i := range 3 {
		flows = append(flows, flow.Flow{ID: i + 1, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.244.8.23:%d", 40000+i)),
			Service: netip.MustParseAddrPort("10.120.0.90:80"), Backend: netip.MustParseAddrPort("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip t pre -> b", VLAN: &vlan, RepliesLostOnNode: 2, Reason: "replies lost"})
	}
	flows = append(flows, flow.Flow{ID: 4, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40010"),
		Service: netip.MustParseAddrPort("10.120.0.90:80"), Backend: netip.MustParseAddrPort("10.244.20.77:3000"),
		RewrittenAt: flow.PlaceNetfilter, By: "nftables ip t pre -> b", VLAN: &vlan})
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: 4}, nil, Run{})
	_, summary, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS")
	for _, want := range []string{
		"10.244.20.31:3000  3      lost 3  <- it answered; the node lost the replies on their way to the client\n",
		"10.244.20.77:3000  1      no 1  <- no flow got a reply\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
}

// TestBackendsSummaryLostAmongRefusals: README marks "it answered; the node
// lost the replies" a backend with only flows whose replies the node lost;
// one that refused three flows and answered one whose replies were lost is
// not cleared of its refusals by that mark.
func TestBackendsSummaryLostAmongRefusals(t *testing.T) {
	vlan := uint16(200)
	var flows []flow.Flow
	for i := range 4 {
		f := flow.Flow{ID: i + 1, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.244.8.23:%d", 40000+i)),
			Service: netip.MustParseAddrPort("10.120.0.90:80"), Backend: netip.MustParseAddrPort("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip t pre -> b", VLAN: &vlan, Refused: true}
		if i == 0 {
			f.Refused, f.RepliesLostOnNode = false, 2
		}
		flows = append(flows, f)
	}
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: 4}, nil, Run{})
	_, summary, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS")
	if want := "10.244.20.31:3000  4      rst 3, lost 1  <- no flow got a reply\n"; !strings.Contains(summary, want) {
		t.Errorf("summary lacks %q:\n%s", want, summary)
	}
}

// TestBackendsSummaryUntranslatedReplies: a backend that answered every
// flow while nothing translated its replies back to the VIP (a bridge with
// bridge-nf-call-iptables 0 switched them straight to the client, whose
// socket dropped them: REPLY no, untranslated_replies) is not marked as one
// that got no reply: its count says "untranslated" and its mark says what
// the node did not do. The marks keep their rules: a backend that also
// refused is not cleared by it, one with no other flow is marked "no flow
// got a reply", and one whose flows' replies were some lost and some
// untranslated answered them all.
func TestBackendsSummaryUntranslatedReplies(t *testing.T) {
	vlan := uint16(200)
	var flows []flow.Flow
	add := func(backend string, set func(*flow.Flow)) {
		f := flow.Flow{ID: len(flows) + 1, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.88.1.11:%d", 40000+len(flows))),
			Service: netip.MustParseAddrPort("10.96.0.80:80"), Backend: netip.MustParseAddrPort(backend),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip t pre -> b", VLAN: &vlan}
		set(&f)
		flows = append(flows, f)
	}
	untranslated := func(backend string) func(*flow.Flow) {
		return func(f *flow.Flow) {
			f.UntranslatedReplies = &flow.StrayReplies{From: netip.MustParseAddrPort(backend), Packets: 3, Point: "pod"}
		}
	}
	// 10.88.1.21: two flows, both answered untranslated.
	add("10.88.1.21:8080", untranslated("10.88.1.21:8080"))
	add("10.88.1.21:8080", untranslated("10.88.1.21:8080"))
	// 10.88.1.22: one answered untranslated, one refused.
	add("10.88.1.22:8080", untranslated("10.88.1.22:8080"))
	add("10.88.1.22:8080", func(f *flow.Flow) { f.Refused = true })
	// 10.88.1.23: one answered untranslated, one whose replies the node lost.
	add("10.88.1.23:8080", untranslated("10.88.1.23:8080"))
	add("10.88.1.23:8080", func(f *flow.Flow) { f.RepliesLostOnNode = 2 })
	// 10.88.1.24: untranslated replies, and a reply from the VIP too: yes.
	add("10.88.1.24:8080", func(f *flow.Flow) { untranslated("10.88.1.24:8080")(f); f.Reply = true })
	// 10.88.1.25: nothing came back.
	add("10.88.1.25:8080", func(*flow.Flow) {})
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: len(flows)}, nil, Run{})
	_, summary, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS")
	for _, want := range []string{
		"10.88.1.21:8080  2      untranslated 2  <- it answered; the node did not translate its replies back\n",
		"10.88.1.22:8080  2      rst 1, untranslated 1  <- no flow got a reply\n",
		"10.88.1.23:8080  2      lost 1, untranslated 1  <- not its failure: the node lost or did not translate its replies, or dropped the requests on their way out\n",
		"10.88.1.24:8080  1      yes 1\n",
		"10.88.1.25:8080  1      no 1  <- no flow got a reply\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
}

// TestBackendsSummaryNotSent: a backend whose flows' requests never left
// the node (not_sent: the kernel dropped them at the uplink device after
// its TX tap, an overlay without an fdb entry for the remote VTEP) is not
// marked as one that got no reply: no request reached it. One that also
// left a flow unanswered after a request did reach it keeps that mark.
func TestBackendsSummaryNotSent(t *testing.T) {
	vlan := uint16(0)
	var flows []flow.Flow
	for i := range 2 {
		flows = append(flows, flow.Flow{ID: i + 1, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.244.1.5:%d", 40400+i)),
			Service: netip.MustParseAddrPort("10.96.0.80:80"), Backend: netip.MustParseAddrPort("10.244.2.7:8080"),
			RewrittenAt: flow.PlaceNetfilter, By: "iptables-legacy nat KUBE-SVC-X -> dnat", VLAN: &vlan, UplinkDstMAC: "de:ad:be:ef:00:02",
			LostOnNode: 2, NotSent: true, Reason: "none left the node"})
	}
	for i, be := range []string{"10.244.3.9:8080", "10.244.3.9:8080"} {
		f := flow.Flow{ID: i + 3, Proto: "tcp", Client: netip.MustParseAddrPort(fmt.Sprintf("10.244.1.5:%d", 40410+i)),
			Service: netip.MustParseAddrPort("10.96.0.80:80"), Backend: netip.MustParseAddrPort(be),
			RewrittenAt: flow.PlaceNetfilter, By: "iptables-legacy nat KUBE-SVC-X -> dnat", VLAN: &vlan}
		if i == 0 {
			f.LostOnNode, f.NotSent = 1, true
		}
		flows = append(flows, f)
	}
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: 4}, nil, Run{})
	out := b.String()
	_, summary, _ := strings.Cut(out, "REWRITTEN AT  FLOWS")
	for _, want := range []string{
		"10.244.2.7:8080  2      unsent 2  <- no request reached it: the node dropped them on their way out\n",
		"10.244.3.9:8080  2      unsent 1, no 1  <- no flow got a reply\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
	if !strings.Contains(out, "Rewritten, not all sent out or no reply") {
		t.Errorf("the flows whose requests never left are not listed as such:\n%s", out)
	}
}
