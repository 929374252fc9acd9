package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestRoutedNode traces a Service on a routed node, as Calico-like CNIs
// build them: the Pod's host veth has no master and an address of its own,
// kube-proxy-shaped NAT rules translate the VIP in the node (nftables, and
// kube-proxy's iptables-mode chains with iptables-legacy and iptables-nft),
// and the uplink is the device of the node's route towards the VIP, whose
// frames go to the next hop's MAC, untagged. The Service has two backends,
// taken in turn: each flow names its own backend and endpoint rule. A
// process in the node's own netns (a hostNetwork Pod, the kubelet) connects
// too: its flows are translated at OUTPUT, and its socket's egress hook runs
// after that NAT, and after POSTROUTING's masquerade, which kube-proxy makes
// fully random (a new source port, whatever the socket's): the flow is the
// socket's endpoint, one flow per connection, its uplink frame and SNAT
// found through conntrack. With nftables the node masquerades everything
// that leaves its uplink, so the uplink sees the Pod's flows with the
// node's address too: only conntrack's reply tuple links them. Names and
// addresses share nothing with the lab.
func TestRoutedNode(t *testing.T) {
	needRoot(t)
	const vip = "10.79.0.10:80"
	backends := []string{"10.78.0.7:8080", "10.78.0.8:8080"}
	vipIP, vipPort, _ := strings.Cut(vip, ":")
	for _, nat := range []struct {
		name, tool string
		install    func(t *testing.T, node string)
		// by is what a flow's "by" holds for the hook's chain and backend i;
		// hooks are the chains of PREROUTING (the Pod) and OUTPUT (the node).
		by    string
		hooks [2]string
	}{
		{"nftables", "nft", func(t *testing.T, node string) {
			rules := fmt.Sprintf(`table ip rt-kube-proxy {
	chain services {
		ip daddr %s tcp dport %s goto service-web
	}
	chain service-web {
		numgen inc mod 2 vmap { 0 : goto endpoint-web-0, 1 : goto endpoint-web-1 }
	}
	chain endpoint-web-0 {
		meta l4proto tcp dnat to %s
	}
	chain endpoint-web-1 {
		meta l4proto tcp dnat to %s
	}
	chain nat-prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		jump services
	}
	chain nat-output {
		type nat hook output priority -100; policy accept;
		jump services
	}
	chain nat-postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		oifname "rt-up" masquerade fully-random
	}
}
`, vipIP, vipPort, backends[0], backends[1])
			mustRun(t, strings.NewReader(rules), "ip", "netns", "exec", node, "nft", "-f", "-")
		}, "nftables ip rt-kube-proxy %s -> services -> service-web -> endpoint-web-%d", [2]string{"nat-prerouting", "nat-output"}},
		{"iptables-legacy", "iptables-legacy", func(t *testing.T, node string) {
			kubeProxyIPTables(t, "iptables-legacy", node, vip, backends)
		}, "iptables-legacy nat %s -> KUBE-SERVICES -> KUBE-SVC-WEB -> KUBE-SEP-WEB%d", [2]string{"PREROUTING", "OUTPUT"}},
		// iptables-nft writes the same chains as nftables rules with
		// xtables matches, in table ip nat.
		{"iptables-nft", "iptables-nft", func(t *testing.T, node string) {
			kubeProxyIPTables(t, "iptables-nft", node, vip, backends)
		}, "nftables ip nat %s -> KUBE-SERVICES -> KUBE-SVC-WEB -> KUBE-SEP-WEB%d", [2]string{"PREROUTING", "OUTPUT"}},
	} {
		t.Run(nat.name, func(t *testing.T) {
			if _, err := exec.LookPath(nat.tool); err != nil {
				t.Skipf("%s is not installed", nat.tool)
			}
			routedNode(t, nat.name, vip, backends, nat.install, nat.by, nat.hooks)
		})
	}
}

