package discover

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
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

// scaleNode is a netns holding kubeProxyNFTRuleset(services, 3).
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
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(kubeProxyNFTRuleset(services, 3))
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("nft -f: %v: %s", err, out)
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
	for b.Loop() {
		var info NodeInfo
		nf := readNetfilter(context.Background(), path, svcs, &info)
		if len(nf.Rules) != 6 { // 3 endpoints at prerouting and at output
			b.Fatalf("%d rules (%s), want 6: %+v", len(nf.Rules), nf.NFTables, nf.Rules)
		}
	}
}
