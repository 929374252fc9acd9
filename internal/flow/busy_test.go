package flow_test

import (
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// This file is the flow engine's adversary: busy-node situations (several
// Pods, several backends, reused ports, connections older than the trace,
// hairpin, node processes, replies first, more flows than MaxFlows), each
// generated packet by packet at every active point, then fed in the
// orders the session can deliver them: three taps handing over ring
// blocks up to 200 ms apart, the BPF observers' ring buffer and
// conntrack's netlink socket with their own delays. Every order must give
// the same flows, and those flows the expected verdict, backend and reply.

// rewriter is where a generated connection's VIP is rewritten.
type rewriter int

const (
	byNetfilter rewriter = iota // kube-proxy DNAT at PREROUTING (OUTPUT for a node client)
	byTC                        // a tc ingress program on the client's host veth
	bySocket                    // a cgroup connect4 program
	byNobody                    // it leaves the node with the VIP
)

// conn is one connection (TCP) or one socket's exchange (UDP) to generate.
type conn struct {
	proto       obs.Proto
	cl, svc, be netip.AddrPort
	at          float64 // ms of its first packet
	rw          rewriter
	node        bool // a node process (host netns): OUTPUT hook, no Pod veth
	local       bool // the backend is a Pod on this node: its veth, not the uplink
	redirect    bool // tc redirects to the local backend's veth: netfilter never sees it
	refused     bool // the backend answers its first request with an ICMP port unreachable (noReply)
	reset       bool // TCP: the backend answers the SYN with a RST (nothing listens)
	midway      bool // began before the trace: first packets are ACKs, no SYN, no conntrack NEW
	close       bool // FIN both ways, then the last ACK
	noReply     bool
	exchanges   int     // request/response pairs after the handshake (1 when 0)
	gap         float64 // ms between exchanges (10 when 0)
	cookie      uint64  // the socket's cookie, for the socket-layer points
	ctLag       float64 // how late conntrack stamps its events (receipt time), ms (0.1 when 0)
	masq        netip.AddrPort
}

var (
	podA   = netip.MustParseAddr("10.244.8.23")
	podB   = netip.MustParseAddr("10.244.8.24")
	podC   = netip.MustParseAddr("10.244.8.25")
	nodeIP = netip.MustParseAddr("192.168.77.2")
	be1    = netip.MustParseAddrPort("10.244.20.31:3000")
	be2    = netip.MustParseAddrPort("10.244.20.32:3000")
	be3    = netip.MustParseAddrPort("10.244.20.33:3000")
	beL    = netip.MustParseAddrPort("10.244.8.40:3000") // a backend Pod on this node
	dnsVIP = netip.MustParseAddrPort("10.120.0.10:53")
	dns1   = netip.MustParseAddrPort("10.244.20.41:53")
	dns2   = netip.MustParseAddrPort("10.244.20.42:53")
)

const hostNetNS = 4026531840

func ap(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// veth is a Pod's host-side veth index, for the tc attribution.
func veth(a netip.Addr) int { return 100 + int(a.As4()[3]) }

// busyConfig watches the HTTP and DNS VIPs with kube-proxy's rules for
// them, at the given points.
func busyConfig(points ...obs.Point) flow.Config {
	cfg := httpConfig(points...)
	cfg.HostNetNS = hostNetNS
	cfg.Services = append(cfg.Services, flow.Service{Addr: dnsVIP.Addr(), Port: dnsVIP.Port(), Proto: obs.UDP})
	for _, b := range []netip.AddrPort{be1, be2, be3, beL} {
		cfg.Attribution.NATRules = append(cfg.Attribution.NATRules, flow.NATRule{Source: "nftables", Table: "ip kube-proxy",
			Chain: "service-web", Hook: "prerouting", VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{b}, Rule: "dnat to " + b.String()})
	}
	for _, b := range []netip.AddrPort{dns1, dns2} {
		cfg.Attribution.NATRules = append(cfg.Attribution.NATRules, flow.NATRule{Source: "nftables", Table: "ip kube-proxy",
			Chain: "service-dns", Hook: "prerouting", VIP: dnsVIP, Proto: obs.UDP, Backends: []netip.AddrPort{b}, Rule: "dnat to " + b.String()})
	}
	cfg.Attribution.SockPrograms = []flow.SockProgram{{AttachType: "connect4", Name: "sock_lb", ID: 3}}
	return cfg
}

var allPoints = []obs.Point{obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointPod, obs.PointHost,
	obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink}

// gen makes the observations of connections at the active points of cfg.
type gen struct {
	cfg flow.Config
	out []obs.Observation
}

func (g *gen) on(p obs.Point) bool { return g.cfg.Points[p] }

func (g *gen) emit(o obs.Observation) {
	if g.on(o.Point) {
		g.out = append(g.out, o)
	}
}

// packet is one packet of a connection: its time, direction and flags.
type packet struct {
	at    float64
	reply bool
	flags uint8
	first bool // the connection's first request packet seen
	// state: conntrack reports an UPDATE event for it (TCP: the SYN-ACK,
	// the handshake's ACK, each FIN, the last ACK)
	state bool
}

func (c conn) packets() []packet {
	var ps []packet
	t := c.at
	if c.proto == obs.TCP && c.reset {
		return []packet{{at: t, flags: synFlag, first: true}, {at: t + 0.3, reply: true, flags: rstFlag | ackFlag, state: true}}
	}
	if c.proto == obs.TCP && !c.midway && c.noReply {
		// unanswered: the SYN and its retransmission a second later
		return []packet{{at: t, flags: synFlag, first: true}, {at: t + 1000, flags: synFlag}}
	}
	if c.proto == obs.TCP && !c.midway {
		ps = append(ps, packet{at: t, flags: synFlag}, packet{at: t + 0.3, reply: true, flags: synFlag | ackFlag, state: true},
			packet{at: t + 0.4, flags: ackFlag, state: true})
		t += 1
	}
	n, gap := max(c.exchanges, 1), c.gap
	if gap == 0 {
		gap = 10
	}
	for i := range n {
		at := t + float64(i)*gap
		var f uint8
		if c.proto == obs.TCP {
			f = pshAck
		}
		ps = append(ps, packet{at: at, flags: f})
		if !c.noReply {
			ps = append(ps, packet{at: at + 0.3, reply: true, flags: f})
		}
	}
	if c.proto == obs.TCP && c.close {
		end := t + float64(n-1)*gap + 5
		ps = append(ps, packet{at: end, flags: finFlag, state: true}, packet{at: end + 0.3, reply: true, flags: finFlag, state: true},
			packet{at: end + 0.4, flags: ackFlag, state: true})
	}
	for i := range ps {
		if !ps[i].reply {
			ps[i].first = true
			break
		}
	}
	return ps
}

// add generates c's observations.
func (g *gen) add(c conn) {
	lag := c.ctLag
	if lag == 0 {
		lag = 0.1
	}
	// What each part of the path sees as the request's destination.
	sockDst, tcDst, nfDst, outDst := c.svc, c.svc, c.svc, c.be
	switch c.rw {
	case bySocket:
		sockDst, tcDst, nfDst = c.be, c.be, c.be
	case byTC:
		tcDst, nfDst = c.be, c.be
	case byNobody:
		outDst = c.svc
	}
	src := c.cl
	if c.masq.IsValid() {
		src = c.masq
	}
	hook := obs.HookPrerouting
	if c.node {
		hook = obs.HookLocalOut
	}
	// The reply's source as the client sees it: translated back by
	// netfilter or tc, not by a socket program.
	backSrc := c.svc
	if c.rw == bySocket {
		backSrc = c.be
	}
	pk := func(at float64, p obs.Point, dir obs.Dir, s, d netip.AddrPort, flags uint8) obs.Observation {
		o := obs.Observation{Time: flowtest.At(at), Point: p, Dir: dir, Proto: c.proto, Src: s, Dst: d, Len: 60}
		if c.proto == obs.TCP {
			o.TCPFlags = flags
		}
		switch p {
		case obs.PointNFBefore, obs.PointNFAfter:
			o.Hook = hook
		case obs.PointHost, obs.PointTCHead, obs.PointTCTail:
			o.Ifindex, o.Ifname = veth(s.Addr()), "veth-"+s.Addr().String()
			if dir == obs.DirOut {
				o.Ifindex, o.Ifname = veth(d.Addr()), "veth-"+d.Addr().String()
			}
		case obs.PointPod:
			o.Ifname = "eth0-" + s.Addr().String()
			if dir == obs.DirIn {
				o.Ifname = "eth0-" + d.Addr().String()
			}
		case obs.PointUplink:
			o.VLAN = 200
			o.DstMAC = obs.MAC{2, 0, 0x0a, 0xf4, 8, 1}
		}
		return o
	}
	ct := func(at float64) {
		o := obs.Observation{Time: flowtest.At(at + lag), Point: obs.PointConntrack, Proto: c.proto, Src: c.cl, Dst: nfDst}
		if c.rw == byNetfilter {
			o.NATDst = c.be
		}
		if c.masq.IsValid() {
			o.NATSrc = c.masq
		}
		g.emit(o)
	}
	sock := func(at float64, p obs.Point, s, d netip.AddrPort) obs.Observation {
		o := obs.Observation{Time: flowtest.At(at), Point: p, Proto: c.proto, Src: s, Dst: d, Cookie: c.cookie,
			PID: 4242, Comm: "client", Cgroup: 9100}
		if c.node {
			o.NetNS = hostNetNS
		}
		return o
	}
	for _, p := range c.packets() {
		t := p.at
		if c.refused && p.first {
			// The backend's port unreachable about it, at each tap the
			// way back: quoting the request to the backend, then (once
			// conntrack translated it back) to the VIP.
			g.emit(icmpError(t+0.3, obs.PointUplink, obs.DirIn, c.proto, src, outDst, outDst.Addr(), ""))
			if !c.node {
				g.emit(icmpError(t+0.32, obs.PointHost, obs.DirOut, c.proto, c.cl, c.svc, c.svc.Addr(), "veth-"+c.cl.Addr().String()))
				g.emit(icmpError(t+0.33, obs.PointPod, obs.DirIn, c.proto, c.cl, c.svc, c.svc.Addr(), "eth0-"+c.cl.Addr().String()))
			}
		}
		if !p.reply {
			if p.first && c.cookie != 0 && !c.midway {
				o := sock(t-0.05, obs.PointSockAddr, ap(c.cl.Addr(), 0), sockDst)
				o.ReqDst, o.Kind = c.svc, obs.SockConnect
				if c.proto == obs.UDP {
					o.Kind = obs.SockSendmsg
					o.Src = c.cl
				}
				g.emit(o)
				if c.proto == obs.TCP {
					g.emit(sock(t-0.02, obs.PointSockState, c.cl, sockDst))
				}
				egressDst := sockDst
				if c.node && c.rw == byNetfilter {
					egressDst = c.be // after the node's OUTPUT NAT
				}
				g.emit(sock(t-0.003, obs.PointSockEgress, c.cl, egressDst))
			}
			if !c.node {
				g.emit(pk(t, obs.PointPod, obs.DirOut, c.cl, sockDst, p.flags))
				g.emit(pk(t+0.01, obs.PointHost, obs.DirIn, c.cl, sockDst, p.flags))
				g.emit(pk(t+0.012, obs.PointTCHead, obs.DirIn, c.cl, sockDst, p.flags))
				g.emit(pk(t+0.014, obs.PointTCTail, obs.DirIn, c.cl, tcDst, p.flags))
			}
			if c.redirect {
				g.emit(pk(t+0.03, obs.PointHost, obs.DirOut, src, outDst, p.flags))
				g.emit(pk(t+0.04, obs.PointPod, obs.DirIn, src, outDst, p.flags))
				continue
			}
			if c.rw != byNobody || !c.node {
				g.emit(pk(t+0.02, obs.PointNFBefore, 0, c.cl, nfDst, p.flags))
				g.emit(pk(t+0.021, obs.PointNFAfter, 0, c.cl, outDst, p.flags))
			}
			if p.first && !c.midway || p.state {
				ct(t) // NEW, then an UPDATE at each TCP state change
			}
			if c.local {
				g.emit(pk(t+0.03, obs.PointHost, obs.DirOut, src, outDst, p.flags))
				g.emit(pk(t+0.04, obs.PointPod, obs.DirIn, src, outDst, p.flags))
			} else {
				g.emit(pk(t+0.03, obs.PointUplink, obs.DirOut, src, outDst, p.flags))
			}
			continue
		}
		from := outDst // the backend, or the VIP when nothing rewrote it
		if c.local {
			g.emit(pk(t-0.05, obs.PointPod, obs.DirOut, from, src, p.flags))
			g.emit(pk(t-0.04, obs.PointHost, obs.DirIn, from, src, p.flags))
		} else {
			g.emit(pk(t, obs.PointUplink, obs.DirIn, from, src, p.flags))
		}
		if !c.redirect {
			g.emit(pk(t+0.01, obs.PointNFBefore, 0, from, src, p.flags))
		}
		if p.state && !c.redirect {
			ct(t)
		}
		if !c.node {
			g.emit(pk(t+0.02, obs.PointHost, obs.DirOut, backSrc, c.cl, p.flags))
			g.emit(pk(t+0.03, obs.PointPod, obs.DirIn, backSrc, c.cl, p.flags))
		}
	}
}

// icmpError stands for an ICMP error message seen at a tap about the
// packet src -> dst (its quote), sent by from: feedSeq hands it to
// NoteICMPError. Len -1 marks it.
func icmpError(ms float64, p obs.Point, dir obs.Dir, proto obs.Proto, src, dst netip.AddrPort, from netip.Addr, ifname string) obs.Observation {
	return obs.Observation{Time: flowtest.At(ms), Point: p, Dir: dir, Proto: proto, Src: src, Dst: dst, Len: -1, Ifname: ifname,
		Comm: "ICMP destination unreachable (code 3: port unreachable)", NATSrc: netip.AddrPortFrom(from, 0)}
}

func generate(cfg flow.Config, conns ...conn) []obs.Observation {
	g := &gen{cfg: cfg}
	for _, c := range conns {
		g.add(c)
	}
	return g.out
}

// source names what delivers an observation to the engine: each tapped
// interface its ring, the BPF observers one ring buffer, conntrack its
// netlink socket.
func source(o obs.Observation) string {
	switch o.Point {
	case obs.PointPod, obs.PointHost:
		return o.Point.String() + ":" + o.Ifname
	case obs.PointUplink:
		return "uplink"
	case obs.PointConntrack:
		return "conntrack"
	}
	return "bpf"
}

// deliveryOrders returns the orders in which the session can hand the
// observations over: time order; each source a whole block (200 ms)
// late; then random blocks: every tap retires a block after up to 200 ms
// of traffic, the BPF ring buffer and conntrack deliver within a few
// milliseconds; a source's own observations stay in order.
func deliveryOrders(o []obs.Observation, seeds int) map[string][]int {
	out := map[string][]int{}
	byArrival := func(arrival func(i int) float64) []int {
		order := identity(len(o))
		key := make([]float64, len(o))
		for i := range o {
			key[i] = arrival(i)
		}
		sort.SliceStable(order, func(a, b int) bool { return key[order[a]] < key[order[b]] })
		return order
	}
	ms := func(i int) float64 { return float64(o[i].Time.Sub(flowtest.At(0))) / float64(time.Millisecond) }
	out["time"] = byArrival(ms)
	sources := map[string]bool{}
	for i := range o {
		sources[source(o[i])] = true
	}
	for s := range sources {
		out[s+"-late"] = byArrival(func(i int) float64 {
			if source(o[i]) == s {
				return ms(i) + 200
			}
			return ms(i)
		})
		out[s+"-first"] = byArrival(func(i int) float64 {
			if source(o[i]) == s {
				return ms(i)
			}
			return ms(i) + 200
		})
	}
	for n := range seeds {
		rng := rand.New(rand.NewPCG(uint64(n), uint64(len(o))))
		// Each source's blocks: a block ends after up to 200 ms (taps) or
		// 3 ms (the others) of its own time and arrives when it ends.
		// Sources in a fixed order: each seed gives the same orders on every
		// run (a map's own order made a failing one come once in hundreds).
		phase := map[string]float64{}
		for _, s := range slices.Sorted(maps.Keys(sources)) {
			phase[s] = rng.Float64() * 200
		}
		arrival := func(i int) float64 {
			s, t := source(o[i]), ms(i)
			span := 200.0
			if s == "bpf" || s == "conntrack" {
				span = 3
			}
			// blocks are [phase + k*span, phase + (k+1)*span)
			end := phase[s] + (math.Floor((t-phase[s])/span)+1)*span
			return end + float64(len(s)%7)*0.001
		}
		out[fmt.Sprintf("blocks-%d", n+1)] = byArrival(arrival)
	}
	return out
}

// wantFlow is what one flow must be.
type wantFlow struct {
	proto    obs.Proto
	cl, svc  netip.AddrPort
	place    flow.Place
	backend  netip.AddrPort   // invalid: none
	backends []netip.AddrPort // when more than one
	reply    bool
	icmp     string // the point of its ICMP error, if one answered it
	uplink   bool   // seen at the uplink (VLAN set)
	reason   string // substring, when set
	// alt is a verdict also accepted, with a reason containing altReason:
	// an unknown where the arrival order hid what tells (the orders then
	// need not agree).
	alt       flow.Place
	altReason string
}

func (w wantFlow) String() string {
	return fmt.Sprintf("%s %s -> %s %s backend=%s backends=%v reply=%v uplink=%v", w.proto, w.cl, w.svc, w.place, w.backend, w.backends, w.reply, w.uplink)
}

// byEndpoints orders flows by protocol, client and service, then first
// seen: the connections of a reused port in their order.
func byEndpoints(fs []flow.Flow) []flow.Flow {
	fs = slices.Clone(fs)
	slices.SortStableFunc(fs, func(a, b flow.Flow) int {
		if c := strings.Compare(a.Proto, b.Proto); c != 0 {
			return c
		}
		if c := a.Client.Compare(b.Client); c != 0 {
			return c
		}
		if c := a.Service.Compare(b.Service); c != 0 {
			return c
		}
		return a.First.Compare(b.First)
	})
	return fs
}

// checkFlows compares flows with want, both by endpoints (want in the
// order of first seen).
func checkFlows(got []flow.Flow, want []wantFlow) []string {
	got = byEndpoints(got)
	want = slices.Clone(want)
	slices.SortStableFunc(want, func(a, b wantFlow) int {
		if c := strings.Compare(a.proto.String(), b.proto.String()); c != 0 {
			return c
		}
		if c := a.cl.Compare(b.cl); c != 0 {
			return c
		}
		return a.svc.Compare(b.svc)
	})
	var errs []string
	if len(got) != len(want) {
		errs = append(errs, fmt.Sprintf("got %d flows, want %d", len(got), len(want)))
	}
	for i := 0; i < len(got) && i < len(want); i++ {
		g, w := got[i], want[i]
		var bad []string
		if g.Proto != w.proto.String() || g.Client != w.cl || g.Service != w.svc {
			bad = append(bad, "endpoints")
		}
		isAlt := w.alt != "" && g.RewrittenAt == w.alt && strings.Contains(g.Reason, w.altReason)
		if g.RewrittenAt != w.place && !isAlt {
			bad = append(bad, "rewritten_at")
		}
		if g.Backend != w.backend {
			bad = append(bad, "backend")
		}
		if !slices.Equal(g.Backends, w.backends) {
			bad = append(bad, "backends")
		}
		if g.Reply != w.reply {
			bad = append(bad, "reply")
		}
		if icmp := ""; true {
			if g.ICMPError != nil {
				icmp = g.ICMPError.Point
			}
			if icmp != w.icmp {
				bad = append(bad, "icmp_error "+icmp)
			}
		}
		if (g.VLAN != nil) != w.uplink {
			bad = append(bad, "uplink")
		}
		if !isAlt && !strings.Contains(g.Reason, w.reason) {
			bad = append(bad, "reason")
		}
		if g.RewrittenAt == flow.PlaceUnknown && g.Reason == "" {
			bad = append(bad, "unknown without a reason")
		}
		if len(bad) > 0 {
			errs = append(errs, fmt.Sprintf("flow %d: wrong %s:\n      want %s\n      got  %s %s -> %s %s backend=%s backends=%v reply=%v uplink=%v by=%q reason=%q",
				i, strings.Join(bad, ", "), w, g.Proto, g.Client, g.Service, g.RewrittenAt, g.Backend, g.Backends, g.Reply, g.VLAN != nil, g.By, g.Reason))
		}
	}
	if len(got) > len(want) {
		for _, g := range got[len(want):] {
			errs = append(errs, fmt.Sprintf("extra flow %s %s -> %s %s backend=%s reason=%q", g.Proto, g.Client, g.Service, g.RewrittenAt, g.Backend, g.Reason))
		}
	}
	return errs
}

// busyCase is one situation and what the engine must make of it.
type busyCase struct {
	name  string
	cfg   flow.Config
	obs   []obs.Observation
	want  []wantFlow
	seeds int // random block orders (6 when 0)
}

// run feeds c in every delivery order, through Add and through
// AddPacket/Repeat as the capture path does, and checks the flows, the
// summary, the verdict cache and that every order gives the same flows.
// The first failing order is reported in full, the others by name.
func (c busyCase) run(t *testing.T) {
	t.Helper()
	seeds := c.seeds
	if seeds == 0 {
		seeds = 6
	}
	var ref []flow.Flow
	refName := ""
	orders := deliveryOrders(c.obs, seeds)
	names := make([]string, 0, len(orders))
	for name := range orders {
		names = append(names, name)
	}
	sort.Strings(names)
	slices.SortStableFunc(names, func(a, b string) int { return compareBool(a != "time", b != "time") })
	var failed []string
	for _, name := range names {
		order := orders[name]
		seq := make([]obs.Observation, len(order))
		for i, j := range order {
			seq[i] = c.obs[j]
		}
		for _, fast := range []bool{false, true} {
			label := name
			if fast {
				label += " (repeat path)"
			}
			errs := c.runOrder(seq, fast, &ref, &refName, label)
			if len(errs) == 0 {
				continue
			}
			if len(failed) == 0 {
				t.Errorf("%s order:\n    %s", label, strings.Join(errs, "\n    "))
			}
			failed = append(failed, label)
		}
	}
	if len(failed) > 1 {
		t.Errorf("%d of %d orders fail: %s", len(failed), 2*len(names), strings.Join(failed, ", "))
	}
}

func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

func (c busyCase) runOrder(seq []obs.Observation, fast bool, ref *[]flow.Flow, refName *string, label string) []string {
	e := flow.NewEngine(c.cfg)
	if stale := feedSeq(e, seq, fast); stale != "" {
		return []string{stale}
	}
	last := seq[0].Time
	for _, o := range seq {
		if o.Time.After(last) {
			last = o.Time
		}
	}
	flushAt(e, last)
	got := e.Flows()
	errs := checkFlows(got, c.want)
	s := e.Summary()
	if n := sumPlaces(s); s.Flows != len(got) || n != len(got) {
		errs = append(errs, fmt.Sprintf("summary counts %d flows, %d by verdict; Flows has %d", s.Flows, n, len(got)))
	}
	// Every observation is some flow's (or a refused one's).
	if s.Unmatched != 0 || s.Drops[flow.DropUnmatchedOverflow] != 0 {
		errs = append(errs, fmt.Sprintf("%d observations unmatched, %d overflowed; want none", s.Unmatched, s.Drops[flow.DropUnmatchedOverflow]))
	}
	if stale := e.StaleVerdicts(); len(stale) > 0 {
		errs = append(errs, fmt.Sprintf("stale cached verdicts %v", stale))
	}
	if bad := e.SNATIndexErrors(); len(bad) > 0 {
		errs = append(errs, fmt.Sprintf("SNAT index: %v", bad))
	}
	got = byEndpoints(got)
	for i := range got {
		got[i].ID = 0
	}
	alts := slices.ContainsFunc(c.want, func(w wantFlow) bool { return w.alt != "" })
	if *ref == nil {
		*ref, *refName = got, label
	} else if len(errs) == 0 && !alts && !reflect.DeepEqual(got, *ref) {
		errs = append(errs, "flows differ from the "+*refName+" order's: "+diffFlows(got, *ref))
	}
	return errs
}

// diffFlows names the first field that differs between two flow lists.
func diffFlows(a, b []flow.Flow) string {
	if len(a) != len(b) {
		return fmt.Sprintf("%d flows vs %d", len(a), len(b))
	}
	for i := range a {
		va, vb := reflect.ValueOf(a[i]), reflect.ValueOf(b[i])
		for j := range va.NumField() {
			if !reflect.DeepEqual(va.Field(j).Interface(), vb.Field(j).Interface()) {
				return fmt.Sprintf("flow %d (%s) %s: %+v vs %+v", i, a[i].Client, va.Type().Field(j).Name, va.Field(j).Interface(), vb.Field(j).Interface())
			}
		}
	}
	return "?"
}

func sumPlaces(s flow.Summary) int {
	n := 0
	for _, v := range s.RewrittenAt {
		n += v
	}
	return n
}

// feedSeq adds the observations in order; with fast, as the capture
// path does: a packet of a kind seen before (same point, direction,
// tuple) is only counted (Repeat), unless it is a TCP SYN, FIN or RST.
// After each, no cached verdict may be stale; it says which went stale.
func feedSeq(e *flow.Engine, seq []obs.Observation, fast bool) string {
	handles := map[packetKey]flow.Handle{}
	for step, o := range seq {
		k := packetKey{o.Point, o.Dir, o.Proto, o.Src, o.Dst}
		control := o.Proto == obs.TCP && o.TCPFlags&0x07 != 0
		switch h, ok := handles[k]; {
		case o.Len == -1:
			e.NoteICMPError(o, o.Comm, o.NATSrc.Addr())
		case !fast || !isPacket(o.Point):
			e.Add(o)
		case ok && !control && e.Repeat(&h, o.Point, o.Time, o.Len):
		default:
			if h, ok := e.AddPacket(o); ok {
				handles[k] = h
			} else {
				delete(handles, k)
			}
		}
		if stale := e.StaleVerdicts(); len(stale) > 0 {
			return fmt.Sprintf("step %d (%s %s -> %s): stale cached verdicts of flows %v", step, o.Point, o.Src, o.Dst, stale)
		}
		e.WarmVerdicts()
	}
	return ""
}

// flushAt moves the engine's clock well past t (flush), so that whatever
// still waits is settled.
func flushAt(e *flow.Engine, t time.Time) {
	flush(e, float64(t.Sub(flowtest.At(0)))/float64(time.Millisecond))
}

var nfPoints = []obs.Point{obs.PointPod, obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink}

func TestBusyNode(t *testing.T) {
	nf := busyConfig(nfPoints...)
	all := busyConfig(allPoints...)
	tc := busyConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointConntrack, obs.PointUplink)
	tcp, udp := obs.TCP, obs.UDP
	cases := []busyCase{}
	{
		// Three Pods to one VIP at once, kube-proxy picking backends at
		// random; Pods A and B both use source port 40100.
		conns := []conn{
			{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 3},
			{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be2, at: 0.05, close: true, exchanges: 3},
			{proto: tcp, cl: ap(podA, 40101), svc: vip, be: be2, at: 0.1, close: true},
			{proto: tcp, cl: ap(podC, 35000), svc: vip, be: be1, at: 0.15, exchanges: 5},
			{proto: udp, cl: ap(podB, 40100), svc: dnsVIP, be: dns1, at: 0.2},
		}
		var want []wantFlow
		for _, c := range conns {
			want = append(want, wantFlow{proto: c.proto, cl: c.cl, svc: c.svc, place: flow.PlaceNetfilter, backend: c.be, reply: true, uplink: true})
		}
		cases = append(cases, busyCase{name: "pods to one VIP, netfilter", cfg: nf, obs: generate(nf, conns...), want: want})
		cases = append(cases, busyCase{name: "pods to one VIP, every point", cfg: all, obs: generate(all, conns...), want: want})
		want = slices.Clone(want)
		for i := range conns {
			conns[i].rw = byTC
			want[i].place = flow.PlaceTC
		}
		cases = append(cases, busyCase{name: "pods to one VIP, tc", cfg: tc, obs: generate(tc, conns...), want: want})
		// Cilium's socket LB: connect4 picks the backend; the packets
		// never carry the VIP.
		want = slices.Clone(want)
		for i := range conns {
			conns[i].rw, conns[i].cookie = bySocket, uint64(100+i)
			want[i].place = flow.PlaceSocket
		}
		sock := busyConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointPod, obs.PointHost, obs.PointUplink)
		cases = append(cases, busyCase{name: "pods to one VIP, socket", cfg: sock, obs: generate(sock, conns...), want: want})
	}
	{
		// Each Pod's resolver sends from one unconnected UDP socket to
		// both nameservers (two DNS VIPs) a millisecond apart; tc
		// rewrites them; the nameservers answer.
		dnsVIP2 := netip.MustParseAddrPort("10.120.0.11:53")
		cfg := busyConfig(obs.PointPod, obs.PointHost, obs.PointNFBefore, obs.PointUplink)
		cfg.Services = append(cfg.Services, flow.Service{Addr: dnsVIP2.Addr(), Port: 53, Proto: obs.UDP})
		var conns []conn
		for i, pod := range []netip.Addr{podA, podB, podC} {
			ms := float64(i) * 0.3
			conns = append(conns,
				conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP, be: dns1, at: ms, rw: byTC},
				conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP2, be: dns2, at: ms + 1, rw: byTC})
		}
		var want []wantFlow
		for _, c := range conns {
			want = append(want, flowOf(c, flow.PlaceTC))
		}
		cases = append(cases, busyCase{name: "pods to two nameservers from one socket, tc", cfg: cfg, obs: generate(cfg, conns...), want: want})
		// Both nameservers served by one backend: after the rewrite the
		// second VIP's datagrams have the first's tuple. Ambiguous: the
		// second is unknown, and says why.
		want = slices.Clone(want)
		for i := range conns {
			if i%2 == 1 {
				conns[i].be = dns1
				want[i] = flowOf(conns[i], flow.PlaceUnknown)
				want[i].backend, want[i].uplink = netip.AddrPort{}, false
				want[i].reason = "whose backend 10.244.20.41:53 gets packets of the same tuple"
			}
		}
		cases = append(cases, busyCase{name: "pods to two nameservers of one backend, tc", cfg: cfg, obs: generate(cfg, conns...), want: want})
	}
	{
		// A migration: each Pod's resolver asks, from one unconnected UDP
		// socket, a nameserver VIP that a tc program rewrites and one that
		// kube-proxy's DNAT rewrites, both to one backend. Conntrack finds
		// the tc flow's entry holding the tuple and gives the netfilter
		// flow another source port. Before NAT only the tc flow goes to
		// the backend, beyond the SNAT only the netfilter flow leaves
		// from the new port: neither is ambiguous. (After NAT both send
		// one tuple: which flow counts those depends on arrival, so that
		// point is left out.)
		dnsVIP2 := netip.MustParseAddrPort("10.120.0.11:53")
		cfg := busyConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointNFBefore, obs.PointConntrack, obs.PointUplink)
		cfg.Services = append(cfg.Services, flow.Service{Addr: dnsVIP2.Addr(), Port: 53, Proto: obs.UDP})
		var conns []conn
		var want []wantFlow
		for i, pod := range []netip.Addr{podA, podB, podC} {
			ms := float64(i) * 0.3
			tc := conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP2, be: dns1, at: ms, rw: byTC}
			nf := conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP, be: dns1, at: ms + 1, masq: ap(pod, 1805)}
			conns = append(conns, tc, nf)
			want = append(want, flowOf(tc, flow.PlaceTC), flowOf(nf, flow.PlaceNetfilter))
		}
		cases = append(cases, busyCase{name: "pods to a tc and a netfilter nameserver of one backend from one socket", cfg: cfg, obs: generate(cfg, conns...), want: want})
		// The same resolvers ask the tc nameserver, then one nothing
		// rewrites (it leaves with its VIP, and no answer comes): the
		// second began just after the first's datagram, and is no
		// candidate for its backend once a point past the host veth saw
		// it go on to its VIP.
		dnsVIP3 := netip.MustParseAddrPort("10.120.0.12:53")
		cfg = busyConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink)
		cfg.Services = append(cfg.Services, flow.Service{Addr: dnsVIP2.Addr(), Port: 53, Proto: obs.UDP}, flow.Service{Addr: dnsVIP3.Addr(), Port: 53, Proto: obs.UDP})
		conns, want = nil, nil
		for i, pod := range []netip.Addr{podA, podB, podC} {
			ms := float64(i) * 0.3
			tc := conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP2, be: dns1, at: ms, rw: byTC}
			none := conn{proto: udp, cl: ap(pod, 51000), svc: dnsVIP3, at: ms + 0.5, rw: byNobody, noReply: true}
			conns = append(conns, tc, none)
			want = append(want, flowOf(tc, flow.PlaceTC), flowOf(none, flow.PlaceNowhere))
		}
		cases = append(cases, busyCase{name: "pods to a tc nameserver and an unrewritten one from one socket", cfg: cfg, obs: generate(cfg, conns...), want: want})
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

