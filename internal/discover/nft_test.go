package discover

import (
	"encoding/binary"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Expression builders in the shapes nft(8) and iptables-nft emit.

func loadDaddr(reg uint32) expr.Any {
	return &expr.Payload{DestRegister: reg, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}
}

func loadDport(reg uint32) expr.Any {
	return &expr.Payload{DestRegister: reg, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}
}

func loadProto(reg uint32) expr.Any { return &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg} }

func cmpEq(reg uint32, data ...byte) expr.Any {
	return &expr.Cmp{Op: expr.CmpOpEq, Register: reg, Data: data}
}

func ip4(s string) []byte { a := netip.MustParseAddr(s).As4(); return a[:] }

func port(p uint16) []byte { return []byte{byte(p >> 8), byte(p)} }

func jump(chain string) expr.Any { return &expr.Verdict{Kind: expr.VerdictJump, Chain: chain} }

func gotoChain(chain string) *expr.Verdict {
	return &expr.Verdict{Kind: expr.VerdictGoto, Chain: chain}
}

// dnatTo is `dnat to ADDR:PORT` as nft(8) compiles it.
func dnatTo(addr string, p uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: ip4(addr)},
		&expr.Immediate{Register: 2, Data: port(p)},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true},
	}
}

func noSets(string) (nftSet, bool) { return nftSet{}, false }

func TestNFTRuleDirectMatchAndDNAT(t *testing.T) {
	// ip daddr 10.120.0.80 meta l4proto tcp th dport 80 jump svc-web
	r := nftNATRules([]expr.Any{
		loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...),
		loadProto(1), cmpEq(1, unix.IPPROTO_TCP),
		loadDport(1), cmpEq(1, port(80)...),
		jump("svc-web"),
	}, noSets)
	if len(r) != 1 || len(r[0].dst) != 1 || r[0].dst[0] != netip.MustParsePrefix("10.120.0.80/32") ||
		r[0].proto != "tcp" || r[0].port != 80 || !slices.Equal(r[0].targets, []string{"svc-web"}) || r[0].dnat {
		t.Fatalf("match rule: got %+v", r)
	}
	d := nftNATRules(append([]expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_TCP)}, dnatTo("10.244.20.31", 3000)...), noSets)
	if len(d) != 1 || !d[0].dnat || d[0].backend != netip.MustParseAddrPort("10.244.20.31:3000") || len(d[0].dst) != 0 {
		t.Fatalf("dnat rule: got %+v", d)
	}
	// dnat to an address held in a register loaded from the packet: not decodable.
	u := nftNATRules([]expr.Any{loadDaddr(1), &expr.NAT{Type: expr.NATTypeDestNAT, RegAddrMin: 1}}, noSets)
	if !u[0].dnat || u[0].backend.IsValid() || u[0].note == "" {
		t.Fatalf("undecodable dnat: got %+v", u)
	}
}

func TestNFTRuleMaskAndNegation(t *testing.T) {
	// ip daddr != 127.0.0.0/8 jump nodeports
	r := nftNATRules([]expr.Any{
		loadDaddr(1),
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: []byte{255, 0, 0, 0}, Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ip4("127.0.0.0")},
		jump("nodeports"),
	}, noSets)
	if len(r) != 1 || !r[0].dstNeg || r[0].dst[0] != netip.MustParsePrefix("127.0.0.0/8") {
		t.Fatalf("got %+v", r)
	}
	applies, names := r[0].appliesTo(netip.MustParseAddr("10.120.0.80"), false)
	if !applies || names {
		t.Errorf("negated prefix: applies %v names %v, want true false", applies, names)
	}
}

