package flow_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// BenchmarkAdd feeds the packets of established netfilter-mode flows: the
// steady state, one observation per packet per point.
func BenchmarkAdd(b *testing.B) {
	const nflows = 1000
	e, seq := establishedFlows(nflows)
	start := flowtest.At(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		o := seq[i%len(seq)]
		o.Time = start.Add(time.Duration(len(seq)+i) * time.Microsecond)
		e.Add(o)
	}
	b.StopTimer()
	if s := e.Summary(); s.Flows != nflows || s.RewrittenAt[flow.PlaceNetfilter] != nflows {
		b.Fatalf("flows %d, netfilter %d; want %d each", s.Flows, s.RewrittenAt[flow.PlaceNetfilter], nflows)
	}
}

// establishedFlows is an engine that followed nflows netfilter-mode flows,
// each seen at every point, its reply too, and the observations that made
// them (times from flowtest.At(0) on, a microsecond apart).
func establishedFlows(nflows int) (*flow.Engine, []obs.Observation) {
	cfg := httpConfig(obs.PointPod, obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
	e := flow.NewEngine(cfg)
	var seq []obs.Observation
	for i := range nflows {
		src := netip.AddrPortFrom(client.Addr(), uint16(20000+i))
		for _, o := range []obs.Observation{
			{Point: obs.PointPod, Dir: obs.DirOut, Dst: vip},
			{Point: obs.PointHost, Dir: obs.DirIn, Dst: vip},
			{Point: obs.PointNFBefore, Dst: vip},
			{Point: obs.PointNFAfter, Dst: backend},
			{Point: obs.PointUplink, Dir: obs.DirOut, Dst: backend, VLAN: 200},
			{Point: obs.PointUplink, Dir: obs.DirIn, Src: backend, Dst: src},
			{Point: obs.PointHost, Dir: obs.DirOut, Src: vip, Dst: src},
			{Point: obs.PointPod, Dir: obs.DirIn, Src: vip, Dst: src},
		} {
			o.Proto, o.Len = obs.TCP, 100
			if !o.Src.IsValid() {
				o.Src = src
			}
			seq = append(seq, o)
		}
	}
	start := flowtest.At(0)
	for i, o := range seq { // establish the flows and their backends
		o.Time = start.Add(time.Duration(i) * time.Microsecond)
		e.Add(o)
	}
	return e, seq
}

// BenchmarkFlows is the report's cost per flow (Engine.Flows, all 1000 flows
// an op): its
// verdict, reason and per-point entries, as the final report and a run
// until stopped's flow log make them.
func BenchmarkFlows(b *testing.B) {
	const nflows = 1000
	e, _ := establishedFlows(nflows)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if n := len(e.Flows()); n != nflows {
			b.Fatalf("%d flows, want %d", n, nflows)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*nflows), "ns/flow")
}

// BenchmarkFlowsSidecar is BenchmarkFlows for a Pod whose sidecar's
// redirect takes every connection: 1000 app connections to the proxy's
// port, each followed by the proxy's own to the VIP, whose reasons name
// the proxy's upstream flows (proxyUpstreams, on an index: not a scan of
// every flow per redirected one).
func BenchmarkFlowsSidecar(b *testing.B) {
	const nflows = 1000
	cfg := httpConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress)
	e := flow.NewEngine(cfg)
	proxy := netip.MustParseAddrPort("127.0.0.1:15001")
	unbound := netip.AddrPortFrom(client.Addr(), 0)
	for i := range nflows {
		at := flowtest.At(float64(i))
		for j, dst := range []netip.AddrPort{proxy, vip} { // the app's, then the proxy's
			cookie, pid := uint64(2*i+j+1), uint32(100+j)
			src := netip.AddrPortFrom(client.Addr(), uint16(20000+2*i+j))
			at = at.Add(100 * time.Microsecond)
			for _, o := range []obs.Observation{
				{Point: obs.PointSockAddr, Kind: obs.SockConnect, Src: unbound, ReqDst: vip, Dst: vip},
				{Point: obs.PointSockState, Src: unbound, Dst: vip},
				{Point: obs.PointSockEgress, Src: src, Dst: dst, Len: 60},
			} {
				o.Time, o.Proto, o.Cookie, o.PID = at, obs.TCP, cookie, pid
				e.Add(o)
			}
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if fs := e.Flows(); len(fs) != 2*nflows || len(fs[0].ProxyUpstreams) != 1 {
			b.Fatalf("%d flows, want %d; the first names %v as its proxy's upstream, want one", len(fs), 2*nflows, fs[0].ProxyUpstreams)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*2*nflows), "ns/flow")
}

// BenchmarkAddUnmatched feeds traffic no flow claims: the waiting room's cost.
func BenchmarkAddUnmatched(b *testing.B) {
	e := flow.NewEngine(httpConfig(obs.PointUplink))
	start := flowtest.At(0)
	b.ReportAllocs()
	for i := range b.N {
		e.Add(obs.Observation{Time: start.Add(time.Duration(i) * time.Millisecond), Point: obs.PointUplink,
			Dir: obs.DirOut, Proto: obs.TCP, Len: 100,
			Src: netip.AddrPortFrom(netip.MustParseAddr("10.244.9.1"), uint16(i)), Dst: backend})
	}
}
