package main

import (
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestNetdevIngressRewrite: an nftables netdev chain at the ingress of the
// Pod's host veth sets the VIP's destination statelessly (and one at its
// egress sets the replies' source back), before the bridge and PREROUTING,
// where the lab's kube-proxy DNAT waits (netfilter mode) and never meets
// the VIP. The node block lists the chain with its rewrite; the flows are
// rewritten at netfilter by the chain's rule, not kube-proxy's. Beside the
// lab's tc-legacy mode (a cls_bpf DNAT on the same veth's ingress, which
// rewrites first), no point tells the two apart: unknown, naming both.
func TestNetdevIngressRewrite(t *testing.T) {
	nft := needNFT(t)
	l := testLab(t, "ptlab-ndev")
	vip, backend := lab.TCPVIP, lab.TCPBackend
	ruleset := fmt.Sprintf(`table netdev ptdev {
  chain vip-in {
    type filter hook ingress device %[1]s priority -500; policy accept;
    ip daddr %[2]s tcp dport %[3]d ip daddr set %[4]s tcp dport set %[5]d
  }
  chain vip-out {
    type filter hook egress device %[1]s priority -500; policy accept;
    ip saddr %[4]s tcp sport %[5]d ip saddr set %[2]s tcp sport set %[3]d
  }
}
`, lab.HostVeth, vip.Addr(), vip.Port(), backend.Addr(), backend.Port())
	const chain = "nftables netdev ptdev/vip-in ingress on " + lab.HostVeth
	for _, tc := range []struct {
		mode lab.Mode
		at   string   // rewritten_at
		by   []string // in by, or in the reason of an unknown
	}{
		{lab.ModeNetfilter, "netfilter", []string{chain + " -> daddr set " + backend.String()}},
		{lab.ModeTCLegacy, "unknown", []string{"one of 2: cls_bpf ingress", chain}},
	} {
		t.Run(string(tc.mode), func(t *testing.T) {
			if err := l.Up(t.Context(), tc.mode); err != nil {
				t.Fatalf("lab up %s: %v", tc.mode, err)
			}
			t.Cleanup(func() {
				nsutil.Do(l.NodeNetNS(), func() error { return exec.Command(nft, "delete", "table", "netdev", "ptdev").Run() })
			})
			if err := nftApply(nft, l.NodeNetNS(), ruleset); err != nil {
				if strings.Contains(err.Error(), "egress") {
					t.Skipf("this kernel has no netdev egress hook: %v", err)
				}
				t.Fatalf("nft -f: %v", err)
			}
			r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", vip.String()+"/tcp", "--duration", "5s")
			node := r.waitNode(t)
			chains, _ := node["netfilter"].(map[string]any)["device_chains"].([]any)
			if !strings.Contains(fmt.Sprint(chains), "vip-in") || !strings.Contains(fmt.Sprint(chains), backend.Addr().String()) {
				t.Errorf("node device_chains %v, want vip-in on %s with its rewrite to %s", chains, lab.HostVeth, backend)
			}
			for range 2 {
				if err := nsutil.Do(l.PodNetNS(), func() error { return httpGet(vip.String()) }); err != nil {
					t.Fatalf("GET http://%s from the Pod: %v", vip, err)
				}
			}
			flows, _ := r.rest(t)
			if len(flows) != 2 {
				t.Fatalf("%d flows, want 2: %v", len(flows), flows)
			}
			for _, f := range flows {
				by, _ := f["by"].(string)
				reason, _ := f["reason"].(string)
				text := by
				if tc.at == "unknown" {
					text = reason
				}
				ok := f["rewritten_at"] == tc.at && f["backend"] == backend.String() && f["reply"] == true
				for _, w := range tc.by {
					ok = ok && strings.Contains(text, w)
				}
				if !ok || strings.Contains(by, "kube-proxy") {
					t.Errorf("flow %v: at %v to %v reply %v by %q (reason %q); want %s to %s, a reply, naming %q",
						f["client"], f["rewritten_at"], f["backend"], f["reply"], by, reason, tc.at, backend, tc.by)
				}
			}
		})
	}
}

// TestNetdevChainMadeDuringRun: a netdev chain made at the Pod's host veth
// while pathtrace runs sets the VIP's destination. To a backend port no NAT
// rule names (nothing listens there: the backend resets), it is read when
// the flows reach that backend; to the backend kube-proxy's rules name
// (which then never meet the VIP), no news asks for a look, and the run's
// last look reads it for the flows pathtrace would place at tc unnamed.
// Either way the flow names it: netfilter, by the chain's rule.
func TestNetdevChainMadeDuringRun(t *testing.T) {
	nft := needNFT(t)
	l := testLab(t, "ptlab-ndevlate")
	if err := l.Up(t.Context(), lab.ModeNetfilter); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	vip := lab.TCPVIP
	for _, tc := range []struct {
		name string
		to   netip.AddrPort
	}{
		{"to a port no rule names", netip.AddrPortFrom(lab.TCPBackend.Addr(), lab.TCPBackend.Port()+1)}, // no listener
		{"to the backend the NAT rules name", lab.TCPBackend},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ruleset := fmt.Sprintf(`table netdev ptlate {
  chain vip-in {
    type filter hook ingress device %[1]s priority -500; policy accept;
    ip daddr %[2]s tcp dport %[3]d ip daddr set %[4]s tcp dport set %[5]d
  }
}
`, lab.HostVeth, vip.Addr(), vip.Port(), tc.to.Addr(), tc.to.Port())
			t.Cleanup(func() {
				nsutil.Do(l.NodeNetNS(), func() error { return exec.Command(nft, "delete", "table", "netdev", "ptlate").Run() })
			})
			r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", vip.String()+"/tcp", "--duration", "4s")
			r.waitNode(t)
			if err := nftApply(nft, l.NodeNetNS(), ruleset); err != nil {
				t.Fatalf("nft -f: %v", err)
			}
			// Nothing translates the replies back (no egress chain): the
			// GET fails, the flow is made all the same.
			nsutil.Do(l.PodNetNS(), func() error { return httpGet(vip.String()) })
			flows, _ := r.rest(t)
			if len(flows) != 1 {
				t.Fatalf("%d flows, want 1: %v", len(flows), flows)
			}
			f := flows[0]
			want := "nftables netdev ptlate/vip-in ingress on " + lab.HostVeth + " -> daddr set " + tc.to.String()
			if f["rewritten_at"] != "netfilter" || f["backend"] != tc.to.String() || f["by"] != want {
				t.Errorf("flow at %v to %v by %q (reason %q); want netfilter to %s by %q", f["rewritten_at"], f["backend"], f["by"], f["reason"], tc.to, want)
			}
		})
	}
}

// needNFT is the path of nft(8), which makes the tests' chains; it skips
// the test without root or nft.
func needNFT(t *testing.T) string {
	t.Helper()
	needRoot(t)
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Skip("needs nft (apt-get install nftables) to make the netdev chains")
	}
	return nft
}

// nftApply loads ruleset (nft -f) in the netns at nsPath.
func nftApply(nft, nsPath, ruleset string) error {
	return nsutil.Do(nsPath, func() error {
		cmd := exec.Command(nft, "-f", "-")
		cmd.Stdin = strings.NewReader(ruleset)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
}
