package probe

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

const tcpSYN = 0x02

// collector keeps what Run emits.
type collector struct {
	mu  sync.Mutex
	all []obs.Observation
}

func (c *collector) add(o obs.Observation) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.all = append(c.all, o)
}

func (c *collector) matching(pred func(obs.Observation) bool) []obs.Observation {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []obs.Observation
	for _, o := range c.all {
		if pred(o) {
			out = append(out, o)
		}
	}
	return out
}

// waitFor returns the first observation matching pred, waiting for it to
// arrive (events are asynchronous), or fails the test.
func (c *collector) waitFor(t *testing.T, what string, pred func(obs.Observation) bool) obs.Observation {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if got := c.matching(pred); len(got) > 0 {
			return got[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no observation: %s (got %d observations)", what, len(c.matching(func(obs.Observation) bool { return true })))
		}
	}
}

// waitCount waits until at least n observations match pred and returns them.
func (c *collector) waitCount(t *testing.T, what string, n int, pred func(obs.Observation) bool) []obs.Observation {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		got := c.matching(pred)
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d observations, want %d", what, len(got), n)
		}
	}
}

// newB0Probe creates a Probe watching env's VIP, with tc observers on b0,
// not running yet: the test reads its ring itself.
func newB0Probe(t *testing.T, env *testEnv) *Probe {
	t.Helper()
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if err := p.Watch(env.vip); err != nil {
		t.Fatal(err)
	}
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
	return p
}

// startProbe creates a Probe watching addrs and runs it until the test ends.
func startProbe(t *testing.T, addrs ...netip.Addr) (*Probe, *collector) {
	t.Helper()
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if err := p.Watch(addrs...); err != nil {
		t.Fatal(err)
	}
	c := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, c.add) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return p, c
}

func mustAttach(t *testing.T, atts []Attachment) []Attachment {
	t.Helper()
	for _, a := range atts {
		if a.Err != nil {
			t.Fatalf("%s at %s: %v", a.Observer, a.Where, a.Err)
		}
	}
	return atts
}

// attachedPrograms returns the IDs of the programs that links currently attach.
func attachedPrograms(t *testing.T) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	it := new(link.Iterator)
	defer it.Close()
	for it.Next() {
		info, err := it.Link.Info()
		if err != nil {
			t.Fatalf("link %d info: %v", it.ID, err)
		}
		ids = append(ids, info.Program)
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// assertDetached checks that no link attaches any of ids and that the
// programs themselves are gone.
func assertDetached(t *testing.T, ids []ebpf.ProgramID) {
	t.Helper()
	for _, id := range ids {
		if slices.Contains(attachedPrograms(t), id) {
			t.Errorf("program %d still attached by a link after Close", id)
		}
	}
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var alive []ebpf.ProgramID
		for _, id := range ids {
			if prog, err := ebpf.NewProgramFromID(id); err == nil {
				prog.Close()
				alive = append(alive, id)
			}
		}
		if len(alive) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("programs %v still loaded after Close", alive)
			return
		}
	}
}