// flowOf is the flow c must make.
func flowOf(c conn, place flow.Place) wantFlow {
	w := wantFlow{proto: c.proto, cl: c.cl, svc: c.svc, place: place, backend: c.be, reply: !c.noReply, uplink: !c.local}
	if c.refused {
		w.icmp = "uplink"
	}
	if place == flow.PlaceNowhere {
		w.backend = netip.AddrPort{}
	}
	return w
}

func TestBusyPortReuse(t *testing.T) {
	nf := busyConfig(nfPoints...)
	all := busyConfig(allPoints...)
	tcp, udp := obs.TCP, obs.UDP
	var cases []busyCase
	// TCP: a client's connection closes (FIN both ways) and the same
	// port opens the next one to the same VIP, kube-proxy picking another
	// backend: a short-lived HTTP/1.0 client, a port freed by the server
	// closing first or reused from TIME_WAIT (tcp_tw_reuse).
	// (Reused sooner than clockSlack after the first's last packets, the
	// two are beyond what the clocks tell apart.)
	for _, after := range []float64{15, 200, 1500, 61000} {
		first := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 3}
		end := 1 + 20 + 5 + 0.4 // its last ACK
		second := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be2, at: end + after, close: true, exchanges: 2}
		third := conn{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be1, at: end + after/2, close: true}
		for _, cfg := range []flow.Config{nf, all} {
			name := fmt.Sprintf("tcp port reused %v ms after the close", after)
			if len(cfg.Points) == len(allPoints) {
				name += ", every point"
				first.cookie, second.cookie, third.cookie = 11, 12, 13
			}
			cases = append(cases, busyCase{name: name, cfg: cfg, obs: generate(cfg, first, second, third),
				want: []wantFlow{flowOf(first, flow.PlaceNetfilter), flowOf(third, flow.PlaceNetfilter), flowOf(second, flow.PlaceNetfilter)}})
		}
	}
	// The first connection's close was not seen (lost in a full ring):
	// its client acknowledged the handshake long before the next SYN.
	// The capture path counts that ACK with Repeat, not Add.
	{
		first := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, exchanges: 2}
		second := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be2, at: 120000, close: true}
		cases = append(cases, busyCase{name: "tcp port reused 2 min later, the first close unseen", cfg: nf, obs: generate(nf, first, second),
			want: []wantFlow{flowOf(first, flow.PlaceNetfilter), flowOf(second, flow.PlaceNetfilter)}})
	}
	// A single-backend Service: both connections of the reused port go to
	// the same backend, and only the host veth, conntrack and the uplink
	// watch. Conntrack's event for the second can be taken for the first's
	// (conntrack delivers ahead of the taps): its silence about the second
	// then proves nothing, and the second is not called tc.
	{
		thin := busyConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink)
		first := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 3}
		second := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 226.4, close: true}
		w2 := flowOf(second, flow.PlaceNetfilter)
		w2.alt, w2.altReason = flow.PlaceUnknown, "its client port was reused"
		cases = append(cases, busyCase{name: "tcp port reused, one backend, thin points", cfg: thin, obs: generate(thin, first, second),
			want: []wantFlow{flowOf(first, flow.PlaceNetfilter), w2}})
	}
	// Refused with a RST (nothing listened on the first backend): the
	// client never acknowledged anything; it retries from the same port.
	{
		first := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, reset: true}
		second := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be2, at: 200, close: true}
		cases = append(cases, busyCase{name: "tcp port reused after a RST", cfg: nf, obs: generate(nf, first, second),
			want: []wantFlow{flowOf(first, flow.PlaceNetfilter), flowOf(second, flow.PlaceNetfilter)}})
	}
	// UDP: a DNS client with a new socket per query; its port comes
	// back 31 s later, when conntrack has forgotten the first query and
	// kube-proxy picks another backend.
	{
		q1 := conn{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0}
		q2 := conn{proto: udp, cl: ap(podA, 51001), svc: dnsVIP, be: dns2, at: 5}
		q3 := conn{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns2, at: 31000}
		w1 := flowOf(q1, flow.PlaceNetfilter)
		w1.backends = []netip.AddrPort{dns1, dns2}
		cases = append(cases, busyCase{name: "dns port reused after 31 s", cfg: nf, obs: generate(nf, q1, q2, q3),
			want: []wantFlow{w1, flowOf(q2, flow.PlaceNetfilter)}})
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

func TestBusyLongLived(t *testing.T) {
	tcp := obs.TCP
	nf := busyConfig(nfPoints...)
	tcFull := busyConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointConntrack, obs.PointUplink)
	thin := busyConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink)
	var cases []busyCase
	for _, close := range []bool{false, true} {
		c := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, midway: true, close: close, exchanges: 4, gap: 150}
		d := conn{proto: tcp, cl: ap(podB, 40200), svc: vip, be: be2, at: 50, midway: true, close: close, exchanges: 3, gap: 150}
		name := "midway"
		if close {
			name += ", closing (conntrack updates)"
		}
		cases = append(cases,
			busyCase{name: name + ", netfilter", cfg: nf, obs: generate(nf, c, d),
				want: []wantFlow{flowOf(c, flow.PlaceNetfilter), flowOf(d, flow.PlaceNetfilter)}})
		c.rw, d.rw = byTC, byTC
		cases = append(cases,
			busyCase{name: name + ", tc", cfg: tcFull, obs: generate(tcFull, c, d),
				want: []wantFlow{flowOf(c, flow.PlaceTC), flowOf(d, flow.PlaceTC)}})
		// Only the host veth, conntrack and the uplink: tc or netfilter?
		// Conntrack's update at the close tells (its original
		// destination is the VIP or already the backend); without it,
		// nothing does.
		wc, wd := flowOf(c, flow.PlaceTC), flowOf(d, flow.PlaceTC)
		if !close {
			wc.place, wd.place = flow.PlaceUnknown, flow.PlaceUnknown
			wc.reason = "could be tc or netfilter"
			wd.reason = wc.reason
		}
		cases = append(cases, busyCase{name: name + ", tc, thin", cfg: thin, obs: generate(thin, c, d), want: []wantFlow{wc, wd}})
		c.rw, d.rw = byNetfilter, byNetfilter
		wc, wd = flowOf(c, flow.PlaceNetfilter), flowOf(d, flow.PlaceNetfilter)
		if !close {
			wc.place, wd.place = flow.PlaceUnknown, flow.PlaceUnknown
			wc.reason = "could be tc or netfilter"
			wd.reason = wc.reason
		}
		cases = append(cases, busyCase{name: name + ", netfilter, thin", cfg: thin, obs: generate(thin, c, d), want: []wantFlow{wc, wd}})
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

