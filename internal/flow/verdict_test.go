package flow_test

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

var (
	client  = netip.MustParseAddrPort("10.244.8.23:40100")
	vip     = netip.MustParseAddrPort("10.120.0.80:80")
	backend = netip.MustParseAddrPort("10.244.20.31:3000")
	other   = netip.MustParseAddrPort("10.244.20.32:3000")
)

// req is a request-direction observation at point p, ms after the base time.
func req(ms float64, p obs.Point, dir obs.Dir, dst netip.AddrPort) obs.Observation {
	return obs.Observation{Time: flowtest.At(ms), Point: p, Dir: dir, Proto: obs.TCP, Src: client, Dst: dst, Len: 60}
}

func ct(ms float64, dst, natDst netip.AddrPort) obs.Observation {
	return obs.Observation{Time: flowtest.At(ms), Point: obs.PointConntrack, Proto: obs.TCP, Src: client, Dst: dst, NATDst: natDst}
}

// flags sets a TCP observation's flags.
func flags(o obs.Observation, f uint8) obs.Observation {
	o.TCPFlags = f
	return o
}

// udp makes an observation UDP.
func udp(o obs.Observation) obs.Observation {
	o.Proto = obs.UDP
	return o
}

func httpConfig(points ...obs.Point) flow.Config {
	cfg := flow.Config{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.TCP}},
		Points:   make(map[obs.Point]bool),
		Attribution: flow.Attribution{
			TCPrograms: []flow.TCProgram{
				{Direction: "ingress", Kind: "tcx", Name: "lb_tcx", ID: 7},
				{Direction: "ingress", Kind: "cls_bpf", Name: "lb_cls", ID: 8},
				{Direction: "egress", Kind: "tcx", Name: "lb_rev", ID: 9},
			},
		},
	}
	for _, p := range points {
		cfg.Points[p] = true
	}
	return cfg
}

func only(t *testing.T, e *flow.Engine) flow.Flow {
	t.Helper()
	flows := e.Flows()
	if len(flows) != 1 {
		t.Fatalf("got %d flows, want 1: %+v", len(flows), flows)
	}
	return flows[0]
}