// kubeProxyIPTables writes kube-proxy's iptables-mode chains for vip with
// iptables (the iptables-legacy or iptables-nft command) in node: the
// Service chain takes the backends in turn, and marks a client outside the
// Pods' network (the node itself: 10.77.1.0/24 is routedNode's Pod) for
// KUBE-POSTROUTING's MASQUERADE --random-fully.
func kubeProxyIPTables(t *testing.T, iptables, node, vip string, backends []string) {
	vipIP, vipPort, _ := strings.Cut(vip, ":")
	ipt := func(args ...string) {
		mustRun(t, nil, "ip", append([]string{"netns", "exec", node, iptables, "-t", "nat"}, args...)...)
	}
	for _, chain := range []string{"KUBE-SERVICES", "KUBE-SVC-WEB", "KUBE-SEP-WEB0", "KUBE-SEP-WEB1", "KUBE-MARK-MASQ", "KUBE-POSTROUTING"} {
		ipt("-N", chain)
	}
	ipt("-A", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
	ipt("-A", "OUTPUT", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES")
	ipt("-A", "POSTROUTING", "-m", "comment", "--comment", "kubernetes postrouting rules", "-j", "KUBE-POSTROUTING")
	ipt("-A", "KUBE-MARK-MASQ", "-j", "MARK", "--set-xmark", "0x4000/0x4000")
	ipt("-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", "0x4000/0x4000", "-j", "RETURN")
	ipt("-A", "KUBE-POSTROUTING", "-j", "MARK", "--set-xmark", "0x4000/0x0")
	ipt("-A", "KUBE-POSTROUTING", "-m", "comment", "--comment", "kubernetes service traffic requiring SNAT", "-j", "MASQUERADE", "--random-fully")
	ipt("-A", "KUBE-SERVICES", "-d", vipIP+"/32", "-p", "tcp", "--dport", vipPort, "-j", "KUBE-SVC-WEB")
	ipt("-A", "KUBE-SVC-WEB", "!", "-s", "10.77.1.0/24", "-d", vipIP+"/32", "-p", "tcp", "--dport", vipPort, "-j", "KUBE-MARK-MASQ")
	ipt("-A", "KUBE-SVC-WEB", "-m", "statistic", "--mode", "nth", "--every", "2", "--packet", "0", "-j", "KUBE-SEP-WEB0")
	ipt("-A", "KUBE-SVC-WEB", "-j", "KUBE-SEP-WEB1")
	ipt("-A", "KUBE-SEP-WEB0", "-p", "tcp", "-j", "DNAT", "--to-destination", backends[0])
	ipt("-A", "KUBE-SEP-WEB1", "-p", "tcp", "-j", "DNAT", "--to-destination", backends[1])
}

// routedNode builds the routed node, installs its NAT rules and checks the
// flows of a few connections to vip from its Pod, then from the node itself.
func routedNode(t *testing.T, name, vip string, backends []string, install func(*testing.T, string), by string, hooks [2]string) {
	ns := testNetns(t, fmt.Sprintf("ptrt%d-%s", os.Getpid()%100000, name), "node", "pod", "gw")
	node, pod, gw := ns[0], ns[1], ns[2]
	routedTopology(t, node, pod, gw, "rt", "10.77.1", "192.168.77", backends, true)
	mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	install(t, node)

	gwMAC := macIn(t, gw, "rt-down")
	serveIn(t, "/run/netns/"+gw, backends...)

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	r.waitNode(t)
	const requests = 4
	if err := connectFrom("/run/netns/"+pod, vip, requests); err != nil {
		t.Fatalf("connect from the Pod: %v", err)
	}
	flows, _ := r.connectAndStop(t, "/run/netns/"+node, vip, requests)
	if len(flows) != 2*requests {
		t.Fatalf("%d flows, want %d: %s", len(flows), 2*requests, dump(flows))
	}
	perBackend, perClient := map[string]int{}, map[string]int{}
	for _, f := range flows {
		desc := dump([]map[string]any{f})
		got, _ := f["by"].(string)
		i := slices.Index(backends, fmt.Sprint(f["backend"]))
		perBackend[fmt.Sprint(f["backend"])]++
		client, _, _ := strings.Cut(fmt.Sprint(f["client"]), ":")
		perClient[client]++
		hook := hooks[0] // from the Pod
		if client == "192.168.77.2" {
			hook = hooks[1] // from the node, by its route's source address
		}
		if want := fmt.Sprintf(by, hook, max(i, 0)); f["rewritten_at"] != "netfilter" || i < 0 || !strings.Contains(got, want) {
			t.Errorf("want rewritten at netfilter to a backend, by its endpoint chain (%s): %s", want, desc)
		}
		if f["uplink_dst_mac"] != gwMAC || f["vlan"] != float64(0) || f["reply"] != true {
			t.Errorf("want the frame to leave untagged to the next hop %s and a reply: %s", gwMAC, desc)
		}
		if reason, _ := f["reason"].(string); hook == hooks[1] && !strings.Contains(reason, "SNAT on the node: it left with source 192.168.77.2:") {
			t.Errorf("want the node's flow masqueraded (the socket's port is its client, the SNAT's port the uplink's): %s", desc)
		}
	}
	if perBackend[backends[0]] != requests || perBackend[backends[1]] != requests {
		t.Errorf("flows per backend %v, want %d each (the rules take them in turn)", perBackend, requests)
	}
	if perClient["10.77.1.5"] != requests || perClient["192.168.77.2"] != requests {
		t.Errorf("flows per client %v, want %d from the Pod (10.77.1.5) and %d from the node (192.168.77.2)", perClient, requests, requests)
	}
}

// flowsOf connects n times from the netns to vip, stops the run and returns
// its flows, failing unless there are n.
func (r *run) flowsOf(t *testing.T, netns, vip string, n int) []map[string]any {
	t.Helper()
	flows, _ := r.connectAndStop(t, netns, vip, n)
	if len(flows) != n {
		t.Fatalf("%d flows, want %d: %s", len(flows), n, dump(flows))
	}
	return flows
}

// routedTopology wires a routed node: the Pod's eth0 (podNet.5/24) behind
// the node's veth TAG-pod1 (podNet.1), and the node's uplink TAG-up
// (upNet.2/24, its default route) to the gateway's TAG-down (upNet.1), which
// holds the backends' addresses (IP:port) on lo. routeBack gives the gateway
// a route to the Pods; without it only what the node masquerades comes back.
func routedTopology(t *testing.T, node, pod, gw, tag, podNet, upNet string, backends []string, routeBack bool) {
	t.Helper()
	cmds := [][]string{
		{"link", "add", tag + "-pod1", "netns", node, "type", "veth", "peer", "name", "eth0", "netns", pod},
		{"link", "add", tag + "-up", "netns", node, "type", "veth", "peer", "name", tag + "-down", "netns", gw},
		{"-n", pod, "addr", "add", podNet + ".5/24", "dev", "eth0"},
		{"-n", pod, "link", "set", "eth0", "up"},
		{"-n", pod, "route", "add", "default", "via", podNet + ".1"},
		{"-n", node, "addr", "add", podNet + ".1/24", "dev", tag + "-pod1"},
		{"-n", node, "addr", "add", upNet + ".2/24", "dev", tag + "-up"},
		{"-n", node, "link", "set", tag + "-pod1", "up"},
		{"-n", node, "link", "set", tag + "-up", "up"},
		{"-n", node, "route", "add", "default", "via", upNet + ".1"},
		{"-n", gw, "addr", "add", upNet + ".1/24", "dev", tag + "-down"},
		{"-n", gw, "link", "set", tag + "-down", "up"},
		{"-n", gw, "link", "set", "lo", "up"},
	}
	for _, b := range backends {
		host, _, _ := strings.Cut(b, ":")
		cmds = append(cmds, []string{"-n", gw, "addr", "add", host + "/32", "dev", "lo"})
	}
	if routeBack {
		cmds = append(cmds, []string{"-n", gw, "route", "add", podNet + ".0/24", "via", upNet + ".2"})
	}
	ipAll(t, cmds)
}

// macIn returns the MAC address of the interface ifname in the netns
// named netns.
func macIn(t *testing.T, netns, ifname string) string {
	t.Helper()
	var mac string
	err := nsutil.Do("/run/netns/"+netns, func() error {
		ifi, err := net.InterfaceByName(ifname)
		if err == nil {
			mac = ifi.HardwareAddr.String()
		}
		return err
	})
	if err != nil {
		t.Fatalf("MAC of %s in %s: %v", ifname, netns, err)
	}
	return mac
}

// ipAll runs `ip` with each list of arguments, failing the test at the
// first that fails.
func ipAll(t *testing.T, cmds [][]string) {
	t.Helper()
	for _, args := range cmds {
		mustRun(t, nil, "ip", args...)
	}
}

// dnatAt installs in the netns node an nftables table that DNATs TCP to
// vip to target at PREROUTING, as kube-proxy does for a Service.
func dnatAt(t *testing.T, node, table, vip, target string) {
	t.Helper()
	vipIP, vipPort, _ := strings.Cut(vip, ":")
	rules := fmt.Sprintf(`table ip %s {
	chain nat-prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		ip daddr %s tcp dport %s dnat to %s
	}
}
`, table, vipIP, vipPort, target)
	mustRun(t, strings.NewReader(rules), "ip", "netns", "exec", node, "nft", "-f", "-")
}

// testNetns adds the network namespaces PREFIX-ROLE, one per role, deleted
// when the test ends, and returns their names.
func testNetns(t *testing.T, prefix string, roles ...string) []string {
	t.Helper()
	names := make([]string, len(roles))
	for i, role := range roles {
		names[i] = prefix + "-" + role
		mustRun(t, nil, "ip", "netns", "add", names[i])
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", names[i]).Run() })
	}
	return names
}

// serveIn serves "ok" on each TCP address in the netns at path until the
// test ends.
func serveIn(t *testing.T, netns string, addrs ...string) {
	t.Helper()
	err := nsutil.Do(netns, func() error {
		for _, a := range addrs {
			ln, err := net.Listen("tcp", a)
			if err != nil {
				return err
			}
			t.Cleanup(func() { ln.Close() })
			go serveOK(ln)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("servers %v in %s: %v", addrs, netns, err)
	}
}

// serveOK answers every connection with "ok" until ln is closed.
func serveOK(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.Write([]byte("ok"))
		c.Close()
	}
}

// mustRun runs a command (with stdin when not nil) and fails the test if it fails.
func mustRun(t *testing.T, stdin *strings.Reader, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	if stdin != nil {
		cmd.Stdin = stdin
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out.String())
	}
}

// TestOverlayNode traces a Service on a node laid out as the CNI bridge
// plugin and flannel's VXLAN backend do it: the Pod's host veth is a port
// of a bridge that holds the Pod's gateway address itself (the node routes,
// nothing else is plugged into the bridge), and the backend lives on
// another node, reached through a VXLAN device while the VIP follows the
// default route. The uplinks are the tunnel device, where the translated
// frames leave untagged to the remote node's VTEP MAC, and the VIP's route's
// device (where a Service without NAT rule would leave unrewritten), which
// sees the translated frames only encapsulated. A traced Service without
// NAT rule (kube-proxy never programmed it) is named in the node object,
// and its flow, seen leaving that device unrewritten, is nowhere.
func TestOverlayNode(t *testing.T) {
	needRoot(t)
	const vip, backend, vtepMAC = "10.66.0.50:80", "10.65.2.7:8080", "02:00:00:00:02:02"
	const noRule = "10.66.0.51:80"
	ns := testNetns(t, fmt.Sprintf("ptov%d", os.Getpid()%100000), "node", "other", "pod")
	node, other, pod := ns[0], ns[1], ns[2]
	ipAll(t, [][]string{
		{"-n", node, "link", "add", "cbr0", "type", "bridge"},
		{"-n", node, "addr", "add", "10.65.1.1/24", "dev", "cbr0"},
		{"-n", node, "link", "set", "cbr0", "up"},
		{"link", "add", "vethov1", "netns", node, "type", "veth", "peer", "name", "eth0", "netns", pod},
		{"-n", node, "link", "set", "vethov1", "master", "cbr0", "up"},
		{"-n", pod, "addr", "add", "10.65.1.5/24", "dev", "eth0"},
		{"-n", pod, "link", "set", "eth0", "up"},
		{"-n", pod, "route", "add", "default", "via", "10.65.1.1"},
		{"link", "add", "ovnic", "netns", node, "type", "veth", "peer", "name", "ovnic", "netns", other},
		{"-n", node, "addr", "add", "192.168.66.1/24", "dev", "ovnic"},
		{"-n", node, "link", "set", "ovnic", "up"},
		{"-n", node, "route", "add", "default", "via", "192.168.66.2"},
		{"-n", other, "addr", "add", "192.168.66.2/24", "dev", "ovnic"},
		{"-n", other, "link", "set", "ovnic", "up"},
		{"-n", node, "link", "add", "tun.1", "type", "vxlan", "id", "1", "local", "192.168.66.1", "dev", "ovnic", "dstport", "8472", "nolearning"},
		{"-n", other, "link", "add", "tun.1", "type", "vxlan", "id", "1", "local", "192.168.66.2", "dev", "ovnic", "dstport", "8472", "nolearning"},
		{"-n", node, "link", "set", "tun.1", "address", "02:00:00:00:01:01"},
		{"-n", other, "link", "set", "tun.1", "address", vtepMAC},
		{"-n", node, "addr", "add", "10.65.1.0/32", "dev", "tun.1"},
		{"-n", other, "addr", "add", "10.65.2.0/32", "dev", "tun.1"},
		{"-n", node, "link", "set", "tun.1", "up"},
		{"-n", other, "link", "set", "tun.1", "up"},
		{"-n", node, "route", "add", "10.65.2.0/24", "via", "10.65.2.0", "dev", "tun.1", "onlink"},
		{"-n", other, "route", "add", "10.65.1.0/24", "via", "10.65.1.0", "dev", "tun.1", "onlink"},
		{"-n", node, "neigh", "add", "10.65.2.0", "lladdr", vtepMAC, "dev", "tun.1", "nud", "permanent"},
		{"-n", other, "neigh", "add", "10.65.1.0", "lladdr", "02:00:00:00:01:01", "dev", "tun.1", "nud", "permanent"},
		{"-n", other, "addr", "add", strings.Split(backend, ":")[0] + "/32", "dev", "lo"},
		{"-n", other, "link", "set", "lo", "up"},
	})
	mustRun(t, nil, "bridge", "-n", node, "fdb", "append", vtepMAC, "dev", "tun.1", "dst", "192.168.66.2")
	mustRun(t, nil, "bridge", "-n", other, "fdb", "append", "02:00:00:00:01:01", "dev", "tun.1", "dst", "192.168.66.1")
	mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	dnatAt(t, node, "ov-kube-proxy", vip, backend)
	serveIn(t, "/run/netns/"+other, backend)

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--svc", noRule+"/tcp", "--duration", "30s")
	nodeInfo := r.waitNode(t)
	if got := fmt.Sprint(nodeInfo["services_without_nat"]); got != "["+noRule+"/tcp]" {
		t.Errorf("services_without_nat %s, want [%s/tcp]", got, noRule)
	}
	var uplinks []string
	cps, _ := nodeInfo["capture_points"].([]any)
	for _, c := range cps {
		if cp, _ := c.(map[string]any); cp["role"] == "uplink" {
			uplinks = append(uplinks, fmt.Sprint(cp["ifname"]))
		}
	}
	if !slices.Equal(uplinks, []string{"tun.1", "ovnic"}) {
		t.Errorf("uplinks %v, want [tun.1 ovnic] (the routes to the backend and the VIP)", uplinks)
	}
	const requests = 2
	if err := connectFrom("/run/netns/"+pod, vip, requests); err != nil {
		t.Fatalf("connect from %s to %s: %v", pod, vip, err)
	}
	_ = connectFrom("/run/netns/"+pod, noRule, 1) // nothing translates it: it fails
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, _ := r.rest(t)
	if len(flows) != requests+1 {
		t.Fatalf("%d flows, want %d: %s", len(flows), requests+1, dump(flows))
	}
	for _, f := range flows {
		if f["service"] == noRule {
			if f["rewritten_at"] != "nowhere" || f["vlan"] != float64(0) {
				t.Errorf("want the Service without NAT rule nowhere, seen leaving ovnic untagged: %s", dump([]map[string]any{f}))
			}
			continue
		}
		if f["rewritten_at"] != "netfilter" || f["backend"] != backend || f["uplink_dst_mac"] != vtepMAC || f["vlan"] != float64(0) || f["reply"] != true {
			t.Errorf("want rewritten at netfilter to %s, leaving tun.1 untagged to %s, and a reply: %s", backend, vtepMAC, dump([]map[string]any{f}))
		}
	}
}

// TestMacvlanPod traces a Pod whose interface is a macvlan on a node device
// (Multus, macvlan CNIs), or an ipvlan in L2 mode (as some CNIs do),
// selected with --pod-netns: its frames leave through that device past the
// node's stack, so no netfilter rule of the node applies; the uplink is the
// device below the macvlan.
func TestMacvlanPod(t *testing.T) {
	needRoot(t)
	for _, kind := range [][]string{{"macvlan", "mode", "bridge"}, {"ipvlan", "mode", "l2"}} {
		t.Run(kind[0], func(t *testing.T) {
			const vip = "10.67.0.10:80"
			node, _, pod := macvlanPod(t, fmt.Sprintf("ptmv%d-%s", os.Getpid()%100000, kind[0]), kind...)
			// The node's rules for the VIP, which the Pod's frames never meet.
			dnatAt(t, node, "mv-kube-proxy", vip, "10.66.5.1:8080")

			r := startJSON(t, "--host-netns", "/run/netns/"+node, "--pod-netns", "/run/netns/"+pod, "--svc", vip+"/tcp", "--duration", "30s")
			nodeInfo := r.waitNode(t)
			var points []string
			cps, _ := nodeInfo["capture_points"].([]any)
			for _, c := range cps {
				cp, _ := c.(map[string]any)
				points = append(points, fmt.Sprint(cp["role"], ":", cp["ifname"]))
			}
			if !slices.Equal(points, []string{"pod:mvpod", "uplink:mvnic"}) {
				t.Errorf("capture points %v, want [pod:mvpod uplink:mvnic] (the %s and the device below it)", points, kind[0])
			}
			_ = connectFrom("/run/netns/"+pod, vip, 1) // nobody answers: it fails
			time.Sleep(300 * time.Millisecond)
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
			flows, _ := r.rest(t)
			if len(flows) != 1 {
				t.Fatalf("%d flows, want 1: %s", len(flows), dump(flows))
			}
			if f := flows[0]; f["rewritten_at"] != "nowhere" || f["vlan"] != float64(0) {
				t.Errorf("want nowhere, seen leaving the uplink untagged: %s", dump(flows))
			}
		})
	}
}

// macvlanPod builds a node whose device mvnic leads to a gateway
// (10.66.5.1) and a Pod PREFIX-pod on a link of it (mvpod, 10.66.5.9), of
// the type and options kind (a macvlan in bridge mode without), and
// returns the names of the node, gateway and Pod netns. A kernel without
// that link type skips the test.
func macvlanPod(t *testing.T, prefix string, kind ...string) (node, gw, pod string) {
	t.Helper()
	if len(kind) == 0 {
		kind = []string{"macvlan", "mode", "bridge"}
	}
	ns := testNetns(t, prefix, "node", "gw", "pod")
	node, gw, pod = ns[0], ns[1], ns[2]
	ipAll(t, [][]string{
		{"link", "add", "mvnic", "netns", node, "type", "veth", "peer", "name", "mvgw", "netns", gw},
		{"-n", node, "link", "set", "mvnic", "up"},
		{"-n", gw, "addr", "add", "10.66.5.1/24", "dev", "mvgw"},
		{"-n", gw, "link", "set", "mvgw", "up"},
	})
	if out, err := exec.Command("ip", append([]string{"-n", node, "link", "add", "mvpod", "link", "mvnic", "type"}, kind...)...).CombinedOutput(); err != nil {
		t.Skipf("no %s links on this kernel: %v: %s", kind[0], err, out)
	}
	ipAll(t, [][]string{
		{"-n", node, "link", "set", "mvpod", "netns", pod},
		{"-n", pod, "addr", "add", "10.66.5.9/24", "dev", "mvpod"},
		{"-n", pod, "link", "set", "mvpod", "up"},
		{"-n", pod, "route", "add", "default", "via", "10.66.5.1"},
	})
	return node, gw, pod
}

// TestMacvlanPodRewrittenOnUplinkEgress: a macvlan Pod's request is
// rewritten on the device below it by an nftables netdev egress chain. The
// Pod has no host side, so only the uplink's egress lies between its eth0
// and the uplink's TX tap: netfilter, by the chain's rule, when the rule
// names the VIP; unknown, at the uplink's egress with nothing found there,
// when it rewrites every port-80 packet without naming it (not read as the
// VIP's), never placed at a host veth's tc that does not exist.
func TestMacvlanPodRewrittenOnUplinkEgress(t *testing.T) {
	needRoot(t)
	const vip, backend = "10.67.0.11:80", "10.66.5.1:8080"
	for i, tc := range []struct {
		name, match string
		check       func(f map[string]any, reason string) bool
	}{
		{"read", "ip daddr 10.67.0.11 tcp dport 80", func(f map[string]any, _ string) bool {
			by, _ := f["by"].(string)
			return f["rewritten_at"] == "netfilter" && by == "nftables netdev mu-rewrite/egress egress on mvnic -> daddr set "+backend
		}},
		{"unread", "tcp dport 80", func(f map[string]any, reason string) bool {
			return f["rewritten_at"] == "unknown" && strings.Contains(reason, "no host side (macvlan on mvnic)") && !strings.Contains(reason, "host veth's tc")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, gw, pod := macvlanPod(t, fmt.Sprintf("ptmu%d-%d", os.Getpid()%100000, i))
			rules := `table netdev mu-rewrite {
	chain egress {
		type filter hook egress device mvnic priority 0;
		` + tc.match + ` ip daddr set 10.66.5.1 tcp dport set 8080
	}
}
`
			cmd := exec.Command("ip", "netns", "exec", node, "nft", "-f", "-")
			cmd.Stdin = strings.NewReader(rules)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Skipf("no nftables netdev egress hook here: %v: %s", err, out)
			}
			serveIn(t, "/run/netns/"+gw, backend)

			r := startJSON(t, "--host-netns", "/run/netns/"+node, "--pod-netns", "/run/netns/"+pod, "--svc", vip+"/tcp", "--duration", "30s")
			r.waitNode(t)
			_ = connectFrom("/run/netns/"+pod, vip, 1) // the reply is not translated back: it fails
			time.Sleep(300 * time.Millisecond)
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
			flows, _ := r.rest(t)
			if len(flows) != 1 {
				t.Fatalf("%d flows, want 1: %s", len(flows), dump(flows))
			}
			f := flows[0]
			reason, _ := f["reason"].(string)
			if f["backend"] != backend || !tc.check(f, reason) {
				t.Errorf("rule %q: want backend %s, %s: %s", tc.match, backend, tc.name, dump(flows))
			}
		})
	}
}

// TestTunnelUplinkWithoutEthernet: the backends' route goes through a tunnel
// without a link layer (as Calico's IPIP tunl0 or a WireGuard device: here a
// TUN device). Its packets carry no Ethernet header, which the capture file
// and the decoder expect, so the uplink is the route to the VIP instead, and
// the Pod's uplink_how says why.
func TestTunnelUplinkWithoutEthernet(t *testing.T) {
	needRoot(t)
	const vip, backend = "10.69.0.10:80", "10.68.9.7:8080"
	ns := testNetns(t, fmt.Sprintf("pttn%d", os.Getpid()%100000), "node", "pod", "gw")
	node, pod, gw := ns[0], ns[1], ns[2]
	ipAll(t, [][]string{
		{"link", "add", "tn-pod1", "netns", node, "type", "veth", "peer", "name", "eth0", "netns", pod},
		{"link", "add", "tn-up", "netns", node, "type", "veth", "peer", "name", "tn-down", "netns", gw},
		{"-n", pod, "addr", "add", "10.68.1.5/24", "dev", "eth0"},
		{"-n", pod, "link", "set", "eth0", "up"},
		{"-n", pod, "route", "add", "default", "via", "10.68.1.1"},
		{"-n", node, "addr", "add", "10.68.1.1/24", "dev", "tn-pod1"},
		{"-n", node, "link", "set", "tn-pod1", "up"},
		{"-n", node, "addr", "add", "192.168.68.2/24", "dev", "tn-up"},
		{"-n", node, "link", "set", "tn-up", "up"},
		{"-n", node, "route", "add", "default", "via", "192.168.68.1"},
		{"-n", node, "tuntap", "add", "dev", "tn-tun", "mode", "tun"},
		{"-n", node, "link", "set", "tn-tun", "up"},
		{"-n", node, "route", "add", "10.68.9.0/24", "dev", "tn-tun"},
	})
	dnatAt(t, node, "tn-kube-proxy", vip, backend)

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	nodeInfo := r.waitNode(t)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	r.rest(t)
	pods, _ := nodeInfo["pods"].([]any)
	if len(pods) != 1 {
		t.Fatalf("%d pods, want 1: %v", len(pods), nodeInfo["pods"])
	}
	p, _ := pods[0].(map[string]any)
	how := fmt.Sprint(p["uplink_how"])
	if fmt.Sprint(p["uplinks"]) != "[tn-up]" || !strings.Contains(how, "tn-tun (none)") {
		t.Errorf("uplinks %v (%s), want [tn-up], the VIP's route, and tn-tun named as left out", p["uplinks"], how)
	}

	// With the default route through the tunnel too, there is no Ethernet
	// device to capture: no uplink, and the Pod says to give one.
	mustRun(t, nil, "ip", "-n", node, "route", "replace", "default", "dev", "tn-tun")
	r = startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	nodeInfo = r.waitNode(t)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	r.rest(t)
	pods, _ = nodeInfo["pods"].([]any)
	p, _ = pods[0].(map[string]any)
	if ups, _ := p["uplinks"].([]any); len(ups) != 0 || !strings.Contains(fmt.Sprint(p["uplink_how"]), "give --uplink") {
		t.Errorf("uplinks %v (%s), want none and a hint to give --uplink", p["uplinks"], p["uplink_how"])
	}
}

// TestRoutedPodStartedOwnUplink: on a routed node whose routing rules send
// one Pod's source through a second uplink, a Pod that starts there during
// the trace gets a tap on that uplink too (the Pods of the start left only
// the first tapped): its flows show the frame leaving through it, to its
// next hop. Names and addresses share nothing with the lab.
func TestRoutedPodStartedOwnUplink(t *testing.T) {
	needRoot(t)
	const vip, backend = "10.79.0.20:80", "10.78.0.9:8080"
	ns := testNetns(t, fmt.Sprintf("ptru%d", os.Getpid()%100000), "node", "pod1", "pod2", "gw1", "gw2")
	node, pod1, pod2, gw1, gw2 := ns[0], ns[1], ns[2], ns[3], ns[4]
	ipAll(t, [][]string{
		{"link", "add", "rt-up1", "netns", node, "type", "veth", "peer", "name", "rt-down", "netns", gw1},
		{"link", "add", "rt-up2", "netns", node, "type", "veth", "peer", "name", "rt-down", "netns", gw2},
		{"link", "add", "rt-pod1", "netns", node, "type", "veth", "peer", "name", "eth0", "netns", pod1},
		{"-n", node, "addr", "add", "192.168.77.2/24", "dev", "rt-up1"},
		{"-n", node, "addr", "add", "192.168.78.2/24", "dev", "rt-up2"},
		{"-n", node, "addr", "add", "10.77.1.1/24", "dev", "rt-pod1"},
		{"-n", node, "link", "set", "rt-up1", "up"},
		{"-n", node, "link", "set", "rt-up2", "up"},
		{"-n", node, "link", "set", "rt-pod1", "up"},
		{"-n", node, "route", "add", "default", "via", "192.168.77.1"},
		{"-n", node, "route", "add", "default", "via", "192.168.78.1", "table", "100"},
		{"-n", node, "rule", "add", "from", "10.77.2.0/24", "lookup", "100", "priority", "1536"},
		{"-n", pod1, "addr", "add", "10.77.1.5/24", "dev", "eth0"},
		{"-n", pod1, "link", "set", "eth0", "up"},
		{"-n", pod1, "route", "add", "default", "via", "10.77.1.1"},
	})
	for i, gw := range []string{gw1, gw2} {
		ipAll(t, [][]string{
			{"-n", gw, "addr", "add", fmt.Sprintf("192.168.%d.1/24", 77+i), "dev", "rt-down"},
			{"-n", gw, "addr", "add", strings.Split(backend, ":")[0] + "/32", "dev", "lo"},
			{"-n", gw, "link", "set", "rt-down", "up"},
			{"-n", gw, "link", "set", "lo", "up"},
			{"-n", gw, "route", "add", "10.77.0.0/16", "via", fmt.Sprintf("192.168.%d.2", 77+i)},
		})
		serveIn(t, "/run/netns/"+gw, backend)
	}
	mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	dnatAt(t, node, "rt-kube-proxy", vip, backend)
	gw2MAC := macIn(t, gw2, "rt-down")

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "60s")
	node0 := r.waitNode(t)
	for _, cp := range node0["capture_points"].([]any) {
		if m := cp.(map[string]any); m["ifname"] == "rt-up2" {
			t.Fatalf("rt-up2 tapped from the start: the test needs a Pod of the start that does not use it")
		}
	}
	ipAll(t, [][]string{
		{"link", "add", "rt-pod2", "netns", node, "type", "veth", "peer", "name", "eth0", "netns", pod2},
		{"-n", node, "addr", "add", "10.77.2.1/24", "dev", "rt-pod2"},
		{"-n", node, "link", "set", "rt-pod2", "up"},
		{"-n", pod2, "addr", "add", "10.77.2.5/24", "dev", "eth0"},
		{"-n", pod2, "link", "set", "eth0", "up"},
		{"-n", pod2, "route", "add", "default", "via", "10.77.2.1"},
	})
	time.Sleep(7 * time.Second) // found within two looks (every 2 s, on a 1 s tick)
	const requests = 2
	flows, summary := r.connectAndStop(t, "/run/netns/"+pod2, vip, requests)
	mine := flowsFrom(flows, "10.77.2.5")
	if len(mine) != requests {
		t.Fatalf("%d flows from the new Pod, want %d: %s", len(mine), requests, dump(flows))
	}
	for _, f := range mine {
		if f["rewritten_at"] != "netfilter" || f["backend"] != backend || f["uplink_dst_mac"] != gw2MAC || f["reply"] != true ||
			!strings.Contains(fmt.Sprint(f["points"]), "uplink:rt-up2") {
			t.Errorf("want rewritten at netfilter to %s, seen leaving uplink:rt-up2 to its next hop %s, and a reply: %s", backend, gw2MAC, dump([]map[string]any{f}))
		}
	}
	started, _ := summary["pods_started"].([]any)
	if len(started) != 1 || !strings.Contains(fmt.Sprint(started[0]), "uplink:rt-up2") {
		t.Errorf("pods_started %v, want the new Pod with its uplink's tap", started)
	}
}