func TestObserversBracketTraffic(t *testing.T) {
	needRoot(t)
	// A socket LB on the client's cgroup, attached before the observer: the
	// observer must see its rewrite as the effective destination.
	env, cg, lbTCP := newLBEnv(t)
	vipTCP := netip.AddrPortFrom(env.vip, env.tcpPort)
	vipUDP := netip.AddrPortFrom(env.vip, env.udpPort)

	p, c := startProbe(t, env.vip, env.lbVIP, env.srvIP)
	p.Preload(true, true)
	preloaded := len(p.progs)
	mustAttach(t, p.AttachSocket(cg))
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
	nf := mustAttach(t, p.AttachNetfilter(env.srvNS))
	mustAttach(t, p.AttachConntrack(env.srvNS))
	mustAttach(t, p.AttachDrops())
	if len(p.progs) != preloaded {
		t.Errorf("attaching loaded %d programs Preload had not: it should load every one", len(p.progs)-preloaded)
	}
	for _, a := range nf {
		if want := map[obs.Point]int32{obs.PointNFBefore: -101, obs.PointNFAfter: -99}[a.Point]; a.Prio != want {
			t.Errorf("%s at %s: priority %d, want %d in a fresh netns", a.Observer, a.Where, a.Prio, want)
		}
	}

	pid := uint32(env.runClient(t, cg,
		"tcp="+vipTCP.String(), "udpconn="+vipUDP.String(),
		"sendto="+vipUDP.String(), "sendmsg="+vipUDP.String(), "sendmmsg="+vipUDP.String(), "tcp="+lbTCP.String(),
		"tcp6="+vipTCP.String()))
	clientNS, _ := nsutil.Inode(env.clientNS)
	srvNS, _ := nsutil.Inode(env.srvNS)
	cgid := cgroupID(t, cg)

	// Socket bracket: requested (syscall) against effective (cgroup hook).
	sockAddr := func(kind obs.SockKind, proto obs.Proto, req netip.AddrPort) func(obs.Observation) bool {
		return func(o obs.Observation) bool {
			return o.Point == obs.PointSockAddr && o.PID == pid && o.Kind == kind && o.Proto == proto && o.ReqDst == req
		}
	}
	conn := c.waitFor(t, "connect4 to the TCP VIP", sockAddr(obs.SockConnect, obs.TCP, vipTCP))
	if conn.Dst != vipTCP || conn.Cgroup != cgid || conn.NetNS != clientNS || conn.Cookie == 0 || conn.Comm == "" {
		t.Errorf("connect4 observation %+v: want Dst %v (nothing rewrites at the socket), cgroup %d, netns %d, a cookie and a comm",
			conn, vipTCP, cgid, clientNS)
	}
	if o := c.waitFor(t, "connect4 of connected UDP", sockAddr(obs.SockConnect, obs.UDP, vipUDP)); o.Dst != vipUDP {
		t.Errorf("connected UDP: effective dst %v, want %v", o.Dst, vipUDP)
	}
	sends := c.waitCount(t, "sendmsg4 with the requested VIP from sendto, sendmsg and sendmmsg", 3,
		sockAddr(obs.SockSendmsg, obs.UDP, vipUDP))
	if len(sends) != 3 {
		t.Errorf("%d sendmsg4 observations, want 3", len(sends))
	}
	for _, o := range sends {
		if o.Dst != vipUDP {
			t.Errorf("unconnected UDP: effective dst %v, want %v", o.Dst, vipUDP)
		}
	}
	// Two TCP connections to the VIP: one from an AF_INET socket (connect4,
	// above), one from a dual-stack socket to ::ffff:VIP, which runs the
	// connect6 hooks and says so (a socket LB's connect6 program is what
	// can rewrite it).
	c.waitFor(t, "connect6 of the dual-stack socket to ::ffff:VIP", sockAddr(obs.SockConnect6, obs.TCP, vipTCP))
	lb := c.waitFor(t, "connect4 to the socket-LB VIP", sockAddr(obs.SockConnect, obs.TCP, lbTCP))
	if lb.Dst != env.backendTCP {
		t.Errorf("socket LB: effective dst %v, want the backend %v", lb.Dst, env.backendTCP)
	}

	// The cookie ties the socket to its SYN_SENT state and its first packet.
	state := c.waitFor(t, "SYN_SENT of the TCP connection", func(o obs.Observation) bool {
		return o.Point == obs.PointSockState && o.Cookie == conn.Cookie
	})
	if state.Dst != vipTCP || state.Src.Addr() != env.clientIP || state.PID != pid {
		t.Errorf("SYN_SENT observation %+v: want %v -> %v by pid %d", state, env.clientIP, vipTCP, pid)
	}
	syn := c.waitFor(t, "first packet of the TCP connection", func(o obs.Observation) bool {
		return o.Point == obs.PointSockEgress && o.Cookie == conn.Cookie
	})
	if syn.Dst != vipTCP || syn.Src.Addr() != env.clientIP || syn.Src.Port() == 0 || syn.TCPFlags&tcpSYN == 0 {
		t.Errorf("first packet %+v: want a SYN from %v to %v", syn, env.clientIP, vipTCP)
	}
	if o := c.waitFor(t, "first packet of the LB connection", func(o obs.Observation) bool {
		return o.Point == obs.PointSockEgress && o.Cookie == lb.Cookie
	}); o.Dst != env.backendTCP {
		t.Errorf("first packet of the LB connection to %v, want %v", o.Dst, env.backendTCP)
	}
	for _, send := range sends {
		if o := c.waitFor(t, "first datagram of unconnected UDP", func(o obs.Observation) bool {
			return o.Point == obs.PointSockEgress && o.Cookie == send.Cookie
		}); o.Dst != vipUDP || o.Proto != obs.UDP {
			t.Errorf("unconnected UDP datagram %+v, want to %v", o, vipUDP)
		}
	}
	client := syn.Src

	// tc bracket on b0: nothing rewrites at tc, so head and tail agree.
	for _, pt := range []obs.Point{obs.PointTCHead, obs.PointTCTail} {
		in := c.waitFor(t, pt.String()+" ingress of the SYN", func(o obs.Observation) bool {
			return o.Point == pt && o.Dir == obs.DirIn && o.Src == client && o.Dst == vipTCP
		})
		if in.Ifname != "b0" || in.Ifindex != env.b0Index || in.NetNS != srvNS || in.Len == 0 {
			t.Errorf("%s observation %+v: want b0 (ifindex %d) in netns %d", pt, in, env.b0Index, srvNS)
		}
		c.waitFor(t, pt.String()+" egress of the reply from the VIP", func(o obs.Observation) bool {
			return o.Point == pt && o.Dir == obs.DirOut && o.Src == vipTCP && o.Dst == client
		})
	}

	// netfilter bracket: DNAT at prerouting between before and after.
	nfSeen := func(pt obs.Point, hook obs.Hook, prio int32, src, dst netip.AddrPort) {
		t.Helper()
		c.waitFor(t, fmt.Sprintf("%s at %s (prio %d): %v -> %v", pt, hook, prio, src, dst), func(o obs.Observation) bool {
			return o.Point == pt && o.Hook == hook && o.Prio == prio && o.Src == src && o.Dst == dst && o.NetNS == srvNS
		})
	}
	nfSeen(obs.PointNFBefore, obs.HookPrerouting, -101, client, vipTCP)
	nfSeen(obs.PointNFAfter, obs.HookPrerouting, -99, client, env.backendTCP)
	// The server's replies leave from the backend; the reverse NAT comes later.
	nfSeen(obs.PointNFBefore, obs.HookLocalOut, -101, env.backendTCP, client)
	nfSeen(obs.PointNFAfter, obs.HookLocalOut, -99, env.backendTCP, client)

	// conntrack: original destination the VIP, reply source the backend.
	c.waitFor(t, "conntrack entry of the TCP connection", func(o obs.Observation) bool {
		return o.Point == obs.PointConntrack && o.Src == client && o.Dst == vipTCP && o.NATDst == env.backendTCP && o.NetNS == srvNS
	})
	c.waitFor(t, "conntrack entry of UDP", func(o obs.Observation) bool {
		return o.Point == obs.PointConntrack && o.Proto == obs.UDP && o.Dst == vipUDP && o.NATDst == env.backendUDP
	})

	s := p.Stats()
	if s.Events == 0 || s.ConntrackEvents == 0 || s.RingbufLosses != 0 || s.DecodeErrors != 0 || s.ConntrackErrors != 0 {
		t.Errorf("stats %+v: want events, conntrack events, no losses and no errors", s)
	}

	ids := ownProgramIDs(p)
	if len(ids) != 14 {
		t.Errorf("%d own programs, want 14 (sock state, 4 cgroup, 4 tcx, 2 netfilter, the conntrack filter, the drop observer and its symbol lookup)", len(ids))
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	assertDetached(t, ids)
}

// ownProgramIDs are the kernel IDs of p's programs.
func ownProgramIDs(p *Probe) []ebpf.ProgramID {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.progIDs)
}