func TestVerdicts(t *testing.T) {
	in, out := obs.DirIn, obs.DirOut
	tests := []struct {
		name       string
		points     []obs.Point
		obs        []obs.Observation
		want       flow.Place
		wantBy     string // substring
		wantNotBy  string
		wantReason string // substring
	}{
		{
			name:   "tcx tail sees the backend: tight tcx bracket names tcx programs only",
			points: []obs.Point{obs.PointTCHead, obs.PointTCTail},
			obs:    []obs.Observation{req(0, obs.PointTCHead, in, vip), req(0.01, obs.PointTCTail, in, backend)},
			want:   flow.PlaceTC, wantBy: "tcx ingress lb_tcx (id 7)", wantNotBy: "cls_bpf",
		},
		{
			name:   "tc tail sees the VIP, netfilter the backend: cls_bpf after the tcx chain",
			points: []obs.Point{obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore},
			obs: []obs.Observation{req(0, obs.PointTCHead, in, vip), req(0.01, obs.PointTCTail, in, vip),
				req(0.02, obs.PointNFBefore, 0, backend)},
			// lb_tcx was on the veth before the tail observer went
			// after it, and that observer saw the VIP: only the cls_bpf
			// filter, which runs after the tcx chain, is left.
			want: flow.PlaceTC, wantBy: "cls_bpf ingress lb_cls (id 8)", wantNotBy: "tcx", wantReason: "at netfilter before NAT",
		},
		{
			name:   "socket tuple shows the VIP, pod eth0 the backend: inside the pod netns",
			points: []obs.Point{obs.PointSockState, obs.PointPod},
			obs: []obs.Observation{
				{Time: flowtest.At(0), Point: obs.PointSockState, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 5},
				req(0.01, obs.PointPod, out, backend)},
			want: flow.PlaceUnknown, wantReason: "could be netfilter in the Pod's netns or tc egress in the Pod's netns; inactive points in between: sockegress",
		},
		{
			// Istio's capture: the Pod's own OUTPUT chain redirects the
			// app's connection to the sidecar; the cgroup egress hook runs
			// after it, so the socket's first packet already goes there.
			name:   "socket tuple shows the VIP, its first packet the sidecar: netfilter in the pod netns",
			points: []obs.Point{obs.PointSockState, obs.PointSockEgress, obs.PointPod},
			obs: []obs.Observation{
				{Time: flowtest.At(0), Point: obs.PointSockState, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 6},
				{Time: flowtest.At(0.01), Point: obs.PointSockEgress, Proto: obs.TCP, Src: client, Dst: netip.MustParseAddrPort("127.0.0.1:15001"), Cookie: 6}},
			want: flow.PlaceNetfilter, wantBy: "netfilter OUTPUT in the client's netns",
			// Envoy dials the Service's endpoints, not the VIP: no flow of
			// its own is promised.
			wantReason: "sidecar proxy's capture does: the proxy's own upstream connection is another flow, listed when it goes to a watched VIP (one to the Service's endpoints directly, as Envoy's, is not followed)",
		},
		{
			// Istio's TPROXY capture: the Pod's mangle OUTPUT marks the
			// app's packets, its policy routing sends them to lo and a
			// TPROXY rule hands them to the proxy with the VIP unchanged:
			// they never reach the Pod's eth0. Not the node's doing.
			name:   "socket's first packet shows the VIP, pod eth0 captured and never saw it: kept in the pod",
			points: []obs.Point{obs.PointSockState, obs.PointSockEgress, obs.PointPod, obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink},
			obs: []obs.Observation{
				{Time: flowtest.At(0), Point: obs.PointSockState, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 8},
				{Time: flowtest.At(0.01), Point: obs.PointSockEgress, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 8}},
			want: flow.PlaceUnknown, wantReason: "did not leave the Pod's netns",
		},
		{
			name:   "socket's first packet shows the VIP, pod eth0 the backend: tc egress in the pod netns",
			points: []obs.Point{obs.PointSockState, obs.PointSockEgress, obs.PointPod},
			obs: []obs.Observation{
				{Time: flowtest.At(0), Point: obs.PointSockState, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 7},
				{Time: flowtest.At(0.01), Point: obs.PointSockEgress, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 7},
				req(0.02, obs.PointPod, out, backend)},
			want: flow.PlaceUnknown, wantReason: "at its eth0's egress, where no tc program was found",
		},
		{
			name:   "VIP after the backend is inconsistent",
			points: []obs.Point{obs.PointPod, obs.PointHost},
			obs:    []obs.Observation{req(0, obs.PointPod, out, backend), req(0.01, obs.PointHost, in, vip)},
			want:   flow.PlaceUnknown, wantReason: "inconsistent",
		},
		{
			name:   "rewritten across a veth is impossible",
			points: []obs.Point{obs.PointPod, obs.PointHost},
			obs:    []obs.Observation{req(0, obs.PointPod, out, vip), req(0.01, obs.PointHost, in, backend)},
			want:   flow.PlaceUnknown, wantReason: "nothing between these points rewrites",
		},
		{
			name:   "conntrack NAT but the uplink shows the VIP: conflicting, not guessed",
			points: []obs.Point{obs.PointConntrack, obs.PointUplink},
			obs:    []obs.Observation{ct(0.3, vip, backend), req(0.01, obs.PointUplink, out, vip)},
			want:   flow.PlaceUnknown, wantReason: "inconsistent",
		},
		{
			name:   "conntrack without NAT on the VIP and nothing after: not rewritten by netfilter, uplink inactive",
			points: []obs.Point{obs.PointHost, obs.PointConntrack},
			obs:    []obs.Observation{req(0, obs.PointHost, in, vip), ct(0.3, vip, netip.AddrPort{})},
			want:   flow.PlaceUnknown, wantReason: "uplink capture was inactive",
		},
		{
			name:   "netfilter observer at FORWARD is not a NAT checkpoint",
			points: []obs.Point{obs.PointHost, obs.PointNFAfter, obs.PointUplink},
			obs: []obs.Observation{req(0, obs.PointHost, in, vip),
				{Time: flowtest.At(0.02), Point: obs.PointNFAfter, Hook: obs.HookForward, Proto: obs.TCP, Src: client, Dst: backend},
				req(0.03, obs.PointUplink, out, backend)},
			want: flow.PlaceUnknown, wantReason: "could be tc or netfilter",
		},
		{
			name:   "host VIP, uplink backend, conntrack attached but silent: netfilter excluded",
			points: []obs.Point{obs.PointHost, obs.PointConntrack, obs.PointUplink},
			obs:    []obs.Observation{flags(req(0, obs.PointHost, in, vip), 0x02), flags(req(0.03, obs.PointUplink, out, backend), 0x02)},
			want:   flow.PlaceTC, wantReason: "netfilter excluded: conntrack reported no connection",
		},
		{
			// A kube-proxy flow that began before the capture: conntrack
			// reports new connections, so it never will.
			name:   "conntrack silent about a TCP flow seen from its middle: not excluded",
			points: []obs.Point{obs.PointHost, obs.PointConntrack, obs.PointUplink},
			obs:    []obs.Observation{flags(req(0, obs.PointHost, in, vip), 0x10), flags(req(0.03, obs.PointUplink, out, backend), 0x10)},
			want:   flow.PlaceUnknown, wantReason: "could be tc or netfilter; inactive points in between: tc_head, tc_tail, nf_before, nf_after, sockegress; conntrack reported no connection for this flow, which does not exclude netfilter: its first packets seen were not a SYN",
		},
		{
			name:   "conntrack silent about a TCP flow without flags: not excluded",
			points: []obs.Point{obs.PointHost, obs.PointConntrack, obs.PointUplink},
			obs:    []obs.Observation{req(0, obs.PointHost, in, vip), req(0.03, obs.PointUplink, out, backend)},
			want:   flow.PlaceUnknown, wantReason: "which does not exclude netfilter: its first packets seen were not a SYN",
		},
		{
			// A long-lived UDP socket rides an entry made before the run.
			name:   "conntrack silent about a UDP flow: proves nothing",
			points: []obs.Point{obs.PointHost, obs.PointConntrack, obs.PointUplink},
			obs:    []obs.Observation{udp(req(0, obs.PointHost, in, vip)), udp(req(0.03, obs.PointUplink, out, backend))},
			want:   flow.PlaceUnknown, wantReason: "may ride a conntrack entry made before",
		},
		{
			name:   "IPVS service but no observer between netfilter and the uplink: ambiguous",
			points: []obs.Point{obs.PointHost, obs.PointUplink},
			obs:    []obs.Observation{req(0, obs.PointHost, in, vip), req(0.03, obs.PointUplink, out, backend)},
			want:   flow.PlaceUnknown, wantReason: "could be tc or netfilter or ipvs",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := httpConfig(tt.points...)
			cfg.Services[0].Proto = 0 // TCP and UDP
			if strings.Contains(tt.name, "IPVS") {
				cfg.Attribution.IPVS = []flow.IPVSService{{VIP: vip, Proto: obs.TCP, Scheduler: "rr"}}
			}
			// Both arrival orders must agree.
			for _, reverse := range []bool{false, true} {
				e := flow.NewEngine(cfg)
				for i := range tt.obs {
					if reverse {
						i = len(tt.obs) - 1 - i
					}
					e.Add(tt.obs[i])
				}
				f := only(t, e)
				if f.RewrittenAt != tt.want || !strings.Contains(f.By, tt.wantBy) ||
					!strings.Contains(f.Reason, tt.wantReason) || (tt.wantNotBy != "" && strings.Contains(f.By, tt.wantNotBy)) {
					t.Errorf("reverse=%v: got %s by %q reason %q; want %s by ~%q reason ~%q",
						reverse, f.RewrittenAt, f.By, f.Reason, tt.want, tt.wantBy, tt.wantReason)
				}
				if f.RewrittenAt == flow.PlaceUnknown && f.Reason == "" {
					t.Error("unknown without a reason")
				}
			}
		})
	}
}

