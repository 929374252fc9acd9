package flow_test

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

const scenarioDir = "../../testdata/flows"

// TestScenarios runs every recorded sequence in its recorded (arrival) order,
// in reverse, and in random permutations: sources reorder events, and the
// verdicts must not depend on it.
func TestScenarios(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(scenarios) < 20 {
		t.Fatalf("found %d scenarios in %s, want at least 20", len(scenarios), scenarioDir)
	}
	for _, s := range scenarios {
		t.Run(s.Name, func(t *testing.T) {
			for name, order := range orders(s) {
				e := s.Run(order)
				if errs := s.Want.Check(e.Flows(), e.Summary()); len(errs) > 0 {
					t.Errorf("%s order:\n  %s", name, strings.Join(errs, "\n  "))
				}
			}
		})
	}
}

// TestFlowIDsDense checks that the flows reported are numbered 1 to n, in
// the order they were first seen, whatever the order the observations came
// in: a socket's event that comes before its first packet makes a flow of
// its own that the packet's flow absorbs, and its number must not leave a
// gap ("flows 1, 3, 4": where is flow 2?).
func TestFlowIDsDense(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range scenarios {
		for name, order := range orders(s) {
			flows := s.Run(order).Flows()
			for i, f := range flows {
				if f.ID != i+1 {
					ids := make([]int, len(flows))
					for j, g := range flows {
						ids[j] = g.ID
					}
					t.Errorf("%s, %s order: flow ids %v, want 1 to %d in the order listed", s.Name, name, ids, len(flows))
					break
				}
			}
		}
	}
}

// orders returns the observation orders to try: recorded, reversed and shuffled.
func orders(s flowtest.Scenario) map[string][]int {
	out := map[string][]int{"recorded": nil}
	if s.Ordered {
		return out
	}
	n := len(s.Observations)
	rev := make([]int, n)
	for i := range rev {
		rev[i] = n - 1 - i
	}
	out["reversed"] = rev
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	for _, name := range []string{"shuffled-1", "shuffled-2", "shuffled-3", "shuffled-4", "shuffled-5"} {
		out[name] = rng.Perm(n)
	}
	if s.SocketOrdered {
		for _, order := range out {
			keepSocketOrder(s.Observations, order)
		}
	}
	return out
}

// keepSocketOrder puts the socket observers' events of order back in their
// recorded order, in the places order gives them.
func keepSocketOrder(observations []obs.Observation, order []int) {
	isSocket := func(i int) bool {
		switch observations[i].Point {
		case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
			return true
		}
		return false
	}
	var places, socket []int
	for place, i := range order {
		if isSocket(i) {
			places, socket = append(places, place), append(socket, i)
		}
	}
	slices.Sort(socket)
	for k, place := range places {
		order[place] = socket[k]
	}
}

func identity(n int) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	return order
}

// TestScenarioSummaries checks the per-place counts and that every flow is
// counted once.
func TestScenarioSummaries(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/mixed-modes.json")
	if err != nil {
		t.Fatal(err)
	}
	sum := s.Run(nil).Summary()
	want := map[flow.Place]int{flow.PlaceSocket: 1, flow.PlaceTC: 1, flow.PlaceNetfilter: 1,
		flow.PlaceIPVS: 0, flow.PlaceNowhere: 1, flow.PlaceUnknown: 1}
	if sum.Flows != 5 {
		t.Errorf("flows = %d, want 5", sum.Flows)
	}
	for p, n := range want {
		if got, ok := sum.RewrittenAt[p]; !ok || got != n {
			t.Errorf("rewritten_at[%s] = %d (present %v), want %d", p, got, ok, n)
		}
	}
	if sum.Observations["uplink"] == 0 || sum.Observations["pod"] == 0 {
		t.Errorf("observations per point missing: %v", sum.Observations)
	}
	for _, name := range []string{flow.DropFlowsOverMax, flow.DropUnmatchedOverflow} {
		if _, ok := sum.Drops[name]; !ok {
			t.Errorf("drop counter %s missing (must be reported even when zero)", name)
		}
	}
}

func TestFlowsSortedByFirstSeen(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/concurrent-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	for name, order := range orders(s) {
		flows := s.Run(order).Flows()
		if !slices.IsSortedFunc(flows, func(a, b flow.Flow) int { return a.First.Compare(b.First) }) {
			t.Errorf("%s order: flows not sorted by first seen", name)
		}
		for _, f := range flows {
			if len(f.Points) == 0 || f.First.IsZero() || f.Last.Before(f.First) {
				t.Errorf("%s order: flow %d lacks points or times: %+v", name, f.ID, f)
			}
		}
	}
}