// A TCP socket whose SYN its own netns rejects at filter OUTPUT never
// reaches the egress observer: its close from SYN_SENT names its port
// (SockClosed), the only observation that ties the socket to the flow
// netfilter saw.
func TestSocketClosedBeforeFirstPacket(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	cg := newCgroup(t, env.name)
	vipTCP := netip.AddrPortFrom(env.vip, env.tcpPort)
	env.rejectOutput(t, vipTCP)
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachSocket(cg))

	env.runClient(t, cg, "tcprefused="+vipTCP.String())
	conn := c.waitFor(t, "connect4 to the rejected VIP", func(o obs.Observation) bool {
		return o.Point == obs.PointSockAddr && o.Kind == obs.SockConnect && o.Dst == vipTCP
	})
	closed := c.waitFor(t, "the socket's close from SYN_SENT", func(o obs.Observation) bool {
		return o.Point == obs.PointSockState && o.Kind == obs.SockClosed && o.Cookie == conn.Cookie
	})
	if closed.Dst != vipTCP || closed.Src.Addr() != env.clientIP || closed.Src.Port() == 0 {
		t.Errorf("close observation %+v: want %v:PORT -> %v", closed, env.clientIP, vipTCP)
	}
	if n := len(c.matching(func(o obs.Observation) bool {
		return o.Point == obs.PointSockEgress && o.Cookie == conn.Cookie
	})); n != 0 {
		t.Errorf("%d egress observations of the rejected socket, want none (its SYN never left)", n)
	}
}

