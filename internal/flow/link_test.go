package flow_test

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sort"
	"testing"
	"time"

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

// flush moves the engine's clock a minute past ms, so that whatever still
// waits for its flow is counted unmatched (with an observation that waits
// for nothing itself).
func flush(e *flow.Engine, ms float64) {
	e.Add(obs.Observation{Time: flowtest.At(ms + 60000), Point: obs.PointUplink, Proto: 1,
		Src: netip.MustParseAddrPort("10.244.9.9:0"), Dst: netip.MustParseAddrPort("10.244.9.10:0")})
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

const (
	synFlag = 0x02
	ackFlag = 0x10
	finFlag = 0x01 | ackFlag
	rstFlag = 0x04
	pshAck  = 0x08 | ackFlag
)

// tcpPkt is a TCP packet observation with flags.
func tcpPkt(ms float64, p obs.Point, dir obs.Dir, src, dst netip.AddrPort, flags uint8) obs.Observation {
	o := pkt(ms, p, dir, obs.TCP, src, dst)
	o.TCPFlags = flags
	return o
}

// tcConn is one TCP connection from cl to svc that tc rewrites to be,
// opened at ms: its packets at the host veth (before tc), netfilter before
// NAT and the uplink (after), with its handshake, data and close. close
// false leaves it open.
func tcConn(ms float64, cl, svc, be netip.AddrPort, close bool) []obs.Observation {
	host, nfb, up := obs.PointHost, obs.PointNFBefore, obs.PointUplink
	in, out := obs.DirIn, obs.DirOut
	o := []obs.Observation{
		tcpPkt(ms, host, in, cl, svc, synFlag),
		tcpPkt(ms+0.02, nfb, 0, cl, be, synFlag),
		tcpPkt(ms+0.03, up, out, cl, be, synFlag),
		tcpPkt(ms+0.3, up, in, be, cl, synFlag|ackFlag),
		tcpPkt(ms+0.32, host, out, svc, cl, synFlag|ackFlag),
		tcpPkt(ms+0.4, host, in, cl, svc, ackFlag),
		tcpPkt(ms+0.42, nfb, 0, cl, be, ackFlag),
		tcpPkt(ms+0.5, host, in, cl, svc, pshAck),
		tcpPkt(ms+0.52, nfb, 0, cl, be, pshAck),
		tcpPkt(ms+0.53, up, out, cl, be, pshAck),
		tcpPkt(ms+0.9, up, in, be, cl, pshAck),
	}
	for i := range o {
		o[i].Hook = obs.HookPrerouting
	}
	if !close {
		return o
	}
	return append(o,
		tcpPkt(ms+10, host, in, cl, svc, finFlag),
		tcpPkt(ms+10.02, nfb, 0, cl, be, finFlag),
		tcpPkt(ms+10.3, up, in, be, cl, finFlag),
		tcpPkt(ms+10.32, host, out, svc, cl, finFlag),
		tcpPkt(ms+10.4, host, in, cl, svc, ackFlag))
}

// arrivalOrders returns orders in which the observations can arrive:
// sources deliver within a second of the time they stamp, in any order
// within that (the reordering the engine allows for is more). The first
// is time order; then each point's observations late by most of a second;
// then random delays.
func arrivalOrders(o []obs.Observation) map[string][]int {
	out := map[string][]int{}
	byDelay := func(delay func(i int) float64) []int {
		order := identity(len(o))
		key := make([]float64, len(o))
		for i := range o {
			key[i] = float64(o[i].Time.Sub(flowtest.At(0)))/float64(time.Millisecond) + delay(i)
		}
		sort.SliceStable(order, func(a, b int) bool { return key[order[a]] < key[order[b]] })
		return order
	}
	out["time"] = byDelay(func(int) float64 { return 0 })
	for _, p := range []obs.Point{obs.PointHost, obs.PointNFBefore, obs.PointUplink} {
		out[p.String()+"-late"] = byDelay(func(i int) float64 {
			if o[i].Point == p {
				return 900
			}
			return 0
		})
	}
	rng := rand.New(rand.NewPCG(7, uint64(len(o))))
	for n := range 8 {
		out[fmt.Sprintf("delayed-%d", n+1)] = byDelay(func(int) float64 { return rng.Float64() * 1000 })
	}
	return out
}

func reuseConfig(vips ...netip.AddrPort) flow.Config {
	cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointUplink)
	for _, v := range vips {
		cfg.Services = append(cfg.Services, flow.Service{Addr: v.Addr(), Port: v.Port(), Proto: obs.TCP})
	}
	return cfg
}