// TestNodeLocalVIP: a VIP that is an address of the node itself (as
// NodeLocal DNSCache binds kube-dns's ClusterIP on a device of the node)
// is delivered to the node's own listener, unrewritten: the node object
// lists it with its device, and each flow is "nowhere" with the local
// address as its reason and its answer seen, never "unknown" with a guessed
// drop.
func TestNodeLocalVIP(t *testing.T) {
	needRoot(t)
	ns := testNetns(t, fmt.Sprintf("ptnl%d", os.Getpid()%100000), "node", "pod", "gw")
	node, pod, gw := ns[0], ns[1], ns[2]
	const vip = "10.79.0.53:8053"
	routedTopology(t, node, pod, gw, "nl", "10.77.2", "192.168.79", nil, true)
	ipAll(t, [][]string{
		{"link", "add", "nodelocal", "netns", node, "type", "veth", "peer", "name", "nodelocal-p", "netns", node},
		{"-n", node, "addr", "add", "10.79.0.53/32", "dev", "nodelocal"},
		{"-n", node, "link", "set", "nodelocal", "up"},
		{"-n", node, "link", "set", "nodelocal-p", "up"},
		{"-n", node, "link", "set", "lo", "up"},
	})
	serveIn(t, "/run/netns/"+node, vip)

	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	nodeObj := r.waitNode(t)
	if lv, _ := nodeObj["local_vips"].([]any); len(lv) != 1 || fmt.Sprint(lv[0]) != "map[addr:10.79.0.53 device:nodelocal]" {
		t.Errorf("node local_vips %v, want 10.79.0.53 on nodelocal", nodeObj["local_vips"])
	}
	for _, f := range r.flowsOf(t, "/run/netns/"+pod, vip, 3) {
		reason, _ := f["reason"].(string)
		if f["rewritten_at"] != "nowhere" || f["reply"] != true || !strings.Contains(reason, "10.79.0.53 is an address of the node itself (on nodelocal)") || f["backend"] != "" {
			t.Errorf("want nowhere, answered by the node, the local address as the reason, no backend: %s", dump([]map[string]any{f}))
		}
	}
}