// udpPool is how many connected UDP sockets the client's udppool action
// opens before any of them sends.
const udpPool = 500

// A pool of connected UDP sockets that all wait before they send (a
// resolver's, a load generator's) keeps every socket's watch until its
// first datagram, which the egress observer then ties to the socket: with
// 8000 slots in sets of 4, 500 sockets waiting at once lose none (odds of
// one loss ~1/100000); a single table of 1024 slots lost ~15 of them.
func TestConnectedUDPPoolWatched(t *testing.T) {
	needRoot(t)
	env, cg, _ := newLBEnv(t) // with the backend's echo servers
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachSocket(cg))

	env.runClient(t, cg, "udppool="+netip.AddrPortFrom(env.vip, env.udpPort).String())
	egress := func(o obs.Observation) bool { return o.Point == obs.PointSockEgress }
	c.waitCount(t, "the first datagram of every socket of the pool", udpPool-1, egress)
	time.Sleep(100 * time.Millisecond)
	if n, s := len(c.matching(egress)), p.Stats(); n < udpPool-1 || s.LearnErrors > 1 {
		t.Errorf("%d of %d sockets' first datagrams tied to their socket, %d watches lost; want all but one at most", n, udpPool, s.LearnErrors)
	}
}

// The netfilter observers at OUTPUT name the socket a packet comes from (its
// cookie): the one tie to its flow when a rule at OUTPUT drops its SYN, so
// that neither the egress hook nor a close reports its port in time. At
// PREROUTING they name none.
func TestNetfilterOutputNamesSocket(t *testing.T) {
	needRoot(t)
	env, cg, _ := newLBEnv(t)
	vipTCP := netip.AddrPortFrom(env.vip, env.tcpPort)
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachSocket(cg))
	mustAttach(t, p.AttachNetfilter(env.clientNS))
	mustAttach(t, p.AttachNetfilter(env.srvNS))

	env.runClient(t, cg, "tcp="+vipTCP.String())
	conn := c.waitFor(t, "connect4 to the VIP", func(o obs.Observation) bool {
		return o.Point == obs.PointSockAddr && o.Kind == obs.SockConnect && o.Dst == vipTCP
	})
	out := c.waitFor(t, "the SYN at the client's OUTPUT", func(o obs.Observation) bool {
		return o.Point == obs.PointNFBefore && o.Hook == obs.HookLocalOut && o.Dst == vipTCP
	})
	if out.Cookie != conn.Cookie || out.Src.Port() == 0 {
		t.Errorf("OUTPUT observation %+v: want the socket's cookie %d and its port", out, conn.Cookie)
	}
	in := c.waitFor(t, "the SYN at the server's PREROUTING", func(o obs.Observation) bool {
		return o.Point == obs.PointNFBefore && o.Hook == obs.HookPrerouting && o.Dst == vipTCP
	})
	if in.Cookie != 0 {
		t.Errorf("PREROUTING observation %+v names a socket (cookie %d)", in, in.Cookie)
	}
}

