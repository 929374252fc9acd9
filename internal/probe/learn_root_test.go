package probe

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

func (p *Probe) hasAddr(t *testing.T, a netip.Addr) bool {
	t.Helper()
	var v uint8
	return p.maps["watch_addrs"].Lookup(a.As4(), &v) == nil
}

// watchHow is watch_addrs' value of a (0: not watched).
func (p *Probe) watchHow(a netip.Addr) uint8 {
	var v uint8
	if p.maps["watch_addrs"].Lookup(a.As4(), &v) != nil {
		return 0
	}
	return v
}

func (p *Probe) hasEndpoint(ap netip.AddrPort, proto obs.Proto) bool {
	var v uint8
	return p.maps["watch_endpoints"].Lookup(endpointKey(ap, proto), &v) == nil
}

func (p *Probe) hasClient(t *testing.T, ap netip.AddrPort, proto obs.Proto) bool {
	t.Helper()
	var v uint8
	return p.maps["watch_clients"].Lookup(clientKey(ap, proto), &v) == nil
}

// The socket observers learn in the kernel, before the connection's first
// packet: the backend a socket LB chose, and the client endpoint.
func TestSocketObserversLearnBackendAndClient(t *testing.T) {
	needRoot(t)
	env, cg, lbTCP := newLBEnv(t)

	p, c := startProbe(t, env.lbVIP) // the backend is not named
	mustAttach(t, p.AttachSocket(cg))
	if p.hasAddr(t, env.srvIP) {
		t.Fatal("backend watched before any connection")
	}
	env.runClient(t, cg, "tcp="+lbTCP.String())
	// Nothing in user space adds addresses: only the kernel can have.
	if !p.hasAddr(t, env.srvIP) {
		t.Errorf("watch_addrs lacks the backend %v right after the socket LB rewrote the connect", env.srvIP)
	}
	if p.isWatched(env.srvIP) {
		t.Errorf("backend %v in the user-space watch set: the test would not tell kernel learning", env.srvIP)
	}
	// The endpoint the LB chose, not every port of the backend.
	if how := p.watchHow(env.srvIP); how != watchEndpoints {
		t.Errorf("watch_addrs[%v] = %d, want %d (its endpoints only)", env.srvIP, how, watchEndpoints)
	}
	if !p.hasEndpoint(env.backendTCP, obs.TCP) {
		t.Errorf("watch_endpoints lacks %v/tcp, the endpoint the socket LB chose", env.backendTCP)
	}
	if other := netip.AddrPortFrom(env.srvIP, env.backendTCP.Port()+1); p.hasEndpoint(other, obs.TCP) || p.hasEndpoint(env.backendTCP, obs.UDP) {
		t.Errorf("watch_endpoints has an endpoint of %v the LB did not choose", env.srvIP)
	}
	first := c.waitFor(t, "first packet of the LB connection", func(o obs.Observation) bool {
		return o.Point == obs.PointSockEgress && o.Dst == env.backendTCP
	})
	if !p.hasClient(t, first.Src, obs.TCP) {
		t.Errorf("watch_clients lacks the client endpoint %v of the first packet", first.Src)
	}
	if s := p.Stats(); s.LearnErrors != 0 {
		t.Errorf("learn errors: %d", s.LearnErrors)
	}
}

