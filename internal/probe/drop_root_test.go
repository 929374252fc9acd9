package probe

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// dropInput makes the server netns drop every packet of proto (a
// unix.IPPROTO_ number) to to at filter INPUT, as a node's firewall rule
// does.
func (e *testEnv) dropInput(t *testing.T, proto byte, to netip.AddrPort) {
	t.Helper()
	c, tbl := nftTable(t, e.srvNS)
	ch := c.AddChain(&nftables.Chain{Name: "input", Table: tbl, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: tbl, Chain: ch, Exprs: append(matchDst(proto, to),
		&expr.Verdict{Kind: expr.VerdictDrop})})
	if err := c.Flush(); err != nil {
		t.Fatalf("nft drop rule: %v", err)
	}
}

// startDropProbe is a test env whose server serves and drops proto's
// packets to the backend endpoint to names at filter INPUT, and a probe
// watching the server with the drop observer attached.
func startDropProbe(t *testing.T, proto byte, to func(*testEnv) netip.AddrPort) (*testEnv, *Probe, *collector) {
	t.Helper()
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	env.dropInput(t, proto, to(env))
	p, c := startProbe(t, env.srvIP)
	mustAttach(t, p.AttachDrops())
	return env, p, c
}

// A datagram of a watched flow that a filter rule drops is reported at
// PointDrop with the kernel's reason by name, the function that dropped
// it, and the netns and device where it was.
func TestDropObserverNamesReasonAndFunction(t *testing.T) {
	env, p, c := startDropProbe(t, unix.IPPROTO_UDP, func(e *testEnv) netip.AddrPort { return e.backendUDP })
	conn := env.clientUDP(t)
	sendUDP(t, conn, env.backendUDP, []byte("dropped"))
	client := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	o := c.waitFor(t, "the dropped datagram", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Src == client && o.Dst == env.backendUDP
	})
	srvNS, err := nsutil.Inode(env.srvNS)
	if err != nil {
		t.Fatal(err)
	}
	if o.Drop == nil {
		t.Fatalf("drop observation without its reason: %+v", o)
	}
	if o.Drop.Reason != "NETFILTER_DROP" {
		t.Errorf("reason %q (code %d), want NETFILTER_DROP", o.Drop.Reason, o.Drop.Code)
	}
	// The kernel's symbol lookup (pt_ksym) names the place on the first
	// event already; DropFunc gives the same from the cache.
	fn := p.DropFunc(o.Drop.Location)
	if fn == "" || o.Drop.Location == 0 || o.Drop.Func != fn {
		t.Errorf("location %#x: function %q, event's %q", o.Drop.Location, fn, o.Drop.Func)
	}
	t.Logf("dropped by %s (%#x)", fn, o.Drop.Location)
	conn2 := env.clientUDP(t)
	sendUDP(t, conn2, env.backendUDP, []byte("dropped again"))
	client2 := conn2.LocalAddr().(*net.UDPAddr).AddrPort()
	again := c.waitFor(t, "the second dropped datagram", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Src == client2 && o.Dst == env.backendUDP
	})
	if again.Drop == nil || again.Drop.Location != o.Drop.Location || again.Drop.Func != fn {
		t.Errorf("second drop at %#x: %+v, want its function %q from the cache", o.Drop.Location, again.Drop, fn)
	}
	if o.NetNS != srvNS || o.Ifindex != env.b0Index {
		t.Errorf("dropped in netns %d ifindex %d, want the server's %d, b0 %d", o.NetNS, o.Ifindex, srvNS, env.b0Index)
	}
	if o.Proto != obs.UDP {
		t.Errorf("proto %v, want udp", o.Proto)
	}
}