func TestTwoProbesSideBySide(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	cg := newCgroup(t, env.name)
	vipTCP := netip.AddrPortFrom(env.vip, env.tcpPort)

	var probes [2]*Probe
	var seen [2]*collector
	for i := range probes {
		probes[i], seen[i] = startProbe(t, env.vip, env.srvIP)
		mustAttach(t, probes[i].AttachSocket(cg))
		mustAttach(t, probes[i].AttachTC(env.srvNS, env.b0Index, "b0"))
		nf := mustAttach(t, probes[i].AttachNetfilter(env.srvNS))
		for _, a := range nf {
			want := map[obs.Point]int32{obs.PointNFBefore: -101 - int32(i), obs.PointNFAfter: -99 + int32(i)}[a.Point]
			if a.Prio != want || (i == 1) != (a.Note != "") {
				t.Errorf("probe %d: %s at %s: priority %d (note %q), want %d", i, a.Observer, a.Where, a.Prio, a.Note, want)
			}
		}
	}

	env.runClient(t, cg, "tcp="+vipTCP.String())
	for i, c := range seen {
		for _, pt := range []obs.Point{obs.PointNFBefore, obs.PointNFAfter} {
			prio := map[obs.Point]int32{obs.PointNFBefore: -101 - int32(i), obs.PointNFAfter: -99 + int32(i)}[pt]
			c.waitFor(t, fmt.Sprintf("probe %d: %s at prerouting with priority %d", i, pt, prio), func(o obs.Observation) bool {
				return o.Point == pt && o.Hook == obs.HookPrerouting && o.Prio == prio
			})
		}
		c.waitFor(t, fmt.Sprintf("probe %d: connect4", i), func(o obs.Observation) bool {
			return o.Point == obs.PointSockAddr && o.ReqDst == vipTCP
		})
	}

	// Each tells the other's observers from the node's programs: they are
	// never named as rewriters.
	first, second := ownProgramIDs(probes[0]), ownProgramIDs(probes[1])
	for _, id := range second {
		if !probes[0].IsObserver(id) {
			t.Errorf("program %d of the second probe is not recognized by the first as a pathtrace observer", id)
		}
	}
	other, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "pt_tc_head_x", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if info, err := other.Info(); err != nil {
		t.Fatal(err)
	} else if id, _ := info.ID(); probes[0].IsObserver(id) {
		t.Errorf("a program of the node (%s, id %d) is taken for a pathtrace observer", info.Name, id)
	}

	// Closing the first leaves the second attached and working.
	if err := probes[0].Close(); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, first)
	attached := attachedPrograms(t)
	for _, id := range second {
		if !slices.Contains(attached, id) {
			t.Errorf("program %d of the second probe detached by closing the first", id)
		}
	}
	tcHead := func(o obs.Observation) bool { return o.Point == obs.PointTCHead }
	before := len(seen[1].matching(tcHead))
	env.runClient(t, cg, "tcp="+vipTCP.String())
	seen[1].waitCount(t, "second probe still observing", before+1, tcHead)
	if err := probes[1].Close(); err != nil {
		t.Fatal(err)
	}
	assertDetached(t, second)
}

// A flow's packets past the per-flow budget are summarized, not reported: the
// first PT_EVENTS_PER_FLOW (8) of a flow direction reach user space at each
// point, then one more per 10 ms the flow lasts; the rest are counted.
func TestBusyFlowIsSummarized(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p := newB0Probe(t, env)
	c := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = p.Run(ctx, c.add) }()

	const datagrams = 100
	conn := env.clientUDP(t)
	start := time.Now()
	for range datagrams {
		if _, err := conn.WriteToUDPAddrPort([]byte("x"), netip.AddrPortFrom(env.vip, 9)); err != nil {
			t.Fatal(err)
		}
	}
	refills := int(time.Since(start)/(10*time.Millisecond)) + 1
	head := func(o obs.Observation) bool { return o.Point == obs.PointTCHead && o.Dir == obs.DirIn }
	tail := func(o obs.Observation) bool { return o.Point == obs.PointTCTail && o.Dir == obs.DirIn }
	c.waitCount(t, "the flow's first packets at tc head", 8, head)
	time.Sleep(200 * time.Millisecond)
	heads, tails := len(c.matching(head)), len(c.matching(tail))
	if heads < 8 || heads > 8+refills {
		t.Errorf("%d tc head events for one flow of %d datagrams sent within %d refills, want 8 to %d", heads, datagrams, refills, 8+refills)
	}
	// head and tail each summarize the others.
	if s := p.Stats(); s.Summarized != uint64(2*datagrams-heads-tails) || s.RingbufLosses != 0 {
		t.Errorf("stats %+v: want %d summarized (%d head and %d tail events) and no loss", s, 2*datagrams-heads-tails, heads, tails)
	}
}

