package capture

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/obs"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/net/bpf"
)

// runFilter runs a classic BPF program in x/net/bpf's VM, which follows the
// kernel's semantics (a load past the end of the frame returns 0).
func runFilter(t testing.TB, prog []bpf.RawInstruction, frame []byte) int {
	t.Helper()
	ins, ok := bpf.Disassemble(prog)
	if !ok {
		t.Fatalf("program does not disassemble")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatalf("NewVM: %v", err)
	}
	n, err := vm.Run(frame)
	if err != nil {
		t.Fatalf("vm.Run: %v", err)
	}
	return n
}

// mustFilter builds the filter of watches: "ADDR" (every port), "ADDR:PORT"
// (TCP and UDP) or "ADDR:PORT/tcp|udp".
// watchAll watches every port of addrs.
func watchAll(addrs []netip.Addr) []obs.Watch {
	ws := make([]obs.Watch, len(addrs))
	for i, a := range addrs {
		ws[i] = obs.WatchAddr(a)
	}
	return ws
}

func mustFilter(t testing.TB, snaplen int, watches ...string) []bpf.RawInstruction {
	t.Helper()
	var ws []obs.Watch
	for _, w := range watches {
		s, proto, _ := strings.Cut(w, "/")
		var ow obs.Watch
		if ap, err := netip.ParseAddrPort(s); err == nil {
			ow = obs.Watch{Addr: ap.Addr(), Port: ap.Port()}
		} else {
			ow = obs.WatchAddr(netip.MustParseAddr(s))
		}
		switch proto {
		case "tcp":
			ow.Proto = obs.TCP
		case "udp":
			ow.Proto = obs.UDP
		}
		ws = append(ws, ow)
	}
	prog, err := FilterFor(ws, snaplen)
	if err != nil {
		t.Fatalf("FilterFor: %v", err)
	}
	return prog
}

func TestFilterFor(t *testing.T) {
	prog := mustFilter(t, 96, "10.120.0.80", "10.244.20.31")
	dot1q := tag{tpid: etherTypeDot1Q, vid: 200}
	qinq := []tag{{tpid: etherTypeDot1AD, vid: 100}, {tpid: etherTypeDot1Q, vid: 200}}

	arp := buildFrame(t, nil, layers.EthernetTypeARP, &layers.ARP{
		AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4,
		HwAddressSize: 6, ProtAddressSize: 4, Operation: layers.ARPRequest,
		SourceHwAddress: macA, SourceProtAddress: net.ParseIP("10.244.8.23").To4(),
		DstHwAddress: make([]byte, 6), DstProtAddress: net.ParseIP("10.120.0.80").To4(),
	})
	ip6 := &layers.IPv6{Version: 6, NextHeader: layers.IPProtocolUDP, HopLimit: 64,
		SrcIP: net.ParseIP("fd00::1"), DstIP: net.ParseIP("fd00::2")}
	udp6 := &layers.UDP{SrcPort: 1, DstPort: 2}
	_ = udp6.SetNetworkLayerForChecksum(ip6)
	ipv6 := buildFrame(t, nil, layers.EthernetTypeIPv6, ip6, udp6, gopacket.Payload("x"))
	icmp := buildFrame(t, nil, layers.EthernetTypeIPv4, ipv4("10.244.8.23", "10.244.20.31", layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0)})

	tests := []struct {
		name  string
		frame []byte
		want  int
	}{
		{"udp to listed", udpFrame(t, "10.244.8.23", "10.120.0.80", 40000, 80), 96},
		{"tcp from listed", tcpFrame(t, "10.244.20.31", "10.244.8.23", 3000, 40000), 96},
		{"tcp to second listed", tcpFrame(t, "10.244.8.23", "10.244.20.31", 40000, 3000), 96},
		{"not listed", udpFrame(t, "10.244.8.23", "10.244.8.24", 40000, 80), 0},
		{"icmp to listed (any L4)", icmp, 96},
		{"802.1Q to listed", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2, dot1q), 96},
		{"802.1Q not listed", udpFrame(t, "10.244.8.23", "10.0.0.1", 1, 2, dot1q), 0},
		{"802.1ad to listed", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2, tag{tpid: etherTypeDot1AD, vid: 7}), 96},
		{"QinQ to listed", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2, qinq...), 96},
		{"QinQ from listed", tcpFrame(t, "10.244.20.31", "10.1.1.1", 1, 2, qinq...), 96},
		{"QinQ not listed", udpFrame(t, "10.244.8.23", "10.0.0.1", 1, 2, qinq...), 0},
		{"double 802.1Q", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2, dot1q, dot1q), 96},
		{"three tags", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2, dot1q, dot1q, dot1q), 0},
		{"arp for listed", arp, 0},
		{"ipv6", ipv6, 0},
		{"truncated in dst", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2)[:14+18], 0},
		{"truncated in src, listed dst", tcpFrame(t, "10.120.0.80", "10.0.0.1", 1, 2)[:14+14], 0},
		{"ethernet header only", udpFrame(t, "10.244.8.23", "10.120.0.80", 1, 2)[:14], 0},
		{"runt", []byte{1, 2, 3}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := runFilter(t, prog, tc.frame); got != tc.want {
				t.Errorf("filter returned %d, want %d", got, tc.want)
			}
		})
	}
}

