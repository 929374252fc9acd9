package probe

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// frameOpts shapes a test frame for the taps' filter.
type frameOpts struct {
	tags      []uint16 // in-band tag TPIDs, outer first
	ipOptions int      // 4-byte words of IP options
	proto     uint8
	fragment  bool // a later fragment (no L4 header)
	payload   int
	etherType uint16 // 0: IPv4
	sport     uint16 // 0: 40000
	tcpFlags  uint8  // 0: SYN
}

// testFrame is an Ethernet frame from 10.244.8.23 (port 40000 unless
// o.sport) to dst.
func testFrame(dst netip.AddrPort, o frameOpts) []byte {
	f := make([]byte, 12) // MAC addresses
	for _, tpid := range o.tags {
		f = binary.BigEndian.AppendUint16(f, tpid)
		f = binary.BigEndian.AppendUint16(f, 200)
	}
	if o.etherType != 0 {
		return append(binary.BigEndian.AppendUint16(f, o.etherType), make([]byte, 28)...)
	}
	f = binary.BigEndian.AppendUint16(f, 0x0800)
	l4 := 8
	if o.proto == 6 {
		l4 = 20
	}
	ihl := 5 + o.ipOptions
	total := ihl*4 + l4 + o.payload
	ip := []byte{byte(0x40 | ihl), 0, byte(total >> 8), byte(total), 0, 0, 0, 0, 64, o.proto, 0, 0, 10, 244, 8, 23}
	if o.fragment {
		ip[6], ip[7] = 0x00, 0x10 // offset 128 bytes
	}
	d := dst.Addr().As4()
	ip = append(ip, d[:]...)
	ip = append(ip, make([]byte, o.ipOptions*4)...)
	sport := o.sport
	if sport == 0 {
		sport = 40000
	}
	hdr := binary.BigEndian.AppendUint16(nil, sport)
	hdr = binary.BigEndian.AppendUint16(hdr, dst.Port())
	hdr = append(hdr, make([]byte, l4-4)...)
	if o.proto == 6 {
		hdr[13] = 0x02 // SYN
		if o.tcpFlags != 0 {
			hdr[13] = o.tcpFlags
		}
	}
	return append(append(append(f, ip...), hdr...), make([]byte, o.payload)...)
}

// TestTapFilterFrames runs the taps' eBPF filter on crafted frames: every
// shape of a watched packet is kept (snaplen), anything else is dropped (0).
func TestTapFilterFrames(t *testing.T) {
	needRoot(t)
	vip := netip.MustParseAddrPort("10.120.0.10:53")
	other := netip.MustParseAddrPort("10.0.0.9:53")
	p, _ := startProbe(t, vip.Addr())
	const snaplen = 96
	prog, err := p.TapFilter(snaplen)
	if err != nil {
		t.Fatal(err)
	}
	const udp, tcp = 17, 6
	for _, tc := range []struct {
		name string
		dst  netip.AddrPort
		o    frameOpts
		keep bool
	}{
		{"UDP to the VIP", vip, frameOpts{proto: udp, payload: 64}, true},
		{"UDP elsewhere", other, frameOpts{proto: udp, payload: 64}, false},
		{"TCP SYN to the VIP", vip, frameOpts{proto: tcp}, true},
		{"short UDP to the VIP (no payload)", vip, frameOpts{proto: udp}, true},
		{"IP options, to the VIP", vip, frameOpts{proto: udp, ipOptions: 2, payload: 8}, true},
		{"IP options, elsewhere", other, frameOpts{proto: udp, ipOptions: 2, payload: 8}, false},
		{"later fragment to the VIP", vip, frameOpts{proto: udp, fragment: true, payload: 64}, true},
		{"802.1Q to the VIP", vip, frameOpts{tags: []uint16{0x8100}, proto: udp, payload: 64}, true},
		{"QinQ to the VIP", vip, frameOpts{tags: []uint16{0x88a8, 0x8100}, proto: udp, payload: 64}, true},
		{"three tags to the VIP", vip, frameOpts{tags: []uint16{0x88a8, 0x8100, 0x8100}, proto: udp, payload: 64}, false},
		{"802.1Q elsewhere", other, frameOpts{tags: []uint16{0x8100}, proto: udp, payload: 64}, false},
		{"ARP", vip, frameOpts{etherType: 0x0806}, false},
	} {
		// A socket filter's test run starts after the MAC header it pulls:
		// an outer header in front leaves the frame where a packet socket
		// sees it, at its own MAC header.
		outer := append(make([]byte, 12), 0x08, 0x00)
		ret, err := prog.Run(&ebpf.RunOptions{Data: append(outer, testFrame(tc.dst, tc.o)...)})
		if err != nil {
			t.Fatalf("%s: test run: %v", tc.name, err)
		}
		if want := map[bool]uint32{true: snaplen, false: 0}[tc.keep]; ret != want {
			t.Errorf("%s: filter returned %d, want %d", tc.name, ret, want)
		}
	}
}