// A 5-tuple used again by a later flow (a UDP client port the next socket
// binds, a port reused hours later) gets its packets reported again: the
// budget refills with time. It used to stay spent for the map entry's life,
// and the next flows of the tuple went unseen at every packet observer,
// which the engine takes for "not there" (a netfilter rewrite read as tc).
func TestReusedTupleReportedAgain(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p := newB0Probe(t, env)
	c := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = p.Run(ctx, c.add) }()

	// Each datagram stands for a query of its own socket on the same port.
	const flows = 12
	conn := env.clientUDP(t)
	for range flows {
		if _, err := conn.WriteToUDPAddrPort([]byte("q"), netip.AddrPortFrom(env.vip, 53)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(150 * time.Millisecond)
	}
	head := func(o obs.Observation) bool { return o.Point == obs.PointTCHead && o.Dir == obs.DirIn }
	c.waitCount(t, "every query at tc head", flows, head)
	if s := p.Stats(); s.Summarized != 0 {
		t.Errorf("stats %+v: want nothing summarized", s)
	}
}

// A full ring buffer loses events; the losses are counted per point, so for
// every packet seen at the head and tail of b0 ingress, events + losses agree.
func TestRingbufLossesCounted(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p := newB0Probe(t, env)

	// Two events per datagram; the 512 KiB ring holds about 5,000.
	const datagrams = 30000
	// The server answers some datagrams (no socket on their port) with ICMP
	// errors from the VIP, which the egress observers report too; the kernel
	// rate-limits them (net.ipv4.icmp_msgs_burst, 50 by default).
	const icmpErrors = 100
	conn := env.clientUDP(t)
	// Each datagram to its own port: a flow of its own, reported in full (the
	// per-flow budget would summarize one flow's packets).
	for i := range datagrams {
		to := netip.AddrPortFrom(env.vip, uint16(1+i))
		if _, err := conn.WriteToUDPAddrPort([]byte("x"), to); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatal(err)
		}
	}
	if s := p.Stats(); s.RingbufLosses == 0 {
		t.Fatalf("no ring-buffer losses after %d datagrams with no reader: %+v", datagrams, s)
	}

	c := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx, c.add) }()
	count := func(pt obs.Point) int {
		return len(c.matching(func(o obs.Observation) bool { return o.Point == pt }))
	}
	var s Stats
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		s = p.Stats()
		head := uint64(count(obs.PointTCHead)) + s.LossesByPoint[obs.PointTCHead]
		tail := uint64(count(obs.PointTCTail)) + s.LossesByPoint[obs.PointTCTail]
		if head == tail && head >= datagrams && head <= datagrams+icmpErrors {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("head events+losses %d, tail %d (datagrams %d, ICMP errors at most %d)", head, tail, datagrams, icmpErrors)
		}
	}
	if s.RingbufLosses != s.LossesByPoint[obs.PointTCHead]+s.LossesByPoint[obs.PointTCTail] {
		t.Errorf("losses %d not all at the tc points: %v", s.RingbufLosses, s.LossesByPoint)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// Detach takes the observers out of the traffic's path and keeps the
// counters: what they lost while attached is still said, and what comes
// afterwards (nobody reads the ring any more) is neither seen nor lost.
func TestDetachKeepsCounters(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p := newB0Probe(t, env)
	conn := env.clientUDP(t)
	// Flows of their own, more than the ring holds (see
	// TestRingbufLossesCounted).
	send := func(first int) {
		for i := range 10000 {
			to := netip.AddrPortFrom(env.vip, uint16(first+i))
			if _, err := conn.WriteToUDPAddrPort([]byte("x"), to); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatal(err)
			}
		}
	}
	send(1)
	lost := p.Stats().RingbufLosses
	if lost == 0 {
		t.Fatal("no ring-buffer losses with no reader")
	}
	if err := p.Detach(); err != nil {
		t.Fatal(err)
	}
	send(10001)
	if s := p.Stats(); s.RingbufLosses != lost {
		t.Errorf("ring-buffer losses %d after Detach, want the %d of before kept, no more", s.RingbufLosses, lost)
	}
	if err := p.Watch(env.vip); err == nil {
		t.Error("Watch after Detach succeeded")
	}
}

