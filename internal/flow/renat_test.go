package flow_test

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestUDPDirectDropNotRenat: a resolver's unconnected socket first sends
// a datagram to one of the VIP's NAT backends itself, which the node's
// filter drops, then queries the VIP, NATed to the other backend and
// answered. The dropped datagram was the client's own, not the VIP's
// NATed to a pick the node dropped: in no delivery order may the flow's
// reason say the VIP was NATed anew (its drop, delivered before the
// datagram's sightings at the Pod, looks like a renat one at first).
func TestUDPDirectDropNotRenat(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/udp-unconnected-vip-and-other-server-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	other := netip.MustParseAddrPort("10.244.20.32:5353")
	rule := s.Config.Attribution.NATRules[0]
	rule.Backends = []netip.AddrPort{other}
	rule.Rule = "dnat to " + other.String()
	s.Config.Attribution.NATRules = append(s.Config.Attribution.NATRules, rule)
	s.Config.Points[obs.PointDrop] = true

	// Its datagram to the other backend, a millisecond before the VIP's,
	// dropped after netfilter's NAT hooks; no reply.
	var observations []obs.Observation
	for _, o := range s.Observations {
		if o.Src.Addr() == other.Addr() {
			continue
		}
		if o.Dst != other {
			observations = append(observations, o)
			continue
		}
		switch o.Point {
		case obs.PointUplink, obs.PointConntrack:
			continue
		}
		o.Time = o.Time.Add(-time.Millisecond)
		observations = append(observations, o)
		if o.Point == obs.PointNFAfter {
			d := o
			d.Point, d.Hook, d.Prio, d.Len = obs.PointDrop, 0, 0, 0
			d.Time = o.Time.Add(5 * time.Microsecond)
			d.NetNS = s.Config.HostNetNS
			d.Drop = &obs.KernelDrop{Reason: "NETFILTER_DROP", Func: "nft_do_chain"}
			observations = append(observations, d)
		}
	}
	s.Observations = observations
	oneFlowNotRenatted(t, s, orders(s), fmt.Sprintf("takes the client's own datagram to %s for the VIP's", other))
}

// TestUDPBackendChangedNotRenat: a connected UDP socket's datagrams to the
// VIP ride an entry made before the run (no event), DNATed to a backend
// behind the uplink that no longer answers; they leave the uplink. The
// backend is taken out of the Service and kube-proxy deletes its UDP
// entries: the next datagram gets a new entry, to the other backend,
// which conntrack reports and which answers. The flow changed backend for
// real: the uplink's TX tap, which runs after conntrack confirms an entry,
// saw its datagrams to the first one, so in no delivery order may its
// reason say they were dropped before conntrack confirmed an entry and a
// later one NATed anew.
func TestUDPBackendChangedNotRenat(t *testing.T) {
	s := backendChangedScenario(t)
	gone := netip.MustParseAddrPort("10.244.20.32:5353")
	all := orders(s)
	maps.Copy(all, movedOrders(len(s.Observations)))
	oneFlowNotRenatted(t, s, all, fmt.Sprintf("says the datagrams that left the uplink to %s were dropped before conntrack confirmed an entry", gone))
}

// TestUDPBackendChangedAnyOrder: the flow of TestUDPBackendChangedNotRenat
// keeps its first backend's datagrams in every delivery order. Delivered
// after the second backend was learned, they were nobody's (that flow
// knew a backend, so none of its datagrams to another was guessed its):
// backends listed only the second, netfilter after NAT and the uplink
// counted 2 requests of 4.
func TestUDPBackendChangedAnyOrder(t *testing.T) {
	s := backendChangedScenario(t)
	vlan := uint16(200)
	s.Want = flowtest.Want{Flows: []flowtest.WantFlow{{
		Proto:              "udp",
		Client:             "10.244.8.23:58354",
		Service:            "10.120.0.10:53",
		Backend:            "10.244.20.32:5353",
		Backends:           []string{"10.244.20.32:5353", "10.244.20.31:5353"},
		RewrittenAt:        "netfilter",
		ReasonLacks:        "NATed anew",
		VLAN:               &vlan,
		UplinkDstMAC:       "42:d8:df:41:e4:22",
		UplinkDstIsGateway: true,
		Reply:              true,
		Packets:            map[string]uint64{"nf_after": 4, "uplink": 4, "uplink reply": 2},
	}}}
	all := orders(s)
	maps.Copy(all, movedOrders(len(s.Observations)))
	wantInEveryOrder(t, s, all)
}

// wantInEveryOrder checks s's want with its observations delivered in
// each of the orders, and names the orders that fail.
func wantInEveryOrder(t *testing.T, s flowtest.Scenario, orders map[string][]int) {
	t.Helper()
	var failed []string
	for name, order := range orders {
		e := s.Run(order)
		if errs := s.Want.Check(e.Flows(), e.Summary()); len(errs) > 0 {
			failed = append(failed, name)
			t.Errorf("%s order:\n  %s", name, strings.Join(errs, "\n  "))
		}
	}
	if len(failed) > 0 {
		slices.Sort(failed)
		t.Errorf("%d of %d orders fail: %s", len(failed), len(orders), strings.Join(failed, ", "))
	}
}