// checkConns wants one flow per connection, in order, each tc to its
// backend alone, with its uplink frame and reply.
func checkConns(t *testing.T, name string, e *flow.Engine, want ...[2]netip.AddrPort) []flow.Flow {
	t.Helper()
	fs := e.Flows()
	ok := len(fs) == len(want)
	for i := 0; ok && i < len(fs); i++ {
		f := fs[i]
		ok = f.Service == want[i][0] && f.Backend == want[i][1] && len(f.Backends) == 0 &&
			f.RewrittenAt == flow.PlaceTC && f.VLAN != nil && f.Reply
	}
	if !ok {
		t.Errorf("%s order: want %d flows, tc to their own backends %v; got:", name, len(want), want)
		logFlows(t, fs)
	}
	return fs
}

// A client port reused two minutes later for another VIP whose Service
// selects the same backend: the second connection's packets to the backend
// are the second flow's.
func TestPortReusedForAnotherVIP(t *testing.T) {
	vip2 := netip.MustParseAddrPort("10.120.0.81:80")
	all := append(tcConn(0, client, vip, backend, true), tcConn(120000, client, vip2, backend, true)...)
	for name, order := range arrivalOrders(all) {
		e := flow.NewEngine(reuseConfig(vip2))
		feed(t, e, all, order)
		fs := checkConns(t, name, e, [2]netip.AddrPort{vip, backend}, [2]netip.AddrPort{vip2, backend})
		if len(fs) != 2 {
			continue
		}
		for i, ms := range []float64{5, 120005} {
			if r, ok := e.Classify(tcpPkt(ms, obs.PointUplink, obs.DirOut, client, backend, pshAck)); !ok || r.ID != fs[i].ID {
				t.Errorf("%s order: Classify of a packet to the backend at %v ms = %+v %v, want flow %d", name, ms, r, ok, fs[i].ID)
			}
		}
	}
	// Without TCP flags (observers that do not report them), the later
	// sighting of the backend goes to the flow that began last before it.
	e := flow.NewEngine(reuseConfig(vip2))
	e.Add(req(0, obs.PointHost, obs.DirIn, vip))
	e.Add(req(0.02, obs.PointNFBefore, 0, backend))
	e.Add(req(120000, obs.PointHost, obs.DirIn, vip2))
	e.Add(req(120000.02, obs.PointNFBefore, 0, backend))
	fs := e.Flows()
	if len(fs) != 2 || fs[0].Backend != backend || fs[1].Backend != backend ||
		fs[0].RewrittenAt != flow.PlaceTC || fs[1].RewrittenAt != flow.PlaceTC {
		t.Error("without flags: want both flows tc to the backend; got:")
		logFlows(t, fs)
	}
}

// A client port reused for the same VIP after the first connection closed:
// tc picks another backend the second time. The new SYN begins a new flow.
func TestPortReusedForSameVIP(t *testing.T) {
	for _, closed := range []bool{true, false} {
		// Not closed: the first connection's FINs were not seen, but its
		// client acknowledged the handshake long before the new SYN.
		all := append(tcConn(0, client, vip, backend, closed), tcConn(120000, client, vip, other, true)...)
		for name, order := range arrivalOrders(all) {
			e := flow.NewEngine(reuseConfig())
			feed(t, e, all, order)
			flush(e, 120011)
			checkConns(t, name, e, [2]netip.AddrPort{vip, backend}, [2]netip.AddrPort{vip, other})
			if s := e.Summary(); s.Unmatched != 0 || s.Flows != 2 {
				t.Errorf("%s order (closed %v): unmatched %d, flows %d; want 0, 2", name, closed, s.Unmatched, s.Flows)
			}
		}
	}
}

