package discover

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
)

// TestTableFoldsManyPods: with more than three Pods, the Pod-side capture
// points take one row per role and the tc programs of one kind (one per
// Pod, as Cilium loads them) one row; with fewer, every one has its row.
func TestTableFoldsManyPods(t *testing.T) {
	node := func(pods int) *NodeInfo {
		n := &NodeInfo{}
		for i := range pods {
			veth := fmt.Sprintf("lxc%d", i)
			n.Pods = append(n.Pods, Pod{NetNS: NetNS{Path: fmt.Sprintf("/run/netns/p%d", i)}})
			n.CapturePoints = append(n.CapturePoints,
				CapturePoint{Role: RolePod, NetNS: fmt.Sprintf("/run/netns/p%d", i), Ifname: "eth0"},
				CapturePoint{Role: RoleHost, Ifname: veth, Ifindex: 10 + i})
			n.TCPrograms = append(n.TCPrograms, TCProgram{Ifname: veth, Ifindex: 10 + i, Role: RoleHost, Dir: "ingress", Via: "tcx",
				Name: "cil_from_container", ID: ebpf.ProgramID(100 + i)})
		}
		n.CapturePoints = append(n.CapturePoints, CapturePoint{Role: RoleUplink, Ifname: "bond0"})
		return n
	}
	var many bytes.Buffer
	if err := node(5).Table(&many); err != nil {
		t.Fatal(err)
	}
	var folded, progRows []string
	for _, line := range strings.Split(many.String(), "\n") {
		if strings.Contains(line, "one per Pod (see PODS)") {
			folded = append(folded, line)
		}
		if strings.Contains(line, "cil_from_container") {
			progRows = append(progRows, line)
		}
	}
	if len(folded) != 2 || strings.Contains(many.String(), "lxc3") {
		t.Errorf("5 Pods: want one row for the pod points and one for the host points, no veth listed:\n%s", many.String())
	}
	if len(progRows) != 1 || !strings.Contains(progRows[0], "5 host interfaces ingress tcx") || !strings.Contains(progRows[0], "(ids 100, 101, 102, …)") {
		t.Errorf("5 Pods: want one row for the 5 copies of the program:\n%s", many.String())
	}
	var few bytes.Buffer
	if err := node(2).Table(&few); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"lxc0 ingress tcx", "lxc1 ingress tcx", "cil_from_container (id 101)"} {
		if !strings.Contains(few.String(), want) {
			t.Errorf("2 Pods: lacks %q:\n%s", want, few.String())
		}
	}
	if strings.Contains(few.String(), "one per Pod") {
		t.Errorf("2 Pods: folded:\n%s", few.String())
	}
	// One program on every veth (an observer's, such as pwru's or Hubble's
	// tcx program): its id once, not once per veth.
	shared := node(110)
	for i := range shared.TCPrograms {
		shared.TCPrograms[i].ID = 34501
	}
	var one bytes.Buffer
	if err := shared.Table(&one); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(one.String(), "110 host interfaces ingress tcx  cil_from_container (id 34501)") {
		t.Errorf("110 Pods sharing one program: want it named with its id once:\n%s", one.String())
	}
}

// TestTableRejectAfterNAT: kube-proxy's reject of a ClusterIP's other ports
// sees packets after NAT, so it never meets the port a DNAT serves: the
// node block says which ports those are, rather than list a healthy VIP as
// rejected; a rule before NAT is listed as is.
func TestTableRejectAfterNAT(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.80")
	n := &NodeInfo{Netfilter: Netfilter{
		Rules: []NATRule{{Source: SourceNFTables, Table: "ip kube-proxy", Hook: "prerouting", Service: vip, Port: 80, Proto: "tcp",
			Chains: []string{"nat-prerouting", "services"}, Backend: netip.MustParseAddrPort("10.244.2.31:8080")}},
		Rejects: []NATRule{
			{Source: SourceNFTables, Table: "ip kube-proxy", Hook: "forward", Service: vip, Chains: []string{"filter-forward", "cluster-ips-check"},
				Verdict: "reject", Comment: "Reject traffic to invalid ports of ClusterIPs", AfterNAT: true},
			{Source: SourceNFTables, Table: "ip kube-proxy", Hook: "output", Service: vip, Chains: []string{"filter-output", "x"}, Verdict: "drop"},
		},
	}}
	var b bytes.Buffer
	if err := n.Table(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`10.96.0.80 except 80/tcp (DNATed before) reject ("Reject traffic to invalid ports of ClusterIPs")`,
		`10.96.0.80 drop`,
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("lacks %q:\n%s", want, b.String())
		}
	}
}