func TestSeveralBackendsInOneFlow(t *testing.T) {
	cfg := httpConfig(obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack)
	cfg.Services[0].Proto = obs.UDP
	e := flow.NewEngine(cfg)
	// One UDP client endpoint whose conntrack entry expired between datagrams:
	// conntrack names each backend, the later packets to the second one follow.
	e.Add(udp(req(0, obs.PointNFBefore, 0, vip)))
	e.Add(udp(req(0.01, obs.PointNFAfter, 0, backend)))
	e.Add(udp(ct(0.02, vip, backend)))
	e.Add(udp(req(40000, obs.PointNFAfter, 0, other)))
	e.Add(udp(ct(40000.02, vip, other)))
	f := only(t, e)
	if f.Backend != backend || len(f.Backends) != 2 || f.RewrittenAt != flow.PlaceNetfilter ||
		!strings.Contains(f.Reason, "2 backends seen") {
		t.Errorf("got backend %s backends %v %s (%s), want %s first of two, netfilter", f.Backend, f.Backends, f.RewrittenAt, f.Reason, backend)
	}
}

func TestOneSocketToTwoVIPs(t *testing.T) {
	dns1 := netip.MustParseAddrPort("10.120.0.10:53")
	dns2 := netip.MustParseAddrPort("10.120.0.11:53")
	be1 := netip.MustParseAddrPort("10.244.20.31:5353")
	be2 := netip.MustParseAddrPort("10.244.20.32:5353")
	src := netip.MustParseAddrPort("10.244.8.23:51000")
	cfg := flow.Config{Services: []flow.Service{{Addr: dns1.Addr()}, {Addr: dns2.Addr()}}}
	e := flow.NewEngine(cfg)
	add := func(ms float64, p obs.Point, dst, reqDst netip.AddrPort) {
		e.Add(obs.Observation{Time: flowtest.At(ms), Point: p, Dir: obs.DirOut, Kind: obs.SockSendmsg, Proto: obs.UDP,
			Src: src, Dst: dst, ReqDst: reqDst, Cookie: 77})
	}
	add(0, obs.PointSockAddr, be1, dns1)
	add(1, obs.PointSockAddr, be2, dns2)
	add(2, obs.PointPod, be2, netip.AddrPort{})
	add(3, obs.PointPod, be1, netip.AddrPort{})
	flows := e.Flows()
	if len(flows) != 2 {
		t.Fatalf("got %d flows, want 2", len(flows))
	}
	for i, want := range []struct{ svc, be netip.AddrPort }{{dns1, be1}, {dns2, be2}} {
		f := flows[i]
		if f.Service != want.svc || f.Backend != want.be || f.RewrittenAt != flow.PlaceSocket || len(f.Points) != 2 {
			t.Errorf("flow %d: %s -> %s backend %s %s points %d; want %s -> %s socket with 2 points",
				i, f.Client, f.Service, f.Backend, f.RewrittenAt, len(f.Points), src, want.svc)
		}
	}
}