// One connection seen at several points, with its SYN retransmitted while
// unanswered, its clocks a little apart, a SYN-ACK retransmitted after the
// client's ACK, and its last ACK after the close: one flow, in every order.
func TestOneConnectionIsOneFlow(t *testing.T) {
	host, nfb, up := obs.PointHost, obs.PointNFBefore, obs.PointUplink
	in, out := obs.DirIn, obs.DirOut
	var o []obs.Observation
	for _, ms := range []float64{0, 1000, 3000, 7000} { // unanswered SYNs
		o = append(o,
			tcpPkt(ms, host, in, client, vip, synFlag),
			tcpPkt(ms-0.5, nfb, 0, client, backend, synFlag), // a clock 0.5 ms behind
			tcpPkt(ms+0.03, up, out, client, backend, synFlag))
	}
	o = append(o, tcConn(7000, client, vip, backend, true)...)
	o = append(o,
		tcpPkt(7900, up, in, backend, client, synFlag|ackFlag), // retransmitted: the ACK was lost
		tcpPkt(7900.1, nfb, 0, client, backend, ackFlag),
		tcpPkt(7010.5, up, out, client, backend, ackFlag), // the last ACK
		tcpPkt(7600, up, out, client, backend, finFlag))   // a FIN retransmitted
	for i := range o {
		o[i].Hook = obs.HookPrerouting
	}
	for name, order := range arrivalOrders(o) {
		e := flow.NewEngine(reuseConfig())
		feed(t, e, o, order)
		flush(e, 7900)
		checkConns(t, name, e, [2]netip.AddrPort{vip, backend})
		if s := e.Summary(); s.Unmatched != 0 {
			t.Errorf("%s order: %d observations unmatched", name, s.Unmatched)
		}
	}
}

// A handle of a closed connection's packets is not repeated for a packet
// of a new connection on the same port: AddPacket finds its flow.
func TestRepeatAfterClose(t *testing.T) {
	e := flow.NewEngine(reuseConfig())
	var h flow.Handle
	for i, o := range tcConn(0, client, vip, backend, true) {
		if o.Point != obs.PointHost || o.Dir != obs.DirIn {
			e.Add(o)
			continue
		}
		if i == 0 {
			h, _ = e.AddPacket(o)
		} else if !e.Repeat(&h, o.Point, o.Time, o.Len) {
			t.Fatalf("packet %d of the open connection not repeated", i)
		}
	}
	next := tcConn(120000, client, vip, other, true)
	if e.Repeat(&h, next[0].Point, next[0].Time, next[0].Len) {
		t.Fatal("a packet 2 minutes after the close was counted in the closed flow")
	}
	for _, o := range next {
		e.Add(o)
	}
	checkConns(t, "recorded", e, [2]netip.AddrPort{vip, backend}, [2]netip.AddrPort{vip, other})
}

// nfConn is one TCP connection from cl to svc that kube-proxy's DNAT
// rewrites to be at PREROUTING, opened at ms: its packets at the host veth,
// netfilter before and after NAT and the uplink, and conntrack's event
// (received a little after the SYN).
func nfConn(ms float64, cl, svc, be netip.AddrPort) []obs.Observation {
	host, nfb, nfa, up := obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink
	in, out := obs.DirIn, obs.DirOut
	o := []obs.Observation{
		tcpPkt(ms, host, in, cl, svc, synFlag),
		tcpPkt(ms+0.02, nfb, 0, cl, svc, synFlag),
		tcpPkt(ms+0.021, nfa, 0, cl, be, synFlag),
		{Time: flowtest.At(ms + 0.1), Point: obs.PointConntrack, Proto: obs.TCP, Src: cl, Dst: svc, NATDst: be, CTStatus: 0x8 | 0x20},
		tcpPkt(ms+0.03, up, out, cl, be, synFlag),
		tcpPkt(ms+0.3, up, in, be, cl, synFlag|ackFlag),
		tcpPkt(ms+0.32, host, out, svc, cl, synFlag|ackFlag),
		tcpPkt(ms+0.4, host, in, cl, svc, ackFlag),
		tcpPkt(ms+0.42, nfb, 0, cl, svc, ackFlag),
		tcpPkt(ms+0.421, nfa, 0, cl, be, ackFlag),
		tcpPkt(ms+10, host, in, cl, svc, finFlag),
		tcpPkt(ms+10.02, nfb, 0, cl, svc, finFlag),
		tcpPkt(ms+10.021, nfa, 0, cl, be, finFlag),
		tcpPkt(ms+10.3, up, in, be, cl, finFlag),
		tcpPkt(ms+10.32, host, out, svc, cl, finFlag),
		tcpPkt(ms+10.4, host, in, cl, svc, ackFlag),
	}
	for i := range o {
		o[i].Hook = obs.HookPrerouting
	}
	return o
}

