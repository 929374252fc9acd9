package flow_test

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// flood makes n UDP datagrams from a Pod to a backend's address on ports
// no Service uses, at the given capture points, spread over the first
// spanMs milliseconds: the taps capture every frame to or from a watched
// address, on any port. pairs is how many distinct port pairs it uses
// (1: one socket to one port; n: every datagram its own pair).
func flood(n, pairs int, spanMs float64, from netip.Addr, to netip.Addr, points ...obs.Point) []obs.Observation {
	var out []obs.Observation
	for i := range n {
		k := i % pairs
		src := ap(from, uint16(20000+k%30000))
		dst := ap(to, uint16(9000+k/30000))
		for _, p := range points {
			o := obs.Observation{Time: flowtest.At(spanMs * float64(i) / float64(n)), Point: p, Dir: obs.DirOut,
				Proto: obs.UDP, Src: src, Dst: dst, Len: 1000}
			if p == obs.PointHost {
				o.Dir = obs.DirIn
			}
			out = append(out, o)
		}
	}
	return out
}

// TestFloodKeepsTracedFlows: a Pod floods a backend's address on other UDP
// ports (its observations wait for a flow that never comes) while a traced
// flow's observations come out of order: those that wait for their flow
// (the uplink's post-DNAT packets before the packets that make the flow;
// a socket LB's packets before its socket events) must not be evicted by
// the flood: the flow keeps its points, backend and reply. The flood's
// observations are counted, never silently lost.
func TestFloodKeepsTracedFlows(t *testing.T) {
	tcp := obs.TCP
	// late puts the observations of the given sources after the flood,
	// the others (which wait) before it.
	type tc struct {
		name  string
		cfg   flow.Config
		c     conn
		place flow.Place
		late  func(obs.Observation) bool // delivered after the flood
		pairs int
	}
	nf := busyConfig(nfPoints...)
	// A pure socket-LB node (Cilium's kube-proxy replacement): no NAT
	// rule names the backends, whose ports are learned from the socket
	// events only.
	sock := httpConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointPod, obs.PointHost, obs.PointUplink)
	sock.Attribution.SockPrograms = []flow.SockProgram{{AttachType: "connect4", Name: "sock_lb", ID: 3}}
	notUplink := func(o obs.Observation) bool { return o.Point != obs.PointUplink }
	bpfEvents := func(o obs.Observation) bool { return source(o) == "bpf" }
	cases := []tc{
		{"netfilter, uplink first, one flood socket", nf, conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, close: true, exchanges: 3}, flow.PlaceNetfilter, notUplink, 1},
		{"netfilter, uplink first, many flood sockets", nf, conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, close: true, exchanges: 3}, flow.PlaceNetfilter, notUplink, 40000},
		{"socket LB, events late, one flood socket", sock, conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, close: true, exchanges: 3, rw: bySocket, cookie: 77}, flow.PlaceSocket, bpfEvents, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			traced := generate(c.cfg, c.c)
			var first, last []obs.Observation
			for _, o := range traced {
				if c.late(o) {
					last = append(last, o)
				} else {
					first = append(first, o)
				}
			}
			// 40000 datagrams in 100 ms at the host veth and the uplink:
			// ten times what the waiting room holds, well within the
			// reordering window.
			fl := flood(40000, c.pairs, 100, podA, be1.Addr(), obs.PointHost, obs.PointUplink)
			seq := append(append(append([]obs.Observation{}, first...), fl...), last...)
			e := flow.NewEngine(c.cfg)
			for _, o := range seq {
				e.Add(o)
			}
			flushAt(e, flowtest.At(1000))
			got := e.Flows()
			if errs := checkFlows(got, []wantFlow{flowOf(c.c, c.place)}); len(errs) > 0 {
				logFlows(t, got)
				t.Fatalf("the traced flow lost its evidence to the flood:\n  %s", strings.Join(errs, "\n  "))
			}
			// Its every packet was counted in it, at every point, as
			// without the flood.
			ref := flow.NewEngine(c.cfg)
			for _, o := range append(append([]obs.Observation{}, first...), last...) {
				ref.Add(o)
			}
			flushAt(ref, flowtest.At(1000))
			if want := ref.Flows(); fmt.Sprint(want[0].Points) != fmt.Sprint(got[0].Points) {
				t.Errorf("the flow's points\n  %v\nwant\n  %v", got[0].Points, want[0].Points)
			}
			s := e.Summary()
			if s.Drops[flow.DropUnmatchedOverflow] != 0 {
				t.Errorf("unmatched_overflow %d: the flood took the traced flows' room", s.Drops[flow.DropUnmatchedOverflow])
			}
			// The flood is accounted for: unmatched once it waited its
			// window, or dropped from its own room.
			if total := s.Unmatched + s.Drops[flow.DropUnrelatedOverflow]; total != uint64(len(fl)) {
				t.Errorf("unmatched %d + unrelated_overflow %d = %d, want the flood's %d observations", s.Unmatched, s.Drops[flow.DropUnrelatedOverflow], total, len(fl))
			}
			t.Log(fmt.Sprintf("unmatched %d, unrelated_overflow %d", s.Unmatched, s.Drops[flow.DropUnrelatedOverflow]))
		})
	}
}