func TestUplinkFrame(t *testing.T) {
	gw, _ := net.ParseMAC("02:00:0a:f4:08:01")
	stranger, _ := net.ParseMAC("02:00:00:00:00:99")
	cfg := httpConfig(obs.PointUplink)
	cfg.Attribution.GatewayMACs = []net.HardwareAddr{gw}
	for _, tt := range []struct {
		mac  net.HardwareAddr
		vlan uint16
		isGW bool
	}{{gw, 200, true}, {stranger, 0, false}} {
		e := flow.NewEngine(cfg)
		o := req(0, obs.PointUplink, obs.DirOut, vip)
		o.DstMAC, o.VLAN = obs.MAC(tt.mac), tt.vlan
		e.Add(o)
		f := only(t, e)
		if f.VLAN == nil || *f.VLAN != tt.vlan || f.UplinkDstMAC != tt.mac.String() || f.UplinkDstIsGateway != tt.isGW {
			t.Errorf("vlan %v mac %s gw %v; want %d %s %v", f.VLAN, f.UplinkDstMAC, f.UplinkDstIsGateway, tt.vlan, tt.mac, tt.isGW)
		}
		if f.RewrittenAt != flow.PlaceNowhere {
			t.Errorf("got %s, want nowhere", f.RewrittenAt)
		}
	}
}