// TestTableDropFromSources: kube-proxy's drop of a LoadBalancer's clients
// outside its loadBalancerSourceRanges names those it spares; without it
// the line reads as a drop of every client of the LB IP.
func TestTableDropFromSources(t *testing.T) {
	lb := netip.MustParseAddr("203.0.113.50")
	n := &NodeInfo{Netfilter: Netfilter{Rejects: []NATRule{{Source: SourceNFTables, Table: "ip kube-proxy", Hook: "output",
		Service: lb, Port: 80, Proto: "tcp", Chains: []string{"filter-output", "firewall-check", "firewall-x"}, Verdict: "drop",
		Sources: []SourceMatch{{Prefixes: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}, Not: true}}}}}}
	var b bytes.Buffer
	if err := n.Table(&b); err != nil {
		t.Fatal(err)
	}
	if want := "filter-output > firewall-check > firewall-x from not 198.51.100.0/24"; !strings.Contains(b.String(), want) {
		t.Errorf("lacks %q:\n%s", want, b.String())
	}
}

// TestTableUplinkHairpin: an uplink that is a bridge port says its hairpin
// mode, off meaning that its bridge never sends a frame back out it.
func TestTableUplinkHairpin(t *testing.T) {
	off, on := false, true
	n := &NodeInfo{CapturePoints: []CapturePoint{
		{Role: RoleUplink, Ifname: "up0", Master: "br0", MasterKind: "bridge", Hairpin: &off},
		{Role: RoleUplink, Ifname: "up1", Master: "br1", MasterKind: "bridge", Hairpin: &on},
	}}
	var b bytes.Buffer
	if err := n.Table(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"hairpin off: br0 never sends a frame that came in here back out here", "hairpin on"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("lacks %q:\n%s", want, b.String())
		}
	}
}

// TestTableListsMirredRedirects: a tc filter's mirred redirect is a row of
// its own; one per Pod (a CNI that redirects every veth) folds into one.
func TestTableListsMirredRedirects(t *testing.T) {
	node := func(pods int) *NodeInfo {
		n := &NodeInfo{}
		for i := range pods {
			n.TCRedirects = append(n.TCRedirects, TCRedirect{Ifname: fmt.Sprintf("veth%d", i), Ifindex: 10 + i, Role: RoleHost,
				Dir: "ingress", Filter: "u32 pref 10", Action: "egress redirect", To: "bond0"})
		}
		return n
	}
	var one bytes.Buffer
	if err := node(1).Table(&one); err != nil {
		t.Fatal(err)
	}
	if want := "veth0 ingress u32 pref 10  mirred egress redirect to bond0 (not BPF)"; !strings.Contains(one.String(), want) {
		t.Errorf("lacks %q:\n%s", want, one.String())
	}
	var many bytes.Buffer
	if err := node(5).Table(&many); err != nil {
		t.Fatal(err)
	}
	if rows := strings.Count(many.String(), "mirred egress redirect"); rows != 1 || !strings.Contains(many.String(), "5 host interfaces ingress") {
		t.Errorf("5 redirects: want one folded row:\n%s", many.String())
	}
}