// A TCP packet's drop carries its ports and flags: a SYN a filter rule
// drops is reported as a SYN (the flow engine tells connection attempts,
// resets and data apart by them).
func TestDropObserverReadsTCPFlags(t *testing.T) {
	env, _, c := startDropProbe(t, unix.IPPROTO_TCP, func(e *testEnv) netip.AddrPort { return e.backendTCP })
	if err := nsutil.Do(env.clientNS, func() error {
		conn, err := net.DialTimeout("tcp4", env.backendTCP.String(), 300*time.Millisecond)
		if err == nil {
			conn.Close()
			return errors.New("connected through the drop rule")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	o := c.waitFor(t, "the dropped SYN", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Dst == env.backendTCP
	})
	const syn = 0x02
	if o.Proto != obs.TCP || o.TCPFlags != syn || o.Src.Addr() != env.clientIP || o.Src.Port() == 0 {
		t.Errorf("dropped packet %v %v -> %v flags %#x, want a tcp SYN from %v and a port", o.Proto, o.Src, o.Dst, o.TCPFlags, env.clientIP)
	}
}

// A connection's last FIN that comes after its peer closed (a client that
// closes a moment after the server, as one kept off the CPU does) meets a
// TIME_WAIT socket (an orphaned FIN_WAIT2 one is one), which answers it;
// tcp_v4_rcv then frees it with no reason (NOT_SPECIFIED). It went no
// further than where it was going: no drop.
func TestDropObserverLeavesOutWhatTimeWaitTook(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	p, c := startProbe(t, env.srvIP)
	mustAttach(t, p.AttachDrops())
	client := afterServerClosed(t, env, func(net.Conn) error { return nil })
	time.Sleep(300 * time.Millisecond)
	if drops := c.matching(func(o obs.Observation) bool { return o.Point == obs.PointDrop && o.Src == client }); len(drops) > 0 {
		t.Errorf("the client's FIN, which the server's TIME_WAIT socket answered, reported dropped: %+v", drops[0].Drop)
	}
}

// TestDropObserverReportsWhatTimeWaitRefused: a request sent on a connection
// the server closed meets its orphaned FIN_WAIT2 socket (a TIME_WAIT one),
// which answers it with a reset; tcp_v4_rcv frees the segment with no
// reason, as it does a FIN the socket took, but this one is a drop of the
// request (the keep-alive race a client loses), and is reported.
func TestDropObserverReportsWhatTimeWaitRefused(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	p, c := startProbe(t, env.srvIP)
	mustAttach(t, p.AttachDrops())
	client := afterServerClosed(t, env, func(conn net.Conn) error {
		_, err := conn.Write([]byte("again\n"))
		return err
	})
	c.waitFor(t, "the request the server's TIME_WAIT socket refused", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Src == client
	})
}

// TestDropObserverReportsSYNTimeWaitRefused: a SYN from the port of a
// connection the server closed first meets the server's TIME_WAIT socket;
// with no listener left to hand it to, the socket answers it with an ACK
// and tcp_v4_rcv frees it with no reason: the connection attempt's drop.
func TestDropObserverReportsSYNTimeWaitRefused(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	var ln net.Listener
	if err := nsutil.Do(env.srvNS, func() (err error) { ln, err = net.Listen("tcp4", env.backendTCP.String()); return }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close() // first: its socket ends in TIME_WAIT
		}
	}()
	p, c := startProbe(t, env.srvIP)
	mustAttach(t, p.AttachDrops())
	var client netip.AddrPort
	err := nsutil.Do(env.clientNS, func() error {
		conn, err := net.DialTimeout("tcp4", env.backendTCP.String(), time.Second)
		if err != nil {
			return err
		}
		ap := conn.LocalAddr().(*net.TCPAddr).AddrPort()
		client = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		_, err = io.ReadAll(conn) // the server's FIN
		conn.Close()
		if err != nil {
			return err
		}
		time.Sleep(100 * time.Millisecond)
		ln.Close()
		d := net.Dialer{Timeout: 1500 * time.Millisecond, LocalAddr: net.TCPAddrFromAddrPort(client),
			Control: func(_, _ string, rc syscall.RawConn) error {
				return rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
			}}
		if conn, err := d.Dial("tcp4", env.backendTCP.String()); err == nil {
			conn.Close()
			return errors.New("connected again with no listener")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	c.waitFor(t, "the SYN the server's TIME_WAIT socket refused", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Src == client && o.TCPFlags&0x02 != 0 && o.Drop.Reason == "NOT_SPECIFIED"
	})
}

// The copies of a packet a packet socket was given and drops (its queue
// full) are not drops of the packet, which went on: the observer leaves
// them out, whoever the socket's owner (a tap, tcpdump). So is the buffer
// a route lookup that fails builds (RTM_GETROUTE, as discovery asks) and
// frees: no packet.
func TestDropObserverLeavesOutPacketSocketCopies(t *testing.T) {
	needRoot(t)
	env := newTestEnv(t)
	env.serve(t)
	unroutable := netip.MustParseAddr("192.0.2.7") // TEST-NET-1: the client netns has no route to it
	p, c := startProbe(t, env.srvIP, unroutable)
	mustAttach(t, p.AttachDrops())

	// A packet socket on b0 that is never read, with the smallest
	// receive buffer: it drops its copies of the echoes below.
	var fd int
	if err := nsutil.Do(env.srvNS, func() error {
		var err error
		if fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, int(htons(unix.ETH_P_ALL))); err != nil {
			return err
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 0); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: env.b0Index})
	}); err != nil {
		t.Fatalf("packet socket: %v", err)
	}
	defer unix.Close(fd)

	conn := env.clientUDP(t)
	client := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	buf := make([]byte, 64)
	for range 50 {
		env.echoUDPTo(t, conn, env.backendUDP, buf)
	}
	var st unix.TpacketStats
	size := uint32(unsafe.Sizeof(st))
	if _, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_PACKET, unix.PACKET_STATISTICS,
		uintptr(unsafe.Pointer(&st)), uintptr(unsafe.Pointer(&size)), 0); errno != 0 {
		t.Fatalf("PACKET_STATISTICS: %v", errno)
	}
	if st.Drops == 0 {
		t.Fatalf("the packet socket dropped none of %d copies: the test proves nothing", st.Packets)
	}
	h, _ := nsHandle(t, env.clientNS)
	if _, err := h.RouteGet(net.IP(unroutable.AsSlice())); err == nil {
		t.Fatalf("route get %v: found a route", unroutable)
	}

	// A real drop of the same flow afterwards: once it is read, every
	// event of before it was too.
	env.dropInput(t, unix.IPPROTO_UDP, env.backendUDP)
	sendUDP(t, conn, env.backendUDP, []byte("dropped"))
	c.waitFor(t, "the datagram the rule dropped", func(o obs.Observation) bool {
		return o.Point == obs.PointDrop && o.Src == client && o.Drop != nil && o.Drop.Reason == "NETFILTER_DROP"
	})
	for _, o := range c.matching(func(o obs.Observation) bool { return o.Point == obs.PointDrop }) {
		if o.Drop.Reason != "NETFILTER_DROP" {
			t.Errorf("a packet socket's copy (it dropped %d) or a route lookup's buffer reported: %v -> %v %s at %s", st.Drops, o.Src, o.Dst, o.Drop.Reason, o.Drop.Func)
		}
	}
}