// A client port reused for the same VIP after the first connection
// closed, kube-proxy picking another backend: conntrack's event for the
// new connection (which can come before any of its packets) is not the old
// flow's.
func TestPortReusedConntrack(t *testing.T) {
	all := append(nfConn(0, client, vip, backend), nfConn(120000, client, vip, other)...)
	// conntrack's event first: its receipt is stamped before the packets
	// of the taps and observers that deliver later
	all[len(all)/2+3].Time = flowtest.At(119999.9)
	orders := arrivalOrders(all)
	for name, order := range orders {
		cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink)
		e := flow.NewEngine(cfg)
		feed(t, e, all, order)
		flush(e, 120011)
		fs := e.Flows()
		if len(fs) != 2 || fs[0].Backend != backend || fs[1].Backend != other || len(fs[0].Backends)+len(fs[1].Backends) != 0 ||
			fs[0].RewrittenAt != flow.PlaceNetfilter || fs[1].RewrittenAt != flow.PlaceNetfilter {
			t.Errorf("%s order: want two netfilter flows, to %s and to %s alone; got:", name, backend, other)
			logFlows(t, fs)
		}
		if s := e.Summary(); s.Unmatched != 0 {
			t.Errorf("%s order: %d unmatched", name, s.Unmatched)
		}
	}
}

// One unconnected UDP socket sends to two VIPs a millisecond apart, tc
// rewriting both: the netfilter observer's report of the second datagram
// (after the rewrite) can come before the Pod tap's (before it). It is not
// taken for the first VIP's backend, in any arrival order.
func TestUDPSocketToTwoVIPs(t *testing.T) {
	dns1 := netip.MustParseAddrPort("10.120.0.10:53")
	dns2 := netip.MustParseAddrPort("10.120.0.11:53")
	be1 := netip.MustParseAddrPort("10.244.20.31:5353")
	be2 := netip.MustParseAddrPort("10.244.20.32:5353")
	src := netip.MustParseAddrPort("10.244.8.23:51000")
	cfg := flow.Config{Services: []flow.Service{{Addr: dns1.Addr()}, {Addr: dns2.Addr()}},
		Points: map[obs.Point]bool{obs.PointPod: true, obs.PointNFBefore: true, obs.PointUplink: true}}
	obsv := []obs.Observation{
		pkt(0, obs.PointPod, obs.DirOut, obs.UDP, src, dns1),
		pkt(1, obs.PointPod, obs.DirOut, obs.UDP, src, dns2),
		pkt(1.03, obs.PointNFBefore, 0, obs.UDP, src, be2),
		pkt(0.03, obs.PointNFBefore, 0, obs.UDP, src, be1),
	}
	for _, order := range permutations(len(obsv)) {
		e := flow.NewEngine(cfg)
		feed(t, e, obsv, order)
		flush(e, 2)
		fs := e.Flows()
		if len(fs) != 2 || fs[0].Service != dns1 || fs[0].Backend != be1 || fs[1].Service != dns2 || fs[1].Backend != be2 ||
			fs[0].RewrittenAt != flow.PlaceTC || fs[1].RewrittenAt != flow.PlaceTC || len(fs[0].Backends)+len(fs[1].Backends) != 0 {
			t.Errorf("order %v: want %s tc to %s and %s tc to %s; got:", order, dns1, be1, dns2, be2)
			logFlows(t, fs)
		}
		if s := e.Summary(); s.Unmatched != 0 {
			t.Errorf("order %v: %d unmatched", order, s.Unmatched)
		}
	}
}