// TestTableListsFilterRewrites: a tc filter (not BPF) whose act_nat
// rewrites a VIP is a row of its own, with what it rewrites, not a program
// of id 0; one per Pod folds into one.
func TestTableListsFilterRewrites(t *testing.T) {
	node := func(pods int) *NodeInfo {
		n := &NodeInfo{}
		for i := range pods {
			n.TCPrograms = append(n.TCPrograms, TCProgram{Ifname: fmt.Sprintf("veth%d", i), Ifindex: 10 + i, Role: RoleHost, Dir: "ingress",
				Via: "u32", Name: "pref 10", Action: "nat ingress 10.120.0.80/32 -> 10.244.20.31", Rewrites: netip.MustParsePrefix("10.120.0.80/32")})
		}
		return n
	}
	var one bytes.Buffer
	if err := node(1).Table(&one); err != nil {
		t.Fatal(err)
	}
	if want := "veth0 ingress u32 pref 10  nat ingress 10.120.0.80/32 -> 10.244.20.31 (not BPF)"; !strings.Contains(one.String(), want) || strings.Contains(one.String(), "id 0") {
		t.Errorf("lacks %q, or says id 0:\n%s", want, one.String())
	}
	var many bytes.Buffer
	if err := node(5).Table(&many); err != nil {
		t.Fatal(err)
	}
	if rows := strings.Count(many.String(), "nat ingress"); rows != 1 || !strings.Contains(many.String(), "5 host interfaces ingress u32 pref 10") {
		t.Errorf("5 filters: want one folded row:\n%s", many.String())
	}
}

// TestTableFoldsManyEndpoints: a Service of 500 endpoints (a DNAT per
// endpoint at prerouting and at output) takes one row per hook, which says
// how many backends and shows a few; one of 2 endpoints keeps a row each.
func TestTableFoldsManyEndpoints(t *testing.T) {
	vip := netip.MustParseAddr("10.123.0.1")
	n := &NodeInfo{}
	for _, hook := range []string{"prerouting", "output"} {
		base := map[string]string{"prerouting": "nat-prerouting", "output": "nat-output"}[hook]
		for j := range 500 {
			i := 499 - j // the rules' order is not the addresses': the row shows the lowest
			n.Netfilter.Rules = append(n.Netfilter.Rules, NATRule{Source: SourceNFTables, Table: "ip kube-proxy", Hook: hook,
				Service: vip, Port: 80, Proto: "tcp", Backend: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 246, byte(i / 250), byte(i%250 + 1)}), 8080),
				Chains: []string{base, "services", "service-BIG-big/web/tcp/http", fmt.Sprintf("endpoint-%d", i)}})
		}
		for i := range 2 {
			n.Netfilter.Rules = append(n.Netfilter.Rules, NATRule{Source: SourceNFTables, Table: "ip kube-proxy", Hook: hook,
				Service: netip.MustParseAddr("10.120.0.80"), Port: 80, Proto: "tcp", Backend: netip.MustParseAddrPort(fmt.Sprintf("10.244.20.%d:3000", 31+i)),
				Chains: []string{base, "services", "service-web", fmt.Sprintf("endpoint-web-%d", i)}})
		}
	}
	var b bytes.Buffer
	if err := n.Table(&b); err != nil {
		t.Fatal(err)
	}
	var big, web []string
	for _, line := range strings.Split(b.String(), "\n") {
		if strings.Contains(line, "10.123.0.1:80/tcp") {
			big = append(big, line)
		}
		if strings.Contains(line, "10.120.0.80:80/tcp") {
			web = append(web, line)
		}
	}
	if len(big) != 2 || !strings.Contains(big[0], "(prerouting)") || !strings.Contains(big[0], "-> 500 backends: 10.246.0.1:8080, 10.246.0.2:8080, 10.246.0.3:8080, …") ||
		!strings.Contains(big[0], "nat-prerouting > services > service-BIG-big/web/tcp/http > one of 500 chains such as endpoint-0") {
		t.Errorf("500 endpoints: want one row per hook:\n%s", b.String())
	}
	if len(web) != 4 || !strings.Contains(web[1], "-> 10.244.20.32:3000") || !strings.Contains(web[1], "service-web > endpoint-web-1") {
		t.Errorf("2 endpoints: want a row each:\n%s", b.String())
	}
}

// TestTableSaysWhatIsTraced: the report names the Services it traced, as
// --svc gave them, each once (a report pasted into a ticket, read later,
// says what it looked for); JSON has them as "services".
func TestTableSaysWhatIsTraced(t *testing.T) {
	vip, dns := netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10")
	got := traced([]netip.Addr{vip, dns, vip}, []ServicePort{{Addr: vip}, {Addr: dns, Port: 53, Proto: "UDP"}, {Addr: vip}})
	if want := []string{"10.120.0.80", "10.120.0.10:53/udp"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("traced = %q, want %q", got, want)
	}
	var b bytes.Buffer
	if err := (&NodeInfo{Services: got}).Table(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "TRACING  10.120.0.80 (any port), 10.120.0.10:53/udp\n") {
		t.Errorf("table does not say what is traced:\n%s", b.String())
	}
}