// icmpOpts shapes the outer packet of a test ICMP message.
type icmpOpts struct {
	tags      []uint16 // in-band tag TPIDs, outer first
	ipOptions int      // 4-byte words of IP options
	fragment  bool     // a later fragment of the ICMP message
}

// icmpFrame is an Ethernet frame from the gateway 10.244.8.1 to the client
// 10.244.8.23 carrying an ICMP message of type typ and code that quotes
// quote (an IPv4 packet, e.g. quoted()).
func icmpFrame(typ, code byte, quote []byte, o icmpOpts) []byte {
	f := make([]byte, 12) // MAC addresses
	for _, tpid := range o.tags {
		f = binary.BigEndian.AppendUint16(f, tpid)
		f = binary.BigEndian.AppendUint16(f, 200)
	}
	f = binary.BigEndian.AppendUint16(f, 0x0800)
	msg := append([]byte{typ, code, 0, 0, 0, 0, 0, 0}, quote...)
	ihl := 5 + o.ipOptions
	total := ihl*4 + len(msg)
	ip := []byte{byte(0x40 | ihl), 0, byte(total >> 8), byte(total), 0, 0, 0, 0, 64, 1, 0, 0, 10, 244, 8, 1, 10, 244, 8, 23}
	if o.fragment {
		ip[6], ip[7] = 0x00, 0x10
	}
	ip = append(ip, make([]byte, o.ipOptions*4)...)
	return append(append(f, ip...), msg...)
}

// quoted is what an ICMP error quotes of the packet testFrame(dst, o) makes
// (from 10.244.8.23:40000): its IPv4 header and the first n bytes after it
// (RFC 792 asks for 8; n < 0 keeps all of them).
func quoted(dst netip.AddrPort, o frameOpts, n int) []byte {
	ip := testFrame(dst, o)[14:]
	if n < 0 {
		return ip
	}
	return ip[:(5+o.ipOptions)*4+n]
}

