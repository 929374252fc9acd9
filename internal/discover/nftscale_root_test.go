package discover

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// kubeProxyNFTRuleset is kube-proxy's nftables mode for services Services of
// endpoints endpoints each (its service-ips verdict map, a chain per
// Service picking an endpoint with numgen, a chain per endpoint), as a
// node of a big cluster carries it. Service i is 10.121.i/250.i%250+1:80,
// its endpoints 10.245.x.y:8080.
func kubeProxyNFTRuleset(services, endpoints int) string {
	var b strings.Builder
	b.WriteString("table ip kube-proxy {\n")
	b.WriteString("  map service-ips {\n    type ipv4_addr . inet_proto . inet_service : verdict\n  }\n")
	b.WriteString("  chain mark-for-masquerade {\n    meta mark set meta mark | 0x4000\n  }\n")
	b.WriteString("  chain services {\n    ip daddr . meta l4proto . th dport vmap @service-ips\n  }\n")
	b.WriteString("  chain nat-prerouting {\n    type nat hook prerouting priority dstnat; policy accept;\n    jump services\n  }\n")
	b.WriteString("  chain nat-output {\n    type nat hook output priority -100; policy accept;\n    jump services\n  }\n")
	var elems []string
	for i := range services {
		base := fmt.Sprintf("ns%d/svc%d/tcp/http", i%50, i)
		svc := fmt.Sprintf("service-S%07d-%s", i, base)
		var vmap []string
		for j := range endpoints {
			k := i*endpoints + j
			ep := fmt.Sprintf("10.245.%d.%d", k/250, k%250+1)
			chain := fmt.Sprintf("endpoint-E%07d-%s__%s/8080", k, base, ep)
			fmt.Fprintf(&b, "  chain %s {\n    ip saddr %s jump mark-for-masquerade\n    meta l4proto tcp dnat to %s:8080\n  }\n", chain, ep, ep)
			vmap = append(vmap, fmt.Sprintf("%d : goto %s", j, chain))
		}
		fmt.Fprintf(&b, "  chain %s {\n    ip daddr %s tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade\n    numgen random mod %d vmap { %s }\n  }\n",
			svc, scaleVIP(i), endpoints, strings.Join(vmap, ", "))
		elems = append(elems, fmt.Sprintf("%s . tcp . 80 : goto %s", scaleVIP(i), svc))
	}
	b.WriteString("}\n")
	fmt.Fprintf(&b, "add element ip kube-proxy service-ips { %s }\n", strings.Join(elems, ", "))
	return b.String()
}

func scaleVIP(i int) string { return fmt.Sprintf("10.121.%d.%d", i/250, i%250+1) }

// scaleNode is a netns holding kubeProxyNFTRuleset(services, 3) (none for 0).
func scaleNode(tb testing.TB, services int) string {
	tb.Helper()
	if testing.Short() || os.Geteuid() != 0 {
		tb.Skip("needs root (and not -short): creates a network namespace")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		tb.Skip("nft is not installed")
	}
	name := fmt.Sprintf("pttest-scale-%06x", rand.IntN(1<<24))
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Fatalf("ip netns add: %v: %s", err, out)
	}
	tb.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	if services > 0 {
		cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
		cmd.Stdin = strings.NewReader(kubeProxyNFTRuleset(services, 3))
		if out, err := cmd.CombinedOutput(); err != nil {
			tb.Fatalf("nft -f: %v: %s", err, out)
		}
	}
	return "/run/netns/" + name
}

// BenchmarkReadNetfilterManyServices: discovery's read of the NAT rules
// for one traced VIP on a node of 2,000 kube-proxy (nftables mode)
// Services with 3 endpoints each, 8,000 chains. What it costs must not grow
// with the Services that are not traced.
func BenchmarkReadNetfilterManyServices(b *testing.B) {
	path := scaleNode(b, 2000)
	vip := netip.MustParseAddr(scaleVIP(1234))
	svcs := newServiceSet([]netip.Addr{vip}, nil)
	b.ReportAllocs()
	for b.Loop() {
		var info NodeInfo
		nf := readNetfilter(context.Background(), path, svcs, &info)
		if len(nf.Rules) != 6 { // 3 endpoints at prerouting and at output
			b.Fatalf("%d rules (%s), want 6: %+v", len(nf.Rules), nf.NFTables, nf.Rules)
		}
	}
}