// echoUDPTo sends to to and waits for its echo.
func (e *testEnv) echoUDPTo(t *testing.T, c *net.UDPConn, to netip.AddrPort, buf []byte) {
	t.Helper()
	sendUDP(t, c, to, []byte("ping"))
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if _, _, err := c.ReadFromUDPAddrPort(buf); err != nil {
		t.Fatalf("echo from %v: %v", to, err)
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// pt_ksym names kernel text addresses as /proc/kallsyms does: the function
// an address is in, and nothing for an address that is no symbol's.
func TestKernelSymbolAgreesWithKallsyms(t *testing.T) {
	needRoot(t)
	spec, err := loadObserveDrop()
	if err != nil {
		t.Fatal(err)
	}
	var objs struct {
		Ksym *ebpf.Program `ebpf:"pt_ksym"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		t.Fatalf("load %s: %v", ksymProgram, err)
	}
	defer objs.Ksym.Close()
	syms := kallsymsText(t, "ip_rcv", "nf_hook_slow", "kfree_skb_list_reason")
	if len(syms) == 0 {
		t.Skip("no text symbol readable in /proc/kallsyms (kptr_restrict)")
	}
	for name, addr := range syms {
		for _, at := range []uint64{addr, addr + 0x10} {
			got, want := kernelSymbol(objs.Ksym, at), kernelFunc(kallsymsPath, at)
			if got != name || got != want {
				t.Errorf("%s+%#x: pt_ksym %q, kallsyms %q", name, at-addr, got, want)
			}
		}
	}
	if got := kernelSymbol(objs.Ksym, 0x1000); got != "" {
		t.Errorf("an address that is no symbol's: %q, want none", got)
	}
}

// kallsymsText reads the addresses of the named text symbols of vmlinux
// that /proc/kallsyms shows (not hidden).
func kallsymsText(t *testing.T, names ...string) map[string]uint64 {
	t.Helper()
	data, err := os.ReadFile(kallsymsPath)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	out := map[string]uint64{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || (f[1] != "T" && f[1] != "t") || !want[f[2]] {
			continue
		}
		if a, err := strconv.ParseUint(f[0], 16, 64); err == nil && a != 0 {
			out[f[2]] = a
		}
	}
	return out
}

// afterServerClosed opens a connection from the client to the backend's
// echo server, sends a line and reads until the server closed it; once the
// server's socket is a TIME_WAIT one, then runs on the open connection. It
// returns the client's endpoint.
func afterServerClosed(t *testing.T, env *testEnv, then func(net.Conn) error) netip.AddrPort {
	t.Helper()
	var client netip.AddrPort
	err := nsutil.Do(env.clientNS, func() error {
		conn, err := net.DialTimeout("tcp4", env.backendTCP.String(), time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		ap := conn.LocalAddr().(*net.TCPAddr).AddrPort()
		client = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		if _, err := conn.Write([]byte("bye\n")); err != nil {
			return err
		}
		if _, err := io.ReadAll(conn); err != nil { // the echo, then the server's FIN
			return err
		}
		time.Sleep(100 * time.Millisecond) // its socket is a TIME_WAIT one by now
		return then(conn)
	})
	if err != nil {
		t.Fatal(err)
	}
	return client
}