// backendChangedScenario is TestUDPBackendChangedNotRenat's scenario: a
// UDP flow's datagrams NATed to a backend that no longer answers leave the
// uplink, then, after its entries were deleted, to the other one, which
// answers.
func backendChangedScenario(t *testing.T) flowtest.Scenario {
	t.Helper()
	s, err := flowtest.Load("../../testdata/flows/netfilter-udp-renatted-after-drop.json")
	if err != nil {
		t.Fatal(err)
	}
	pod := netip.MustParseAddrPort("10.244.8.23:5353")
	gone := netip.MustParseAddrPort("10.244.20.32:5353")
	rule := &s.Config.Attribution.NATRules[0]
	if !slices.Contains(rule.Backends, pod) {
		t.Fatalf("rule %v does not name %s", rule, pod)
	}
	rule.Backends = []netip.AddrPort{gone}
	rule.Rule = "dnat to " + gone.String()

	var observations []obs.Observation
	var uplink obs.Observation
	for _, o := range s.Observations {
		if o.Point == obs.PointUplink && o.Dir == obs.DirOut {
			uplink = o
			break
		}
	}
	for _, o := range s.Observations {
		switch {
		case o.Point == obs.PointSockAddr:
			continue // connected before the run
		case o.Point == obs.PointDrop:
			// It left the uplink to the backend that no longer answers.
			u := uplink
			u.Time, u.Dst = o.Time, gone
			observations = append(observations, u)
			continue
		case o.Dst == pod:
			o.Dst = gone
		}
		observations = append(observations, o)
	}
	s.Observations = observations
	return s
}

// oneFlowNotRenatted checks that s, delivered in each of the orders, makes
// one flow whose reason does not say it was NATed anew (what such a
// reason would wrongly do).
func oneFlowNotRenatted(t *testing.T, s flowtest.Scenario, orders map[string][]int, what string) {
	t.Helper()
	for name, order := range orders {
		fs := s.Run(order).Flows()
		if len(fs) != 1 {
			t.Errorf("%s order: %d flows, want 1", name, len(fs))
			continue
		}
		if strings.Contains(fs[0].Reason, "NATed anew") {
			t.Errorf("%s order: reason %q %s", name, fs[0].Reason, what)
		}
	}
}

// movedOrders are the orders of n observations in which one of them is
// delivered first, or last, the others in their recorded order.
func movedOrders(n int) map[string][]int {
	out := make(map[string][]int, 2*n)
	for i := range n {
		rest := make([]int, 0, n-1)
		for j := range n {
			if j != i {
				rest = append(rest, j)
			}
		}
		out[fmt.Sprintf("observation %d first", i)] = append([]int{i}, rest...)
		out[fmt.Sprintf("observation %d last", i)] = append(rest, i)
	}
	return out
}

// TestRenatAnyObservationFirstOrLast runs the renat scenarios with each
// observation delivered first, and last: a drop delivered before any of
// its flow's packets, or after everything, a reply before its request
// (another ring's block), and the verdicts must not change.
func TestRenatAnyObservationFirstOrLast(t *testing.T) {
	for _, name := range []string{"netfilter-syn-renatted-after-drop", "netfilter-udp-renatted-after-drop"} {
		s, err := flowtest.Load(scenarioDir + "/" + name + ".json")
		if err != nil {
			t.Fatal(err)
		}
		t.Run(name, func(t *testing.T) { wantInEveryOrder(t, s, movedOrders(len(s.Observations))) })
	}
}

// TestUDPDropInPodNotRenat: a resolver's unconnected socket sends a
// datagram to one of the VIP's NAT backends itself, which its Pod drops
// (a tc program on the Pod's eth0: nothing captured it), then queries the
// VIP, NATed to the other backend and answered; no socket observers. The
// drop, in the Pod's netns, where nothing on the node rewrote anything,
// is not the VIP's datagram NATed to a pick the node dropped: in no
// delivery order may the flow say it was NATed anew.
func TestUDPDropInPodNotRenat(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/udp-unconnected-vip-and-other-server-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	const podNetNS = 4026532654
	s.Config.HostNetNS = 4026532774
	other := netip.MustParseAddrPort("10.244.20.32:5353")
	rule := s.Config.Attribution.NATRules[0]
	rule.Backends = []netip.AddrPort{other}
	rule.Rule = "dnat to " + other.String()
	s.Config.Attribution.NATRules = append(s.Config.Attribution.NATRules, rule)
	s.Config.Points[obs.PointDrop] = true
	for _, p := range []obs.Point{obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress} {
		delete(s.Config.Points, p)
	}

	var observations []obs.Observation
	for _, o := range s.Observations {
		switch {
		case o.Point == obs.PointSockAddr || o.Point == obs.PointSockState || o.Point == obs.PointSockEgress:
			continue
		case o.Src.Addr() == other.Addr():
			continue
		case o.Dst != other:
			observations = append(observations, o)
		case o.Point == obs.PointPod:
			// Dropped at the Pod's eth0 egress, a millisecond before
			// the VIP's query, before its tap.
			d := o
			d.Point, d.Dir, d.Len = obs.PointDrop, 0, 0
			d.Time = o.Time.Add(-time.Millisecond)
			d.NetNS = podNetNS
			d.Drop = &obs.KernelDrop{Reason: "TC_EGRESS", Func: "tcf_classify"}
			observations = append(observations, d)
		}
	}
	s.Observations = observations
	all := orders(s)
	maps.Copy(all, movedOrders(len(s.Observations)))
	oneFlowNotRenatted(t, s, all, "takes the datagram its Pod dropped for the VIP's, NATed on the node")
}
