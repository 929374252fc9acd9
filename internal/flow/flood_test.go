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

// flood makes n datagrams (segments) from a Pod to a backend's address at
// the given capture points, spread over the first spanMs milliseconds: the
// taps capture every frame to or from a watched address, on any port. to's
// port 0: UDP to ports no Service uses; else TCP to that port. pairs is how
// many distinct port pairs it uses (1: one socket to one port; n: every
// datagram its own pair).
func flood(n, pairs int, spanMs float64, from netip.Addr, to netip.AddrPort, points ...obs.Point) []obs.Observation {
	var out []obs.Observation
	for i := range n {
		k := i % pairs
		src := ap(from, uint16(20000+k%30000))
		dst, proto := ap(to.Addr(), uint16(9000+k/30000)), obs.UDP
		if to.Port() != 0 {
			dst, proto = to, obs.TCP
		}
		for _, p := range points {
			o := obs.Observation{Time: flowtest.At(spanMs * float64(i) / float64(n)), Point: p, Dir: obs.DirOut,
				Proto: proto, Src: src, Dst: dst, Len: 1000, TCPFlags: 0x10}
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
		to    netip.AddrPort // the flood's destination (port 0: UDP to other ports)
		from  netip.Addr
	}
	nf := busyConfig(nfPoints...)
	// A pure socket-LB node (Cilium's kube-proxy replacement): no NAT
	// rule names the backends, whose ports are learned from the socket
	// events only.
	sock := httpConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointPod, obs.PointHost, obs.PointUplink)
	sock.Attribution.SockPrograms = []flow.SockProgram{{AttachType: "connect4", Name: "sock_lb", ID: 3}}
	notUplink := func(o obs.Observation) bool { return o.Point != obs.PointUplink }
	bpfEvents := func(o obs.Observation) bool { return source(o) == "bpf" }
	nfConn := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, close: true, exchanges: 3}
	other := ap(be1.Addr(), 0)
	cases := []tc{
		{"netfilter, uplink first, one flood socket", nf, nfConn, flow.PlaceNetfilter, notUplink, 1, other, podA},
		{"netfilter, uplink first, many flood sockets", nf, nfConn, flow.PlaceNetfilter, notUplink, 40000, other, podA},
		{"socket LB, events late, one flood socket", sock, conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, close: true, exchanges: 3, rw: bySocket, cookie: 77}, flow.PlaceSocket, bpfEvents, 1, other, podA},
		// Another Pod's bulk connection straight to the backend's served
		// port (a headless Service's client): it may be a traced flow's
		// until its window is over, and waits in the main room, of which
		// one endpoint pair cannot take it all.
		{"netfilter, uplink first, bulk straight to the backend", nf, nfConn, flow.PlaceNetfilter, notUplink, 1, be1, podB},
	}
	// A traced bulk flow whose uplink packets (about 2900) all wait for
	// it: no flood, nothing refused.
	bulk := nfConn
	bulk.exchanges, bulk.gap = 1400, 0.05
	cases = append(cases, tc{"netfilter, uplink first, bulk traced flow", nf, bulk, flow.PlaceNetfilter, notUplink, 1, other, podA})
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
			// 40000 datagrams in 100 ms at the host veth, netfilter and the
			// uplink: tens of times what the waiting room holds, well
			// within the reordering window.
			if c.c.exchanges > 100 && len(first) < 2800 {
				t.Fatalf("%d observations of the bulk flow wait, want more than 2800", len(first))
			}
			var points []obs.Point
			for _, p := range []obs.Point{obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink} {
				if c.cfg.Points[p] {
					points = append(points, p)
				}
			}
			n := 40000
			if c.c.exchanges > 100 {
				n = 0
			}
			fl := flood(n, c.pairs, 100, c.from, c.to, points...)
			seq := append(append(append([]obs.Observation{}, first...), fl...), last...)
			c.cfg.MaxFlows = 4096 // pathtrace's default: a room of 4096
			e := flow.NewEngine(c.cfg)
			peak := map[string]int{}
			for i, o := range seq {
				e.Add(o)
				if i%1000 == 0 {
					for k, v := range e.Sizes() {
						peak[k] = max(peak[k], v)
					}
				}
			}
			// The rooms stay bounded: 4096 and 1024 observations (their
			// queues hold those and at most 4*4096 more, done ones).
			for k, b := range map[string]int{"waiting.queue": 5*4096 + 1024, "waiting.others": 5*4096 + 1024,
				"waiting.byEnd": 2 * (5*4096 + 1024), "waiting.pairs": 4096 + 1024} {
				if peak[k] > b {
					t.Errorf("%s grew to %d, want at most %d", k, peak[k], b)
				}
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
			over, unrelated := s.Drops[flow.DropUnmatchedOverflow], s.Drops[flow.DropUnrelatedOverflow]
			if over != 0 && c.to.Port() == 0 {
				t.Errorf("unmatched_overflow %d: the flood took the traced flows' room", over)
			}
			// The flood is accounted for: unmatched once it waited its
			// window, or dropped from its room.
			if total := s.Unmatched + over + unrelated; total != uint64(len(fl)) {
				t.Errorf("unmatched %d + unmatched_overflow %d + unrelated_overflow %d = %d, want the flood's %d observations", s.Unmatched, over, unrelated, total, len(fl))
			}
			t.Logf("unmatched %d, unmatched_overflow %d, unrelated_overflow %d", s.Unmatched, over, unrelated)
		})
	}
}