// kubeProxyIPTablesSave is kube-proxy's iptables mode for services
// Services of 3 endpoints each, as iptables-restore input (the nat table):
// Service i is scaleVIP(i):80.
func kubeProxyIPTablesSave(services int) string {
	var chains, rules strings.Builder
	chains.WriteString("*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n")
	rules.WriteString("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	rules.WriteString("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	rules.WriteString("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n")
	for i := range services {
		name := fmt.Sprintf("ns%d/svc%d:http", i%50, i)
		svc := fmt.Sprintf("KUBE-SVC-%016d", i)
		fmt.Fprintf(&chains, ":%s - [0:0]\n", svc)
		fmt.Fprintf(&rules, "-A KUBE-SERVICES -d %s/32 -p tcp -m comment --comment \"%s cluster IP\" -m tcp --dport 80 -j %s\n", scaleVIP(i), name, svc)
		fmt.Fprintf(&rules, "-A %s ! -s 10.244.0.0/16 -d %s/32 -p tcp -m comment --comment \"%s cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ\n", svc, scaleVIP(i), name)
		for j := range 3 {
			k := i*3 + j
			ep := fmt.Sprintf("10.245.%d.%d", k/250, k%250+1)
			sep := fmt.Sprintf("KUBE-SEP-%016d", k)
			fmt.Fprintf(&chains, ":%s - [0:0]\n", sep)
			prob := []string{" -m statistic --mode random --probability 0.33333333349", " -m statistic --mode random --probability 0.50000000000", ""}[j]
			fmt.Fprintf(&rules, "-A %s -m comment --comment \"%s -> %s:8080\"%s -j %s\n", svc, name, ep, prob, sep)
			fmt.Fprintf(&rules, "-A %s -s %s/32 -m comment --comment \"%s\" -j KUBE-MARK-MASQ\n", sep, ep, name)
			fmt.Fprintf(&rules, "-A %s -p tcp -m comment --comment \"%s\" -m tcp -j DNAT --to-destination %s:8080\n", sep, name, ep)
		}
	}
	return chains.String() + rules.String() + "COMMIT\n"
}

// kubeProxyIPTablesNode is a scale node whose nat table holds n kube-proxy
// Services, loaded with restore (iptables-legacy-restore or
// iptables-nft-restore), which the test skips without.
func kubeProxyIPTablesNode(tb testing.TB, restore string, n int) string {
	tb.Helper()
	if _, err := exec.LookPath(restore); err != nil {
		tb.Skip(restore + " is not installed")
	}
	path := scaleNode(tb, 0)
	cmd := exec.Command("ip", "netns", "exec", path[len("/run/netns/"):], restore)
	cmd.Stdin = strings.NewReader(kubeProxyIPTablesSave(n))
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("%s: %v: %s", restore, err, out)
	}
	return path
}

// BenchmarkReadNetfilterLegacyManyServices: discovery's read of an
// iptables-legacy nat table of 5,000 kube-proxy Services (55,000 rules)
// for one traced VIP.
func BenchmarkReadNetfilterLegacyManyServices(b *testing.B) {
	path := kubeProxyIPTablesNode(b, "iptables-legacy-restore", 5000)
	vip := netip.MustParseAddr(scaleVIP(4321))
	svcs := newServiceSet([]netip.Addr{vip}, nil)
	b.ReportAllocs()
	for b.Loop() {
		var info NodeInfo
		nf := readNetfilter(context.Background(), path, svcs, &info)
		if len(nf.Rules) != 6 || nf.IPTablesLegacy != "read" {
			b.Fatalf("%d rules (%s), want 6: %+v", len(nf.Rules), nf.IPTablesLegacy, nf.Rules)
		}
	}
}

// BenchmarkReadNetfilterIPTablesNFTManyServices: the same read of 5,000
// kube-proxy Services in iptables-nft (an nftables table of 20,000
// chains, KUBE-SERVICES a rule per Service, each with xtables matches).
// The rules are reduced as each part of a dump comes (NFTDump): held
// whole, a read allocated 80 MB, most of it live at once.
func BenchmarkReadNetfilterIPTablesNFTManyServices(b *testing.B) {
	path := kubeProxyIPTablesNode(b, "iptables-nft-restore", 5000)
	vip := netip.MustParseAddr(scaleVIP(4321))
	svcs := newServiceSet([]netip.Addr{vip}, nil)
	b.ReportAllocs()
	for b.Loop() {
		var info NodeInfo
		nf := readNetfilter(context.Background(), path, svcs, &info)
		if len(nf.Rules) != 6 || !strings.HasPrefix(nf.NFTables, "read ") {
			b.Fatalf("%d rules (%s), want 6: %+v", len(nf.Rules), nf.NFTables, nf.Rules)
		}
	}
}