// A frame sent with an in-band 802.1Q tag arrives with the tag moved out of
// band (skb_vlan_untag runs before tc): the tc observers report it.
func TestTCReportsVLANTag(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))

	hs, _ := nsHandle(t, env.srvNS)
	b0, err := hs.LinkByName("b0")
	if err != nil {
		t.Fatal(err)
	}
	frame := taggedUDPFrame(b0.Attrs().HardwareAddr, 200, env.clientIP, env.vip, 4321, 53)
	err = nsutil.Do(env.clientNS, func() error { return sendFrame(env.a0Index, frame) })
	if err != nil {
		t.Fatalf("send tagged frame: %v", err)
	}
	want := netip.AddrPortFrom(env.vip, 53)
	for _, pt := range []obs.Point{obs.PointTCHead, obs.PointTCTail} {
		o := c.waitFor(t, pt.String()+" of the tagged frame", func(o obs.Observation) bool {
			return o.Point == pt && o.Dst == want
		})
		if o.VLAN != 200 || o.TPID != 0x8100 || o.Proto != obs.UDP || o.Src != netip.AddrPortFrom(env.clientIP, 4321) {
			t.Errorf("%s: %+v, want VLAN 200 TPID 0x8100 from %v:4321", pt, o, env.clientIP)
		}
	}
}

// sendFrame writes frame as is to the interface ifindex of the caller's netns.
func sendFrame(ifindex int, frame []byte) error {
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: ifindex, Halen: 6})
}

// taggedUDPFrame builds Ethernet + 802.1Q + IPv4 + UDP (one payload byte).
func taggedUDPFrame(dstMAC net.HardwareAddr, vlan uint16, src, dst netip.Addr, sport, dport uint16) []byte {
	be := binary.BigEndian
	f := append([]byte{}, dstMAC...)
	f = append(f, 0x02, 0, 0, 0, 0, 1)
	f = be.AppendUint16(f, 0x8100)
	f = be.AppendUint16(f, vlan)
	f = be.AppendUint16(f, 0x0800)
	s4, d4 := src.As4(), dst.As4()
	ip := []byte{0x45, 0, 0, 29, 0, 0, 0, 0, 64, 17, 0, 0}
	ip = append(append(ip, s4[:]...), d4[:]...)
	f = append(f, ip...)
	f = be.AppendUint16(f, sport)
	f = be.AppendUint16(f, dport)
	f = be.AppendUint16(f, 9)
	f = be.AppendUint16(f, 0)
	return append(f, 'x')
}

func TestKernelFunctionProbesReport(t *testing.T) {
	needRoot(t)
	got := KernelFunctionProbes()
	var names []string
	for _, a := range got {
		names = append(names, a.Observer)
		if (a.Err == nil) == (a.Note == "") {
			t.Errorf("%s: want either a reason (err) or a note, got err %v note %q", a.Observer, a.Err, a.Note)
		}
	}
	if !slices.Equal(names, []string{"kprobe", "kprobe-multi", "fentry"}) {
		t.Errorf("detected %v", names)
	}
	_, statErr := os.Stat(kprobePMU)
	if (statErr != nil) != (got[0].Err != nil) {
		t.Errorf("kprobe reported %v while %s stat gives %v", got[0].Err, kprobePMU, statErr)
	}
}