// An ICMP error is judged by the packet it quotes: kept when the quoted
// source or destination is listed, whoever sent the error to whom.
func TestFilterForICMPErrors(t *testing.T) {
	prog := mustFilter(t, 96, "10.120.0.80", "10.244.20.31")
	const gw, client, other = "10.244.8.1", "10.244.8.23", "10.0.0.9"
	toVIP := quoteOf(udpFrame(t, client, "10.120.0.80", 41911, 80), 8)
	toBackend := quoteOf(tcpFrame(t, client, "10.244.20.31", 40000, 3000), 8)
	elsewhere := quoteOf(udpFrame(t, client, other, 41911, 80), 8)
	fromBackend := quoteOf(udpFrame(t, "10.244.20.31", other, 5353, 80), 8)
	dot1q := tag{tpid: etherTypeDot1Q, vid: 200}
	qinq := []tag{{tpid: etherTypeDot1AD, vid: 100}, dot1q}
	notIPv4 := append([]byte(nil), toVIP...)
	notIPv4[0] = 0x65
	fragment := func(f []byte) []byte { f[14+6], f[14+7] = 0, 0x10; return f }
	for _, tc := range []struct {
		name  string
		frame []byte
		want  int
	}{
		{"net unreachable about a request to the VIP", icmpFrame(t, gw, client, 3, 0, toVIP), 96},
		{"host unreachable about a request to a backend", icmpFrame(t, gw, client, 3, 1, toBackend), 96},
		{"time exceeded about the VIP", icmpFrame(t, gw, client, 11, 0, toVIP), 96},
		{"parameter problem about the VIP", icmpFrame(t, gw, client, 12, 0, toVIP), 96},
		{"the whole request quoted", icmpFrame(t, gw, client, 3, 0, quoteOf(udpFrame(t, client, "10.120.0.80", 1, 80), 13)), 96},
		{"802.1Q, about the VIP", icmpFrame(t, gw, client, 3, 0, toVIP, dot1q), 96},
		{"QinQ, about the VIP", icmpFrame(t, gw, client, 3, 0, toVIP, qinq...), 96},
		{"three tags, about the VIP", icmpFrame(t, gw, client, 3, 0, toVIP, dot1q, dot1q, dot1q), 0},
		{"outer IP options, about the VIP", withOuterIPOptions(t, icmpFrame(t, gw, client, 3, 0, toVIP)), 96},
		{"quoted IP options, about a backend", icmpFrame(t, gw, client, 3, 0, quoteOf(withIPOptions(t, tcpFrame(t, client, "10.244.20.31", 1, 2)), 8)), 96},
		{"port unreachable from a backend", icmpFrame(t, "10.244.20.31", client, 3, 3, toBackend), 96},
		{"sent to a backend about its own packet", icmpFrame(t, gw, "10.244.20.31", 3, 0, fromBackend), 96},
		{"about a request elsewhere", icmpFrame(t, gw, client, 3, 0, elsewhere), 0},
		{"from a backend, about a packet it forwarded", icmpFrame(t, "10.244.20.31", client, 11, 0, elsewhere), 0},
		{"echo request quoting a request to the VIP", icmpFrame(t, gw, client, 8, 0, toVIP), 0},
		{"redirect about the VIP", icmpFrame(t, gw, client, 5, 0, toVIP), 0},
		{"echo reply from a backend", icmpFrame(t, "10.244.20.31", client, 0, 0, elsewhere), 96},
		{"quote cut, sent to a backend", icmpFrame(t, gw, "10.244.20.31", 3, 0, toVIP[:19]), 96},
		{"quote cut, about the VIP", icmpFrame(t, gw, client, 3, 0, toVIP[:19]), 0},
		{"quote not IPv4, from a backend", icmpFrame(t, "10.244.20.31", client, 3, 0, notIPv4), 96},
		{"quote not IPv4, about the VIP", icmpFrame(t, gw, client, 3, 0, notIPv4), 0},
		{"later fragment of an error about the VIP", fragment(icmpFrame(t, gw, client, 3, 0, toVIP)), 0},
		{"later fragment of an error from a backend", fragment(icmpFrame(t, "10.244.20.31", client, 3, 0, elsewhere)), 96},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := runFilter(t, prog, tc.frame); got != tc.want {
				t.Errorf("filter returned %d, want %d", got, tc.want)
			}
		})
	}
}