func TestWaitingBounded(t *testing.T) {
	cfg := httpConfig(obs.PointUplink)
	cfg.MaxFlows = 10 // the waiting room holds max(4096, MaxFlows)
	// The backend is the VIP's by a NAT rule: traffic to it may be a
	// traced flow's and waits in the main room.
	cfg.Attribution.NATRules = []flow.NATRule{{Source: "nftables", Table: "ip kube-proxy", Chain: "service-web", Hook: "prerouting",
		VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{backend}, Rule: "dnat to " + backend.String()}}
	e := flow.NewEngine(cfg)
	// Traffic between endpoints no flow ever claims: it waits, then counts.
	const n = 5000
	for i := range n {
		o := req(0, obs.PointUplink, obs.DirOut, backend)
		o.Src = netip.AddrPortFrom(netip.MustParseAddr("10.244.9.1"), uint16(1000+i))
		e.Add(o)
	}
	s := e.Summary()
	if s.Drops[flow.DropUnmatchedOverflow] == 0 || s.Drops[flow.DropUnmatchedOverflow] >= n {
		t.Errorf("unmatched_overflow = %d, want some but not all of %d", s.Drops[flow.DropUnmatchedOverflow], n)
	}
	// Time moving past the reordering window expires the rest.
	late := req(0, obs.PointUplink, obs.DirOut, backend)
	late.Time = flowtest.At(0).Add(time.Minute)
	late.Src = netip.MustParseAddrPort("10.244.9.2:1")
	e.Add(late)
	s = e.Summary()
	if got := s.Unmatched + s.Drops[flow.DropUnmatchedOverflow]; got != n {
		t.Errorf("unmatched %d + overflow %d = %d, want %d", s.Unmatched, s.Drops[flow.DropUnmatchedOverflow], got, n)
	}
	if s.Flows != 0 {
		t.Errorf("flows = %d, want 0", s.Flows)
	}
}

func TestMaxFlowsCountsEachRefusedFlowOnce(t *testing.T) {
	cfg := httpConfig(obs.PointPod)
	cfg.MaxFlows = 1
	e := flow.NewEngine(cfg)
	for port := range uint16(3) {
		for range 4 {
			o := req(0, obs.PointPod, obs.DirOut, vip)
			o.Src = netip.AddrPortFrom(client.Addr(), 50000+port)
			e.Add(o)
		}
	}
	s := e.Summary()
	if s.Flows != 1 || s.Drops[flow.DropFlowsOverMax] != 2 {
		t.Errorf("flows %d, flows_over_max %d; want 1 and 2", s.Flows, s.Drops[flow.DropFlowsOverMax])
	}
}

