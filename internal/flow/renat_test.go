package flow_test

import (
	"net/netip"
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
	for name, order := range orders(s) {
		fs := s.Run(order).Flows()
		if len(fs) != 1 {
			t.Errorf("%s order: %d flows, want 1", name, len(fs))
			continue
		}
		if strings.Contains(fs[0].Reason, "NATed anew") {
			t.Errorf("%s order: reason %q takes the client's own datagram to %s for the VIP's", name, fs[0].Reason, other)
		}
	}
}