func TestFilterForNoAddrsAcceptsNothing(t *testing.T) {
	prog := mustFilter(t, 96)
	if len(prog) != 1 {
		t.Errorf("empty filter has %d instructions, want 1", len(prog))
	}
	if got := runFilter(t, prog, udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)); got != 0 {
		t.Errorf("empty filter accepted a frame (%d)", got)
	}
}

func TestFilterForSnaplenAndDuplicates(t *testing.T) {
	one := mustFilter(t, 200, "10.0.0.2")
	dup := mustFilter(t, 200, "10.0.0.2", "::ffff:10.0.0.2", "10.0.0.2")
	if len(one) != len(dup) {
		t.Errorf("duplicates not merged: %d vs %d instructions", len(dup), len(one))
	}
	if got := runFilter(t, dup, udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)); got != 200 {
		t.Errorf("returned %d, want snaplen 200", got)
	}
}

func TestFilterForLimits(t *testing.T) {
	addrs := make([]netip.Addr, MaxFilterAddrs+1)
	for i := range addrs {
		addrs[i] = netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})
	}
	if _, err := FilterFor(watchAll(addrs), 96); err == nil {
		t.Errorf("FilterFor accepted %d addresses", len(addrs))
	}
	prog, err := FilterFor(watchAll(addrs[:MaxFilterAddrs]), 96)
	if err != nil {
		t.Fatalf("FilterFor(%d addresses): %v", MaxFilterAddrs, err)
	}
	if len(prog) > 4096 {
		t.Errorf("%d instructions, the kernel takes at most 4096", len(prog))
	}
	if len(prog) != filterFixed+4*MaxFilterAddrs {
		t.Errorf("%d instructions for %d addresses, want %d+4 each (filterFixed)", len(prog), MaxFilterAddrs, filterFixed)
	}
	last := addrs[MaxFilterAddrs-1].String()
	if got := runFilter(t, prog, icmpFrame(t, "10.9.9.1", "10.9.9.9", 3, 0, quoteOf(udpFrame(t, "10.9.9.9", last, 1, 2), 8))); got != 96 {
		t.Errorf("ICMP error about the last address: %d, want 96", got)
	}
	if got := runFilter(t, prog, udpFrame(t, "10.9.9.9", last, 1, 2, tag{tpid: etherTypeDot1Q, vid: 1})); got != 96 {
		t.Errorf("last address as dst: %d, want 96", got)
	}
	if got := runFilter(t, prog, udpFrame(t, last, "10.9.9.9", 1, 2)); got != 96 {
		t.Errorf("last address as src: %d, want 96", got)
	}
	if got := runFilter(t, prog, udpFrame(t, addrs[MaxFilterAddrs].String(), "10.9.9.9", 1, 2)); got != 0 {
		t.Errorf("address beyond the list accepted: %d", got)
	}

	for _, bad := range []struct {
		addrs   []netip.Addr
		snaplen int
	}{
		{[]netip.Addr{netip.MustParseAddr("fd00::1")}, 96},
		{[]netip.Addr{{}}, 96},
		{nil, 0},
	} {
		if _, err := FilterFor(watchAll(bad.addrs), bad.snaplen); err == nil {
			t.Errorf("FilterFor(%v, %d) gave no error", bad.addrs, bad.snaplen)
		}
	}
}