// TestTableListsDeviceChains: a chain on a device hook is a netfilter row
// with its hook, devices and priority, and one row per rewrite of a VIP
// (what it sets, or ?); one without a rewrite says so.
func TestTableListsDeviceChains(t *testing.T) {
	vip := netip.MustParseAddr("10.120.0.80")
	n := &NodeInfo{Netfilter: Netfilter{DeviceChains: []DeviceChain{
		{Family: "netdev", Table: "lb", Chain: "in", Hook: "ingress", Devices: []string{"veth-a"}, Priority: -500, Rewrites: []NATRule{
			{Source: SourceNFTables, Table: "netdev lb", Hook: "ingress", Service: vip, Port: 80, Proto: "tcp", Chains: []string{"in", "rw"}, Backend: netip.MustParseAddrPort("10.244.20.31:3000")},
			{Source: SourceNFTables, Table: "netdev lb", Hook: "ingress", Service: vip, Chains: []string{"in"}, Note: unknownRewrite}}},
		{Family: "inet", Table: "fw", Chain: "early", Hook: "ingress", Devices: []string{"bond0"}, Priority: 0},
	}}}
	var b bytes.Buffer
	if err := n.Table(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"nftables netdev lb/in (ingress on veth-a priority -500) 10.120.0.80:80/tcp -> 10.244.20.31:3000 in > rw",
		"nftables netdev lb/in (ingress on veth-a priority -500) 10.120.0.80 -> " + unknownRewrite,
		"nftables inet fw/early (ingress on bond0 priority 0) no rewrite of the services' destination read",
	} {
		// Columns padded by the tabwriter: compared with single spaces.
		if !strings.Contains(strings.Join(strings.Fields(b.String()), " "), want) {
			t.Errorf("lacks %q:\n%s", want, b.String())
		}
	}
}

// TestTableServiceWithoutNAT: a traced Service without any NAT rule or
// IPVS service, while others have theirs, is named in the node block; when
// none has a rule, the one line for all of them stays.
func TestTableServiceWithoutNAT(t *testing.T) {
	vip := netip.MustParseAddr("10.96.50.10")
	rule := NATRule{Source: SourceNFTables, Table: "ip kube-proxy", Hook: "prerouting", Service: vip, Port: 80, Proto: "tcp",
		Chains: []string{"nat-prerouting", "services"}, Backend: netip.MustParseAddrPort("10.244.1.5:8080")}
	flat := func(n *NodeInfo) string {
		var b bytes.Buffer
		if err := n.Table(&b); err != nil {
			t.Fatal(err)
		}
		return strings.Join(strings.Fields(b.String()), " ")
	}
	svcs := []string{"10.96.50.10:80/tcp", "10.96.50.11:80/tcp"}
	got := flat(&NodeInfo{Services: svcs, ServicesWithoutNAT: svcs[1:], Netfilter: Netfilter{Rules: []NATRule{rule}}})
	if !strings.Contains(got, "netfilter no DNAT rule for 10.96.50.11:80/tcp") || strings.Contains(got, "for the services") {
		t.Errorf("one Service without a rule: %s", got)
	}
	got = flat(&NodeInfo{Services: svcs, ServicesWithoutNAT: svcs[1:], IPVS: IPVS{Present: true, Services: []IPVSService{
		{Proto: "tcp", Service: netip.MustParseAddrPort("10.96.50.10:80"), Scheduler: "rr"}}}})
	if !strings.Contains(got, "netfilter no DNAT rule for the services") || !strings.Contains(got, "ipvs no virtual service for 10.96.50.11:80/tcp") {
		t.Errorf("one Service without an IPVS service: %s", got)
	}
	got = flat(&NodeInfo{Services: svcs, ServicesWithoutNAT: svcs})
	if !strings.Contains(got, "netfilter no DNAT rule for the services") || strings.Contains(got, "no DNAT rule for 10.96") {
		t.Errorf("no Service with a rule: %s", got)
	}
}