func TestBusyHairpin(t *testing.T) {
	tcp := obs.TCP
	nf := busyConfig(nfPoints...)
	all := busyConfig(allPoints...)
	c := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: beL, at: 0, local: true, close: true, exchanges: 2}
	d := conn{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be1, at: 0.1, close: true, exchanges: 2}
	// A Pod reaching its own Service and landing on itself: kube-proxy
	// masquerades the hairpin (else the Pod would answer itself).
	self := conn{proto: tcp, cl: ap(podC, 40100), svc: vip, be: ap(podC, 3000), at: 0.2, local: true, close: true,
		masq: netip.MustParseAddrPort("10.244.8.1:61000")}
	cases := []busyCase{
		{name: "backend on the node, netfilter", cfg: nf, obs: generate(nf, c, d, self),
			want: []wantFlow{flowOf(c, flow.PlaceNetfilter), flowOf(d, flow.PlaceNetfilter), flowOf(self, flow.PlaceNetfilter)}},
		{name: "backend on the node, netfilter, every point", cfg: all, obs: generate(all, c, d, self),
			want: []wantFlow{flowOf(c, flow.PlaceNetfilter), flowOf(d, flow.PlaceNetfilter), flowOf(self, flow.PlaceNetfilter)}},
	}
	// tc rewrites and redirects to the backend's veth (Cilium with a
	// backend on the node): netfilter and the uplink never see it; the
	// backend's veth TX shows it delivered, rewritten, and netfilter's
	// observer never saw it: tc.
	{
		tc := busyConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointNFBefore, obs.PointConntrack, obs.PointUplink)
		c, d := c, d
		c.rw, c.redirect, d.rw = byTC, true, byTC
		wc := flowOf(c, flow.PlaceTC)
		wc.reason = "backend 10.244.8.40:3000 at host veth TX to the backend Pod; netfilter excluded"
		cases = append(cases, busyCase{name: "backend on the node, tc redirect", cfg: tc, obs: generate(tc, c, d),
			want: []wantFlow{wc, flowOf(d, flow.PlaceTC)}})
		// Without the netfilter observer nor conntrack, tc or netfilter.
		thin := busyConfig(obs.PointPod, obs.PointHost, obs.PointUplink)
		wc.place, wc.reason = flow.PlaceUnknown, "could be tc or netfilter"
		wd := flowOf(d, flow.PlaceUnknown)
		wd.reason = wc.reason
		cases = append(cases, busyCase{name: "backend on the node, tc redirect, thin", cfg: thin, obs: generate(thin, c, d),
			want: []wantFlow{wc, wd}})
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