// A backend known with the port it serves is matched on that port (and
// protocol) in both directions; its other ports are not captured, while a
// packet of it without ports (a later fragment, ICMP) and an ICMP error
// about a traced flow still are. The VIP, watched on every port, keeps
// matching any port.
func TestFilterForEndpoints(t *testing.T) {
	const vip, backend, client, gw = "10.120.0.80", "10.244.20.31", "10.244.8.23", "10.244.8.1"
	prog := mustFilter(t, 96, vip, backend+":3000/tcp", "10.244.20.32:53")
	dot1q := tag{tpid: etherTypeDot1Q, vid: 200}
	qinq := []tag{{tpid: etherTypeDot1AD, vid: 100}, dot1q}
	fragment := func(f []byte) []byte { f[14+6], f[14+7] = 0, 0x10; return f }
	icmpEcho := buildFrame(t, nil, layers.EthernetTypeIPv4, ipv4(client, backend, layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0)})
	for _, tc := range []struct {
		name  string
		frame []byte
		want  int
	}{
		{"to the served port", tcpFrame(t, client, backend, 40000, 3000), 96},
		{"reply from the served port", tcpFrame(t, backend, client, 3000, 40000), 96},
		{"to another port", tcpFrame(t, client, backend, 40000, 9100), 0},
		{"from another port", tcpFrame(t, backend, client, 9100, 40000), 0},
		{"udp to the served tcp port", udpFrame(t, client, backend, 40000, 3000), 0},
		{"served port as the source, to the backend", tcpFrame(t, client, backend, 3000, 9100), 0},
		{"802.1Q to the served port", tcpFrame(t, client, backend, 40000, 3000, dot1q), 96},
		{"802.1Q to another port", tcpFrame(t, client, backend, 40000, 9100, dot1q), 0},
		{"QinQ reply from the served port", tcpFrame(t, backend, client, 3000, 40000, qinq...), 96},
		{"QinQ to another port", udpFrame(t, client, backend, 40000, 9100, qinq...), 0},
		{"IP options, to the served port", withIPOptions(t, tcpFrame(t, client, backend, 40000, 3000)), 96},
		{"IP options, to another port", withIPOptions(t, tcpFrame(t, client, backend, 40000, 9100)), 0},
		{"later fragment to the backend (no ports)", fragment(udpFrame(t, client, backend, 40000, 9100)), 96},
		{"icmp echo to the backend", icmpEcho, 96},
		{"no protocol named: udp", udpFrame(t, client, "10.244.20.32", 40000, 53), 96},
		{"no protocol named: tcp", tcpFrame(t, client, "10.244.20.32", 40000, 53), 96},
		{"no protocol named: another port", udpFrame(t, client, "10.244.20.32", 40000, 54), 0},
		{"VIP, any port", udpFrame(t, client, vip, 40000, 12345), 96},
		{"host unreachable about a request to the served port", icmpFrame(t, gw, client, 3, 1, quoteOf(tcpFrame(t, client, backend, 40000, 3000), 8)), 96},
		{"802.1Q, host unreachable about the served port", icmpFrame(t, gw, client, 3, 1, quoteOf(tcpFrame(t, client, backend, 40000, 3000), 8), dot1q), 96},
		{"host unreachable about another port", icmpFrame(t, gw, client, 3, 1, quoteOf(tcpFrame(t, client, backend, 40000, 9100), 8)), 0},
		{"quote cut before the ports, about the backend", icmpFrame(t, gw, client, 3, 1, quoteOf(tcpFrame(t, client, backend, 40000, 9100), 2)), 96},
		{"net unreachable about a request to the VIP", icmpFrame(t, gw, client, 3, 0, quoteOf(udpFrame(t, client, vip, 41911, 80), 8)), 96},
		{"cut in the ports, another port (by its address)", tcpFrame(t, client, backend, 40000, 9100)[:14+20+3], 96},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := runFilter(t, prog, tc.frame); got != tc.want {
				t.Errorf("filter returned %d, want %d", got, tc.want)
			}
		})
	}
}

// An address watched on every port and with an endpoint is watched on
// every port; one with more endpoints than a program's jumps reach too.
func TestFilterForEndpointsMerge(t *testing.T) {
	const backend, client = "10.244.20.31", "10.244.8.23"
	for _, ws := range [][]string{{backend + ":3000", backend}, {backend, backend + ":3000/tcp"}} {
		prog := mustFilter(t, 96, ws...)
		if got := runFilter(t, prog, tcpFrame(t, client, backend, 40000, 9100)); got != 96 {
			t.Errorf("%v: another port returned %d, want 96", ws, got)
		}
	}
	var many []string
	for p := range maxEndpointsPerAddr + 1 {
		many = append(many, fmt.Sprintf("%s:%d/tcp", backend, 1000+p))
	}
	prog := mustFilter(t, 96, many...)
	if got := runFilter(t, prog, tcpFrame(t, client, backend, 40000, 9100)); got != 96 {
		t.Errorf("%d endpoints: another port returned %d, want 96 (every port)", len(many), got)
	}
	prog = mustFilter(t, 96, many[:maxEndpointsPerAddr]...)
	for _, port := range []uint16{1000, 1000 + maxEndpointsPerAddr - 1} {
		if got := runFilter(t, prog, tcpFrame(t, backend, client, port, 40000)); got != 96 {
			t.Errorf("%d endpoints: reply from %d returned %d, want 96", maxEndpointsPerAddr, port, got)
		}
	}
	if got := runFilter(t, prog, tcpFrame(t, client, backend, 40000, 9100)); got != 0 {
		t.Errorf("%d endpoints: another port returned %d, want 0", maxEndpointsPerAddr, got)
	}
	// The kernel's limit: endpoints of many addresses.
	var ws []obs.Watch
	for i := range 200 {
		for p := range 10 {
			ws = append(ws, obs.Watch{Addr: netip.AddrFrom4([4]byte{10, 2, 0, byte(i)}), Port: uint16(80 + p), Proto: obs.TCP})
		}
	}
	if _, err := FilterFor(ws, 96); err == nil {
		t.Errorf("FilterFor of %d endpoints gave no error past the kernel's limit", len(ws))
	}
}