// TestSocketObserversLearnInScopeOnly: the socket observers see every
// socket of the host, but once a scope is set they learn only from its
// netns: a client of a netns out of it (another node's on this host) is
// reported and teaches the other points nothing, neither its endpoint nor
// the backend its socket LB chose; one in it does, until it is taken out.
func TestSocketObserversLearnInScopeOnly(t *testing.T) {
	needRoot(t)
	env, cg, lbTCP := newLBEnv(t)
	p, c := startProbe(t, env.lbVIP)
	mustAttach(t, p.AttachSocket(cg))
	clientNS, err := nsutil.Inode(env.clientNS)
	if err != nil {
		t.Fatal(err)
	}
	srvNS, err := nsutil.Inode(env.srvNS)
	if err != nil {
		t.Fatal(err)
	}
	connect := func(n int) netip.AddrPort {
		t.Helper()
		env.runClient(t, cg, "tcp="+lbTCP.String())
		firsts := c.waitCount(t, "first packets of the LB connections", n, func(o obs.Observation) bool {
			return o.Point == obs.PointSockEgress && o.Dst == env.backendTCP
		})
		return firsts[n-1].Src
	}
	if err := p.Scope(srvNS); err != nil {
		t.Fatal(err)
	}
	if client := connect(1); p.hasClient(t, client, obs.TCP) || p.hasAddr(t, env.srvIP) {
		t.Errorf("learned from a netns out of scope: client %v %v, backend %v %v", client, p.hasClient(t, client, obs.TCP), env.srvIP, p.hasAddr(t, env.srvIP))
	}
	if err := p.Scope(clientNS); err != nil {
		t.Fatal(err)
	}
	if client := connect(2); !p.hasClient(t, client, obs.TCP) || !p.hasEndpoint(env.backendTCP, obs.TCP) {
		t.Errorf("not learned from a netns in scope: client %v %v, backend %v %v", client, p.hasClient(t, client, obs.TCP), env.backendTCP, p.hasEndpoint(env.backendTCP, obs.TCP))
	}
	if err := p.Unscope(clientNS); err != nil {
		t.Fatal(err)
	}
	if client := connect(3); p.hasClient(t, client, obs.TCP) {
		t.Errorf("client %v learned from a netns taken out of scope", client)
	}
}

// TestSocketLBEachBackend: a socket LB sends an unconnected UDP socket's
// datagrams to the VIP to a backend per datagram. Attached after the
// observers on their cgroup, it runs after them: sendmsg4 sees the VIP each
// time and reports it once, and the egress observer reports the first
// packet, then each datagram that leaves for a destination new for the
// socket, once, with the VIP sendmsg4 saw, and the kernel learns that
// backend. Attached before them, sendmsg4 reports each backend once, and
// the egress observer only the first packet to each: sendmsg4's
// destinations are the egress observer's.
// An LB attached a moment ago, which user space has not seen yet
// (read_requested off), is followed all the same.
func TestSocketLBEachBackend(t *testing.T) {
	needRoot(t)
	for _, c := range []struct {
		name            string
		after, unseen   bool // unseen: read_requested off, the LB not seen yet
		sendmsg, b1, b2 int  // reports of sendmsg4, of egress to each backend
	}{
		// b1: the first packet, and once more as the first datagram
		// that sendmsg4 saw go to the VIP again.
		{"after the observers", true, false, 1, 2, 1},
		{"after the observers, a moment ago", true, true, 1, 2, 1},
		{"before the observers", false, false, 2, 1, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := newTestEnv(t)
			b1, b2 := netip.AddrPortFrom(env.srvIP, 5353), netip.AddrPortFrom(env.srvIP, 5354)
			udpEcho(t, env.srvNS, b1)
			udpEcho(t, env.srvNS, b2)
			cg := newCgroup(t, env.name)
			lbUDP := netip.AddrPortFrom(env.lbVIP, env.udpPort)

			if !c.after {
				attachAlternatingLB(t, cg, lbUDP, [2]netip.AddrPort{b1, b2})
			}
			p, col := startProbe(t, env.lbVIP)
			if err := p.ReadRequested(!c.unseen); err != nil {
				t.Fatal(err)
			}
			mustAttach(t, p.AttachSocket(cg))
			if c.after {
				attachAlternatingLB(t, cg, lbUDP, [2]netip.AddrPort{b1, b2})
			}
			env.runClient(t, cg, "resend="+lbUDP.String())

			sent := col.waitFor(t, "sendmsg4 of the socket", func(o obs.Observation) bool {
				return o.Point == obs.PointSockAddr && o.ReqDst == lbUDP
			})
			second := col.waitFor(t, "the socket's datagram to the second backend", func(o obs.Observation) bool {
				return o.Point == obs.PointSockEgress && o.Dst == b2
			})
			if second.Cookie != sent.Cookie || second.NetNS != sent.NetNS {
				t.Errorf("second backend reported with cookie %d netns %d, want the socket's %d and %d", second.Cookie, second.NetNS, sent.Cookie, sent.NetNS)
			}
			if want := map[bool]obs.SockKind{true: obs.SockSendmsg}[c.after]; second.Kind != want {
				t.Errorf("second backend reported as kind %d, want %d", second.Kind, want)
			}
			// The VIP its sendmsg4 observer saw: a socket may send to
			// several, each with backends of its own.
			if want := map[bool]netip.AddrPort{true: lbUDP}[c.after]; second.ReqDst != want {
				t.Errorf("second backend reported with req_dst %v, want %v", second.ReqDst, want)
			}
			time.Sleep(200 * time.Millisecond) // the ring buffer is polled
			count := func(p obs.Point, dst netip.AddrPort) int {
				return len(col.matching(func(o obs.Observation) bool { return o.Point == p && (!dst.IsValid() || o.Dst == dst) }))
			}
			if s, n1, n2 := count(obs.PointSockAddr, netip.AddrPort{}), count(obs.PointSockEgress, b1), count(obs.PointSockEgress, b2); s != c.sendmsg || n1 != c.b1 || n2 != c.b2 {
				t.Errorf("%d sendmsg4 reports, egress to %v: %d, to %v: %d; want %d, %d and %d (of %d datagrams)", s, b1, n1, b2, n2, c.sendmsg, c.b1, c.b2, resends)
			}
			if !p.hasEndpoint(b2, obs.UDP) {
				t.Errorf("watch_endpoints lacks %v/udp, the LB's second backend", b2)
			}
		})
	}
}