func TestBackendsLearned(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/tc-udp.json")
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	if got := e.BackendWatches(); len(got) != 0 {
		t.Fatalf("backends before any observation = %v, want none (tc mode has no NAT rules)", got)
	}
	for _, o := range s.Observations {
		e.Add(o)
	}
	got := e.BackendWatches()
	if len(got) != 1 || got[0].Addr.String() != "10.244.20.31" || got[0].Port != 5353 {
		t.Errorf("backends = %v, want the endpoint 10.244.20.31:5353", got)
	}
}

func TestBackendsFromNATRules(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/concurrent-netfilter.json")
	if err != nil {
		t.Fatal(err)
	}
	got := flow.NewEngine(s.Config).BackendWatches()
	want := "[10.244.20.31:3000/tcp 10.244.20.31:5353/udp 10.244.20.32:3000/tcp]"
	if fmt.Sprint(got) != want {
		t.Errorf("backends from NAT rules = %v, want %s", got, want)
	}
}

// ICMP to a VIP watched on any protocol, and IP fragments after the first,
// reach the observers with ports 0: they make no flow, join none, and are
// counted apart. A socket's observation before its port is bound (port 0,
// with its cookie) still makes its flow.
func TestObservationsWithoutPorts(t *testing.T) {
	dns := netip.MustParseAddrPort("10.120.0.10:53")
	be := netip.MustParseAddrPort("10.244.20.31:5353")
	cl := netip.MustParseAddrPort("10.244.8.23:51000")
	portless := func(ms float64, p obs.Point, proto obs.Proto, dst netip.Addr) obs.Observation {
		return obs.Observation{Time: flowtest.At(ms), Point: p, Hook: obs.HookPrerouting, Proto: proto,
			Src: netip.AddrPortFrom(cl.Addr(), 0), Dst: netip.AddrPortFrom(dst, 0)}
	}
	obsv := []obs.Observation{
		{Time: flowtest.At(0), Point: obs.PointHost, Dir: obs.DirIn, Proto: obs.UDP, Src: cl, Dst: dns, Len: 1500},
		{Time: flowtest.At(0.01), Point: obs.PointNFBefore, Hook: obs.HookPrerouting, Proto: obs.UDP, Src: cl, Dst: dns},
		{Time: flowtest.At(0.02), Point: obs.PointNFAfter, Hook: obs.HookPrerouting, Proto: obs.UDP, Src: cl, Dst: be},
		// the datagram's second fragment before and after NAT
		portless(0.011, obs.PointNFBefore, obs.UDP, dns.Addr()),
		portless(0.021, obs.PointNFAfter, obs.UDP, be.Addr()),
		// a ping to the VIP, and its conntrack entry
		portless(5, obs.PointNFBefore, 1, dns.Addr()),
		{Time: flowtest.At(5.1), Point: obs.PointConntrack, Proto: 1, Src: netip.AddrPortFrom(cl.Addr(), 0), Dst: netip.AddrPortFrom(dns.Addr(), 0)},
		// a TCP socket connecting to the VIP before its port is bound
		{Time: flowtest.At(6), Point: obs.PointSockAddr, Kind: obs.SockConnect, Proto: obs.TCP,
			Src: netip.AddrPortFrom(cl.Addr(), 0), ReqDst: netip.AddrPortFrom(dns.Addr(), 80), Dst: netip.AddrPortFrom(dns.Addr(), 80), Cookie: 3},
	}
	cfg := flow.Config{Services: []flow.Service{{Addr: dns.Addr()}},
		Points: map[obs.Point]bool{obs.PointHost: true, obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointConntrack: true, obs.PointSockAddr: true}}
	for name, order := range orders(flowtest.Scenario{Observations: obsv}) {
		e := flow.NewEngine(cfg)
		if order == nil {
			order = identity(len(obsv))
		}
		for _, i := range order {
			e.Add(obsv[i])
		}
		fs := e.Flows()
		if len(fs) != 2 || fs[0].Client != cl || fs[0].Service != dns || fs[0].RewrittenAt != flow.PlaceNetfilter ||
			fs[1].Client.Port() != 0 || fs[1].Service.Port() != 80 {
			t.Errorf("%s order: want the UDP flow (netfilter) and the socket's flow; got %d:", name, len(fs))
			for _, f := range fs {
				t.Logf("  %s %s -> %s %s", f.Proto, f.Client, f.Service, f.RewrittenAt)
			}
			continue
		}
		if n := fs[0].Points; len(n) != 3 {
			t.Errorf("%s order: the UDP flow has %d per-point entries, want 3 (a fragment joined it): %+v", name, len(n), n)
		}
		if s := e.Summary(); s.WithoutPorts != 4 || s.Unmatched != 0 || s.Flows != 2 {
			t.Errorf("%s order: without_ports %d, unmatched %d, flows %d; want 4, 0, 2", name, s.WithoutPorts, s.Unmatched, s.Flows)
		}
	}
}

