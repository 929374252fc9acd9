package probe

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/net/ipv4"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// testEnv is a client netns and a server netns joined by a veth pair
// (client a0 <-> b0 server). The server netns DNATs vip to the backend (the
// server's own address) in a nat prerouting chain; lbVIP is for a socket-LB
// program. Everything is removed by t.Cleanup.
type testEnv struct {
	name             string
	clientNS, srvNS  string // /run/netns paths
	clientIP, srvIP  netip.Addr
	vip, lbVIP       netip.Addr
	a0Index, b0Index int
	tcpPort, udpPort uint16 // service ports on the VIPs
	backendTCP       netip.AddrPort
	backendUDP       netip.AddrPort
}

func needRoot(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces, cgroups and BPF links")
	}
}

func newTestEnv(t *testing.T) *testEnv {
	t.Helper()
	// Random /24s inside 10/8 so parallel test binaries do not collide.
	net1, net2 := byte(rand.IntN(200)+20), byte(rand.IntN(250)+1)
	e := &testEnv{
		name:     fmt.Sprintf("pttest-probe-%06x", rand.IntN(1<<24)),
		clientIP: netip.AddrFrom4([4]byte{10, net1, net2, 1}),
		srvIP:    netip.AddrFrom4([4]byte{10, net1, net2, 2}),
		vip:      netip.AddrFrom4([4]byte{10, net1 + 1, net2, 80}),
		lbVIP:    netip.AddrFrom4([4]byte{10, net1 + 1, net2, 81}),
		tcpPort:  80,
		udpPort:  53,
	}
	e.backendTCP = netip.AddrPortFrom(e.srvIP, 3000)
	e.backendUDP = netip.AddrPortFrom(e.srvIP, 5353)
	e.clientNS = newNetns(t, e.name+"-c")
	e.srvNS = newNetns(t, e.name+"-s")
	e.wire(t)
	e.dnat(t)
	return e
}

// newNetns creates a named network namespace (a bind mount under /run/netns)
// from a thread that is discarded afterwards.
func newNetns(t *testing.T, name string) string {
	t.Helper()
	path := filepath.Join("/run/netns", name)
	if err := nsutil.PrepareNamedDir("/run/netns"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Unmount(path, unix.MNT_DETACH)
		os.Remove(path)
	})
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with this goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		errc <- unix.Mount(self, path, "none", unix.MS_BIND, "")
	}()
	if err := <-errc; err != nil {
		t.Fatalf("create netns %s: %v", name, err)
	}
	return path
}

func nsHandle(t *testing.T, path string) (*netlink.Handle, netns.NsHandle) {
	t.Helper()
	ns, err := netns.GetFromPath(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		ns.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close(); ns.Close() })
	return h, ns
}

func (e *testEnv) wire(t *testing.T) {
	t.Helper()
	hc, _ := nsHandle(t, e.clientNS)
	hs, nss := nsHandle(t, e.srvNS)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "a0"}, PeerName: "b0", PeerNamespace: netlink.NsFd(nss)}
	if err := hc.LinkAdd(veth); err != nil {
		t.Fatalf("veth: %v", err)
	}
	for _, side := range []struct {
		h    *netlink.Handle
		dev  string
		addr netip.Addr
	}{{hc, "a0", e.clientIP}, {hs, "b0", e.srvIP}} {
		for _, name := range []string{"lo", side.dev} {
			l, err := side.h.LinkByName(name)
			if err != nil {
				t.Fatal(err)
			}
			if err := side.h.LinkSetUp(l); err != nil {
				t.Fatal(err)
			}
		}
		l, _ := side.h.LinkByName(side.dev)
		a := &netlink.Addr{IPNet: &net.IPNet{IP: side.addr.AsSlice(), Mask: net.CIDRMask(24, 32)}}
		if err := side.h.AddrAdd(l, a); err != nil {
			t.Fatal(err)
		}
		if side.dev == "b0" {
			e.b0Index = l.Attrs().Index
		} else {
			e.a0Index = l.Attrs().Index
			vipNet := netip.PrefixFrom(e.vip, 24).Masked()
			r := &netlink.Route{LinkIndex: l.Attrs().Index, Gw: e.srvIP.AsSlice(),
				Dst: &net.IPNet{IP: vipNet.Addr().AsSlice(), Mask: net.CIDRMask(24, 32)}}
			if err := side.h.RouteAdd(r); err != nil {
				t.Fatalf("route to VIPs: %v", err)
			}
		}
	}
}