// TestReadRequestedOff: with reading off (no socket LB on the node), the
// requested destination is the one the hook sees. A socket LB present while
// reading is off (one loaded since pathtrace last looked) then goes unseen:
// its connection reports the backend as requested, which is why user space
// turns reading on as soon as such a program exists.
func TestReadRequestedOff(t *testing.T) {
	needRoot(t)
	env, cg, lbTCP := newLBEnv(t)
	vipTCP := netip.AddrPortFrom(env.vip, env.tcpPort)
	vipUDP := netip.AddrPortFrom(env.vip, env.udpPort)

	p, c := startProbe(t, env.vip, env.lbVIP, env.srvIP)
	if err := p.ReadRequested(false); err != nil {
		t.Fatal(err)
	}
	mustAttach(t, p.AttachSocket(cg))
	pid := uint32(env.runClient(t, cg, "tcp="+vipTCP.String(), "sendmmsg="+vipUDP.String(), "tcp="+lbTCP.String()))
	for _, want := range []struct {
		kind     obs.SockKind
		req, dst netip.AddrPort
	}{
		{obs.SockConnect, vipTCP, vipTCP},
		{obs.SockSendmsg, vipUDP, vipUDP},
		{obs.SockConnect, env.backendTCP, env.backendTCP},
	} {
		c.waitFor(t, fmt.Sprintf("%v requested %v, effective %v", want.kind, want.req, want.dst), func(o obs.Observation) bool {
			return o.Point == obs.PointSockAddr && o.PID == pid && o.Kind == want.kind && o.ReqDst == want.req && o.Dst == want.dst
		})
	}
}

// TestReaderSleepsUntilAnEvent: with nothing to read, the reader sleeps
// (reader_asleep set) for idleWait, a minute here; the first event wakes it
// long before that, and a stop ends its sleep at once.
func TestReaderSleepsUntilAnEvent(t *testing.T) {
	needRoot(t)
	saved := idleWait
	t.Cleanup(func() { idleWait = saved }) // after the probe's own cleanups
	idleWait = time.Minute
	env := newTestEnv(t)
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
	waitAsleep := func(what string) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			var v uint64
			if err := p.maps["reader_asleep"].Lookup(uint32(0), &v); err != nil {
				t.Fatal(err)
			}
			if v == 1 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal(what)
			}
		}
	}
	waitAsleep("the reader of an idle ring never went to sleep")
	dst := netip.AddrPortFrom(env.vip, 9)
	sendUDP(t, env.clientUDP(t), dst, []byte("x"))
	sent := time.Now()
	c.waitFor(t, "the datagram at tc head, within 5 s of a reader asleep for a minute", func(o obs.Observation) bool {
		return o.Point == obs.PointTCHead && o.Dst == dst
	})
	t.Logf("event read %v after the send", time.Since(sent).Round(time.Millisecond))
	waitAsleep("the reader did not go back to sleep")
	start := time.Now()
	if err := p.Close(); err != nil { // waits for Run to return
		t.Fatal(err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Close took %v with the reader asleep: the stop did not end its sleep", d)
	}
}

// TestCatchUp: once the channel CatchUp returns is closed (or when it
// returns none), every event submitted before the call has been emitted;
// the consumer relies on it to take a socket's events before the tap's
// frames of its packets.
func TestCatchUp(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	p, c := startProbe(t, env.vip)
	mustAttach(t, p.AttachTC(env.srvNS, env.b0Index, "b0"))
	conn := env.clientUDP(t)
	waited := 0
	for i := range 20 {
		// The first datagram wakes the reader; the second comes while it
		// waits for its next poll, awake: nothing wakes it then.
		first, second := netip.AddrPortFrom(env.vip, uint16(1000+2*i)), netip.AddrPortFrom(env.vip, uint16(1001+2*i))
		sendUDP(t, conn, first, []byte("x"))
		c.waitFor(t, "the first datagram at tc head", func(o obs.Observation) bool {
			return o.Point == obs.PointTCHead && o.Dst == first
		})
		sendUDP(t, conn, second, []byte("x"))
		if done := p.CatchUp(); done != nil {
			waited++
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("CatchUp: not answered within 5 s")
			}
		}
		if len(c.matching(func(o obs.Observation) bool { return o.Point == obs.PointTCHead && o.Dst == second })) == 0 {
			t.Fatalf("round %d: the second datagram's event was submitted before CatchUp but not emitted once it answered", i)
		}
	}
	if waited == 0 {
		t.Error("CatchUp never found the second datagram's event waiting in the ring: the reader read it first in all 20 rounds")
	}
	t.Logf("%d of 20 rounds waited for the reader", waited)
}