// clientUDP opens a UDP socket on an ephemeral port of the client netns.
func (e *testEnv) clientUDP(t *testing.T) *net.UDPConn {
	t.Helper()
	var conn *net.UDPConn
	if err := nsutil.Do(e.clientNS, func() error {
		var err error
		conn, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(e.clientIP, 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func sendUDP(t *testing.T, c *net.UDPConn, to netip.AddrPort, payload []byte) {
	t.Helper()
	if _, err := c.WriteToUDPAddrPort(payload, to); err != nil {
		t.Fatalf("send to %v: %v", to, err)
	}
}

// echoUDP sends to the UDP VIP and waits for the backend's echo, so the first
// observer has seen the datagram to the VIP.
func (e *testEnv) echoUDP(t *testing.T, c *net.UDPConn) {
	t.Helper()
	sendUDP(t, c, netip.AddrPortFrom(e.vip, e.udpPort), []byte("ping"))
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 64)
	if _, _, err := c.ReadFromUDPAddrPort(buf); err != nil {
		t.Fatalf("echo through the VIP: %v", err)
	}
}

// The first tc observer (head of ingress) and the netfilter observer before
// NAT learn the client endpoint of a datagram to a watched VIP; from then on
// every observer reports that endpoint's packets to an address nobody named,
// and nothing else.
func TestObserversFollowLearnedClients(t *testing.T) {
	for _, family := range []string{"tc", "netfilter"} {
		t.Run(family, func(t *testing.T) {
			needRoot(t)
			env := newTestEnv(t)
			env.serve(t)
			p, c := startProbe(t, env.vip) // the backend is not watched
			points := []obs.Point{obs.PointTCHead, obs.PointTCTail}
			if family == "tc" {
				mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
			} else {
				mustAttach(t, p.AttachNetfilter(env.srvNS))
				points = []obs.Point{obs.PointNFBefore, obs.PointNFAfter}
			}
			// An echo nobody named, on an address of its own: no rule, no
			// watch, no rewrite to it.
			unwatched := netip.AddrPortFrom(env.otherSrvAddr(t), 7)
			udpEcho(t, env.srvNS, unwatched)

			stranger, learned := env.clientUDP(t), env.clientUDP(t)
			sendUDP(t, stranger, unwatched, []byte("stranger"))
			env.echoUDP(t, learned)
			client := learned.LocalAddr().(*net.UDPAddr).AddrPort()
			if !p.hasClient(t, client, obs.UDP) {
				t.Fatalf("watch_clients lacks %v after its datagram to the VIP", client)
			}
			sendUDP(t, learned, unwatched, []byte("learned"))

			for _, pt := range points {
				c.waitFor(t, fmt.Sprintf("%s: learned client %v -> unwatched %v", pt, client, unwatched), func(o obs.Observation) bool {
					return o.Point == pt && o.Src == client && o.Dst == unwatched && o.Proto == obs.UDP
				})
				c.waitFor(t, fmt.Sprintf("%s: reply of the unwatched %v to the learned client", pt, unwatched), func(o obs.Observation) bool {
					return o.Point == pt && o.Src == unwatched && o.Dst == client
				})
			}
			strangerAddr := stranger.LocalAddr().(*net.UDPAddr).AddrPort()
			if got := c.matching(func(o obs.Observation) bool { return o.Src == strangerAddr || o.Dst == strangerAddr }); len(got) != 0 {
				t.Errorf("traffic of an unlearned client to an unwatched address reported: %+v", got)
			}
			if p.hasClient(t, strangerAddr, obs.UDP) {
				t.Errorf("unlearned client %v in watch_clients", strangerAddr)
			}
		})
	}
}

// udpEcho answers every datagram to addr, in the netns at nsPath, until the
// test ends.
func udpEcho(t *testing.T, nsPath string, addr netip.AddrPort) {
	t.Helper()
	var pc *net.UDPConn
	if err := nsutil.Do(nsPath, func() error {
		var err error
		pc, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(addr))
		return err
	}); err != nil {
		t.Fatalf("echo on %v: %v", addr, err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			pc.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
}

// packets collects what a tap delivers.
type packets struct {
	mu   sync.Mutex
	seen []capture.Packet
}

func (r *packets) add(p *capture.Packet) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, *p.Clone())
}

func (r *packets) all() []capture.Packet {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.seen)
}

func (r *packets) from(src netip.AddrPort) []capture.Packet {
	var out []capture.Packet
	for _, p := range r.all() {
		if o, ok := p.Observation(obs.PointPod); ok && o.Src == src {
			out = append(out, p)
		}
	}
	return out
}

// errorsAbout returns the ICMP errors quoting a packet from src.
func (r *packets) errorsAbout(src netip.AddrPort) []capture.ICMPError {
	var out []capture.ICMPError
	for _, p := range r.all() {
		if e, ok := p.ICMPError(); ok && e.Src == src {
			out = append(out, e)
		}
	}
	return out
}

// The taps' eBPF filter shares the observers' maps: a client endpoint the tc
// observer learned is followed to an address nobody named (and so are the
// ICMP errors about its packets), watched addresses are found behind in-band
// 802.1Q and QinQ tags, and everything else stays in the kernel.
func TestTapFilterFollowsLearnedClients(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	p, _ := startProbe(t, env.vip)
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0")) // the learner

	const snaplen = 96 // the default: it holds an ICMP error's quoted ports
	prog, err := p.TapFilter(snaplen)
	if err != nil {
		t.Fatalf("TapFilter: %v", err)
	}
	if again, err := p.TapFilter(snaplen); err != nil || again != prog {
		t.Errorf("TapFilter(%d) twice: %v, %v; want the same program", snaplen, again, err)
	}
	// The client's TX tap runs before b0's tc ingress learns anything.
	tap, err := capture.Open(capture.Config{NetNS: env.clientNS, Ifname: "a0", Role: "pod", Snaplen: snaplen, Program: prog})
	if err != nil {
		t.Fatalf("open tap: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	var rec packets
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tap.Run(ctx, rec.add) }()
	t.Cleanup(func() { cancel(); <-done })

	hs, _ := nsHandle(t, env.srvNS)
	b0, err := hs.LinkByName("b0")
	if err != nil {
		t.Fatal(err)
	}
	// Frames written to a0 by another packet socket pass a0's TX tap.
	inject := func(frame []byte) {
		t.Helper()
		if err := nsutil.Do(env.clientNS, func() error {
			return sendFrame(env.a0Index, frame)
		}); err != nil {
			t.Fatalf("inject: %v", err)
		}
	}
	mac := b0.Attrs().HardwareAddr
	tagged := netip.AddrPortFrom(env.clientIP, 4321)
	qinq := netip.AddrPortFrom(env.clientIP, 4322)
	taggedOther := netip.AddrPortFrom(env.clientIP, 4323)
	inject(taggedUDPFrame(mac, 200, tagged.Addr(), env.vip, tagged.Port(), 53))
	inject(withOuterTag(taggedUDPFrame(mac, 200, qinq.Addr(), env.vip, qinq.Port(), 53), 0x88a8, 300))
	inject(taggedUDPFrame(mac, 200, taggedOther.Addr(), env.srvIP, taggedOther.Port(), 9))

	stranger, learned := env.clientUDP(t), env.clientUDP(t)
	unwatched := netip.AddrPortFrom(env.srvIP, 9)
	big := make([]byte, 100) // longer than snaplen
	sendUDP(t, stranger, unwatched, big)
	env.echoUDP(t, learned)
	client := learned.LocalAddr().(*net.UDPAddr).AddrPort()
	sendUDP(t, learned, unwatched, big)

	deadline := time.Now().Add(5 * time.Second)
	// The server answers both datagrams to the unwatched port with a port
	// unreachable: the learned client's is kept, the stranger's is not.
	for len(rec.from(client)) < 2 || len(rec.from(qinq)) < 1 || len(rec.from(tagged)) < 1 || len(rec.errorsAbout(client)) < 1 {
		if time.Now().After(deadline) {
			t.Fatalf("tap delivered %d frames of the learned client (want its datagram to the VIP and to %v), %d tagged, %d QinQ, %d ICMP errors about the learned client (want its port unreachable)",
				len(rec.from(client)), unwatched, len(rec.from(tagged)), len(rec.from(qinq)), len(rec.errorsAbout(client)))
		}
		time.Sleep(20 * time.Millisecond)
	}
	var toUnwatched bool
	for _, pkt := range rec.from(client) {
		o, _ := pkt.Observation(obs.PointPod)
		if o.Dst == unwatched {
			toUnwatched = true
			if pkt.CapLen != snaplen || pkt.Len <= snaplen {
				t.Errorf("frame of %d bytes captured %d, want the filter's snaplen %d", pkt.Len, pkt.CapLen, snaplen)
			}
		}
	}
	if !toUnwatched {
		t.Errorf("the learned client's datagram to the unwatched %v was not delivered", unwatched)
	}
	strangerAddr := stranger.LocalAddr().(*net.UDPAddr).AddrPort()
	for _, e := range rec.errorsAbout(client) {
		if e.Type != capture.ICMPDestUnreachable || e.Code != 3 || e.Dst != unwatched || e.From != env.srvIP {
			t.Errorf("ICMP error about the learned client: %s from %v about %s, want a port unreachable from %v about its datagram to %v",
				e.Kind(), e.From, e.QuotedString(), env.srvIP, unwatched)
		}
	}
	for _, pkt := range rec.all() {
		if e, ok := pkt.ICMPError(); ok && e.Src == client {
			continue
		}
		o, ok := pkt.Observation(obs.PointPod)
		if !ok || o.Src == strangerAddr || o.Dst == strangerAddr || o.Src == taggedOther {
			t.Errorf("unrelated frame delivered (ARP, IPv6, an unlearned client or an ICMP error about it, an unwatched tagged frame): %x", pkt.Data)
		}
	}
}

// withOuterTag puts an outer tag (TPID tpid, VLAN vid) in front of frame's
// first tag: QinQ.
func withOuterTag(frame []byte, tpid, vid uint16) []byte {
	out := append([]byte{}, frame[:12]...)
	out = binary.BigEndian.AppendUint16(out, tpid)
	out = binary.BigEndian.AppendUint16(out, vid)
	return append(out, frame[12:]...)
}

// A packet to a watched VIP that a rewrite sends elsewhere teaches the
// observers its new destination, in the kernel, as it passes them: a tcx
// program between the tc head and tail (the tail learns), one after the
// whole chain as legacy cls_bpf runs (netfilter before NAT learns), and
// NAT (netfilter after NAT learns). The taps then capture the flow beyond
// the rewrite from its first packet, also where the node's SNAT gives it a
// source nobody learned. A learned client sending to an address without a
// rewrite teaches nothing.
func TestObserversLearnRewrittenDestination(t *testing.T) {
	for _, place := range []string{"tcx", "after tc", "NAT"} {
		t.Run(place, func(t *testing.T) {
			needRoot(t)
			env := newTestEnv(t)
			p, _ := startProbe(t, env.vip)
			chosen := env.backendUDP.Addr() // the NAT's choice
			if place != "NAT" {
				chosen = netip.AddrFrom4([4]byte{10, 254, 0, 9}) // the tc program's choice
			}
			if place == "tcx" {
				rewriteDst(t, env.srvNS, env.b0Index, env.vip, chosen) // the observers go around it
			}
			mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
			if place == "after tc" {
				rewriteDst(t, env.srvNS, env.b0Index, env.vip, chosen) // appended after the tail
			}
			mustAttach(t, p.AttachNetfilter(env.srvNS))
			if p.hasAddr(t, chosen) {
				t.Fatalf("%v watched before any packet", chosen)
			}
			c := env.clientUDP(t)
			sendUDP(t, c, netip.AddrPortFrom(env.vip, env.udpPort), []byte("to the VIP"))
			deadline := time.Now().Add(3 * time.Second)
			for !p.hasAddr(t, chosen) {
				if time.Now().After(deadline) {
					t.Fatalf("%v, where the %s rewrite sent a datagram to the VIP, not learned", chosen, place)
				}
				time.Sleep(10 * time.Millisecond)
			}

			// The same client to an address no rewrite chose: not learned.
			other := env.otherSrvAddr(t)
			udpEcho(t, env.srvNS, netip.AddrPortFrom(other, 7))
			sendUDP(t, c, netip.AddrPortFrom(other, 7), []byte("elsewhere"))
			c.SetReadDeadline(time.Now().Add(3 * time.Second))
			if _, _, err := c.ReadFromUDPAddrPort(make([]byte, 64)); err != nil {
				t.Fatalf("echo from %v: %v", other, err)
			}
			if p.hasAddr(t, other) {
				t.Errorf("%v learned: the client sent to it without a rewrite", other)
			}
		})
	}
}

// TestReplyNATTeachesNothing: the node masquerades its own connection out
// with an address it watches (a NodePort traced as NODE-IP:PORT has the
// node's address watched); the reply comes back to that address and NAT
// gives it the connection's real source back. That is no rewrite to a
// backend: neither the real source nor the replying peer is learned.
func TestReplyNATTeachesNothing(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	masq := env.otherSrvAddr(t)
	p, _ := startProbe(t, masq)
	mustAttach(t, p.AttachNetfilter(env.srvNS))
	peer := netip.AddrPortFrom(env.clientIP, 7)
	udpEcho(t, env.clientNS, peer)
	rules := fmt.Sprintf("table ip ptmasq {\n chain post {\n  type nat hook postrouting priority srcnat; policy accept;\n  ip daddr %s udp dport 7 snat to %s\n }\n}\n", env.clientIP, masq)
	cmd := exec.Command("ip", "netns", "exec", filepath.Base(env.srvNS), "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	if err := nsutil.Do(env.srvNS, func() error {
		c, err := net.DialUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(env.srvIP, 0)), net.UDPAddrFromAddrPort(peer))
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte("out")); err != nil {
			return err
		}
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, err = c.Read(make([]byte, 64))
		return err
	}); err != nil {
		t.Fatalf("masqueraded echo: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	if p.hasAddr(t, env.srvIP) {
		t.Errorf("%v learned: the reply's destination, which NAT gave back, taken for a backend", env.srvIP)
	}
	if p.hasClient(t, peer, obs.UDP) {
		t.Errorf("%v learned as a client: it only replied to the watched %v", peer, masq)
	}
}