// kubeProxyNFT is the shape of kube-proxy's nftables mode: a concatenated-key
// verdict map of services, a numgen vmap of endpoints, dnat in endpoint chains.
func kubeProxyNFT() *natGraph {
	sets := map[string]nftSet{
		"service-ips": {elems: []nftables.SetElement{
			{Key: concatKey(ip4("10.120.0.80"), []byte{unix.IPPROTO_TCP}, port(80)), VerdictData: gotoChain("service-web")},
			{Key: concatKey(ip4("10.120.0.10"), []byte{unix.IPPROTO_UDP}, port(53)), VerdictData: gotoChain("service-dns")},
			{Key: concatKey(ip4("10.120.0.99"), []byte{unix.IPPROTO_TCP}, port(80)), VerdictData: gotoChain("service-other")},
		}},
		"__map0": {elems: []nftables.SetElement{
			{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-web-a")},
			{Key: []byte{1, 0, 0, 0}, VerdictData: gotoChain("endpoint-web-b")},
		}},
		"__map1": {elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-dns")}}},
		"__map2": {elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-other")}}},
	}
	lookup := func(name string) (nftSet, bool) { s, ok := sets[name]; return s, ok }
	vmap := func(set string, loads ...expr.Any) []expr.Any {
		return append(loads, &expr.Lookup{SourceRegister: 1, SetName: set, IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT})
	}
	numgenVmap := func(set string) []expr.Any {
		return vmap(set, &expr.Numgen{Register: 1, Modulus: 2})
	}
	endpoint := func(proto byte, addr string, p uint16) []expr.Any {
		return append([]expr.Any{loadProto(1), cmpEq(1, proto)}, dnatTo(addr, p)...)
	}
	rules := map[string][][]expr.Any{
		"nat-prerouting": {{jump("services")}},
		"services": {
			vmap("service-ips", loadDaddr(1), loadProto(unix.NFT_REG32_01), loadDport(unix.NFT_REG32_02)),
			{&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true}, cmpEq(1, 2, 0, 0, 0), jump("nodeports")},
		},
		"nodeports":           {{loadProto(1), cmpEq(1, unix.IPPROTO_TCP), loadDport(1), cmpEq(1, port(30080)...), jump("service-web")}},
		"service-web":         {{loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...), jump("mark-for-masquerade")}, numgenVmap("__map0")},
		"service-dns":         {numgenVmap("__map1")},
		"service-other":       {numgenVmap("__map2")},
		"endpoint-web-a":      {endpoint(unix.IPPROTO_TCP, "10.244.20.31", 3000)},
		"endpoint-web-b":      {endpoint(unix.IPPROTO_TCP, "10.244.20.32", 3000)},
		"endpoint-dns":        {endpoint(unix.IPPROTO_UDP, "10.244.20.31", 5353)},
		"endpoint-other":      {endpoint(unix.IPPROTO_TCP, "10.244.30.5", 8080)},
		"mark-for-masquerade": {{&expr.Immediate{Register: 1, Data: []byte{0, 0x40, 0, 0}}}},
	}
	g := &natGraph{source: "nftables", table: "ip kube-proxy", bases: []natBase{{"nat-prerouting", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{}}
	for chain, rs := range rules {
		for _, r := range rs {
			g.chains[chain] = append(g.chains[chain], nftNATRules(r, lookup)...)
		}
	}
	return g
}

// concatKey pads each part to 4 bytes, as nftables lays out concatenations.
func concatKey(parts ...[]byte) []byte {
	var k []byte
	for _, p := range parts {
		k = append(k, p...)
		for len(k)%4 != 0 {
			k = append(k, 0)
		}
	}
	return k
}

func TestNFTKubeProxyShape(t *testing.T) {
	g := kubeProxyNFT()
	got := keys(g.match([]netip.Addr{netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10")}))
	want := []string{
		"prerouting 10.120.0.10 udp/53 nat-prerouting>services>service-dns>endpoint-dns => 10.244.20.31:5353",
		"prerouting 10.120.0.80 tcp/80 nat-prerouting>services>service-web>endpoint-web-a => 10.244.20.31:3000",
		"prerouting 10.120.0.80 tcp/80 nat-prerouting>services>service-web>endpoint-web-b => 10.244.20.32:3000",
	}
	if !slices.Equal(got, want) {
		t.Errorf("rules:\n got %q\nwant %q", got, want)
	}
	if got := g.match([]netip.Addr{netip.MustParseAddr("10.120.0.7")}); len(got) != 0 {
		t.Errorf("a VIP without rules matched %q", keys(got))
	}
}

func TestNFTMembershipSetAndIPTablesNFT(t *testing.T) {
	sets := map[string]nftSet{"vips": {elems: []nftables.SetElement{{Key: ip4("10.120.0.80")}, {Key: ip4("10.120.0.81")}}}}
	lookup := func(name string) (nftSet, bool) { s, ok := sets[name]; return s, ok }
	// ip daddr @vips jump svc
	r := nftNATRules([]expr.Any{loadDaddr(1), &expr.Lookup{SourceRegister: 1, SetName: "vips"}, jump("svc")}, lookup)
	if len(r) != 1 || len(r[0].dst) != 2 || r[0].dstNeg {
		t.Fatalf("membership: got %+v", r)
	}
	// iptables-nft: -p tcp -m tcp --dport 80 -j DNAT --to-destination 10.244.20.31:3000
	x := nftNATRules([]expr.Any{
		&expr.Match{Name: "tcp", Info: &xt.Tcp{DstPorts: [2]uint16{80, 80}}},
		&expr.Target{Name: "DNAT", Info: &xt.NatIPv4MultiRangeCompat{{MinIP: net.ParseIP("10.244.20.31").To4(), MinPort: 3000}}},
	}, noSets)
	if len(x) != 1 || x[0].proto != "tcp" || x[0].port != 80 || !x[0].dnat || x[0].backend != netip.MustParseAddrPort("10.244.20.31:3000") {
		t.Fatalf("xt: got %+v", x)
	}
}

func TestVerdictFromData(t *testing.T) {
	// NFTA_VERDICT_CODE = NFT_GOTO (-4), NFTA_VERDICT_CHAIN = "svc-dns", as listed by the kernel.
	b, err := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_VERDICT_CODE, Data: binary.BigEndian.AppendUint32(nil, uint32(0xfffffffc))},
		{Type: unix.NFTA_VERDICT_CHAIN, Data: []byte("svc-dns\x00")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if v := verdictFromData(b); v == nil || v.Kind != expr.VerdictGoto || v.Chain != "svc-dns" {
		t.Errorf("got %+v, want goto svc-dns", v)
	}
	if v := verdictFromData([]byte{1, 2}); v != nil {
		t.Errorf("garbage: got %+v, want nil", v)
	}
}

func loadSaddr(reg uint32, n uint32) expr.Any {
	return &expr.Payload{DestRegister: reg, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: n}
}

// fibSaddrLocal is `fib saddr type local` (!= with neq).
func fibSaddrLocal(neq bool) []expr.Any {
	op := expr.CmpOpEq
	if neq {
		op = expr.CmpOpNeq
	}
	return []expr.Any{&expr.Fib{Register: 1, FlagSADDR: true, ResultADDRTYPE: true},
		&expr.Cmp{Op: op, Register: 1, Data: binary.NativeEndian.AppendUint32(nil, unix.RTN_LOCAL)}}
}

// TestNFTSourceConditions: kube-proxy's nftables external chain of an
// externalTrafficPolicy: Local NodePort (`ip saddr CLUSTER-CIDR goto
// service-X`, `fib saddr type local goto service-X`, then the local
// endpoints): each path says the sources it is taken from.
func TestNFTSourceConditions(t *testing.T) {
	sets := map[string]nftSet{
		"__map0": {elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-a")}}},
		"__map1": {elems: []nftables.SetElement{
			{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("endpoint-a")},
			{Key: []byte{1, 0, 0, 0}, VerdictData: gotoChain("endpoint-b")},
		}},
	}
	lookup := func(name string) (nftSet, bool) { s, ok := sets[name]; return s, ok }
	numgenVmap := func(set string) []expr.Any {
		return []expr.Any{&expr.Numgen{Register: 1, Modulus: 2},
			&expr.Lookup{SourceRegister: 1, SetName: set, IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT}}
	}
	rules := map[string][][]expr.Any{
		"nat-prerouting": {{jump("services")}},
		"services":       {{&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true}, cmpEq(1, 2, 0, 0, 0), jump("nodeports")}},
		"nodeports":      {{loadProto(1), cmpEq(1, unix.IPPROTO_TCP), loadDport(1), cmpEq(1, port(30081)...), gotoChain("external-local")}},
		"external-local": {
			// ip saddr 10.244.0.0/16: nft loads the two bytes the prefix covers.
			{loadSaddr(1, 2), cmpEq(1, 10, 244), gotoChain("service-local")},
			append(fibSaddrLocal(false), jump("mark-for-masquerade")),
			append(fibSaddrLocal(false), gotoChain("service-local")),
			numgenVmap("__map0"),
		},
		"service-local": {
			{loadDaddr(1), cmpEq(1, ip4("10.120.0.81")...), loadSaddr(1, 2), &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{10, 244}}, jump("mark-for-masquerade")},
			numgenVmap("__map1"),
		},
		"endpoint-a":          {append([]expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_TCP)}, dnatTo("10.244.0.7", 8080)...)},
		"endpoint-b":          {append([]expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_TCP)}, dnatTo("10.244.1.5", 8080)...)},
		"mark-for-masquerade": {{&expr.Immediate{Register: 1, Data: []byte{0, 0x40, 0, 0}}}},
	}
	g := &natGraph{source: "nftables", table: "ip kube-proxy", bases: []natBase{{"nat-prerouting", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{}}
	for chain, rs := range rules {
		for _, r := range rs {
			g.chains[chain] = append(g.chains[chain], nftNATRules(r, lookup)...)
		}
	}
	node := netip.MustParseAddr("192.168.1.10")
	got := sourceKeys(g.matchLocal([]netip.Addr{node}, map[netip.Addr]bool{node: true}))
	want := []string{
		// What the gotos before take is not left to the rules after them:
		// a Pod's or the node's own client never reaches the local
		// endpoints' rule (it was "any source", so a Pod's flow was "one
		// of 2" paths), nor a Pod's the "fib saddr type local" goto.
		"services>nodeports>external-local>endpoint-a => 10.244.0.7:8080 from not 10.244.0.0/16 and not local",
		"services>nodeports>external-local>service-local>endpoint-a => 10.244.0.7:8080 from 10.244.0.0/16",
		"services>nodeports>external-local>service-local>endpoint-a => 10.244.0.7:8080 from not 10.244.0.0/16 and local",
		"services>nodeports>external-local>service-local>endpoint-b => 10.244.1.5:8080 from 10.244.0.0/16",
		"services>nodeports>external-local>service-local>endpoint-b => 10.244.1.5:8080 from not 10.244.0.0/16 and local",
	}
	if !slices.Equal(got, want) {
		t.Errorf("NodePort paths:\n got %q\nwant %q", got, want)
	}
}

func TestNFTSourceMatches(t *testing.T) {
	sets := map[string]nftSet{
		"clients":  {elems: []nftables.SetElement{{Key: ip4("192.168.5.1")}, {Key: ip4("192.168.5.2")}}},
		"affinity": {elems: []nftables.SetElement{{Key: ip4("192.168.5.1")}}, dynamic: true},
		// ip saddr != { 198.51.100.0/24, 203.0.113.7 }: an anonymous
		// interval set, as kube-proxy writes loadBalancerSourceRanges.
		"ranges": {interval: true, elems: []nftables.SetElement{
			{Key: ip4("198.51.100.0")}, {Key: ip4("198.51.101.0"), IntervalEnd: true},
			{Key: ip4("203.0.113.7")}, {Key: ip4("203.0.113.8"), IntervalEnd: true}}},
		"empty": {interval: true},
	}
	lookup := func(name string) (nftSet, bool) { s, ok := sets[name]; return s, ok }
	for name, c := range map[string]struct {
		exprs []expr.Any
		want  string
	}{
		"ip saddr 10.244.0.7":           {[]expr.Any{loadSaddr(1, 4), cmpEq(1, ip4("10.244.0.7")...)}, "10.244.0.7/32"},
		"ip saddr != 10.0.0.0/8":        {[]expr.Any{loadSaddr(1, 1), &expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{10}}}, "not 10.0.0.0/8"},
		"ip saddr 10.244.0.0/17 (mask)": {[]expr.Any{loadSaddr(1, 4), &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: []byte{255, 255, 128, 0}, Xor: []byte{0, 0, 0, 0}}, cmpEq(1, 10, 244, 0, 0)}, "10.244.0.0/17"},
		"fib saddr type != local":       {fibSaddrLocal(true), "not local"},
		"fib saddr . iif type local": {[]expr.Any{&expr.Fib{Register: 1, FlagSADDR: true, FlagIIF: true, ResultADDRTYPE: true},
			cmpEq(1, binary.NativeEndian.AppendUint32(nil, unix.RTN_LOCAL)...)}, ""},
		"ip saddr @clients":                              {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "clients"}}, "{192.168.5.1/32, 192.168.5.2/32}"},
		"ip saddr != @clients":                           {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "clients", Invert: true}}, "not {192.168.5.1/32, 192.168.5.2/32}"},
		"ip saddr @affinity":                             {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "affinity"}}, ""},
		"ip saddr != @ranges":                            {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "ranges", Invert: true}}, "not {198.51.100.0/24, 203.0.113.7/32}"},
		"ip saddr @empty":                                {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "empty"}}, ""},
		"ip saddr @unreadable":                           {[]expr.Any{loadSaddr(1, 4), &expr.Lookup{SourceRegister: 1, SetName: "unreadable"}}, ""},
		"iptables-nft ! --src-type LOCAL":                {[]expr.Any{&expr.Match{Name: "addrtype", Info: &xt.AddrTypeV1{Source: uint16(xt.AddrTypeLocal), Flags: xtAddrTypeInvertSource}}}, "not local"},
		"iptables-nft --src-type LOCAL --limit-iface-in": {[]expr.Any{&expr.Match{Name: "addrtype", Info: &xt.AddrTypeV1{Source: uint16(xt.AddrTypeLocal), Flags: 0x4}}}, ""},
	} {
		r := nftNATRules(append(c.exprs, jump("x")), lookup)
		if got := strings.TrimPrefix(NATRule{Sources: r[0].src}.fromString(), " from "); len(r) != 1 || got != c.want {
			t.Errorf("%s: sources %q, want %q", name, got, c.want)
		}
	}
}