// TestTapFilterICMPErrors runs the taps' eBPF filter on ICMP messages: an
// error (destination unreachable, time exceeded, parameter problem) is kept
// when the packet it quotes is one the filter would keep (to a watched
// address, or from a learned client endpoint), whatever its outer addresses;
// other ICMP messages and errors about other packets are dropped.
func TestTapFilterICMPErrors(t *testing.T) {
	needRoot(t)
	vip := netip.MustParseAddrPort("10.120.0.10:53")
	other := netip.MustParseAddrPort("10.0.0.9:53")
	p, _ := startProbe(t, vip.Addr())
	const snaplen = 96
	prog, err := p.TapFilter(snaplen)
	if err != nil {
		t.Fatal(err)
	}
	// The tc observer learns the client endpoint 10.244.8.23:40000/udp and
	// /tcp from its packets to the VIP: the filter then keeps errors about
	// that endpoint's packets to an address nobody named (other), which
	// only their ports tell.
	p.mu.Lock()
	head, err := p.program(p.tcSpec, "pt_tc_head_in")
	p.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	const udp, tcp = 17, 6
	client := netip.MustParseAddrPort("10.244.8.23:40000")
	for _, proto := range []uint8{udp, tcp} {
		if _, err := head.Run(&ebpf.RunOptions{Data: testFrame(vip, frameOpts{proto: proto, payload: 8})}); err != nil {
			t.Fatal(err)
		}
		if !p.hasClient(t, client, obs.Proto(proto)) {
			t.Fatalf("the tc observer did not learn %v/%d", client, proto)
		}
	}
	// A quote from another client port, to the same address.
	stranger := func(q []byte) []byte {
		q = append([]byte(nil), q...)
		ihl := int(q[0]&0x0f) * 4
		binary.BigEndian.PutUint16(q[ihl:], 40001)
		return q
	}
	const unreach, timeExceeded, paramProblem, echoReply, echoRequest, redirect = 3, 11, 12, 0, 8, 5
	udpToVIP := quoted(vip, frameOpts{proto: udp, payload: 32}, 8)
	for _, tc := range []struct {
		name  string
		frame []byte
		keep  bool
	}{
		{"net unreachable about UDP to the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{}), true},
		{"port unreachable, the whole datagram quoted", icmpFrame(unreach, 3, quoted(vip, frameOpts{proto: udp, payload: 32}, -1), icmpOpts{}), true},
		{"time exceeded about UDP to the VIP", icmpFrame(timeExceeded, 0, udpToVIP, icmpOpts{}), true},
		{"parameter problem about TCP to the VIP", icmpFrame(paramProblem, 0, quoted(vip, frameOpts{proto: tcp}, 8), icmpOpts{}), true},
		{"net unreachable about UDP elsewhere", icmpFrame(unreach, 0, stranger(quoted(other, frameOpts{proto: udp}, 8)), icmpOpts{}), false},
		{"echo reply quoting a packet to the VIP", icmpFrame(echoReply, 0, udpToVIP, icmpOpts{}), false},
		{"echo request quoting a packet to the VIP", icmpFrame(echoRequest, 0, udpToVIP, icmpOpts{}), false},
		{"redirect about UDP to the VIP", icmpFrame(redirect, 0, udpToVIP, icmpOpts{}), false},
		{"802.1Q, about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{tags: []uint16{0x8100}}), true},
		{"QinQ, about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{tags: []uint16{0x88a8, 0x8100}}), true},
		{"three tags, about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{tags: []uint16{0x88a8, 0x8100, 0x8100}}), false},
		{"outer IP options, about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{ipOptions: 3}), true},
		{"802.1Q and outer IP options, about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{tags: []uint16{0x8100}, ipOptions: 1}), true},
		{"a later fragment of an error about the VIP", icmpFrame(unreach, 0, udpToVIP, icmpOpts{fragment: true}), false},
		{"about a learned client's UDP elsewhere", icmpFrame(unreach, 0, quoted(other, frameOpts{proto: udp}, 8), icmpOpts{}), true},
		{"about another port's UDP elsewhere", icmpFrame(unreach, 0, stranger(quoted(other, frameOpts{proto: udp}, 8)), icmpOpts{}), false},
		{"about a learned client's TCP elsewhere, 8 bytes quoted", icmpFrame(unreach, 1, quoted(other, frameOpts{proto: tcp}, 8), icmpOpts{}), true},
		{"quoted IP options, learned client elsewhere", icmpFrame(unreach, 0, quoted(other, frameOpts{proto: udp, ipOptions: 2}, 8), icmpOpts{}), true},
		{"quoted IP options, another port elsewhere", icmpFrame(unreach, 0, stranger(quoted(other, frameOpts{proto: udp, ipOptions: 2}, 8)), icmpOpts{}), false},
		{"QinQ, outer and quoted IP options, learned client elsewhere", icmpFrame(timeExceeded, 0, quoted(other, frameOpts{proto: udp, ipOptions: 1}, 8), icmpOpts{tags: []uint16{0x88a8, 0x8100}, ipOptions: 2}), true},
		{"quote cut before the ports, about the VIP", icmpFrame(unreach, 0, quoted(vip, frameOpts{proto: udp}, 0), icmpOpts{}), true},
		{"quote cut before the ports, learned client elsewhere", icmpFrame(unreach, 0, quoted(other, frameOpts{proto: udp}, 2), icmpOpts{}), false},
		{"quote cut in the IP header, about the VIP", icmpFrame(unreach, 0, udpToVIP[:16], icmpOpts{}), false},
		{"quoted later fragment to the VIP", icmpFrame(unreach, 0, quoted(vip, frameOpts{proto: udp, fragment: true}, 8), icmpOpts{}), true},
		{"quoted later fragment, learned client elsewhere", icmpFrame(unreach, 0, quoted(other, frameOpts{proto: udp, fragment: true}, 8), icmpOpts{}), false},
	} {
		outer := append(make([]byte, 12), 0x08, 0x00) // see TestTapFilterFrames
		ret, err := prog.Run(&ebpf.RunOptions{Data: append(outer, tc.frame...)})
		if err != nil {
			t.Fatalf("%s: test run: %v", tc.name, err)
		}
		if want := map[bool]uint32{true: snaplen, false: 0}[tc.keep]; ret != want {
			t.Errorf("%s: filter returned %d, want %d", tc.name, ret, want)
		}
	}
}

// TestTCObserverFrames runs the tc head observer on crafted frames: it reads
// untagged, option-less headers in place and everything else through the
// helper, and either way learns the client of a packet to a watched address.
func TestTCObserverFrames(t *testing.T) {
	needRoot(t)
	p, prog, vip := tcHeadProbe(t)
	other := netip.MustParseAddrPort("10.0.0.9:53")
	client := netip.MustParseAddrPort("10.244.8.23:40000")
	const tcp = 6
	for _, tc := range []struct {
		name  string
		dst   netip.AddrPort
		o     frameOpts
		learn bool
	}{
		{"UDP to the VIP (read in place)", vip, frameOpts{proto: udp, payload: 64}, true},
		{"TCP SYN to the VIP (read in place)", vip, frameOpts{proto: tcp}, true},
		{"short UDP to the VIP (helper)", vip, frameOpts{proto: udp}, true},
		{"IP options, to the VIP (helper)", vip, frameOpts{proto: udp, ipOptions: 2, payload: 8}, true},
		{"802.1Q to the VIP (helper)", vip, frameOpts{tags: []uint16{0x8100}, proto: udp, payload: 64}, true},
		{"later fragment to the VIP (no ports)", vip, frameOpts{proto: udp, fragment: true, payload: 64}, false},
		{"UDP elsewhere", other, frameOpts{proto: udp, payload: 64}, false},
		{"three tags to the VIP", vip, frameOpts{tags: []uint16{0x88a8, 0x8100, 0x8100}, proto: udp, payload: 64}, false},
	} {
		proto := obs.Proto(tc.o.proto)
		ret, err := prog.Run(&ebpf.RunOptions{Data: testFrame(tc.dst, tc.o)})
		if err != nil {
			t.Fatalf("%s: test run: %v", tc.name, err)
		}
		if int32(ret) != -1 { // TCX_NEXT: observers never end the chain
			t.Errorf("%s: returned %d, want TCX_NEXT", tc.name, int32(ret))
		}
		got := p.hasClient(t, client, proto)
		if got != tc.learn {
			t.Errorf("%s: client %v learned %v, want %v", tc.name, client, got, tc.learn)
		}
		if got { // the next case starts with nothing learned
			if err := p.maps["watch_clients"].Delete(clientKey(client, proto)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// tapFilterRunsPerOp is how many runs the kernel makes per benchmark
// iteration: the syscall's own cost is then a negligible part of ns/run.
const tapFilterRunsPerOp = 1 << 16

// BenchmarkTapFilter times the taps' eBPF filter in the kernel
// (BPF_PROG_TEST_RUN with a repeat count, as `bpftool prog run ... repeat`):
// ns/run is the figure to watch. It is the wall time over the runs, not the
// kernel's own per-run figure, which it truncates to whole nanoseconds. The
// filter runs on every frame of three interfaces, so the frame that matters
// most is the one of unrelated traffic it drops.
func BenchmarkTapFilter(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: loads BPF programs")
	}
	vip := netip.MustParseAddrPort("10.120.0.10:53")
	other := netip.MustParseAddrPort("10.0.0.9:53")
	p, err := New()
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	if err := p.Watch(vip.Addr(), netip.MustParseAddr("10.244.20.31")); err != nil {
		b.Fatal(err)
	}
	const snaplen = 96
	prog, err := p.TapFilter(snaplen)
	if err != nil {
		b.Fatal(err)
	}
	// What the test run itself costs per run: a filter returning 0 at once.
	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "pttest_empty", Type: ebpf.SocketFilter, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		b.Fatal(err)
	}
	defer empty.Close()
	const udp = 17
	outer := append(make([]byte, 12), 0x08, 0x00) // see TestTapFilterFrames
	for _, bc := range []struct {
		name  string
		prog  *ebpf.Program
		frame []byte
		want  uint32
	}{
		{"empty program (test-run cost)", empty, testFrame(other, frameOpts{proto: udp, payload: 64}), 0},
		{"UDP elsewhere", prog, testFrame(other, frameOpts{proto: udp, payload: 64}), 0},
		{"UDP to the VIP", prog, testFrame(vip, frameOpts{proto: udp, payload: 64}), snaplen},
		{"ICMP error elsewhere", prog, icmpFrame(3, 0, quoted(other, frameOpts{proto: udp, payload: 64}, 8), icmpOpts{}), 0},
		{"ICMP error about the VIP", prog, icmpFrame(3, 0, quoted(vip, frameOpts{proto: udp, payload: 64}, 8), icmpOpts{}), snaplen},
	} {
		b.Run(bc.name, func(b *testing.B) {
			data := append(append([]byte(nil), outer...), bc.frame...)
			runs := 0
			for b.Loop() {
				ret, _, err := bc.prog.Benchmark(data, tapFilterRunsPerOp, nil)
				if err != nil {
					b.Fatal(err)
				}
				if ret != bc.want {
					b.Fatalf("filter returned %d, want %d", ret, bc.want)
				}
				runs += tapFilterRunsPerOp
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(runs), "ns/run")
		})
	}
}

// reversed is frame (untagged, no IP options) with its addresses and ports
// swapped: the reply.
func reversed(frame []byte) []byte {
	f := append([]byte(nil), frame...)
	ip := f[14:]
	var a [4]byte
	copy(a[:], ip[12:16])
	copy(ip[12:16], ip[16:20])
	copy(ip[16:20], a[:])
	l4 := ip[20:]
	l4[0], l4[1], l4[2], l4[3] = l4[2], l4[3], l4[0], l4[1]
	return f
}

// A backend watched on the endpoint it serves (WatchEndpoints) is kept on
// that port and protocol, in both directions, and dropped on its other
// ports; what has no ports (a later fragment, ICMP) and an ICMP error about
// the served port stay kept. Watching every port of it later widens it, and
// an endpoint watched after that does not narrow it again.
func TestTapFilterEndpoints(t *testing.T) {
	needRoot(t)
	vip := netip.MustParseAddrPort("10.120.0.80:80")
	served := netip.MustParseAddrPort("10.244.20.31:3000")
	otherPort := netip.AddrPortFrom(served.Addr(), 9100)
	p, _ := startProbe(t, vip.Addr())
	if err := p.WatchEndpoints(obs.Watch{Addr: served.Addr(), Port: served.Port(), Proto: obs.TCP}); err != nil {
		t.Fatal(err)
	}
	if how := p.watchHow(served.Addr()); how != watchEndpoints {
		t.Errorf("watch_addrs[%v] = %d, want %d", served.Addr(), how, watchEndpoints)
	}
	if !p.hasEndpoint(served, obs.TCP) || p.hasEndpoint(served, obs.UDP) {
		t.Errorf("watch_endpoints: want %v/tcp only", served)
	}
	const snaplen = 96
	prog, err := p.TapFilter(snaplen)
	if err != nil {
		t.Fatal(err)
	}
	const udp, tcp = 17, 6
	run := func(name string, frame []byte, keep bool) {
		t.Helper()
		outer := append(make([]byte, 12), 0x08, 0x00) // see TestTapFilterFrames
		ret, err := prog.Run(&ebpf.RunOptions{Data: append(outer, frame...)})
		if err != nil {
			t.Fatalf("%s: test run: %v", name, err)
		}
		if want := map[bool]uint32{true: snaplen, false: 0}[keep]; ret != want {
			t.Errorf("%s: filter returned %d, want %d", name, ret, want)
		}
	}
	run("TCP to the served port", testFrame(served, frameOpts{proto: tcp}), true)
	run("reply from the served port", reversed(testFrame(served, frameOpts{proto: tcp})), true)
	run("TCP to another port", testFrame(otherPort, frameOpts{proto: tcp}), false)
	run("reply from another port", reversed(testFrame(otherPort, frameOpts{proto: tcp})), false)
	run("UDP to the served TCP port", testFrame(served, frameOpts{proto: udp, payload: 8}), false)
	run("UDP flood port", testFrame(netip.AddrPortFrom(served.Addr(), 40001), frameOpts{proto: udp, payload: 64}), false)
	run("802.1Q to the served port", testFrame(served, frameOpts{tags: []uint16{0x8100}, proto: tcp}), true)
	run("802.1Q to another port", testFrame(otherPort, frameOpts{tags: []uint16{0x8100}, proto: tcp}), false)
	run("IP options, to the served port", testFrame(served, frameOpts{proto: tcp, ipOptions: 2}), true)
	run("IP options, to another port", testFrame(otherPort, frameOpts{proto: tcp, ipOptions: 2}), false)
	run("later fragment to the backend", testFrame(otherPort, frameOpts{proto: udp, fragment: true, payload: 64}), true)
	run("VIP on any port", testFrame(netip.AddrPortFrom(vip.Addr(), 12345), frameOpts{proto: udp, payload: 8}), true)
	run("ICMP error about the served port", icmpFrame(3, 1, quoted(served, frameOpts{proto: tcp}, 8), icmpOpts{}), true)
	run("ICMP error about another port", icmpFrame(3, 1, quoted(otherPort, frameOpts{proto: tcp}, 8), icmpOpts{}), false)

	if err := p.Watch(served.Addr()); err != nil {
		t.Fatal(err)
	}
	run("every port watched: another port", testFrame(otherPort, frameOpts{proto: tcp}), true)
	if err := p.WatchEndpoints(obs.Watch{Addr: served.Addr(), Port: 3001}); err != nil {
		t.Fatal(err)
	}
	if how := p.watchHow(served.Addr()); how != watchAnyPort {
		t.Errorf("an endpoint after every port: watch_addrs[%v] = %d, want %d", served.Addr(), how, watchAnyPort)
	}
	run("an endpoint after every port: another port", testFrame(otherPort, frameOpts{proto: tcp}), true)
}

// budgetHashOf is observe.h's pt_flow_point_hash of a flow-point's key
// (struct pt_flow_point: addresses and ports in network byte order, then
// protocol, point and direction or hook): its low 2 bits pick the budget
// table, the rest the set (budgetSetOf).
func budgetHashOf(src, dst netip.AddrPort, proto, point, where uint8) uint64 {
	var k [16]byte
	s, d := src.Addr().As4(), dst.Addr().As4()
	copy(k[0:4], s[:])
	copy(k[4:8], d[:])
	binary.BigEndian.PutUint16(k[8:10], src.Port())
	binary.BigEndian.PutUint16(k[10:12], dst.Port())
	k[12], k[13], k[14] = proto, point, where
	w0, w1 := binary.LittleEndian.Uint64(k[0:8]), binary.LittleEndian.Uint64(k[8:16])
	lo := mix32(uint32(w0) ^ mix32(uint32(w0>>32)) ^ mix32(uint32(w1)^mix32(uint32(w1>>32))))
	hi := mix32(uint32(w0>>32) ^ mix32(uint32(w1)^0x9e3779b9) ^ mix32(uint32(w0)^mix32(uint32(w1>>32)^0x7f4a7c15)))
	if h := uint64(hi)<<32 | uint64(lo); h != 0 {
		return h
	}
	return 1
}

// budgetSets is PT_BUDGET_SETS, the sets of each of the 4 budget tables.
const budgetSets = 500

// budgetSetOf is the table and set of a flow-point's budget (4 tables of
// budgetSets sets).
func budgetSetOf(src, dst netip.AddrPort, proto, point, where uint8) (table, set uint32) {
	h := uint32(budgetHashOf(src, dst, proto, point, where))
	return h & 3, (h >> 2) % budgetSets
}

// The budget of a UDP flow at the tc head observer, in the direction in.
const udp, ptTCHead, ptDirIn = 17, 4, 1

// tcHeadProbe starts a probe watching a VIP and returns it with its tc head
// observer, to run frames through, and the VIP's DNS endpoint.
func tcHeadProbe(t *testing.T) (*Probe, *ebpf.Program, netip.AddrPort) {
	t.Helper()
	vip := netip.MustParseAddrPort("10.120.0.10:53")
	p, _ := startProbe(t, vip.Addr())
	p.mu.Lock()
	prog, err := p.program(p.tcSpec, "pt_tc_head_in")
	p.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	return p, prog, vip
}

// The packet observers keep a flow direction's event budget in a 4-way set
// of slots: a spent budget stays spent while the other flows of its set fill
// the rest of it, and a fifth flow takes the slot whose budget grew earliest,
// whose flow then starts a new budget (a few more events, never fewer).
// Five UDP flows whose tc head budgets share a set, run through the
// observer in the kernel; within one refill (~10 ms), retried on a slow run.
func TestBudgetSetKeepsFourFlows(t *testing.T) {
	needRoot(t)
	p, prog, vip := tcHeadProbe(t)
	onOneCPU(t) // a's quiet slot (TestQuietFlowStillReported) is this CPU's
	client := netip.MustParseAddr("10.244.8.23")
	// Client ports by set, each attempt in a set of its own.
	bySet := map[[2]uint32][]uint16{}
	for port := uint16(1024); port < 65535; port++ {
		table, set := budgetSetOf(netip.AddrPortFrom(client, port), vip, udp, ptTCHead, ptDirIn)
		bySet[[2]uint32{table, set}] = append(bySet[[2]uint32{table, set}], port)
	}
	var sets [][]uint16
	for _, ports := range bySet {
		if len(ports) >= 5 {
			sets = append(sets, ports[:5])
		}
	}
	send := func(port uint16) {
		t.Helper()
		if _, err := prog.Run(&ebpf.RunOptions{Data: testFrame(vip, frameOpts{proto: udp, sport: port, payload: 8})}); err != nil {
			t.Fatal(err)
		}
	}
	summarized := func() uint64 { return p.Stats().Summarized }
	for attempt := range 3 {
		a, b, c, d, e := sets[attempt][0], sets[attempt][1], sets[attempt][2], sets[attempt][3], sets[attempt][4]
		start, before := time.Now(), summarized()
		for range 9 { // a spends its budget: the 9th is summarized
			send(a)
		}
		spent := summarized() - before
		send(b)
		send(c)
		send(d)
		send(a) // the set is full; a's budget is still there, spent
		kept := summarized() - before
		send(e) // takes a's slot, the one that grew earliest
		send(a) // a new budget: reported
		after := summarized() - before
		if time.Since(start) > 5*time.Millisecond {
			t.Logf("attempt %d took %v, near a refill: again", attempt, time.Since(start))
			continue
		}
		if spent != 1 || kept != 2 || after != 2 {
			t.Errorf("summarized %d after a's 9 packets (want 1), %d after b, c, d and a again (want 2), %d after e and a again (want 2)", spent, kept, after)
		}
		return
	}
	t.Skip("three attempts each took longer than 5 ms: the machine is too slow to run them within a refill")
}

// A flow direction found over its budget is summarized at once while the
// jiffy lasts (pt_quiet, which spares a bulk flow's next segments their
// lookups), but that never holds back what the budget reports: a FIN of the
// flow is reported at once, and so is its first packet after a refill. One
// TCP flow's packets (ACK, then FIN+ACK) run through the tc head observer;
// within one refill (~10 ms), retried on a slow run.
func TestQuietFlowStillReported(t *testing.T) {
	needRoot(t)
	p, prog, _ := tcHeadProbe(t)
	vip := netip.MustParseAddrPort("10.120.0.10:443")
	onOneCPU(t) // the quiet flow is per CPU
	const tcp, ack, finAck = 6, 0x10, 0x11
	send := func(port uint16, flags uint8) uint64 {
		t.Helper()
		before := p.Stats().Summarized
		if _, err := prog.Run(&ebpf.RunOptions{Data: testFrame(vip, frameOpts{proto: tcp, sport: port, tcpFlags: flags, payload: 8})}); err != nil {
			t.Fatal(err)
		}
		return p.Stats().Summarized - before
	}
	for attempt := range 3 {
		port := uint16(42000 + attempt)
		start := time.Now()
		var spent uint64
		for range 10 { // 8 reported, the 9th finds the budget spent, the 10th the flow quiet
			spent += send(port, ack)
		}
		fin := send(port, finAck)
		afterFin := send(port, ack)
		if time.Since(start) > 5*time.Millisecond {
			t.Logf("attempt %d took %v, near a refill: again", attempt, time.Since(start))
			continue
		}
		if spent != 2 || fin != 0 || afterFin != 1 {
			t.Errorf("summarized %d of 10 ACKs (want 2), %d of the FIN (want 0), %d of the ACK after it (want 1)", spent, fin, afterFin)
		}
		time.Sleep(25 * time.Millisecond) // two refills, several jiffies
		if n := send(port, ack); n != 0 {
			t.Errorf("the flow's first ACK after a refill summarized, want it reported")
		}
		return
	}
	t.Skip("three attempts each took longer than 5 ms: the machine is too slow to run them within a refill")
}

// onOneCPU keeps the test's goroutine on its thread, and the thread on the
// CPU it runs on, until the test ends: programs run with ebpf.RunOptions
// run on the caller's CPU, and what they keep per CPU stays in view.
func onOneCPU(t *testing.T) {
	t.Helper()
	runtime.LockOSThread()
	var was unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		t.Fatal(err)
	}
	var one unix.CPUSet
	for cpu := 0; one.Count() == 0 && cpu < 1024; cpu++ {
		if was.IsSet(cpu) {
			one.Set(cpu)
		}
	}
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = unix.SchedSetaffinity(0, &was)
		runtime.UnlockOSThread()
	})
}

// A budget's age is read across the wrap of its 32-bit clock: a slot last
// refilled 2^31 units (~26 days) ago, spent, refills (its flow's next
// packet is reported), and one stamped a moment after now (by another CPU
// while this run went on), spent, does not (summarized). Each slot is
// written from user space, then one packet of its flow is run through the
// tc head observer.
func TestBudgetAgeAcrossTheWrap(t *testing.T) {
	needRoot(t)
	p, prog, vip := tcHeadProbe(t)
	client := netip.MustParseAddr("10.244.8.23")
	for _, tc := range []struct {
		name       string
		port       uint16
		stamp      func(now uint32) uint32 // when the budget last grew
		summarized uint64                  // of the packet that follows
	}{
		{"refilled 2^31 units ago", 41000, func(now uint32) uint32 { return now - 1<<31 - 100 }, 0},
		{"stamped 3 units after now", 41001, func(now uint32) uint32 { return now + 3 }, 1},
	} {
		src := netip.AddrPortFrom(client, tc.port)
		h := budgetHashOf(src, vip, udp, ptTCHead, ptDirIn)
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			t.Fatal(err)
		}
		now := uint32(uint64(ts.Nano()) >> 20) // pt_coarse_ms
		var set [64]byte                       // struct pt_budget_set: way 0 spent, the rest free
		binary.LittleEndian.PutUint64(set[0:8], h)
		binary.LittleEndian.PutUint32(set[8:12], tc.stamp(now))
		table := fmt.Sprintf("flow_events_%d", h&3)
		if err := p.maps[table].Put((uint32(h)>>2)%budgetSets, set); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		before := p.Stats().Summarized
		if _, err := prog.Run(&ebpf.RunOptions{Data: testFrame(vip, frameOpts{proto: udp, sport: tc.port, payload: 8})}); err != nil {
			t.Fatal(err)
		}
		if got := p.Stats().Summarized - before; got != tc.summarized {
			t.Errorf("%s: the next packet summarized %d times, want %d", tc.name, got, tc.summarized)
		}
	}
}