// TestReadIPTablesNFTManyServices: a chain the kernel lists in many parts
// (iptables-nft's KUBE-SERVICES of 2,000 Services, a rule per Service) is
// read whole, part after part: the first Service's endpoints and the last
// one's.
func TestReadIPTablesNFTManyServices(t *testing.T) {
	path := kubeProxyIPTablesNode(t, "iptables-nft-restore", 2000)
	for _, i := range []int{0, 1999} {
		var info NodeInfo
		nf := readNetfilter(context.Background(), path, newServiceSet([]netip.Addr{netip.MustParseAddr(scaleVIP(i))}, nil), &info)
		var got, want []string
		for _, r := range nf.Rules {
			got = append(got, r.Hook+" "+r.Backend.String())
		}
		for _, hook := range []string{"prerouting", "output"} {
			for j := range 3 {
				k := i*3 + j
				want = append(want, fmt.Sprintf("%s 10.245.%d.%d:8080", hook, k/250, k%250+1))
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) || !strings.HasPrefix(nf.NFTables, "read ") {
			t.Errorf("Service %d (%s): %q, want %q", i, nf.NFTables, got, want)
		}
	}
}

// firewallNode is scaleNode(services) with a host firewall's filter input
// chain of n rules, each dropping one source's ssh, in a table of its own.
func firewallNode(tb testing.TB, services, n int) string {
	tb.Helper()
	path := scaleNode(tb, services)
	var b strings.Builder
	b.WriteString("table inet host-firewall {\n\tchain input {\n\t\ttype filter hook input priority 0; policy accept;\n")
	for i := range n {
		fmt.Fprintf(&b, "\t\tip saddr 10.%d.%d.%d tcp dport 22 counter drop comment \"host %d\"\n", 100+i>>16, i>>8&255, i&255, i)
	}
	b.WriteString("\t\tip daddr 10.121.0.1 tcp dport 80 reject\n\t}\n}\n")
	cmd := exec.Command("ip", "netns", "exec", path[len("/run/netns/"):], "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(b.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("nft -f: %v: %s", err, out)
	}
	return path
}

// BenchmarkReadNetfilterHostFirewall: the read of one traced VIP's rules
// on a node of 5,000 kube-proxy Services and a host firewall's input chain
// of 50,000 rules, as NATWatch reads it again at each change of a rollout.
// held-MB is what the graphs hold once matched.
func BenchmarkReadNetfilterHostFirewall(b *testing.B) {
	path := firewallNode(b, 5000, 50_000)
	vip := netip.MustParseAddr(scaleVIP(4321))
	svcs := newServiceSet([]netip.Addr{vip}, nil)
	b.ReportAllocs()
	var held uint64
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		graphs, _, closeNFT, err := readNFT(path, svcs)
		if err != nil {
			b.Fatal(err)
		}
		var rules []NATRule
		for _, g := range graphs {
			rules = append(rules, g.matchServices(svcs)...)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		held = max(held, after.HeapAlloc-min(after.HeapAlloc, before.HeapAlloc))
		closeNFT()
		if len(rules) != 6 {
			b.Fatalf("%d rules, want 6: %+v", len(rules), rules)
		}
		runtime.KeepAlive(graphs)
	}
	b.ReportMetric(float64(held)/1e6, "held-MB")
}

// TestHostFirewallNFTRulesNotHeld: of a host firewall's nftables input
// chain, a read holds the reject of a VIP, not the rules on sources and
// ports.
func TestHostFirewallNFTRulesNotHeld(t *testing.T) {
	path := firewallNode(t, 10, 2000)
	vip := netip.MustParseAddr(scaleVIP(0))
	svcs := newServiceSet([]netip.Addr{vip}, nil)
	graphs, _, closeNFT, err := readNFT(path, svcs)
	defer closeNFT()
	if err != nil {
		t.Fatal(err)
	}
	var rejects []NATRule
	var input []natRule
	for _, g := range graphs {
		for _, r := range g.matchServices(svcs) {
			if r.Verdict != "" {
				rejects = append(rejects, r)
			}
		}
		if g.table == "inet host-firewall" {
			input = g.chains["input"]
		}
	}
	if len(rejects) != 1 || rejects[0].Hook != "input" || rejects[0].Verdict != "reject" {
		t.Errorf("rejects %+v, want the input chain's of %s", rejects, vip)
	}
	if len(input) != 1 {
		t.Errorf("input: %d rules held, want 1 (the reject of the VIP)", len(input))
	}
}
