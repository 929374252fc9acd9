package discover

import (
	"net"
	"net/netip"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
	"golang.org/x/sys/unix"
)

// TestNFTIPv6TableNotForIPv4: on a dual-stack node kube-proxy writes an
// IPv6 table beside the IPv4 one, whose NodePort rules name no address and
// hold the same NodePort with the IPv6 endpoints: nftables mode's `ip6
// kube-proxy` (`fib daddr type local ip6 daddr != ::1 meta l4proto . th
// dport vmap @service-nodeports`, nodePortAddresses unset), iptables mode's
// `ip6 nat` through iptables-nft (`-m addrtype --dst-type LOCAL -j
// KUBE-NODEPORTS`). An IPv4 packet never traverses an ip6 table: an IPv4
// NODE-IP:PORT trace must take none of their DNATs.
func TestNFTIPv6TableNotForIPv4(t *testing.T) {
	ip6 := func(s string) []byte { a := netip.MustParseAddr(s).As16(); return a[:] }
	loadDaddr6 := &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 24, Len: 16}
	sets := map[string]nftSet{
		"service-ips": {elems: []nftables.SetElement{
			{Key: concatKey(ip6("fd00:10:96::80"), []byte{unix.IPPROTO_TCP}, port(80)), VerdictData: gotoChain("service-web")},
		}},
		"service-nodeports": {elems: []nftables.SetElement{
			{Key: concatKey([]byte{unix.IPPROTO_TCP}, port(30080)), VerdictData: gotoChain("external-web")},
		}},
		"__map0": {elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-web-a")}}},
	}
	lookup := func(name string) (nftSet, bool) { s, ok := sets[name]; return s, ok }
	rules := map[string][][]expr.Any{
		"nat-prerouting": {{jump("services")}},
		"services": {
			{loadDaddr6, loadProto(unix.NFT_REG32_04), &expr.Payload{DestRegister: unix.NFT_REG32_05, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Lookup{SourceRegister: 1, SetName: "service-ips", IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT}},
			{&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true}, cmpEq(1, 2, 0, 0, 0),
				loadDaddr6, &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ip6("::1")},
				loadProto(1), loadDport(unix.NFT_REG32_01),
				&expr.Lookup{SourceRegister: 1, SetName: "service-nodeports", IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT}},
		},
		"external-web": {{jump("mark-for-masquerade")}, {gotoChain("service-web")}},
		"service-web":  {{&expr.Numgen{Register: 1, Modulus: 1}, &expr.Lookup{SourceRegister: 1, SetName: "__map0", IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT}}},
		"endpoint-web-a": {{loadProto(1), cmpEq(1, unix.IPPROTO_TCP),
			&expr.Immediate{Register: 1, Data: ip6("fd00:10:244::1f")},
			&expr.Immediate{Register: 2, Data: port(3000)},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV6, RegAddrMin: 1, RegProtoMin: 2, Specified: true}}},
		"mark-for-masquerade": {{&expr.Immediate{Register: 1, Data: []byte{0, 0x40, 0, 0}}}},
	}
	g := &natGraph{source: SourceNFTables, table: "ip6 kube-proxy", family: "ip6", bases: []natBase{{"nat-prerouting", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{}}
	for chain, rs := range rules {
		for _, r := range rs {
			g.chains[chain] = append(g.chains[chain], nftNATRules(r, lookup)...)
		}
	}
	// The table is read right: its own IPv6 ClusterIP reaches its endpoint.
	if got := keys(g.match([]netip.Addr{netip.MustParseAddr("fd00:10:96::80")})); len(got) != 1 {
		t.Fatalf("IPv6 ClusterIP: got %q, want its one DNAT", got)
	}
	node := netip.MustParseAddr("192.168.1.10")
	s := newServiceSet(nil, []ServicePort{{Addr: node, Port: 30080, Proto: "tcp"}})
	s.local = map[netip.Addr]bool{node: true}
	if got := g.matchServices(s); len(got) != 0 {
		t.Errorf("IPv4 NodePort %s:30080 took the ip6 kube-proxy table's rules: %q", node, keys(got))
	}

	// kube-proxy's iptables mode through iptables-nft: `ip6 nat`, whose
	// KUBE-SERVICES sends every local destination to KUBE-NODEPORTS.
	x := &natGraph{source: SourceNFTables, table: "ip6 nat", family: "ip6", bases: []natBase{{"PREROUTING", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{}}
	for chain, rs := range map[string][][]expr.Any{
		"PREROUTING":     {{jump("KUBE-SERVICES")}},
		"KUBE-SERVICES":  {{&expr.Match{Name: "addrtype", Info: &xt.AddrTypeV1{Dest: uint16(xt.AddrTypeLocal)}}, jump("KUBE-NODEPORTS")}},
		"KUBE-NODEPORTS": {{loadProto(1), cmpEq(1, unix.IPPROTO_TCP), loadDport(1), cmpEq(1, port(30080)...), jump("KUBE-SEP-WEBAAAAAAAAAAAAA")}},
		"KUBE-SEP-WEBAAAAAAAAAAAAA": {{&expr.Target{Name: "DNAT", Info: &xt.NatRange{Flags: 3,
			MinIP: net.ParseIP("fd00:10:244::1f"), MaxIP: net.ParseIP("fd00:10:244::1f"), MinPort: 3000, MaxPort: 3000}}}},
	} {
		for _, r := range rs {
			x.chains[chain] = append(x.chains[chain], nftNATRules(r, noSets)...)
		}
	}
	if got := x.matchServices(s); len(got) != 0 {
		t.Errorf("IPv4 NodePort %s:30080 took the ip6 nat table's rules: %q", node, keys(got))
	}
}