// A refused flow's packets after the rewrite, and the replies, are refused
// with it: they neither wait for a flow that will never exist nor count as
// unmatched.
func TestRefusedFlowPacketsAfterRewrite(t *testing.T) {
	cfg := httpConfig(obs.PointPod, obs.PointUplink)
	cfg.MaxFlows = 1
	e := flow.NewEngine(cfg)
	for port := range uint16(3) {
		src := netip.AddrPortFrom(client.Addr(), 50000+port)
		o := req(0, obs.PointPod, obs.DirOut, vip)
		o.Src = src
		e.Add(o)
		after := req(1, obs.PointUplink, obs.DirOut, backend)
		after.Src = src
		reply := req(2, obs.PointUplink, obs.DirIn, src)
		reply.Src = backend
		for _, p := range []obs.Observation{after, reply} {
			h, ok := e.AddPacket(p)
			if port > 0 && (!ok || !h.Refused()) {
				t.Errorf("port %d: %s -> %s: handle ok=%v refused=%v, want a refused handle", src.Port(), p.Src, p.Dst, ok, h.Refused())
			}
		}
	}
	late := req(0, obs.PointPod, obs.DirOut, vip)
	late.Src = netip.AddrPortFrom(client.Addr(), 50001) // a refused flow again
	late.Time = flowtest.At(0).Add(time.Minute)         // expires whatever waits
	e.Add(late)
	s := e.Summary()
	if s.Flows != 1 || s.Drops[flow.DropFlowsOverMax] != 2 || s.Unmatched != 0 || s.Drops[flow.DropUnmatchedOverflow] != 0 {
		t.Errorf("flows %d, flows_over_max %d, unmatched %d, overflow %d; want 1, 2, 0, 0",
			s.Flows, s.Drops[flow.DropFlowsOverMax], s.Unmatched, s.Drops[flow.DropUnmatchedOverflow])
	}
}

// Far more refused flows than the refused set holds, each seen again a
// little later (as a busy client's packets interleave at several points):
// every one is still counted once.
func TestManyRefusedFlowsCountedOnce(t *testing.T) {
	cfg := httpConfig(obs.PointPod)
	cfg.MaxFlows = 1
	e := flow.NewEngine(cfg)
	const n, lag = 20000, 500
	src := func(i int) netip.AddrPort {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(8 + i/60000), 23}), uint16(1024+i%60000))
	}
	first := req(0, obs.PointPod, obs.DirOut, vip)
	e.Add(first) // the one flow the table holds
	for i := range n + lag {
		for _, j := range []int{i, i - lag} {
			if j < 0 || j >= n {
				continue
			}
			o := req(0, obs.PointPod, obs.DirOut, vip)
			o.Src = src(j)
			e.Add(o)
		}
	}
	if got := e.Summary().Drops[flow.DropFlowsOverMax]; got != n {
		t.Errorf("flows_over_max = %d, want %d", got, n)
	}
}

// An undecided flow that began while pathtrace was attaching, or after the
// run was asked to stop, says so (points missed it, not the node); one
// within the window keeps the plain reason.
func TestUnknownOutsideTheCaptureWindow(t *testing.T) {
	for _, c := range []struct {
		name       string
		began      float64 // ms after the base time; ready at 10, stop at 20
		wantPrefix string
		before     int
		after      int
	}{
		{"before ready", 5, "it began before pathtrace was in place", 1, 0},
		{"within", 15, "", 0, 0},
		{"after the stop", 25, "it began after the capture was asked to stop", 0, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := httpConfig(obs.PointTCHead, obs.PointUplink)
			cfg.Ready = flowtest.At(10)
			e := flow.NewEngine(cfg)
			// The VIP at tc head and nothing at the uplink: undecided.
			e.Add(req(c.began, obs.PointTCHead, obs.DirIn, vip))
			e.Stopping(flowtest.At(20))
			f := only(t, e)
			if f.RewrittenAt != flow.PlaceUnknown {
				t.Fatalf("rewritten_at %s, want unknown: %+v", f.RewrittenAt, f)
			}
			plain := strings.HasPrefix(f.Reason, "the VIP was last seen")
			if c.wantPrefix == "" && !plain || c.wantPrefix != "" && (plain || !strings.HasPrefix(f.Reason, c.wantPrefix)) {
				t.Errorf("reason %q, want it to start with %q", f.Reason, c.wantPrefix)
			}
			if strings.Contains(f.Reason, "before pathtrace was in place") != (c.before == 1) ||
				strings.Contains(f.Reason, "after the capture was asked to stop") != (c.after == 1) {
				t.Errorf("reason %q names the wrong end of the window", f.Reason)
			}
			s := e.Summary()
			if s.UnknownBeforeReady != c.before || s.UnknownAfterStop != c.after {
				t.Errorf("summary counts %d before ready, %d after the stop; want %d, %d",
					s.UnknownBeforeReady, s.UnknownAfterStop, c.before, c.after)
			}
		})
	}
}