// otherSrvAddr adds a second address to the server's b0, one no rule names
// and no rewrite goes to (the backends' address is learned as a NAT's
// target), and returns it.
func (e *testEnv) otherSrvAddr(t *testing.T) netip.Addr {
	t.Helper()
	other := e.srvIP.Next()
	hs, _ := nsHandle(t, e.srvNS)
	l, err := hs.LinkByName("b0")
	if err != nil {
		t.Fatal(err)
	}
	if err := hs.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: other.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	return other
}

// nftTable is an nftables connection into the netns at path and its table
// "pttest" (ip), to add chains and rules to and flush.
func nftTable(t *testing.T, path string) (*nftables.Conn, *nftables.Table) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	// The connection enters the netns through f when it flushes: f stays
	// open until the test ends.
	t.Cleanup(func() { f.Close() })
	c, err := nftables.New(nftables.WithNetNSFd(int(f.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	return c, c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "pttest"})
}

// dnat installs "ip daddr vip tcp dport 80 dnat to backendTCP" and the UDP
// twin in a nat prerouting chain of the server netns (conntrack starts
// tracking there because of it).
func (e *testEnv) dnat(t *testing.T) {
	t.Helper()
	c, tbl := nftTable(t, e.srvNS)
	ch := c.AddChain(&nftables.Chain{Name: "prerouting", Table: tbl, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	for _, r := range []struct {
		proto   byte
		port    uint16
		backend netip.AddrPort
	}{{unix.IPPROTO_TCP, e.tcpPort, e.backendTCP}, {unix.IPPROTO_UDP, e.udpPort, e.backendUDP}} {
		back := r.backend.Addr().As4()
		c.AddRule(&nftables.Rule{Table: tbl, Chain: ch, Exprs: append(matchDst(r.proto, netip.AddrPortFrom(e.vip, r.port)),
			&expr.Immediate{Register: 1, Data: back[:]},
			&expr.Immediate{Register: 2, Data: binary.BigEndian.AppendUint16(nil, r.backend.Port())},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true},
		)})
	}
	if err := c.Flush(); err != nil {
		t.Fatalf("nft dnat rules: %v", err)
	}
}

// matchDst matches an IPv4 packet of proto to dst, a rule's first expressions.
func matchDst(proto byte, dst netip.AddrPort) []expr.Any {
	addr := dst.Addr().As4()
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: addr[:]},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, dst.Port())},
	}
}

// rejectOutput makes the client netns reject its own TCP connections to
// to with a reset at filter OUTPUT, as a node's firewall (or kube-proxy for
// a Service without endpoints) does: their SYN never leaves the socket
// layer's egress.
func (e *testEnv) rejectOutput(t *testing.T, to netip.AddrPort) {
	t.Helper()
	c, tbl := nftTable(t, e.clientNS)
	ch := c.AddChain(&nftables.Chain{Name: "output", Table: tbl, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter})
	c.AddRule(&nftables.Rule{Table: tbl, Chain: ch, Exprs: append(matchDst(unix.IPPROTO_TCP, to),
		&expr.Reject{Type: unix.NFT_REJECT_TCP_RST})})
	if err := c.Flush(); err != nil {
		t.Fatalf("nft reject rule: %v", err)
	}
}

// serve runs TCP and UDP echo servers on the backend addresses inside the
// server netns until the test ends.
func (e *testEnv) serve(t *testing.T) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	err := nsutil.Do(e.srvNS, func() error {
		var err error
		if ln, err = net.Listen("tcp", e.backendTCP.String()); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", e.backendUDP.String())
		return err
	})
	if err != nil {
		t.Fatalf("servers: %v", err)
	}
	t.Cleanup(func() { ln.Close(); pc.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, err := bufio.NewReader(c).ReadString('\n')
				if err == nil {
					io.WriteString(c, line)
				}
			}()
		}
	}()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	}()
}

// newCgroup creates a child cgroup of the cgroup2 root.
func newCgroup(t *testing.T, name string) string {
	t.Helper()
	root, err := CgroupRoot()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(root, name)
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Processes leave a cgroup when they exit, a moment after wait returns.
		for range 50 {
			if err := os.Remove(path); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", path)
	})
	return path
}

// Client actions of the child process: "tcp", "tcp6" (a dual-stack socket to
// ::ffff:addr), "udpconn", "sendto" (AF_INET socket), "sendmsg" (dual-stack
// socket), "sendmmsg" (AF_INET socket, one sendmmsg(2) call, as glibc's
// resolver sends), "resend" (resends datagrams of one AF_INET socket).
const (
	clientEnvNS      = "PTTEST_PROBE_CLIENT_NETNS"
	clientEnvActions = "PTTEST_PROBE_CLIENT_ACTIONS" // "action=addr:port,..."
)

