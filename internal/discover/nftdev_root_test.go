package discover

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestReadDeviceRules reads the chains on device hooks of a netns holding
// two veth pairs: a netdev ingress chain on one (dev0) that rewrites a VIP
// (jumping to another chain for it) and another to a value not decoded, a
// netdev egress chain on the other that sets it from a numgen map, an inet
// ingress chain that sets it from a map by destination, and an ip filter
// chain at prerouting that must stay one. None of the device
// chains may be read as a prerouting or input filter chain (their hook
// numbers are the device's, not the IP stack's): the netdev drop of the
// VIP is no reject of the node's.
func TestReadDeviceRules(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root (and not -short): creates a network namespace")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft is not installed")
	}
	name := fmt.Sprintf("pttest-devchain-%06x", rand.IntN(1<<24))
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	run("ip", "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	in := func(args ...string) { t.Helper(); run(append([]string{"ip", "netns", "exec", name}, args...)...) }
	in("ip", "link", "add", "dev0", "type", "veth", "peer", "name", "dev1")
	in("ip", "link", "add", "vx0", "type", "veth", "peer", "name", "vy0")
	ruleset := `
table netdev pt {
  chain rw {
    ip daddr set 10.244.20.31 tcp dport set 3000
  }
  chain in0 {
    type filter hook ingress device dev0 priority -500; policy accept;
    ip daddr 10.120.0.80 tcp dport 80 jump rw
    ip daddr 10.120.0.99 drop
    ip daddr 10.120.0.11 ip daddr set ip saddr
  }
  chain out0 {
    type filter hook egress device vx0 priority 0; policy accept;
    ip daddr 10.120.0.80 ip daddr set numgen random mod 2 map { 0 : 10.244.20.31, 1 : 10.244.20.32 }
  }
}
table inet pi {
  chain in1 {
    type filter hook ingress device vx0 priority 10; policy accept;
    udp dport 53 ip daddr set ip daddr map { 10.120.0.10 : 10.244.20.31, 10.120.0.12 : 10.244.20.32 }
  }
}
table ip pf {
  chain pre {
    type filter hook prerouting priority -110; policy accept;
    ip daddr 10.120.0.98 drop
  }
}
`
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(ruleset)
	if out, err := cmd.CombinedOutput(); err != nil {
		if strings.Contains(string(out), "egress") || strings.Contains(string(out), "ingress") {
			t.Skipf("this kernel or nft has no netdev egress or inet ingress hook: %s", out)
		}
		t.Fatalf("nft -f: %v: %s", err, out)
	}
	svcs := newServiceSet([]netip.Addr{netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10"), netip.MustParseAddr("10.120.0.11"),
		netip.MustParseAddr("10.120.0.99"), netip.MustParseAddr("10.120.0.98")}, nil)
	var info NodeInfo
	nf := readNetfilter(context.Background(), "/run/netns/"+name, svcs, &info)
	if strings.HasPrefix(nf.NFTables, "not") {
		t.Fatalf("nftables: %s", nf.NFTables)
	}

	byName := map[string]DeviceChain{}
	for _, c := range nf.DeviceChains {
		byName[c.String()] = c
	}
	if len(byName) != 3 {
		t.Fatalf("device chains %+v, want netdev pt/in0, netdev pt/out0, inet pi/in1", nf.DeviceChains)
	}
	check := func(key, hook, dev string, prio int, want []string) {
		t.Helper()
		c, ok := byName[key]
		if !ok {
			t.Fatalf("no device chain %s in %+v", key, nf.DeviceChains)
		}
		if c.Hook != hook || !slices.Equal(c.Devices, []string{dev}) || c.Priority != prio {
			t.Errorf("%s: hook %s devices %v priority %d, want %s [%s] %d", key, c.Hook, c.Devices, c.Priority, hook, dev, prio)
		}
		var got []string
		for _, r := range c.Rewrites {
			got = append(got, fmt.Sprintf("%s:%d/%s %s -> %s", r.Service, r.Port, r.Proto, strings.Join(r.Chains, ">"), natBackendString(r)))
		}
		slices.Sort(got) // a map's elements come in the kernel's order
		if !slices.Equal(got, want) {
			t.Errorf("%s rewrites:\n got %q\nwant %q", key, got, want)
		}
	}
	// A constant; a value not decoded (?); a numgen map's values, each a
	// possible backend; a map by destination, the traced VIP's element.
	check("netdev pt/in0", "ingress", "dev0", -500, []string{"10.120.0.11:0/ in0 -> " + unknownRewrite, "10.120.0.80:80/tcp in0>rw -> 10.244.20.31:3000"})
	check("netdev pt/out0", "egress", "vx0", 0, []string{"10.120.0.80:0/ out0 -> 10.244.20.31 (port kept)", "10.120.0.80:0/ out0 -> 10.244.20.32 (port kept)"})
	check("inet pi/in1", "ingress", "vx0", 10, []string{"10.120.0.10:53/udp in1 -> 10.244.20.31 (port kept)"})

	// The drop of 10.120.0.99 is the netdev chain's (ingress of dev0),
	// no filter chain's at prerouting; 10.120.0.98's is one.
	var rejects []string
	for _, r := range nf.Rejects {
		rejects = append(rejects, fmt.Sprintf("%s %s %s %s", r.Table, r.Hook, r.Service, r.Verdict))
	}
	if want := []string{"ip pf prerouting 10.120.0.98 drop"}; !slices.Equal(rejects, want) {
		t.Errorf("rejects %q, want %q", rejects, want)
	}
	if len(nf.Rules) != 0 {
		t.Errorf("NAT rules %+v, want none (no NAT chain)", nf.Rules)
	}
}