// TestTCRewriteThenSNAT: a tc program on the Pod's host veth chose a
// backend no NAT rule names, and the node masquerades what leaves its
// uplink (the gateway has no route back to the Pods). Every flow, the first
// one too, has its uplink frame (VLAN, next hop) and the node's SNAT: the
// observers learn the tc program's backend in the kernel as the first
// packet passes them, and the conntrack filter passes the entry of a learned
// client endpoint, before user space has heard of that backend.
func TestTCRewriteThenSNAT(t *testing.T) {
	needRoot(t)
	prefix := fmt.Sprintf("ptts%d", os.Getpid()%100000)
	ns := testNetns(t, prefix, "node", "pod", "gw")
	node, pod, gw := ns[0], ns[1], ns[2]
	routedTopology(t, node, pod, gw, "ts", "10.77.3", "192.168.78", []string{lab.TCPBackend.String()}, false)
	mustRun(t, nil, "ip", "netns", "exec", node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	mustRun(t, strings.NewReader("table ip ts-masq {\n\tchain post {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\toifname \"ts-up\" masquerade\n\t}\n}\n"),
		"ip", "netns", "exec", node, "nft", "-f", "-")
	// The lab's tc LB (10.120.0.80:80 -> its backend), on this node's veth.
	if err := lab.New(prefix).AttachTCLBTo("ts-pod1"); err != nil {
		t.Fatal(err)
	}
	gwMAC := macIn(t, gw, "ts-down")
	serveIn(t, "/run/netns/"+gw, lab.TCPBackend.String())

	vip := lab.TCPVIP.String()
	r := startJSON(t, "--host-netns", "/run/netns/"+node, "--svc", vip+"/tcp", "--duration", "30s")
	r.waitNode(t)
	for _, f := range r.flowsOf(t, "/run/netns/"+pod, vip, 3) {
		reason, _ := f["reason"].(string)
		if f["rewritten_at"] != "tc" || f["backend"] != lab.TCPBackend.String() || f["reply"] != true ||
			f["uplink_dst_mac"] != gwMAC || f["vlan"] != float64(0) || !strings.Contains(reason, "SNAT on the node: it left with source 192.168.78.2:") {
			t.Errorf("want tc to %s, the uplink frame to %s untagged, the node's SNAT and a reply: %s", lab.TCPBackend, gwMAC, dump([]map[string]any{f}))
		}
	}
}