func TestBusyNodeProcess(t *testing.T) {
	tcp := obs.TCP
	all := busyConfig(allPoints...)
	nf := busyConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointNFBefore, obs.PointNFAfter, obs.PointConntrack, obs.PointUplink)
	n1 := conn{proto: tcp, cl: ap(nodeIP, 34718), svc: vip, be: be1, at: 0, node: true, close: true, cookie: 21}
	n2 := conn{proto: tcp, cl: ap(nodeIP, 34719), svc: vip, be: beL, at: 0.05, node: true, local: true, close: true, cookie: 22}
	p1 := conn{proto: tcp, cl: ap(podA, 34718), svc: vip, be: be2, at: 0.02, close: true, cookie: 23}
	want := []wantFlow{flowOf(n1, flow.PlaceNetfilter), flowOf(p1, flow.PlaceNetfilter), flowOf(n2, flow.PlaceNetfilter)}
	cases := []busyCase{
		{name: "node processes and a Pod, every point", cfg: all, obs: generate(all, n1, n2, p1), want: want},
		{name: "node processes and a Pod, no veth taps", cfg: nf, obs: generate(nf, n1, n2, p1), want: want},
	}
	// Cilium's socket LB serves the node's processes too.
	n1.rw, n2.rw, p1.rw = bySocket, bySocket, bySocket
	want = []wantFlow{flowOf(n1, flow.PlaceSocket), flowOf(p1, flow.PlaceSocket), flowOf(n2, flow.PlaceSocket)}
	cases = append(cases, busyCase{name: "node processes and a Pod, socket LB", cfg: all, obs: generate(all, n1, n2, p1), want: want})
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

