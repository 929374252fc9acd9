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

// Masquerade keeps a source port when it can: two Pods' connections with the
// same ephemeral port to different backends share the SNAT source
// node:40100. Each keeps its own packets beyond the SNAT.
func TestSNATSourceSharedByTwoFlows(t *testing.T) {
	a := netip.MustParseAddrPort("10.244.8.23:40100")
	b := netip.MustParseAddrPort("10.244.8.24:40100")
	snat := netip.MustParseAddrPort("192.168.77.2:40100")
	pairs := []struct{ cl, be netip.AddrPort }{{a, backend}, {b, other}}
	var obsv []obs.Observation
	for i, c := range pairs { // two concurrent connections; tc rewrites, conntrack sees no DNAT
		ms := float64(i) * 0.001
		obsv = append(obsv,
			pkt(ms, obs.PointHost, obs.DirIn, obs.TCP, c.cl, vip),
			obs.Observation{Time: flowtest.At(ms + 0.2), Point: obs.PointConntrack, Proto: obs.TCP, Src: c.cl, Dst: c.be, NATSrc: snat},
			pkt(ms+1, obs.PointUplink, obs.DirOut, obs.TCP, snat, c.be),
			pkt(ms+1.4, obs.PointUplink, obs.DirIn, obs.TCP, c.be, snat))
	}
	for name, order := range orders(flowtest.Scenario{Observations: obsv}) {
		if order == nil {
			order = identity(len(obsv))
		}
		e := flow.NewEngine(httpConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink))
		feed(t, e, obsv, order)
		fs := e.Flows()
		if len(fs) != 2 {
			t.Errorf("%s order: got %d flows, want 2:", name, len(fs))
			logFlows(t, fs)
			continue
		}
		for i, f := range fs {
			c := pairs[i]
			if f.Client != c.cl || f.Backend != c.be || len(f.Backends) != 0 || f.RewrittenAt != flow.PlaceTC || f.VLAN == nil || !f.Reply {
				t.Errorf("%s order: want %s tc to %s alone, with its uplink frame and reply; got:", name, c.cl, c.be)
				logFlows(t, []flow.Flow{f})
			}
			for _, o := range []obs.Observation{pkt(2, obs.PointUplink, obs.DirOut, obs.TCP, snat, c.be), pkt(2, obs.PointUplink, obs.DirIn, obs.TCP, c.be, snat)} {
				if r, ok := e.Classify(o); !ok || r.ID != f.ID {
					t.Errorf("%s order: Classify(%s -> %s) = %+v %v, want flow %d", name, o.Src, o.Dst, r, ok, f.ID)
				}
			}
		}
		if errs := e.SNATIndexErrors(); len(errs) > 0 {
			t.Errorf("%s order: SNAT index: %v", name, errs)
		}
	}
}

// The SNAT index lists each flow under its current SNAT source only, and
// drops the flows merged into others.
func TestSNATIndexFollowsFlows(t *testing.T) {
	snat1 := netip.MustParseAddrPort("192.168.77.2:41077")
	snat2 := netip.MustParseAddrPort("192.168.77.2:41078")
	e := flow.NewEngine(httpConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink))
	check := func(step string, wantFlows int) {
		t.Helper()
		if errs := e.SNATIndexErrors(); len(errs) > 0 {
			t.Errorf("%s: SNAT index: %v", step, errs)
		}
		if s := e.Summary(); s.Flows != wantFlows {
			t.Errorf("%s: %d flows, want %d", step, s.Flows, wantFlows)
			logFlows(t, e.Flows())
		}
	}
	// A masqueraded unrewritten flow whose uplink packets came first: the
	// phantom flow they made is merged when conntrack names the source.
	e.Add(pkt(0.03, obs.PointUplink, obs.DirOut, obs.TCP, snat1, vip))
	e.Add(req(0, obs.PointHost, obs.DirIn, vip))
	check("before conntrack", 2)
	e.Add(obs.Observation{Time: flowtest.At(0.2), Point: obs.PointConntrack, Proto: obs.TCP, Src: client, Dst: vip, NATSrc: snat1})
	check("after conntrack", 1)
	// conntrack names another source later (an UPDATE after a clash).
	e.Add(obs.Observation{Time: flowtest.At(0.3), Point: obs.PointConntrack, Proto: obs.TCP, Src: client, Dst: vip, NATSrc: snat2})
	check("after the new source", 1)
	if r, ok := e.Classify(pkt(1, obs.PointUplink, obs.DirOut, obs.TCP, snat2, vip)); !ok {
		t.Errorf("the new source is not the flow's: %+v", r)
	}
	if fs := e.Flows(); len(fs) != 1 || fs[0].Client != client {
		t.Errorf("want one flow from %s:", client)
		logFlows(t, fs)
	}
}