// isService compares a few Services one by one and hashes many: both must
// answer alike.
func TestIsServiceFewAndMany(t *testing.T) {
	for _, n := range []int{1, 8, 9, 40} {
		cfg := flow.Config{Points: map[obs.Point]bool{obs.PointPod: true}}
		for i := range n {
			cfg.Services = append(cfg.Services, flow.Service{Addr: netip.AddrFrom4([4]byte{10, 120, 0, byte(i)}), Port: 80, Proto: obs.TCP})
		}
		cfg.Services = append(cfg.Services, flow.Service{Addr: netip.MustParseAddr("10.120.1.1")}) // any port and protocol
		e := flow.NewEngine(cfg)
		add := func(proto obs.Proto, dst string) {
			e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointPod, Dir: obs.DirOut, Proto: proto,
				Src: netip.MustParseAddrPort("10.244.8.23:40100"), Dst: netip.MustParseAddrPort(dst)})
		}
		add(obs.TCP, "10.120.0.0:80") // a Service
		add(obs.UDP, "10.120.0.0:80") // another protocol
		add(obs.TCP, "10.120.0.0:81") // another port
		add(obs.UDP, "10.120.1.1:53") // any port and protocol
		add(obs.TCP, "10.120.2.2:80") // no Service
		if s := e.Summary(); s.Flows != 2 {
			t.Errorf("%d services: %d flows, want 2", n+1, s.Flows)
		}
	}
}

// TestPending: a flow seen at the Pod only is undecided while the uplink's
// frames may still come (the reordering window), unknown after, and never
// pending once the run is stopping; a decided flow is never pending.
func TestPending(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
	e.Add(req(0, obs.PointPod, obs.DirOut, vip))
	e.Add(req(0.1, obs.PointHost, obs.DirIn, vip))
	if got := e.Summary().RewrittenAt[flow.PlaceUnknown]; got != 1 {
		t.Fatalf("unknown = %d, want 1 (the uplink has not seen it yet)", got)
	}
	if got := e.Pending(flowtest.At(1000)); got != 1 {
		t.Errorf("1 s in: pending = %d, want 1", got)
	}
	if got := e.Pending(flowtest.At(4000)); got != 0 {
		t.Errorf("4 s in, past the reordering window: pending = %d, want 0", got)
	}
	e.Add(req(0.2, obs.PointUplink, obs.DirOut, vip))
	if got := e.Summary().RewrittenAt[flow.PlaceNowhere]; got != 1 {
		t.Fatalf("nowhere = %d, want 1 (the uplink saw the VIP)", got)
	}
	if got := e.Pending(flowtest.At(1000)); got != 0 {
		t.Errorf("decided (nowhere): pending = %d, want 0", got)
	}
	e2 := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
	e2.Add(req(0, obs.PointPod, obs.DirOut, vip))
	e2.Stopping(flowtest.At(500))
	if got := e2.Pending(flowtest.At(1000)); got != 0 {
		t.Errorf("stopping: pending = %d, want 0 (no observation is to come)", got)
	}
}

// TestVLANProto: an uplink frame whose outer tag is a QinQ service tag
// (802.1ad) says so next to its VLAN ID; an 802.1Q one does not, but for
// a priority tag (VLAN ID 0), which VLAN 0 alone would call untagged.
func TestVLANProto(t *testing.T) {
	for _, tc := range []struct {
		tpid, vlan uint16
		want       string
	}{{0x88a8, 10, "802.1ad"}, {0x8100, 10, ""}, {0x8100, 0, "802.1Q"}, {0, 0, ""}} {
		e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointUplink))
		e.Add(req(0, obs.PointPod, obs.DirOut, vip))
		up := req(0.1, obs.PointUplink, obs.DirOut, vip)
		up.VLAN, up.TPID = tc.vlan, tc.tpid
		e.Add(up)
		f := e.Flows()[0]
		if f.VLAN == nil || *f.VLAN != tc.vlan || f.VLANProto != tc.want {
			t.Errorf("TPID %#x VLAN %d: vlan %v proto %q, want %d %q", tc.tpid, tc.vlan, f.VLAN, f.VLANProto, tc.vlan, tc.want)
		}
	}
}