// An undecided connection that began before the run, first seen while
// pathtrace was attaching or after the run was asked to stop, has a reason
// that begins by saying it began before the run (README's began_before_run),
// then places its first packet seen, not its beginning, in the window: it
// began with "it began before pathtrace was in place", and after the stop
// said "it began after the capture was asked to stop" of a connection it
// then said began before the run.
func TestBeganBeforeRunOutsideTheCaptureWindow(t *testing.T) {
	for _, c := range []struct {
		name   string
		seen   float64 // ms after the base time; ready at 10, stop at 20
		window string
	}{
		{"before ready", 5, "its first packet seen came before pathtrace was in place"},
		{"after the stop", 25, "its first packet seen came after the capture was asked to stop"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := httpConfig(obs.PointTCHead, obs.PointUplink)
			cfg.Ready = flowtest.At(10)
			e := flow.NewEngine(cfg)
			// An ACK with the VIP at tc head and nothing at the uplink:
			// mid-connection, undecided.
			e.Add(flags(req(c.seen, obs.PointTCHead, obs.DirIn, vip), 0x10))
			e.Stopping(flowtest.At(20))
			f := only(t, e)
			if f.RewrittenAt != flow.PlaceUnknown || !f.BeganBeforeRun {
				t.Fatalf("rewritten_at %s, began_before_run %v; want unknown, true: %+v", f.RewrittenAt, f.BeganBeforeRun, f)
			}
			if !strings.HasPrefix(f.Reason, "the connection began before the run") {
				t.Errorf("reason %q, want it to begin with the connection began before the run", f.Reason)
			}
			if !strings.Contains(f.Reason, c.window) || strings.Contains(f.Reason, "it began") {
				t.Errorf("reason %q, want %q and no \"it began\"", f.Reason, c.window)
			}
		})
	}
}