// TestNFTPortmapHostPorts: the CNI portmap plugin's nftables hostPorts
// (table ip cni_hostport): its prerouting chain jumps to hostports with no
// destination condition, its output chain only for the node's addresses
// (`fib daddr type local`), and each hostPort is `tcp dport 8080 dnat to
// POD:80`. A NODE-IP:8080 trace is DNATed so at both hooks, from outside
// and other Pods as from the node; a ClusterIP is given none of them.
func TestNFTPortmapHostPorts(t *testing.T) {
	fibLocal := []expr.Any{&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
		cmpEq(1, binary.NativeEndian.AppendUint32(nil, unix.RTN_LOCAL)...)}
	rules := map[string][][]expr.Any{
		"prerouting":       {{jump("hostip_hostports")}, {jump("hostports")}},
		"output":           {{jump("hostip_hostports")}, append(slices.Clone(fibLocal), jump("hostports"))},
		"hostip_hostports": nil,
		"hostports": {append([]expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_TCP), loadDport(1), cmpEq(1, port(8080)...)},
			dnatTo("10.244.8.24", 80)...)},
	}
	g := &natGraph{source: "nftables", table: "ip cni_hostport", chains: map[string][]natRule{},
		bases: []natBase{{"prerouting", "prerouting", true, natDstPriority}, {"output", "output", true, natDstPriority}}}
	for chain, rs := range rules {
		for _, r := range rs {
			g.chains[chain] = append(g.chains[chain], nftNATRules(r, noSets)...)
		}
	}
	node, clusterIP := netip.MustParseAddr("192.168.50.10"), netip.MustParseAddr("10.96.0.80")
	want := []string{
		"output 192.168.50.10 tcp/8080 output>hostports => 10.244.8.24:80",
		"prerouting 192.168.50.10 tcp/8080 prerouting>hostports => 10.244.8.24:80",
	}
	if got := keys(g.matchLocal([]netip.Addr{node}, map[netip.Addr]bool{node: true})); !slices.Equal(got, want) {
		t.Errorf("node address:\n got %q\nwant %q", got, want)
	}
	if got := g.matchLocal([]netip.Addr{clusterIP}, nil); len(got) != 0 {
		t.Errorf("a ClusterIP took hostPorts: %q", keys(got))
	}
}