// runClient starts this test binary as a client process inside cgroup and
// the client netns, and waits for it. It returns the client's PID.
func (e *testEnv) runClient(t *testing.T, cgroup string, actions ...string) int {
	t.Helper()
	cg, err := os.Open(cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), clientEnvNS+"="+e.clientNS, clientEnvActions+"="+strings.Join(actions, ","))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start client: %v", err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("client %v failed (traffic must flow while observed): %v\n%s", actions, err, out.String())
	}
	return cmd.Process.Pid
}

// clientMain is the child process: it performs the actions from inside the
// client netns and exits non-zero on the first failure.
func clientMain() {
	err := nsutil.Do(os.Getenv(clientEnvNS), func() error {
		for _, a := range strings.Split(os.Getenv(clientEnvActions), ",") {
			action, addr, _ := strings.Cut(a, "=")
			if err := clientAction(action, netip.MustParseAddrPort(addr)); err != nil {
				return fmt.Errorf("%s %s: %w", action, addr, err)
			}
		}
		return nil
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

func clientAction(action string, to netip.AddrPort) error {
	const msg = "ping\n"
	deadline := time.Now().Add(3 * time.Second)
	buf := make([]byte, 64)
	switch action {
	case "tcp", "tcp6", "udpconn":
		network := map[string]string{"tcp": "tcp", "tcp6": "tcp", "udpconn": "udp"}[action]
		d := net.Dialer{Timeout: 3 * time.Second}
		if action == "tcp6" { // a wildcard IPv6 local address makes Go use a dual-stack socket
			d.LocalAddr = &net.TCPAddr{IP: net.IPv6unspecified}
		}
		c, err := d.Dial(network, to.String())
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(deadline)
		if _, err := io.WriteString(c, msg); err != nil {
			return err
		}
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != msg {
			return fmt.Errorf("echo %q", buf[:n])
		}
		return nil
	case "udppool": // udpPool connected sockets, all waiting before any sends
		conns := make([]net.Conn, 0, udpPool)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for range udpPool {
			c, err := net.Dial("udp4", to.String())
			if err != nil {
				return err
			}
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.SetDeadline(deadline)
			if _, err := io.WriteString(c, msg); err != nil {
				return err
			}
			if _, err := c.Read(buf); err != nil {
				return err
			}
		}
		return nil
	case "tcprefused": // a connection the client's own netns refuses
		c, err := net.DialTimeout("tcp", to.String(), 3*time.Second)
		if err == nil {
			c.Close()
			return errors.New("connected; want it refused")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return err
		}
		return nil
	case "resend": // one unconnected socket sends resends datagrams, each echoed
		c, err := net.ListenUDP("udp4", nil)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(deadline)
		for range resends {
			if _, err := c.WriteToUDPAddrPort([]byte(msg), to); err != nil {
				return err
			}
			if _, _, err := c.ReadFromUDPAddrPort(buf); err != nil {
				return err
			}
		}
		return nil
	case "sendto", "sendmsg", "sendmmsg":
		network := map[string]string{"sendto": "udp4", "sendmsg": "udp", "sendmmsg": "udp4"}[action]
		c, err := net.ListenUDP(network, nil)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(deadline)
		switch action {
		case "sendto":
			_, err = c.WriteToUDPAddrPort([]byte(msg), to)
		case "sendmmsg":
			_, err = ipv4.NewPacketConn(c).WriteBatch([]ipv4.Message{{Buffers: [][]byte{[]byte(msg)}, Addr: net.UDPAddrFromAddrPort(to)}}, 0)
		default:
			_, _, err = c.WriteMsgUDPAddrPort([]byte(msg), nil, to)
		}
		if err != nil {
			return err
		}
		n, _, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != msg {
			return fmt.Errorf("echo %q", buf[:n])
		}
		return nil
	}
	return fmt.Errorf("unknown action %q", action)
}

func TestMain(m *testing.M) {
	if os.Getenv(clientEnvActions) != "" {
		clientMain()
	}
	os.Exit(m.Run())
}

// attachSocketLB attaches, to cgroup, a connect4 program shaped like a socket
// load balancer: it rewrites from to to. Attached before the observer on the
// same cgroup, it runs first.
func attachSocketLB(t *testing.T, cgroup string, from, to netip.AddrPort) {
	t.Helper()
	ip := func(a netip.Addr) int32 { b := a.As4(); return int32(binary.LittleEndian.Uint32(b[:])) }
	port := func(p uint16) int32 { return int32(p>>8 | p<<8) } // network order in the low 16 bits
	const userIP4, userPort = 4, 24                            // offsets in struct bpf_sock_addr
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "pttest_lb", Type: ebpf.CGroupSockAddr, AttachType: ebpf.AttachCGroupInet4Connect, License: "GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R2, asm.R1, userIP4, asm.Word),
			asm.JNE.Imm32(asm.R2, ip(from.Addr()), "out"),
			asm.LoadMem(asm.R2, asm.R1, userPort, asm.Word),
			asm.JNE.Imm32(asm.R2, port(from.Port()), "out"),
			asm.Mov.Imm(asm.R2, ip(to.Addr())),
			asm.StoreMem(asm.R1, userIP4, asm.R2, asm.Word),
			asm.Mov.Imm(asm.R2, port(to.Port())),
			asm.StoreMem(asm.R1, userPort, asm.R2, asm.Word),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("socket LB program: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: ebpf.AttachCGroupInet4Connect, Program: prog})
	if err != nil {
		t.Fatalf("attach socket LB: %v", err)
	}
	t.Cleanup(func() { l.Close() })
}

// resends is how many datagrams the client's "resend" action sends.
const resends = 4

// attachAlternatingLB attaches, to cgroup, a sendmsg4 program shaped like a
// socket LB that picks a backend per datagram: it rewrites from to the
// backends in turn, one datagram each. Attached after the observers on the
// same cgroup, it runs after them.
func attachAlternatingLB(t *testing.T, cgroup string, from netip.AddrPort, backends [2]netip.AddrPort) {
	t.Helper()
	ip := func(a netip.Addr) int32 { b := a.As4(); return int32(binary.LittleEndian.Uint32(b[:])) }
	port := func(p uint16) int32 { return int32(p>>8 | p<<8) }
	const userIP4, userPort = 4, 24
	turn, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { turn.Close() })
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "pttest_lb_rr", Type: ebpf.CGroupSockAddr, AttachType: ebpf.AttachCGroupUDP4Sendmsg, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1),
			asm.LoadMem(asm.R2, asm.R6, userIP4, asm.Word),
			asm.JNE.Imm32(asm.R2, ip(from.Addr()), "out"),
			asm.LoadMem(asm.R2, asm.R6, userPort, asm.Word),
			asm.JNE.Imm32(asm.R2, port(from.Port()), "out"),
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.LoadMapPtr(asm.R1, turn.FD()),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "out"),
			asm.LoadMem(asm.R2, asm.R0, 0, asm.DWord),
			asm.Add.Imm(asm.R2, 1),
			asm.StoreMem(asm.R0, 0, asm.R2, asm.DWord),
			asm.And.Imm(asm.R2, 1),
			asm.Mov.Imm(asm.R3, port(backends[0].Port())),
			asm.JNE.Imm(asm.R2, 0, "pick"), // the first datagram: backends[0]
			asm.Mov.Imm(asm.R3, port(backends[1].Port())),
			asm.StoreMem(asm.R6, userPort, asm.R3, asm.Word).WithSymbol("pick"),
			asm.Mov.Imm(asm.R2, ip(backends[0].Addr())),
			asm.StoreMem(asm.R6, userIP4, asm.R2, asm.Word),
			asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("socket LB program: %v", err)
	}
	t.Cleanup(func() { prog.Close() })
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: ebpf.AttachCGroupUDP4Sendmsg, Program: prog})
	if err != nil {
		t.Fatalf("attach socket LB: %v", err)
	}
	t.Cleanup(func() { l.Close() })
}

// cgroupID is the cgroup v2 id: the inode of its directory.
func cgroupID(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// newLBEnv is a serving test env with a client cgroup on which a socket LB
// rewrites the LB VIP's TCP port (lbTCP) to the TCP backend.
func newLBEnv(t *testing.T) (env *testEnv, cg string, lbTCP netip.AddrPort) {
	t.Helper()
	env = newTestEnv(t)
	env.serve(t)
	cg = newCgroup(t, env.name)
	lbTCP = netip.AddrPortFrom(env.lbVIP, env.tcpPort)
	attachSocketLB(t, cg, lbTCP, env.backendTCP)
	return env, cg, lbTCP
}