// Conntrack's silence about a flow excludes netfilter only when conntrack
// would have reported it: the flow seen from its start (after every point
// was in place) and no conntrack event lost.
func TestConntrackSilence(t *testing.T) {
	newEngine := func() *flow.Engine {
		cfg := httpConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink)
		cfg.Services[0].Proto = 0
		cfg.Ready = flowtest.At(10)
		return flow.NewEngine(cfg)
	}
	check := func(name string, e *flow.Engine, want flow.Place, reason string) {
		t.Helper()
		if stale := e.StaleVerdicts(); len(stale) > 0 {
			t.Errorf("%s: stale cached verdicts %v", name, stale)
		}
		f := only(t, e)
		if f.RewrittenAt != want || !strings.Contains(f.Reason, reason) {
			t.Errorf("%s: got %s (%s), want %s with %q", name, f.RewrittenAt, f.Reason, want, reason)
		}
		if r, ok := e.Classify(req(20, obs.PointHost, obs.DirIn, vip)); ok && r.Verdict != want {
			t.Errorf("%s: the packets' verdict is %s, want %s", name, r.Verdict, want)
		}
	}
	// UDP: seen from when the points were in place, then an earlier
	// reply arrives: it began before.
	e := newEngine()
	e.Add(udp(req(20, obs.PointHost, obs.DirIn, vip)))
	e.Add(udp(req(20.03, obs.PointUplink, obs.DirOut, backend)))
	e.WarmVerdicts()
	check("udp soon after ready", e, flow.PlaceUnknown, "may ride a conntrack entry made before")
	// UDP first seen long after: any earlier entry of it expired.
	late := newEngine()
	late.Add(udp(req(190_010, obs.PointHost, obs.DirIn, vip)))
	late.Add(udp(req(190_010.03, obs.PointUplink, obs.DirOut, backend)))
	late.WarmVerdicts()
	if f := only(t, late); f.RewrittenAt != flow.PlaceTC || !strings.Contains(f.Reason, "netfilter excluded: conntrack reported no connection") {
		t.Errorf("udp long after ready: got %s (%s), want tc with netfilter excluded", f.RewrittenAt, f.Reason)
	}
	e.Add(obs.Observation{Time: flowtest.At(5), Point: obs.PointUplink, Dir: obs.DirIn, Proto: obs.UDP, Src: backend, Dst: client})
	check("udp before ready", e, flow.PlaceUnknown, "does not exclude netfilter: the flow began before pathtrace was in place")

	// TCP from its SYN, before the points were in place.
	e = newEngine()
	e.Add(flags(req(5, obs.PointHost, obs.DirIn, vip), 0x02))
	e.Add(flags(req(5.03, obs.PointUplink, obs.DirOut, backend), 0x02))
	check("tcp before ready", e, flow.PlaceUnknown, "does not exclude netfilter: the flow began before pathtrace was in place")

	// TCP from its SYN, after: excluded until conntrack loses events.
	e = newEngine()
	e.Add(flags(req(20.03, obs.PointUplink, obs.DirOut, backend), 0x10))
	e.Add(flags(req(20, obs.PointHost, obs.DirIn, vip), 0x02))
	e.WarmVerdicts()
	check("tcp from its SYN", e, flow.PlaceTC, "netfilter excluded: conntrack reported no connection")
	e.SetConntrackLosses(3)
	check("conntrack lost events", e, flow.PlaceUnknown, "does not exclude netfilter: conntrack lost 3 events during the run")
}

// TestNetfilterProgramsNotBlamedForUnsent: a BPF program on a netfilter
// hook is named only for a request that reached the hook: a node's TCP
// connect() that failed before SYN_SENT (no route) sent nothing.
func TestNetfilterProgramsNotBlamedForUnsent(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/netfilter-bpf-program-drops-node.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range s.Run(nil).Flows() {
		if !f.Client.IsValid() && strings.Contains(f.Reason, "pr_nf_drop") {
			t.Errorf("a connect() that sent nothing is told a netfilter BPF program dropped it: %q", f.Reason)
		}
	}
}

// TestRejectedICMPNotTheRules: a flow a reject rule would end, answered by
// an ICMP error other than the rule's (a net unreachable where it answers
// port unreachable): the reason does not call that error the rule's
// answer, since something before the rule refused the request.
func TestRejectedICMPNotTheRules(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/netfilter-reject-unrouted.json")
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	var req obs.Observation
	for _, o := range s.Observations {
		if o.Src.Port() == 40020 && o.Point != obs.PointDrop { // flow 1, its drop unseen
			e.Add(o)
			req = o
		}
	}
	req.Point = obs.PointHost
	if !e.NoteICMPError(req, "ICMP destination unreachable (code 0: net unreachable)", netip.MustParseAddr("10.244.8.1")) {
		t.Fatal("the ICMP error found no flow")
	}
	flows := e.Flows()
	if len(flows) != 1 || flows[0].RewrittenAt != flow.PlaceNowhere {
		t.Fatalf("flows %+v, want one nowhere", flows)
	}
	r := flows[0].Reason
	if strings.Contains(r, "is its answer") || !strings.Contains(r, "is not the rule's answer (ICMP destination unreachable (code 3: port unreachable))") {
		t.Errorf("reason %q: want the net unreachable said not the rule's answer", r)
	}
}
