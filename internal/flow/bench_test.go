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