// rewriteDst attaches to the tcx ingress of ifindex (in the netns at nsPath)
// a program that rewrites the IPv4 destination from to to, with the header
// checksum (the UDP one is left: the packet only has to pass the observers
// after it).
func rewriteDst(t *testing.T, nsPath string, ifindex int, from, to netip.Addr) {
	t.Helper()
	const dstOff = 14 + 16 // Ethernet, then the IPv4 destination
	le := func(a netip.Addr) int32 { b := a.As4(); return int32(binary.LittleEndian.Uint32(b[:])) }
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "test_rewrite", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.Mov.Imm(asm.R2, dstOff),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -4),
			asm.Mov.Imm(asm.R4, 4),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, "next"),
			asm.LoadMem(asm.R1, asm.RFP, -4, asm.Word),
			asm.JNE.Imm32(asm.R1, le(from), "next"),
			// The header checksum, which IP checks before netfilter.
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, 14+10),
			asm.Mov.Imm32(asm.R3, le(from)),
			asm.Mov.Imm32(asm.R4, le(to)),
			asm.Mov.Imm(asm.R5, 4),
			asm.FnL3CsumReplace.Call(),
			asm.StoreImm(asm.RFP, -8, int64(le(to)), asm.Word),
			asm.Mov.Reg(asm.R1, asm.R6),
			asm.Mov.Imm(asm.R2, dstOff),
			asm.Mov.Reg(asm.R3, asm.RFP),
			asm.Add.Imm(asm.R3, -8),
			asm.Mov.Imm(asm.R4, 4),
			asm.Mov.Imm(asm.R5, 0),
			asm.FnSkbStoreBytes.Call(),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("next"), // TCX_NEXT
			asm.Return(),
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	var l link.Link
	if err := nsutil.Do(nsPath, func() error {
		var err error
		l, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: ebpf.AttachTCXIngress})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}
