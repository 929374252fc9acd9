package discover

import (
	"net/netip"
	"os"
	"slices"
	"testing"
)

// TestMatchVIPOnce: a VIP given twice (two ports of one Service) lists each
// of its rules once.
func TestMatchVIPOnce(t *testing.T) {
	g := kubeProxyNFT()
	web := netip.MustParseAddr("10.120.0.80")
	once := keys(g.match([]netip.Addr{web}))
	if twice := keys(g.match([]netip.Addr{web, web})); !slices.Equal(twice, once) {
		t.Errorf("VIP given twice:\n got %q\nwant %q", twice, once)
	}
}

// TestMatchAffinityOnce: an endpoint chain two rules of the Service chain
// lead to (kube-proxy's session affinity next to its random pick) is one
// path to its DNAT, listed once, not two candidates.
func TestMatchAffinityOnce(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.20")
	g := &natGraph{source: "nftables", table: "ip test", bases: []natBase{{"pre", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{
		"pre": {{dst: []netip.Prefix{netip.PrefixFrom(vip, 32)}, proto: "tcp", port: 80, targets: []string{"svc"}}},
		"svc": {
			{targets: []string{"ep-1"}},         // ip saddr @affinity-1 goto ep-1
			{targets: []string{"ep-2"}},         // ip saddr @affinity-2 goto ep-2
			{targets: []string{"ep-1", "ep-2"}}, // numgen random mod 2 vmap
		},
		"ep-1": {{dnat: true, backend: netip.MustParseAddrPort("10.244.0.1:8080")}},
		"ep-2": {{dnat: true, backend: netip.MustParseAddrPort("10.244.0.2:8080")}},
	}}
	want := []string{
		"prerouting 10.96.0.20 tcp/80 pre>svc>ep-1 => 10.244.0.1:8080",
		"prerouting 10.96.0.20 tcp/80 pre>svc>ep-2 => 10.244.0.2:8080",
	}
	if got := keys(g.match([]netip.Addr{vip})); !slices.Equal(got, want) {
		t.Errorf("rules:\n got %q\nwant %q", got, want)
	}
}

// portGraph: VIP 10.96.0.10 has a udp/53 path, a tcp/80 path and a path
// that requires no port, each to its own backend.
func portGraph() *natGraph {
	vip := []netip.Prefix{netip.MustParsePrefix("10.96.0.10/32")}
	return &natGraph{source: "nftables", table: "ip test", bases: []natBase{{"pre", "prerouting", true, natDstPriority}}, chains: map[string][]natRule{
		"pre": {
			{dst: vip, proto: "udp", port: 53, targets: []string{"svc-dns"}},
			{dst: vip, proto: "tcp", port: 80, targets: []string{"svc-web"}},
			{dst: vip, targets: []string{"svc-any"}},
		},
		"svc-dns": {{dnat: true, backend: netip.MustParseAddrPort("10.244.0.53:5353")}},
		"svc-web": {{dnat: true, backend: netip.MustParseAddrPort("10.244.0.80:8080")}},
		"svc-any": {{dnat: true, backend: netip.MustParseAddrPort("10.244.0.99:0")}},
	}}
}

// TestServicePortsFilterRules: with ports and protocols given, only the
// rules of those (and those requiring no port) are reported, each once; a
// VIP given without port keeps all its rules.
func TestServicePortsFilterRules(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.10")
	const (
		dns = "prerouting 10.96.0.10 udp/53 pre>svc-dns => 10.244.0.53:5353"
		web = "prerouting 10.96.0.10 tcp/80 pre>svc-web => 10.244.0.80:8080"
		any = "prerouting 10.96.0.10 /0 pre>svc-any => 10.244.0.99:0"
	)
	for _, tc := range []struct {
		name  string
		addrs []netip.Addr
		ports []ServicePort
		want  []string
	}{
		{"VIP only", []netip.Addr{vip}, nil, []string{any, web, dns}},
		{"VIP twice", []netip.Addr{vip, vip}, nil, []string{any, web, dns}},
		{"80/tcp", []netip.Addr{vip}, []ServicePort{{vip, 80, "tcp"}}, []string{any, web}},
		{"53/udp and 54/udp", []netip.Addr{vip, vip}, []ServicePort{{vip, 53, "udp"}, {vip, 54, "udp"}}, []string{any, dns}},
		{"any udp port", []netip.Addr{vip}, []ServicePort{{vip, 0, "udp"}}, []string{any, dns}},
		{"port 80, any protocol", []netip.Addr{vip}, []ServicePort{{vip, 80, ""}}, []string{any, web}},
		{"80/udp", []netip.Addr{vip}, []ServicePort{{vip, 80, "udp"}}, []string{any}},
		{"a port, and the VIP without port", []netip.Addr{vip}, []ServicePort{{vip, 80, "tcp"}, {vip, 0, ""}}, []string{any, web, dns}},
		{"ports only, no Services", nil, []ServicePort{{vip, 53, "UDP"}}, []string{any, dns}},
	} {
		rules := portGraph().matchServices(newServiceSet(tc.addrs, tc.ports))
		if got := keys(rules); !slices.Equal(got, tc.want) {
			t.Errorf("%s:\n got %q\nwant %q", tc.name, got, tc.want)
		}
		// The backends driving the routed uplink are the remaining rules'.
		n := NodeInfo{Netfilter: Netfilter{Rules: rules}}
		for _, b := range n.Backends() {
			if !slices.ContainsFunc(rules, func(r NATRule) bool { return r.Backend.Addr() == b }) {
				t.Errorf("%s: backend %s of a filtered-out rule", tc.name, b)
			}
		}
	}
}

// TestServicePortsFilterIPVS: IPVS virtual services are kept by VIP, port
// and protocol alike.
func TestServicePortsFilterIPVS(t *testing.T) {
	f, err := os.Open("testdata/ip_vs")
	if err != nil {
		t.Fatal(err)
	}
	all := parseIPVS(f)
	f.Close()
	web, dns := netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10")
	for _, tc := range []struct {
		name  string
		addrs []netip.Addr
		ports []ServicePort
		want  []string
	}{
		{"VIPs", []netip.Addr{web, dns, web}, nil, []string{"tcp 10.120.0.80:80", "udp 10.120.0.10:53"}},
		{"80/tcp", []netip.Addr{web}, []ServicePort{{web, 80, "tcp"}}, []string{"tcp 10.120.0.80:80"}},
		{"81/tcp", []netip.Addr{web}, []ServicePort{{web, 81, "tcp"}}, nil},
		{"53/tcp", []netip.Addr{dns}, []ServicePort{{dns, 53, "tcp"}}, nil},
	} {
		var got []string
		for _, s := range ipvsServices(all, newServiceSet(tc.addrs, tc.ports)) {
			got = append(got, s.Proto+" "+s.Service.String())
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
}

// TestClientAddrs: a selected run's clients are the Pods' and the node's
// addresses, except a traced VIP the node holds, to which every client
// sends.
func TestClientAddrs(t *testing.T) {
	pod, node, local := netip.MustParseAddr("10.244.8.23"), netip.MustParseAddr("192.168.1.10"), netip.MustParseAddr("10.96.0.10")
	n := NodeInfo{
		Pods:      []Pod{{Eth0: Iface{Addrs: []netip.Prefix{netip.PrefixFrom(pod, 22)}}}},
		hostAddrs: []netip.Addr{node, local},
		svcs:      newServiceSet([]netip.Addr{local}, nil),
	}
	if got := n.ClientAddrs(); len(got) != 2 || !got[pod] || !got[node] || got[local] {
		t.Errorf("client addresses %v, want the Pod's and the node's, not the local VIP %s", got, local)
	}
}

// TestNodeVIPPorts: a node address traced with ports (NODE-IP:30081) is
// the Service's on those ports only; one traced without a port (a local
// VIP) is the Service's on every port, and other node addresses are not
// VIPs at all.
func TestNodeVIPPorts(t *testing.T) {
	node, other, local := netip.MustParseAddr("192.168.1.10"), netip.MustParseAddr("192.168.2.10"), netip.MustParseAddr("10.96.0.10")
	n := NodeInfo{
		hostAddrs: []netip.Addr{node, other, local},
		svcs: newServiceSet([]netip.Addr{local}, []ServicePort{
			{Addr: node, Port: 30081, Proto: "tcp"}, {Addr: node, Port: 30082}, {Addr: netip.MustParseAddr("10.96.0.20"), Port: 80}}),
	}
	got := n.NodeVIPPorts()
	if len(got) != 1 || !slices.Equal(got[node], []uint16{30081, 30082}) {
		t.Errorf("node VIP ports %v, want %s on 30081 and 30082 only", got, node)
	}
}

// TestUntranslated: a traced Service that no NAT rule, device rewrite nor
// IPVS virtual service translates (kube-proxy never programmed it) is
// named as --svc gave it; a rule for any port or protocol of its VIP, or
// one of its ports, translates it; another port's does not.
func TestUntranslated(t *testing.T) {
	a := netip.MustParseAddr
	rule := func(vip string, port uint16, proto string) NATRule {
		return NATRule{Service: a(vip), Port: port, Proto: proto, Backend: netip.MustParseAddrPort("10.244.1.5:8080")}
	}
	nf := Netfilter{
		Rules:        []NATRule{rule("10.96.50.10", 80, "tcp"), rule("10.96.50.12", 0, "")},
		DeviceChains: []DeviceChain{{Rewrites: []NATRule{rule("10.96.50.13", 53, "udp")}}},
	}
	ipvs := IPVS{Present: true, Services: []IPVSService{{Proto: "tcp", Service: netip.MustParseAddrPort("10.96.50.14:443")}}}
	ports := []ServicePort{
		{Addr: a("10.96.50.10"), Port: 80, Proto: "TCP"},   // its rule
		{Addr: a("10.96.50.10"), Port: 81, Proto: "tcp"},   // another port: none
		{Addr: a("10.96.50.11"), Port: 80, Proto: "tcp"},   // none
		{Addr: a("10.96.50.12"), Port: 8080, Proto: "tcp"}, // a rule for every port
		{Addr: a("10.96.50.13"), Port: 53, Proto: "udp"},   // a device rewrite
		{Addr: a("10.96.50.14"), Port: 443, Proto: "tcp"},  // IPVS
	}
	addrs := []netip.Addr{a("10.96.50.10"), a("10.96.50.15"), a("10.96.50.14")}
	got := untranslated(addrs, ports, nf, ipvs)
	if want := []string{"10.96.50.10:81/tcp", "10.96.50.11:80/tcp", "10.96.50.15"}; !slices.Equal(got, want) {
		t.Errorf("untranslated = %q, want %q", got, want)
	}
}