// The first VIP's datagram left the node unrewritten and unanswered; the
// second VIP's was rewritten and answered, its uplink frames coming before
// the Pod tap's: the unrewritten flow takes neither the backend nor the
// reply.
func TestUnrewrittenFlowKeepsOtherVIPsBackend(t *testing.T) {
	dns1 := netip.MustParseAddrPort("10.120.0.10:53")
	dns2 := netip.MustParseAddrPort("10.120.0.11:53")
	be2 := netip.MustParseAddrPort("10.244.20.32:5353")
	src := netip.MustParseAddrPort("10.244.8.23:51000")
	cfg := flow.Config{Services: []flow.Service{{Addr: dns1.Addr()}, {Addr: dns2.Addr()}},
		Points: map[obs.Point]bool{obs.PointPod: true, obs.PointUplink: true}}
	obsv := []obs.Observation{
		pkt(0, obs.PointPod, obs.DirOut, obs.UDP, src, dns1),
		pkt(0.03, obs.PointUplink, obs.DirOut, obs.UDP, src, dns1),
		pkt(1.03, obs.PointUplink, obs.DirOut, obs.UDP, src, be2),
		pkt(1.4, obs.PointUplink, obs.DirIn, obs.UDP, be2, src),
		pkt(1, obs.PointPod, obs.DirOut, obs.UDP, src, dns2),
		// The reply reached the client: its Pod's tap saw it, translated
		// (without it the reply is one the node lost, RepliesLostOnNode).
		pkt(1.42, obs.PointPod, obs.DirIn, obs.UDP, dns2, src),
	}
	for _, order := range permutations(len(obsv)) {
		e := flow.NewEngine(cfg)
		feed(t, e, obsv, order)
		flush(e, 2)
		fs := e.Flows()
		if len(fs) != 2 || fs[0].Service != dns1 || fs[0].RewrittenAt != flow.PlaceNowhere || fs[0].Reply || fs[0].Backend.IsValid() ||
			fs[1].Service != dns2 || fs[1].Backend != be2 || !fs[1].Reply {
			t.Errorf("order %v: want %s nowhere without backend or reply, %s to %s with its reply; got:", order, dns1, dns2, be2)
			logFlows(t, fs)
		}
	}
}

// A single-VIP flow whose packet after the rewrite is seen later than the
// guess window (a busy node) still gets its backend: at the flow's next
// activity, or as the packet leaves the waiting room.
func TestDelayedRewriteSightingStillGuessed(t *testing.T) {
	dns := netip.MustParseAddrPort("10.120.0.10:53")
	be := netip.MustParseAddrPort("10.244.20.31:5353")
	src := netip.MustParseAddrPort("10.244.8.23:51000")
	cfg := flow.Config{Services: []flow.Service{{Addr: dns.Addr()}},
		Points: map[obs.Point]bool{obs.PointPod: true, obs.PointNFBefore: true}}
	for _, end := range []string{"answered", "unanswered", "the run stops"} {
		e := flow.NewEngine(cfg)
		e.Add(pkt(0, obs.PointPod, obs.DirOut, obs.UDP, src, dns))
		e.Add(pkt(2, obs.PointNFBefore, 0, obs.UDP, src, be))
		switch end {
		case "answered":
			e.Add(pkt(5, obs.PointPod, obs.DirIn, obs.UDP, dns, src))
		case "unanswered":
			flush(e, 2)
		default:
			if s := e.Summary(); s.RewrittenAt[flow.PlaceTC] != 0 {
				t.Fatalf("%s: guessed before the run stopped", end)
			}
			e.Stopping(flowtest.At(10))
		}
		f := only(t, e)
		if f.Backend != be || f.RewrittenAt != flow.PlaceTC {
			t.Errorf("%s: got backend %s %s (%s), want %s tc", end, f.Backend, f.RewrittenAt, f.Reason, be)
		}
		if s := e.Summary(); s.Unmatched != 0 || s.RewrittenAt[flow.PlaceTC] != 1 {
			t.Errorf("%s: %d unmatched, %d tc; want 0, 1", end, s.Unmatched, s.RewrittenAt[flow.PlaceTC])
		}
	}
}