// Masquerade: two Pods with the same source port to an endpoint beyond
// the node (the node SNATs them, the second to another port), DNAT by
// kube-proxy; conntrack names each SNAT source.
func TestBusyMasquerade(t *testing.T) {
	tcp := obs.TCP
	nf := busyConfig(nfPoints...)
	thin := busyConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink)
	a := conn{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 2, masq: ap(nodeIP, 40100)}
	b := conn{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be1, at: 0.05, close: true, masq: ap(nodeIP, 40101)}
	c := conn{proto: tcp, cl: ap(podC, 40100), svc: vip, be: be2, at: 0.1, close: true, masq: ap(nodeIP, 40102), rw: byNobody}
	want := []wantFlow{flowOf(a, flow.PlaceNetfilter), flowOf(b, flow.PlaceNetfilter), flowOf(c, flow.PlaceNowhere)}
	cases := []busyCase{
		{name: "masqueraded pods, netfilter", cfg: nf, obs: generate(nf, a, b, c), want: want},
		{name: "masqueraded pods, thin", cfg: thin, obs: generate(thin, a, b, c), want: want},
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

// A slow conntrack reader: its events stamped 150 ms after the packets
// they report (its receipt time).
func TestBusySlowConntrack(t *testing.T) {
	tcp, udp := obs.TCP, obs.UDP
	nf := busyConfig(nfPoints...)
	thin := busyConfig(obs.PointHost, obs.PointConntrack, obs.PointUplink)
	conns := []conn{
		{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 3, ctLag: 150},
		{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be2, at: 0.05, close: true, ctLag: 150},
		{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0.1, ctLag: 150},
		{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be2, at: 300, close: true, ctLag: 150}, // the port reused
	}
	var want []wantFlow
	for _, c := range conns {
		want = append(want, flowOf(c, flow.PlaceNetfilter))
	}
	cases := []busyCase{
		{name: "slow conntrack, netfilter", cfg: nf, obs: generate(nf, conns...), want: want},
		{name: "slow conntrack, thin", cfg: thin, obs: generate(thin, conns...), want: want},
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

// DNS through the socket layer: a resolver's new UDP socket per query
// (its cookie), sendmsg with the port known. (A port reused by a later
// socket: TestReusedPortsAccounted.)
func TestBusyDNSSockets(t *testing.T) {
	udp := obs.UDP
	all := busyConfig(allPoints...)
	q1 := conn{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0, cookie: 31}
	q2 := conn{proto: udp, cl: ap(podA, 51001), svc: dnsVIP, be: dns2, at: 0.5, cookie: 32}
	q3 := conn{proto: udp, cl: ap(podB, 51000), svc: dnsVIP, be: dns2, at: 1, cookie: 33}
	(busyCase{name: "dns sockets", cfg: all, obs: generate(all, q1, q2, q3),
		want: []wantFlow{flowOf(q1, flow.PlaceNetfilter), flowOf(q2, flow.PlaceNetfilter), flowOf(q3, flow.PlaceNetfilter)}}).run(t)
}

// More flows than MaxFlows on a busy node: whichever the arrival order
// keeps, each kept flow is whole and right, every other one is counted
// once in flows_over_max, and none of their packets count as unmatched
// or join a kept flow.
func TestBusyMaxFlows(t *testing.T) {
	tcp := obs.TCP
	cfg := busyConfig(nfPoints...)
	cfg.MaxFlows = 3
	conns := []conn{
		{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be1, at: 0, close: true, exchanges: 2},
		{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be2, at: 0.02, close: true},
		{proto: tcp, cl: ap(podC, 40100), svc: vip, be: be3, at: 0.04, close: true},
		{proto: tcp, cl: ap(podA, 40101), svc: vip, be: be2, at: 0.06, close: true},
		{proto: tcp, cl: ap(podB, 40101), svc: vip, be: be1, at: 0.08, close: true},
		// podA's first port again, once its connection closed: a flow of its own, refused
		{proto: tcp, cl: ap(podA, 40100), svc: vip, be: be3, at: 100, close: true, exchanges: 3},
	}
	o := generate(cfg, conns...)
	for name, order := range deliveryOrders(o, 8) {
		for _, fast := range []bool{false, true} {
			seq := make([]obs.Observation, len(order))
			for i, j := range order {
				seq[i] = o[j]
			}
			e := flow.NewEngine(cfg)
			if stale := feedSeq(e, seq, fast); stale != "" {
				t.Errorf("%s order (fast %v): %s", name, fast, stale)
			}
			flush(e, 200)
			fs := e.Flows()
			s := e.Summary()
			if len(fs) != 3 || s.Flows != 3 || s.Drops[flow.DropFlowsOverMax] != 3 || s.Unmatched != 0 || s.Drops[flow.DropUnmatchedOverflow] != 0 {
				t.Errorf("%s order (fast %v): %d flows, summary %d, flows_over_max %d, unmatched %d, overflow %d; want 3, 3, 3, 0, 0",
					name, fast, len(fs), s.Flows, s.Drops[flow.DropFlowsOverMax], s.Unmatched, s.Drops[flow.DropUnmatchedOverflow])
				logFlows(t, fs)
				continue
			}
			for _, f := range fs {
				// The flow of the conn that began at f.First.
				var c *conn
				for i := range conns {
					if conns[i].cl == f.Client && math.Abs(float64(f.First.Sub(flowtest.At(conns[i].at)))) < float64(time.Millisecond) {
						c = &conns[i]
					}
				}
				if c == nil {
					t.Errorf("%s order (fast %v): flow of %s began at %s, no connection's start", name, fast, f.Client, f.First.Format("05.000000"))
					continue
				}
				if errs := checkFlows([]flow.Flow{f}, []wantFlow{flowOf(*c, flow.PlaceNetfilter)}); len(errs) > 0 {
					t.Errorf("%s order (fast %v): %s", name, fast, strings.Join(errs, "; "))
				}
				// exactly its packets: 4 points see each client packet, the
				// SYN, the ACK, its exchanges and the FIN and last ACK.
				n := uint64(0)
				for _, p := range f.Points {
					if p.Point == "host" && !p.Reply {
						n += p.Packets
					}
				}
				if want := uint64(2 + max(c.exchanges, 1) + 2); n != want || !f.Last.Before(flowtest.At(c.at+100)) {
					t.Errorf("%s order (fast %v): flow of %s from %s counts %d requests at the host veth, last %s; want %d, before %s",
						name, fast, f.Client, f.First.Format("05.000000"), n, f.Last.Format("05.000000"), want, flowtest.At(c.at+100).Format("05.000000"))
				}
			}
		}
	}
}

// Backends answering with ICMP port unreachable (a DNS backend whose
// server is down), the taps delivering in any order: each flow reports
// the earliest error, the uplink's, whichever tap delivered first.
func TestBusyICMPErrors(t *testing.T) {
	udp, tcp := obs.UDP, obs.TCP
	nf := busyConfig(nfPoints...)
	conns := []conn{
		{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0, noReply: true, refused: true},
		{proto: udp, cl: ap(podB, 51000), svc: dnsVIP, be: dns2, at: 0.1},
		{proto: tcp, cl: ap(podC, 40100), svc: vip, be: be1, at: 0.2, noReply: true, refused: true},
	}
	var want []wantFlow
	for _, c := range conns {
		want = append(want, flowOf(c, flow.PlaceNetfilter))
	}
	(busyCase{name: "icmp errors", cfg: nf, obs: generate(nf, conns...), want: want}).run(t)
}