// TestNFTDNATFromMap: `dnat to numgen inc mod 2 map { 0 : B1, 1 : B2 }:3000`
// is one DNAT per element, each to its address and the port; keyed by the
// destination (`dnat to ip daddr map { VIP : B }`), each for its key only. A
// map whose values are no addresses, or one not read, stays undecoded.
func TestNFTDNATFromMap(t *testing.T) {
	natFromReg1 := func(withPort bool) []expr.Any {
		if !withPort {
			return []expr.Any{&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, Specified: true}}
		}
		return []expr.Any{&expr.Immediate{Register: 2, Data: port(3000)},
			&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true}}
	}
	byNumgen := []expr.Any{loadDaddr(1), cmpEq(1, ip4("10.120.0.98")...),
		&expr.Numgen{Register: 1, Modulus: 2}, &expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: "__map%d"}}
	maps := func(string) (nftSet, bool) {
		return nftSet{elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, Val: ip4("10.244.20.31")}, {Key: []byte{0, 0, 0, 1}, Val: ip4("10.244.20.1")}}}, true
	}
	rs := nftNATRules(append(slices.Clone(byNumgen), natFromReg1(true)...), maps)
	if len(rs) != 2 || rs[0].backend != netip.MustParseAddrPort("10.244.20.31:3000") || rs[1].backend != netip.MustParseAddrPort("10.244.20.1:3000") ||
		!rs[1].dnat || rs[1].note != "" || !slices.Equal(rs[1].dst, []netip.Prefix{netip.MustParsePrefix("10.120.0.98/32")}) {
		t.Fatalf("numgen map: %+v, want DNATs of 10.120.0.98 to each value, port 3000", rs)
	}

	byDaddr := func(string) (nftSet, bool) {
		return nftSet{elems: []nftables.SetElement{{Key: ip4("10.120.0.98"), Val: ip4("10.244.20.31")}, {Key: ip4("10.120.0.97"), Val: ip4("10.244.20.32")}}}, true
	}
	rs = nftNATRules(append([]expr.Any{loadDaddr(1), &expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: "__map%d"}}, natFromReg1(false)...), byDaddr)
	if len(rs) != 2 || rs[0].backend != netip.MustParseAddrPort("10.244.20.31:0") || !slices.Equal(rs[0].dst, []netip.Prefix{netip.MustParsePrefix("10.120.0.98/32")}) ||
		rs[1].backend != netip.MustParseAddrPort("10.244.20.32:0") || !slices.Equal(rs[1].dst, []netip.Prefix{netip.MustParsePrefix("10.120.0.97/32")}) {
		t.Fatalf("map by destination: %+v, want each VIP DNATed to its value, port kept", rs)
	}

	concat := func(string) (nftSet, bool) {
		return nftSet{elems: []nftables.SetElement{{Key: []byte{0, 0, 0, 0}, Val: append(ip4("10.244.20.31"), 0x0b, 0xb8, 0, 0)}}}, true
	}
	for name, sets := range map[string]setLookup{"address . port values": concat, "map not read": noSets} {
		rs = nftNATRules(append(slices.Clone(byNumgen), natFromReg1(true)...), sets)
		if len(rs) != 1 || !rs[0].dnat || rs[0].backend.IsValid() || rs[0].note == "" {
			t.Errorf("%s: %+v, want one DNAT not decoded", name, rs)
		}
	}
}