// ctRead is nfConn's connection at ms with conntrack's events as the
// subscription delivers them: stamped when read, after the packets they
// tell of, the entry's first (no reply seen yet: 0x1a8) and its updates
// (seen reply 0x1aa, assured 0x1ae), read ahead of the packets, which the
// observers' ring and the taps' blocks hand over later.
func ctRead(ms float64, be netip.AddrPort) (events, packets []obs.Observation) {
	for _, o := range nfConn(ms, client, vip, be) {
		if o.Point != obs.PointConntrack {
			packets = append(packets, o)
		}
	}
	sort.SliceStable(packets, func(i, j int) bool { return packets[i].Time.Before(packets[j].Time) })
	for i, status := range []uint32{0x1a8, 0x1aa, 0x1ae, 0x1ae} {
		events = append(events, obs.Observation{Time: flowtest.At(ms + 10.5 + float64(i)*0.001), Point: obs.PointConntrack,
			Proto: obs.TCP, Src: client, Dst: vip, NATDst: be, CTStatus: status})
	}
	return events, packets
}

// A client port reused 50 ms after its connection closed (a client that
// binds its port, a server that closed first and keeps the TIME_WAIT):
// conntrack's events of the new connection, read before its packets, are
// its own, not the closed connection's, which conntrack reported already
// (their first is a new entry's: no reply seen). The closed flow kept
// them before: conntrack counted 8 events in it, none in the new one, and
// its last sighting the new connection's; and with the netfilter
// observers out, the new flow lacked the conntrack event its netfilter
// verdict rests on. Also beyond MaxFlows, where the later connections are
// refused: the flow followed keeps its own events and last sighting, and
// each refused connection is counted (only the first was, without socket
// events telling them apart).
func TestPortReusedAtOnceConntrackReadAhead(t *testing.T) {
	withNF := []obs.Point{obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink}
	ctOnly := []obs.Point{obs.PointHost, obs.PointConntrack, obs.PointUplink}
	for _, points := range [][]obs.Point{withNF, ctOnly} {
		var all []obs.Observation
		for _, ms := range []float64{0, 60, 120} {
			events, packets := ctRead(ms, backend)
			all = append(append(all, events...), packets...)
		}
		e := flow.NewEngine(httpConfig(points...))
		feed(t, e, all, identity(len(all)))
		fs := e.Flows()
		if len(fs) != 3 {
			t.Errorf("points %v: %d flows, want 3", points, len(fs))
			logFlows(t, fs)
			continue
		}
		for i, f := range fs {
			began := flowtest.At(float64(60 * i))
			if f.Last.After(began.Add(20*time.Millisecond)) || ctEvents(f) != 4 || f.RewrittenAt != flow.PlaceNetfilter {
				t.Errorf("points %v: flow %d: last %v after its connection began, %d conntrack events, %s (%s); want within 20ms, 4, netfilter",
					points, f.ID, f.Last.Sub(began), ctEvents(f), f.RewrittenAt, f.Reason)
			}
		}
	}

	// Beyond MaxFlows: the first connection holds the one place; each
	// later one is refused, and counted, once.
	cfg := httpConfig(withNF...)
	cfg.MaxFlows = 1
	e := flow.NewEngine(cfg)
	for _, ms := range []float64{0, 60, 120, 180} {
		events, packets := ctRead(ms, backend)
		feed(t, e, append(events, packets...), identity(len(events)+len(packets)))
	}
	fs := e.Flows()
	if s := e.Summary(); len(fs) != 1 || s.Drops[flow.DropFlowsOverMax] != 3 || fs[0].Last.After(flowtest.At(20)) || ctEvents(fs[0]) != 4 {
		t.Errorf("MaxFlows 1: %d flows, flows_over_max %d; want 1 and 3, and the flow's own 4 conntrack events and last sighting", len(fs), s.Drops[flow.DropFlowsOverMax])
		for _, f := range fs {
			t.Logf("flow %d: last %v after the first began, %d conntrack events", f.ID, f.Last.Sub(flowtest.At(0)), ctEvents(f))
		}
	}
}

// ctEvents is the number of conntrack events counted in f.
func ctEvents(f flow.Flow) uint64 {
	var n uint64
	for _, p := range f.Points {
		if p.Point == obs.PointConntrack.String() {
			n += p.Packets
		}
	}
	return n
}
