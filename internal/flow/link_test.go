package flow_test

import (
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// pkt is a packet observation at point p, ms after the base time.
func pkt(ms float64, p obs.Point, dir obs.Dir, proto obs.Proto, src, dst netip.AddrPort) obs.Observation {
	return obs.Observation{Time: flowtest.At(ms), Point: p, Dir: dir, Proto: proto, Src: src, Dst: dst, Len: 60}
}

// permutations returns every order of n observations (n small).
func permutations(n int) [][]int {
	if n == 0 {
		return [][]int{nil}
	}
	var out [][]int
	for _, p := range permutations(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := append(append(append([]int(nil), p[:i]...), n-1), p[i:]...)
			out = append(out, q)
		}
	}
	return out
}

// feed adds the observations in the given order, checking after each one
// that no cached verdict went stale.
func feed(t *testing.T, e *flow.Engine, obsv []obs.Observation, order []int) {
	t.Helper()
	for step, i := range order {
		e.Add(obsv[i])
		if stale := e.StaleVerdicts(); len(stale) > 0 {
			t.Fatalf("order %v, step %d: stale cached verdicts for flows %v", order, step, stale)
		}
		e.WarmVerdicts()
	}
}

func logFlows(t *testing.T, fs []flow.Flow) {
	t.Helper()
	for _, f := range fs {
		t.Logf("  #%d %s %s -> %s backend=%s backends=%v %s by=%q reply=%v vlan=%v reason=%q",
			f.ID, f.Proto, f.Client, f.Service, f.Backend, f.Backends, f.RewrittenAt, f.By, f.Reply, f.VLAN != nil, f.Reason)
	}
}

// A flow the node masquerades but does not rewrite leaves with the node's
// address as source and the VIP as destination: the uplink's packets are
// the Pod's flow (conntrack names the source), not a flow from the node,
// whichever arrives first.
func TestMasqueradedUnrewrittenFlow(t *testing.T) {
	snat := netip.MustParseAddrPort("192.168.77.2:41077")
	obsv := []obs.Observation{
		req(0, obs.PointHost, obs.DirIn, vip),
		{Time: flowtest.At(0.2), Point: obs.PointConntrack, Proto: obs.TCP, Src: client, Dst: vip, NATSrc: snat},
		pkt(0.03, obs.PointUplink, obs.DirOut, obs.TCP, snat, vip),
		pkt(0.4, obs.PointUplink, obs.DirIn, obs.TCP, vip, snat),
	}
	for _, order := range permutations(len(obsv)) {
		e := flow.NewEngine(httpConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink))
		feed(t, e, obsv, order)
		fs := e.Flows()
		if len(fs) != 1 || fs[0].Client != client || fs[0].RewrittenAt != flow.PlaceNowhere || fs[0].VLAN == nil || !fs[0].Reply {
			t.Errorf("order %v: want one nowhere flow from %s, seen at the uplink with its reply; got:", order, client)
			logFlows(t, fs)
			continue
		}
		for _, o := range obsv[2:] {
			if r, ok := e.Classify(o); !ok || r.ID != fs[0].ID || r.Translated {
				t.Errorf("order %v: Classify(%s -> %s) = %+v %v, want flow %d untranslated", order, o.Src, o.Dst, r, ok, fs[0].ID)
			}
		}
		if s := e.Summary(); s.Flows != 1 {
			t.Errorf("order %v: summary counts %d flows, want 1", order, s.Flows)
		}
	}
}

// A node socket whose source happens to be a masqueraded flow's SNAT source,
// seen before the SNAT (its egress), is a flow of its own.
func TestNodeFlowNotMergedIntoMasqueradedFlow(t *testing.T) {
	snat := netip.MustParseAddrPort("192.168.77.2:41077")
	cfg := httpConfig(obs.PointHost, obs.PointConntrack, obs.PointSockEgress, obs.PointUplink)
	cfg.HostNetNS = 1
	e := flow.NewEngine(cfg)
	e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointSockEgress, NetNS: 1, Proto: obs.TCP, Src: snat, Dst: vip, Cookie: 9})
	e.Add(req(10, obs.PointHost, obs.DirIn, vip))
	e.Add(obs.Observation{Time: flowtest.At(10.2), Point: obs.PointConntrack, Proto: obs.TCP, Src: client, Dst: vip, NATSrc: snat})
	if fs := e.Flows(); len(fs) != 2 {
		t.Errorf("got %d flows, want the node's and the Pod's:", len(fs))
		logFlows(t, fs)
	}
}
