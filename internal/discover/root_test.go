package discover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// testbed is a node in namespaces: a "node" netns with a bridge br0, a "pod"
// netns whose eth0 is a veth to hv0 on br0, and a "gw" netns (the pod's
// gateway) behind up0, another veth port of br0.
type testbed struct {
	node, pod, gw string // /run/netns paths
	gwMAC         string
}

const (
	podIP = "10.99.8.23"
	gwIP  = "10.99.8.1"
)

func needRoot(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces")
	}
}

func ipCmd(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func newTestbed(t *testing.T) *testbed {
	needRoot(t)
	prefix := fmt.Sprintf("pttest-discover-%06x", rand.IntN(1<<24))
	names := map[string]string{}
	for _, role := range []string{"node", "pod", "gw"} {
		name := prefix + "-" + role
		ipCmd(t, "netns", "add", name)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
		names[role] = name
		ipCmd(t, "-n", name, "link", "set", "lo", "up")
	}
	node, pod, gw := names["node"], names["pod"], names["gw"]
	ipCmd(t, "-n", node, "link", "add", "br0", "type", "bridge")
	ipCmd(t, "-n", node, "link", "add", "hv0", "type", "veth", "peer", "name", "eth0", "netns", pod)
	ipCmd(t, "-n", node, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", gw)
	for _, l := range []string{"hv0", "up0"} {
		ipCmd(t, "-n", node, "link", "set", l, "master", "br0", "up")
	}
	ipCmd(t, "-n", node, "link", "set", "br0", "up")
	ipCmd(t, "-n", pod, "addr", "add", podIP+"/22", "dev", "eth0")
	ipCmd(t, "-n", pod, "link", "set", "eth0", "up")
	ipCmd(t, "-n", pod, "route", "add", "default", "via", gwIP)
	ipCmd(t, "-n", gw, "addr", "add", gwIP+"/22", "dev", "eth0")
	ipCmd(t, "-n", gw, "link", "set", "eth0", "up")

	tb := &testbed{node: "/run/netns/" + node, pod: "/run/netns/" + pod, gw: "/run/netns/" + gw}
	tb.gwMAC = strings.Fields(strings.SplitN(ipCmd(t, "-n", gw, "-br", "link", "show", "eth0"), "\n", 2)[0])[2]
	tb.teachGateway(t)
	return tb
}

// sendDatagram sends a datagram from the netns at nsPath to port 9 (discard)
// of addr: resolving addr's MAC teaches the bridges on the way where it is.
func sendDatagram(t *testing.T, nsPath, addr string) {
	t.Helper()
	err := nsutil.Do(nsPath, func() error {
		c, err := net.Dial("udp4", addr+":9")
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("hello"))
		return err
	})
	if err != nil {
		t.Fatalf("send from %s: %v", nsPath, err)
	}
}

// teachGateway sends a datagram from the pod to its gateway: the ARP exchange
// puts the gateway MAC in the pod's neighbour table and the bridge learns it
// on up0.
func (tb *testbed) teachGateway(t *testing.T) {
	t.Helper()
	sendDatagram(t, tb.pod, gwIP)
	node, pod := filepath.Base(tb.node), filepath.Base(tb.pod)
	for range 100 {
		fdb, _ := exec.Command("bridge", "-n", node, "fdb", "show", "br", "br0").Output()
		if strings.Contains(string(fdb), tb.gwMAC+" dev up0") &&
			strings.Contains(ipCmd(t, "-n", pod, "neigh", "show", gwIP), tb.gwMAC) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("the gateway MAC %s was never learned (pod neighbour table and br0 FDB on up0)", tb.gwMAC)
}

// checkPod asserts what the testbed's pod must look like.
func (tb *testbed) checkPod(t *testing.T, info *NodeInfo, p Pod) {
	t.Helper()
	inode, err := nsutil.Inode(tb.pod)
	if err != nil {
		t.Fatal(err)
	}
	if p.NetNS.Inode != inode || p.NSName != filepath.Base(tb.pod) {
		t.Errorf("pod netns: got %+v name %q, want inode %d name %s", p.NetNS, p.NSName, inode, filepath.Base(tb.pod))
	}
	if p.Eth0.Name != "eth0" || p.Eth0.Kind != "veth" || !slices.Contains(p.Eth0.Addrs, netip.MustParsePrefix(podIP+"/22")) {
		t.Errorf("pod eth0: got %+v", p.Eth0)
	}
	if p.Gateway != netip.MustParseAddr(gwIP) || p.GatewayMAC != tb.gwMAC {
		t.Errorf("gateway: got %s %s, want %s %s", p.Gateway, p.GatewayMAC, gwIP, tb.gwMAC)
	}
	if p.HostPeer == nil || p.HostPeer.Name != "hv0" || p.HostPeer.Master != "br0" || p.HostPeer.MasterKind != "bridge" {
		t.Fatalf("host peer: got %+v, want hv0 on bridge br0", p.HostPeer)
	}
	if !slices.Equal(p.Uplinks, []string{"up0"}) || !strings.Contains(p.UplinkHow, "FDB") {
		t.Errorf("uplink: got %v (%s), want up0 from the bridge FDB", p.Uplinks, p.UplinkHow)
	}
	roles := map[string]CapturePoint{}
	for _, cp := range info.CapturePoints {
		roles[cp.Role+" "+cp.NetNS+" "+cp.Ifname] = cp
	}
	if cp, ok := roles["pod "+p.NetNS.Path+" eth0"]; !ok || cp.Ifindex != p.Eth0.Ifindex {
		t.Errorf("pod capture point: got %+v", info.CapturePoints)
	}
	if cp, ok := roles["host "+tb.node+" hv0"]; !ok || cp.Master != "br0" || cp.MasterKind != "bridge" || cp.Ifindex != p.HostPeer.Ifindex {
		t.Errorf("host capture point: got %+v", info.CapturePoints)
	}
	if cp, ok := roles["uplink "+tb.node+" up0"]; !ok || cp.Kind != "veth" || cp.Master != "br0" {
		t.Errorf("uplink capture point: got %+v", info.CapturePoints)
	}
}

func TestNodeFindsPodByIP(t *testing.T) {
	tb := newTestbed(t)
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 {
		t.Fatalf("pods: got %+v, want one", info.Pods)
	}
	tb.checkPod(t, info, info.Pods[0])
	if len(info.CapturePoints) != 3 {
		t.Errorf("capture points: got %+v, want pod, host, uplink", info.CapturePoints)
	}
	var table strings.Builder
	if err := info.Table(&table); err != nil || !strings.Contains(table.String(), "hv0") {
		t.Errorf("table: %v\n%s", err, table.String())
	}
	t.Logf("\n%s", table.String())
}

// TestUplinkHairpinMode: an uplink that is a bridge port has its hairpin
// mode read (an outside client's request the bridge would send back out
// it is dropped while it is off); another capture point has none.
func TestUplinkHairpinMode(t *testing.T) {
	tb := newTestbed(t)
	for _, on := range []bool{false, true} {
		if on {
			out, err := exec.Command("bridge", "-n", filepath.Base(tb.node), "link", "set", "dev", "up0", "hairpin", "on").CombinedOutput()
			if err != nil {
				t.Fatalf("bridge link set dev up0 hairpin on: %v: %s", err, out)
			}
		}
		info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)})
		if err != nil {
			t.Fatal(err)
		}
		for _, cp := range info.CapturePoints {
			switch {
			case cp.Role == RoleUplink && (cp.Hairpin == nil || *cp.Hairpin != on):
				t.Errorf("hairpin %v: uplink %s: got hairpin %v, want %v", on, cp.Ifname, fmtBoolPtr(cp.Hairpin), on)
			case cp.Role != RoleUplink && cp.Hairpin != nil:
				t.Errorf("hairpin %v: %s point %s: got hairpin %v, want none", on, cp.Role, cp.Ifname, *cp.Hairpin)
			}
		}
	}
}

func fmtBoolPtr(b *bool) string {
	if b == nil {
		return "nil"
	}
	return fmt.Sprint(*b)
}

func TestNodeEnumeratesPods(t *testing.T) {
	tb := newTestbed(t)
	// A second pod on the same bridge: its veth must never be taken for an uplink.
	secondPod(t, tb)

	info, err := Node(context.Background(), Options{HostNetNS: tb.node})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 2 || info.PodsSkipped != 0 {
		t.Fatalf("pods: got %d (%d skipped), want 2", len(info.Pods), info.PodsSkipped)
	}
	for _, p := range info.Pods {
		if p.NSName == filepath.Base(tb.pod) {
			tb.checkPod(t, info, p)
			continue
		}
		// pod2 never talked: no gateway MAC, the uplink is the bridge port
		// that is not a pod veth.
		if p.HostPeer == nil || p.HostPeer.Name != "hv1" || !slices.Equal(p.Uplinks, []string{"up0"}) || p.GatewayMAC != "" {
			t.Errorf("second pod: got %+v host %+v", p, p.HostPeer)
		}
	}

	bounded, err := Node(context.Background(), Options{HostNetNS: tb.node, MaxPods: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(bounded.Pods) != 1 || bounded.PodsSkipped != 1 || !slices.ContainsFunc(bounded.Notes, func(n string) bool { return strings.Contains(n, "follows at most 1 Pods") }) {
		t.Errorf("MaxPods 1: got %d pods, %d skipped, notes %q", len(bounded.Pods), bounded.PodsSkipped, bounded.Notes)
	}
	// The Pod left out is named by its host veth: the other one's.
	followed := bounded.Pods[0].HostPeer.Name
	if want := map[string]string{"hv0": "hv1", "hv1": "hv0"}[followed]; !slices.Equal(bounded.PodsSkippedVeths, []string{want}) {
		t.Errorf("MaxPods 1, %s followed: Pods left out behind %q, want %q", followed, bounded.PodsSkippedVeths, want)
	}
}

func TestNodeUsageErrors(t *testing.T) {
	tb := newTestbed(t)
	pod := netip.MustParseAddr(podIP)
	for _, tc := range []struct {
		name string
		opt  Options
	}{
		{"pod ip nobody has", Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr("10.99.99.99")}},
		{"missing pod netns", Options{HostNetNS: tb.node, PodNetNS: "/nonexistent"}},
		{"pod netns is the node", Options{HostNetNS: tb.node, PodNetNS: tb.node}},
		{"missing host netns", Options{HostNetNS: "/nonexistent"}},
		{"host netns not a netns", Options{HostNetNS: "/proc/self/ns/mnt"}},
		{"missing uplink", Options{HostNetNS: tb.node, PodIP: pod, Uplink: "nosuchif"}},
		{"uplink is the pod's host veth", Options{HostNetNS: tb.node, PodIP: pod, Uplink: "hv0"}},
		{"uplink is a pod's host veth", Options{HostNetNS: tb.node, Uplink: "hv0"}},
		{"missing host veth", Options{HostNetNS: tb.node, PodIP: pod, HostVeth: "nosuchif"}},
		{"missing cgroup", Options{HostNetNS: tb.node, PodIP: pod, Cgroup: "/nonexistent"}},
		{"two selectors", Options{HostNetNS: tb.node, PodIP: pod, PodNetNS: tb.pod}},
		{"no such pid", Options{HostNetNS: tb.node, PodPID: 1 << 30}},
	} {
		_, err := Node(context.Background(), tc.opt)
		var ue *UsageError
		if !errors.As(err, &ue) || strings.Contains(ue.Msg, "\n") {
			t.Errorf("%s: got %v (%T), want a one-line *UsageError", tc.name, err, err)
			continue
		}
		t.Logf("%s: %s", tc.name, ue.Msg)
	}
	// The overrides themselves work when the names exist.
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodNetNS: tb.pod, Uplink: "up0", HostVeth: "hv0"})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || info.Pods[0].UplinkHow != "--uplink" || info.Pods[0].HostPeer.Name != "hv0" {
		t.Errorf("overrides: got %+v", info.Pods)
	}
}

// TestUplinkIsUnselectedPodsVeth: --uplink naming the host veth of a Pod
// the selection left out is refused as the selected Pod's own is: the
// uplink would see none of the traced flows. The node's real uplink, a veth
// too (into the gateway's netns), stays accepted.
func TestUplinkIsUnselectedPodsVeth(t *testing.T) {
	tb := newTestbed(t)
	secondPod(t, tb)
	pod, pod2 := netip.MustParseAddr(podIP), netip.MustParseAddr("10.99.8.24")
	for _, opt := range []Options{
		{HostNetNS: tb.node, PodIP: pod, Uplink: "hv1"},
		{HostNetNS: tb.node, PodIP: pod2, Uplink: "hv0"},
		{HostNetNS: tb.node, HostVeth: "hv1", Uplink: "hv0"},
	} {
		_, err := Node(context.Background(), opt)
		var ue *UsageError
		if !errors.As(err, &ue) || !strings.Contains(ue.Msg, "host veth of a Pod") {
			t.Errorf("pod ip %v, host veth %q, --uplink %s: got %v, want a usage error naming a Pod's host veth", opt.PodIP, opt.HostVeth, opt.Uplink, err)
		}
	}
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: pod, Uplink: "up0"})
	if err != nil {
		t.Fatalf("--uplink up0, the node's uplink: %v", err)
	}
	if len(info.Pods) != 1 || !slices.Equal(info.Pods[0].Uplinks, []string{"up0"}) {
		t.Errorf("--uplink up0: pods %+v, want one with uplink up0", info.Pods)
	}
}

// addNATTables builds, inside the node netns, a DNAT table mixing a plain
// match-and-jump with kube-proxy's nftables shapes: a concatenated-key
// verdict map of services and a numgen verdict map of endpoints.
func (tb *testbed) addNATTables(t *testing.T) {
	t.Helper()
	ns, err := netns.GetFromPath(tb.node)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		t.Fatal(err)
	}
	tbl := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "pttest-nat"})
	chain := func(name string, hook *nftables.ChainHook) *nftables.Chain {
		ch := &nftables.Chain{Name: name, Table: tbl}
		if hook != nil {
			ch.Type, ch.Hooknum, ch.Priority = nftables.ChainTypeNAT, hook, nftables.ChainPriorityNATDest
		}
		return c.AddChain(ch)
	}
	pre := chain("prerouting", nftables.ChainHookPrerouting)
	out := chain("output", nftables.ChainHookOutput)
	services, web, dns, other := chain("services", nil), chain("svc-web", nil), chain("svc-dns", nil), chain("svc-other", nil)
	epA, epB := chain("ep-web-a", nil), chain("ep-web-b", nil)
	svcIPs := &nftables.Set{Table: tbl, Name: "service-ips", IsMap: true, Concatenation: true,
		KeyType:  nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto, nftables.TypeInetService),
		DataType: nftables.TypeVerdict}
	if err := c.AddSet(svcIPs, []nftables.SetElement{
		{Key: concatKey(ip4("10.120.0.10"), []byte{unix.IPPROTO_UDP}, port(53)), VerdictData: gotoChain("svc-dns")},
	}); err != nil {
		t.Fatal(err)
	}
	// numgen random mod 2 vmap { 0 : goto ep-web-a, 1 : goto ep-web-b }, as kube-proxy balances.
	endpoints := &nftables.Set{Table: tbl, Name: "__map%d", Anonymous: true, Constant: true, IsMap: true,
		KeyType: nftables.TypeInteger, DataType: nftables.TypeVerdict}
	if err := c.AddSet(endpoints, []nftables.SetElement{
		{Key: []byte{0, 0, 0, 0}, VerdictData: gotoChain("ep-web-a")},
		{Key: []byte{0, 0, 0, 1}, VerdictData: gotoChain("ep-web-b")},
	}); err != nil {
		t.Fatal(err)
	}
	add := func(ch *nftables.Chain, exprs ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: tbl, Chain: ch, Exprs: exprs})
	}
	add(pre, loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...), loadProto(1), cmpEq(1, unix.IPPROTO_TCP),
		loadDport(1), cmpEq(1, port(80)...), jump("svc-web"))
	add(pre, loadDaddr(1), cmpEq(1, ip4("10.120.0.99")...), jump("svc-other"))
	add(pre, jump("services"))
	add(out, jump("services"))
	add(services, loadDaddr(1), loadProto(unix.NFT_REG32_01), loadDport(unix.NFT_REG32_02),
		&expr.Lookup{SourceRegister: 1, SetName: svcIPs.Name, SetID: svcIPs.ID, IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT})
	add(web, &expr.Numgen{Register: 1, Modulus: 2, Type: unix.NFT_NG_RANDOM},
		&expr.Lookup{SourceRegister: 1, SetName: endpoints.Name, SetID: endpoints.ID, IsDestRegSet: true, DestRegister: unix.NFT_REG_VERDICT})
	add(epA, dnatTo("10.244.20.31", 3000)...)
	add(epB, dnatTo("10.244.20.32", 3000)...)
	add(dns, append([]expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_UDP)}, dnatTo("10.244.20.31", 5353)...)...)
	add(other, dnatTo("10.244.30.5", 8080)...)
	if err := c.Flush(); err != nil {
		t.Fatalf("create nftables tables in the node netns: %v", err)
	}
}

func TestNodeNetfilter(t *testing.T) {
	tb := newTestbed(t)
	tb.addNATTables(t)
	// Per-netns sysctls: set in the node netns to the opposite of the defaults.
	node := filepath.Base(tb.node)
	if out, err := exec.Command("ip", "netns", "exec", node, "sh", "-c",
		"echo 1 > /proc/sys/net/ipv4/ip_forward; [ ! -e "+bridgeNFSysctl+" ] || echo 0 > "+bridgeNFSysctl+
			"; [ ! -e "+bridgeNFVLAN+" ] || echo 1 > "+bridgeNFVLAN+
			"; [ ! -e "+udpTimeoutSysctl+" ] || { echo 45 > "+udpTimeoutSysctl+"; echo 95 > "+udpStreamSysctl+"; }").CombinedOutput(); err != nil {
		t.Fatalf("set sysctls: %v %s", err, out)
	}

	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
		Services: []netip.Addr{netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10")}})
	if err != nil {
		t.Fatal(err)
	}
	nf := info.Netfilter
	got := keys(nf.Rules)
	want := []string{
		"output 10.120.0.10 udp/53 output>services>svc-dns => 10.244.20.31:5353",
		"prerouting 10.120.0.10 udp/53 prerouting>services>svc-dns => 10.244.20.31:5353",
		"prerouting 10.120.0.80 tcp/80 prerouting>svc-web>ep-web-a => 10.244.20.31:3000",
		"prerouting 10.120.0.80 tcp/80 prerouting>svc-web>ep-web-b => 10.244.20.32:3000",
	}
	if !slices.Equal(got, want) {
		t.Errorf("nat rules:\n got %q\nwant %q", got, want)
	}
	for _, r := range nf.Rules {
		if r.Source != "nftables" || r.Table != "ip pttest-nat" {
			t.Errorf("rule %s: source %q table %q", key(r), r.Source, r.Table)
		}
	}
	// The VIPs as --svc gives them, one twice: each rule once, and only
	// those of the ports given.
	web, dns := netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10")
	for _, tc := range []struct {
		ports []ServicePort
		want  []string
	}{
		{[]ServicePort{{web, 80, "tcp"}, {web, 0, ""}, {dns, 53, "udp"}}, want},
		{[]ServicePort{{web, 80, "udp"}, {dns, 53, "udp"}, {dns, 54, "udp"}}, want[:2]},
	} {
		info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
			Services: []netip.Addr{web, web, dns}, ServicePorts: tc.ports})
		if err != nil {
			t.Fatal(err)
		}
		if got := keys(info.Netfilter.Rules); !slices.Equal(got, tc.want) {
			t.Errorf("services %v:\n got %q\nwant %q", tc.ports, got, tc.want)
		}
	}
	if nf.IPForward == nil || !*nf.IPForward {
		t.Errorf("ip_forward of the node netns: got %v, want 1", nf.IPForward)
	}
	if _, err := os.Stat(bridgeNFSysctl); err == nil && (nf.BridgeNFCallIPTables == nil || *nf.BridgeNFCallIPTables) {
		t.Errorf("bridge-nf-call-iptables of the node netns: got %v, want 0", nf.BridgeNFCallIPTables)
	}
	if _, err := os.Stat(bridgeNFVLAN); err == nil && (nf.BridgeNFFilterVLANTagged == nil || !*nf.BridgeNFFilterVLANTagged) {
		t.Errorf("bridge-nf-filter-vlan-tagged of the node netns: got %v, want 1", nf.BridgeNFFilterVLANTagged)
	}
	if fileExistsIn(t, tb.node, udpTimeoutSysctl) && (nf.UDPTimeout != 45 || nf.UDPStreamTimeout != 95) {
		t.Errorf("conntrack's UDP timeouts of the node netns: got %d, %d s, want 45, 95", nf.UDPTimeout, nf.UDPStreamTimeout)
	}
	if info.IPVS.Present != fileExistsIn(t, tb.node, ipvsFile) {
		t.Errorf("ipvs: got %+v", info.IPVS)
	}
	if fileExistsIn(t, tb.node, legacyTablesFile) {
		names := readIn(t, tb.node, legacyTablesFile)
		if strings.Contains(names, "nat") {
			t.Errorf("a legacy nat table exists in the node netns after discovery: %q", names)
		}
	}
	if !strings.HasPrefix(nf.IPTablesLegacy, "absent") {
		t.Errorf("iptables-legacy: got %q, want absent", nf.IPTablesLegacy)
	}
}

func fileExistsIn(t *testing.T, ns, file string) bool {
	t.Helper()
	var exists bool
	if err := nsutil.Do(ns, func() error { _, err := os.Stat(file); exists = err == nil; return nil }); err != nil {
		t.Fatal(err)
	}
	return exists
}

func readIn(t *testing.T, ns, file string) string {
	t.Helper()
	var b []byte
	if err := nsutil.Do(ns, func() error { var err error; b, err = os.ReadFile(file); return err }); err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestNodeLegacyIPTables(t *testing.T) {
	tb := newTestbed(t)
	if _, err := exec.LookPath("iptables-legacy"); err != nil {
		t.Skip("iptables-legacy not installed")
	}
	node := filepath.Base(tb.node)
	for _, rule := range [][]string{
		{"-N", "KUBE-SVC-PTTEST"},
		{"-A", "PREROUTING", "-d", "10.120.0.80/32", "-p", "tcp", "-m", "tcp", "--dport", "80", "-j", "KUBE-SVC-PTTEST"},
		{"-A", "KUBE-SVC-PTTEST", "-p", "tcp", "-m", "comment", "--comment", "web -> backend", "-j", "DNAT", "--to-destination", "10.244.20.31:3000"},
	} {
		ipCmd(t, append([]string{"netns", "exec", node, "iptables-legacy", "-t", "nat"}, rule...)...)
	}
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
		Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	nf := info.Netfilter
	want := []string{"prerouting 10.120.0.80 tcp/80 PREROUTING>KUBE-SVC-PTTEST => 10.244.20.31:3000"}
	if got := keys(nf.Rules); nf.IPTablesLegacy != "read" || !slices.Equal(got, want) || nf.Rules[0].Source != "iptables-legacy" {
		t.Errorf("legacy: status %q rules %q, want read and %q", nf.IPTablesLegacy, got, want)
	}

	// Without iptables-legacy-save (iptables before 1.8, CentOS 7), a
	// legacy iptables-save reads them; the nf_tables one is not used.
	multi := func(save string) string {
		bin, err := exec.LookPath(save)
		if err == nil {
			bin, err = filepath.EvalSymlinks(bin)
		}
		if err != nil {
			t.Skipf("%s: %v", save, err)
		}
		return bin
	}
	legacyMulti, nftMulti := multi("iptables-legacy-save"), multi("iptables-nft-save")
	for _, tc := range []struct {
		target string // what iptables-save is
		status string // prefix of the status
		rules  []string
	}{
		{legacyMulti, "read", want},
		{nftMulti, "not checked: legacy tables exist but iptables-legacy-save is not installed and", nil},
	} {
		dir := t.TempDir()
		if err := os.Symlink(tc.target, filepath.Join(dir, "iptables-save")); err != nil {
			t.Fatal(err)
		}
		t.Setenv("PATH", dir)
		info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
			Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
		if err != nil {
			t.Fatal(err)
		}
		nf := info.Netfilter
		if got := keys(nf.Rules); !strings.HasPrefix(nf.IPTablesLegacy, tc.status) || !slices.Equal(got, tc.rules) {
			t.Errorf("iptables-save -> %s only: status %q rules %q, want %q... and %q", tc.target, nf.IPTablesLegacy, got, tc.status, tc.rules)
		}
		t.Logf("iptables-save -> %s only: %s", tc.target, nf.IPTablesLegacy)
	}
}

// TestNodeLegacyFilterOnly: a node whose legacy iptables has a filter table
// but no nat table (kube-proxy in nftables mode beside an older tool's
// rules): a reject of a Service's connections there is read, and the nat
// table is still not created.
func TestNodeLegacyFilterOnly(t *testing.T) {
	tb := newTestbed(t)
	if _, err := exec.LookPath("iptables-legacy"); err != nil {
		t.Skip("iptables-legacy not installed")
	}
	ipCmd(t, "netns", "exec", filepath.Base(tb.node), "iptables-legacy", "-t", "filter", "-A", "OUTPUT",
		"-d", "10.120.0.80/32", "-p", "tcp", "--dport", "80", "-j", "REJECT", "--reject-with", "tcp-reset")
	if names := readIn(t, tb.node, legacyTablesFile); strings.Contains(names, "nat") {
		t.Fatalf("the legacy nat table exists before discovery: %q", names)
	}
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
		Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	nf := info.Netfilter
	var got []string
	for _, r := range nf.Rejects {
		got = append(got, rejectKey(r))
	}
	want := []string{"output 10.120.0.80 tcp/80 OUTPUT => invalid AddrPort reject "}
	if !strings.HasPrefix(nf.IPTablesLegacy, "filter read") || !slices.Equal(got, want) {
		t.Errorf("legacy filter only: status %q rejects %q, want filter read and %q", nf.IPTablesLegacy, got, want)
	}
	if names := readIn(t, tb.node, legacyTablesFile); strings.Contains(names, "nat") {
		t.Errorf("discovery created the legacy nat table: %q", names)
	}
}

// TestNodeRoutedUplink: a pod veth without master (a routed CNI); the uplink
// is the device of the node's route towards the VIP.
func TestNodeRoutedUplink(t *testing.T) {
	needRoot(t)
	prefix := fmt.Sprintf("pttest-discover-%06x", rand.IntN(1<<24))
	node, pod, gw := prefix+"-node", prefix+"-pod", prefix+"-gw"
	for _, name := range []string{node, pod, gw} {
		ipCmd(t, "netns", "add", name)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	}
	ipCmd(t, "-n", node, "link", "add", "hvr", "type", "veth", "peer", "name", "eth0", "netns", pod)
	ipCmd(t, "-n", node, "link", "add", "upr", "type", "veth", "peer", "name", "eth0", "netns", gw)
	for _, cmd := range [][]string{
		{"-n", node, "addr", "add", "10.99.9.1/24", "dev", "hvr"},
		{"-n", node, "addr", "add", "10.99.10.1/24", "dev", "upr"},
		{"-n", node, "link", "set", "hvr", "up"},
		{"-n", node, "link", "set", "upr", "up"},
		{"-n", node, "route", "add", "default", "via", "10.99.10.254"},
		{"-n", pod, "addr", "add", "10.99.9.2/24", "dev", "eth0"},
		{"-n", pod, "link", "set", "eth0", "up"},
		{"-n", pod, "route", "add", "default", "via", "10.99.9.1"},
		{"-n", gw, "addr", "add", "10.99.10.254/24", "dev", "eth0"},
		{"-n", gw, "link", "set", "eth0", "up"},
	} {
		ipCmd(t, cmd...)
	}
	info, err := Node(context.Background(), Options{HostNetNS: "/run/netns/" + node,
		Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	// The gw netns has a veth into the node too, but its default route does
	// not leave through it: not a pod.
	if len(info.Pods) != 1 || info.Pods[0].NSName != pod {
		t.Fatalf("pods: got %+v, want only %s", info.Pods, pod)
	}
	p := info.Pods[0]
	if p.HostPeer == nil || p.HostPeer.Name != "hvr" || p.HostPeer.MasterKind != "none" ||
		!slices.Equal(p.Uplinks, []string{"upr"}) || p.UplinkHow != "route to VIP 10.120.0.80" {
		t.Errorf("routed pod: got host %+v uplinks %v (%s)", p.HostPeer, p.Uplinks, p.UplinkHow)
	}
}

// nodeNS is a set of namespaces a test builds and removes (even when it
// fails), named prefix-ROLE.
type nodeNS struct {
	prefix string
}

func newNodeNS(t *testing.T, roles ...string) *nodeNS {
	t.Helper()
	needRoot(t)
	n := &nodeNS{prefix: fmt.Sprintf("pttest-discover-%06x", rand.IntN(1<<24))}
	for _, role := range roles {
		name := n.name(role)
		ipCmd(t, "netns", "add", name)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
		ipCmd(t, "-n", name, "link", "set", "lo", "up")
	}
	return n
}

func (n *nodeNS) name(role string) string { return n.prefix + "-" + role }
func (n *nodeNS) path(role string) string { return "/run/netns/" + n.name(role) }

// run runs `ip -n NETNS-OF-ROLE args...` for each command.
func (n *nodeNS) run(t *testing.T, role string, cmds ...string) {
	t.Helper()
	for _, c := range cmds {
		ipCmd(t, append([]string{"-n", n.name(role)}, strings.Fields(c)...)...)
	}
}

// addRoutedPod gives the node a Calico-style Pod: a /32 address behind a
// host veth without master or address, reached by a /32 route, the Pod's
// default route via 169.254.1.1 (answered by proxy ARP).
// addTwoUplinks gives the node up1 towards the role gw1, its default
// route, and up2 towards gw2, the default route of table 100.
func (n *nodeNS) addTwoUplinks(t *testing.T) {
	t.Helper()
	for i, gw := range []string{"gw1", "gw2"} {
		up := fmt.Sprintf("up%d", i+1)
		n.run(t, "node", "link add "+up+" type veth peer name eth0 netns "+n.name(gw),
			fmt.Sprintf("addr add 10.99.%d.1/24 dev %s", 40+i, up), "link set "+up+" up")
		n.run(t, gw, fmt.Sprintf("addr add 10.99.%d.254/24 dev eth0", 40+i), "link set eth0 up")
	}
	n.run(t, "node", "route add default via 10.99.40.254", "route add default via 10.99.41.254 table 100")
}

func (n *nodeNS) addRoutedPod(t *testing.T, role, veth, ip string) {
	t.Helper()
	n.run(t, "node", "link add "+veth+" type veth peer name eth0 netns "+n.name(role), "link set "+veth+" up",
		"route add "+ip+"/32 dev "+veth)
	n.run(t, role, "addr add "+ip+"/32 dev eth0", "link set eth0 up",
		"route add 169.254.1.1 dev eth0 scope link", "route add default via 169.254.1.1 dev eth0")
}

// addDNAT adds, in the node netns, a prerouting and output nat chain that
// translates vip:port/udp to each backend in turn (a rule per backend: every
// one is reachable as far as discovery can tell).
func addDNAT(t *testing.T, nodePath, vip string, svcPort uint16, backends ...string) {
	t.Helper()
	ns, err := netns.GetFromPath(nodePath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		t.Fatal(err)
	}
	tbl := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "pttest-dnat"})
	for _, hook := range []*nftables.ChainHook{nftables.ChainHookPrerouting, nftables.ChainHookOutput} {
		ch := c.AddChain(&nftables.Chain{Name: fmt.Sprintf("nat-%d", *hook), Table: tbl, Type: nftables.ChainTypeNAT,
			Hooknum: hook, Priority: nftables.ChainPriorityNATDest})
		for _, b := range backends {
			exprs := []expr.Any{loadDaddr(1), cmpEq(1, ip4(vip)...), loadProto(1), cmpEq(1, unix.IPPROTO_UDP),
				loadDport(1), cmpEq(1, port(svcPort)...)}
			c.AddRule(&nftables.Rule{Table: tbl, Chain: ch, Exprs: append(exprs, dnatTo(b, svcPort)...)})
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatalf("create nftables table in the node netns: %v", err)
	}
}

// TestRoutedUplinkBridgePort: the node's address on a bridge whose port up0
// leads to the gateway (the seed's node, its NIC a bridge port), a routed
// Pod: the route to the backend leaves by br0, whose taps never see what
// it switches between its ports (an outside client's request DNATed at
// PREROUTING to that backend), so the uplink is up0, the port on which
// br0 learned the gateway's MAC, with its hairpin mode.
func TestRoutedUplinkBridgePort(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", "link add br0 type bridge", "link add up0 type veth peer name eth0 netns "+n.name("gw"),
		"link set up0 master br0 up", "addr add 10.99.50.1/24 dev br0", "link set br0 up", "route add default via 10.99.50.254")
	n.run(t, "gw", "addr add 10.99.50.254/24 dev eth0", "link set eth0 up")
	n.addRoutedPod(t, "pod", "hvp", "10.99.51.2")
	addDNAT(t, n.path("node"), "10.120.0.80", 80, "10.99.60.7")
	// The node's datagram to the gateway resolves its MAC, which br0
	// learns on up0 from the answer.
	sendDatagram(t, n.path("node"), "10.99.50.254")
	gwMAC := strings.Fields(strings.SplitN(ipCmd(t, "-n", n.name("gw"), "-br", "link", "show", "eth0"), "\n", 2)[0])[2]
	for i := 0; ; i++ {
		fdb, _ := exec.Command("bridge", "-n", n.name("node"), "fdb", "show", "br", "br0").Output()
		if strings.Contains(string(fdb), gwMAC+" dev up0") && strings.Contains(ipCmd(t, "-n", n.name("node"), "neigh", "show", "10.99.50.254"), gwMAC) {
			break
		}
		if i == 100 {
			t.Fatalf("the gateway MAC %s was never learned (node neighbour table and br0 FDB on up0)", gwMAC)
		}
		time.Sleep(50 * time.Millisecond)
	}
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || !slices.Equal(info.Pods[0].Uplinks, []string{"up0"}) ||
		!strings.Contains(info.Pods[0].UplinkHow, "up0: the port of br0 on which it learned next hop 10.99.50.254's MAC "+gwMAC) {
		t.Fatalf("pods: got %+v, want one whose uplink is up0, br0's port towards the gateway", info.Pods)
	}
	upIndex := 0
	for _, cp := range info.CapturePoints {
		if cp.Role == RoleUplink && (cp.Ifname != "up0" || cp.Master != "br0" || cp.Hairpin == nil || *cp.Hairpin) {
			t.Errorf("uplink capture point %+v, want up0 on br0, hairpin off", cp)
		}
		if cp.Role == RoleUplink {
			upIndex = cp.Ifindex
		}
	}
	// The next hop's neighbour entry is br0's, where the node's address
	// is: the frames that leave by up0 go to its MAC, which names it.
	if !slices.ContainsFunc(info.UplinkNeighbors, func(ne UplinkNeighbor) bool {
		return ne.Ifindex == upIndex && ne.MAC.String() == gwMAC && slices.Equal(ne.Addrs, []netip.Addr{netip.MustParseAddr("10.99.50.254")})
	}) {
		t.Errorf("uplink neighbours %+v, want up0's (ifindex %d) MAC %s named 10.99.50.254 from br0's table", info.UplinkNeighbors, upIndex, gwMAC)
	}
}

// TestOtherPodNotRoutedUplink: on a routed node (Calico-style /32 routes to
// host veths without master), a Service backend that is another Pod of the
// node is reached through that Pod's host veth, which stays on the node:
// never an uplink, whether the Pods are all discovered or one is selected.
func TestOtherPodNotRoutedUplink(t *testing.T) {
	n := newNodeNS(t, "node", "pod1", "pod2", "gw")
	n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
		"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254")
	n.run(t, "gw", "addr add 10.99.20.254/24 dev eth0", "link set eth0 up")
	n.addRoutedPod(t, "pod1", "cali1", "10.99.21.5")
	n.addRoutedPod(t, "pod2", "cali2", "10.99.21.6")
	// Backends: pod2 on this node, and one elsewhere (via mgmt).
	addDNAT(t, n.path("node"), "10.120.0.10", 53, "10.99.21.6", "10.99.30.7")
	svcs := []netip.Addr{netip.MustParseAddr("10.120.0.10")}

	for _, opt := range []Options{
		{HostNetNS: n.path("node"), Services: svcs},
		{HostNetNS: n.path("node"), Services: svcs, PodIP: netip.MustParseAddr("10.99.21.5")},
		{HostNetNS: n.path("node"), Services: svcs, PodNetNS: n.path("pod1")},
		{HostNetNS: n.path("node"), Services: svcs, MaxPods: 1},
	} {
		info, err := Node(context.Background(), opt)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) == 0 {
			t.Fatalf("%+v: no pod found", opt)
		}
		for _, p := range info.Pods {
			if !slices.Equal(p.Uplinks, []string{"mgmt"}) {
				t.Errorf("pod %s (pod ip %v, netns %q, max %d): uplinks %v (%s), want [mgmt]",
					p.HostPeer.Name, opt.PodIP, opt.PodNetNS, opt.MaxPods, p.Uplinks, p.UplinkHow)
			}
		}
		for _, cp := range info.CapturePoints {
			if cp.Role == RoleUplink && cp.Ifname != "mgmt" {
				t.Errorf("pod ip %v, netns %q, max %d: uplink capture point %s", opt.PodIP, opt.PodNetNS, opt.MaxPods, cp.Ifname)
			}
		}
	}
}

// TestOtherPodNotBridgeUplink: on a bridge whose FDB does not hold the
// gateway MAC, the uplink is the bridge port that is not a Pod's veth:
// another Pod's veth is not one, also when a selector leaves that Pod out.
func TestOtherPodNotBridgeUplink(t *testing.T) {
	tb := newTestbed(t)
	pod2 := secondPod(t, tb)

	// pod2 never talked: no gateway MAC, so no FDB answer.
	for _, opt := range []Options{
		{HostNetNS: tb.node, PodIP: netip.MustParseAddr("10.99.8.24")},
		{HostNetNS: tb.node, PodNetNS: "/run/netns/" + pod2},
		{HostNetNS: tb.node, HostVeth: "hv1"},
	} {
		info, err := Node(context.Background(), opt)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) != 1 {
			t.Fatalf("pods: got %+v, want pod2 only", info.Pods)
		}
		if p := info.Pods[0]; p.HostPeer == nil || p.HostPeer.Name != "hv1" || !slices.Equal(p.Uplinks, []string{"up0"}) {
			t.Errorf("pod ip %v, netns %q, host veth %q: got host %+v uplinks %v (%s), want up0",
				opt.PodIP, opt.PodNetNS, opt.HostVeth, p.HostPeer, p.Uplinks, p.UplinkHow)
		}
	}
}

// TestRoutedUplinkECMP: a multipath route towards the backends (or, without
// NAT rules, the VIP) leaves through each of its next hops' devices: every
// one is an uplink.
func TestRoutedUplinkECMP(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw1", "gw2")
	for i, gw := range []string{"gw1", "gw2"} {
		up := fmt.Sprintf("up%d", i+1)
		n.run(t, "node", "link add "+up+" type veth peer name eth0 netns "+n.name(gw),
			fmt.Sprintf("addr add 10.99.%d.1/24 dev %s", 40+i, up), "link set "+up+" up")
		n.run(t, gw, fmt.Sprintf("addr add 10.99.%d.254/24 dev eth0", 40+i), "link set eth0 up")
	}
	n.run(t, "node", "route add default via 10.99.40.254",
		"route add 10.99.50.0/24 nexthop via 10.99.40.254 dev up1 nexthop via 10.99.41.254 dev up2",
		"route add 10.120.0.0/24 nexthop via 10.99.40.254 dev up1 nexthop via 10.99.41.254 dev up2")
	n.addRoutedPod(t, "pod", "cali1", "10.99.21.5")
	svcs := []netip.Addr{netip.MustParseAddr("10.120.0.10")}

	check := func(what string, want []string, wantHow string) {
		t.Helper()
		info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: svcs})
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) != 1 {
			t.Fatalf("pods: got %+v, want one", info.Pods)
		}
		p := info.Pods[0]
		if !slices.Equal(p.Uplinks, want) || !strings.Contains(p.UplinkHow, wantHow) {
			t.Errorf("%s: uplinks %v (%s), want %v (%s)", what, p.Uplinks, p.UplinkHow, want, wantHow)
		}
	}
	check("multipath route to the VIP", []string{"up1", "up2"}, "route to VIP 10.120.0.10")
	addDNAT(t, n.path("node"), "10.120.0.10", 53, "10.99.50.7")
	check("multipath route to the backend", []string{"up1", "up2"}, "route to backend 10.99.50.7")
	// More backends are named in address order, whatever the rules' order.
	addDNAT(t, n.path("node"), "10.120.0.10", 53, "10.99.50.9", "10.99.50.3", "10.99.50.12")
	check("multipath route to four backends", []string{"up1", "up2"}, "routes to 4 backends (10.99.50.3, 10.99.50.7, 10.99.50.9, ...)")
}

// flannelNode builds a flannel-style node (the Pod on cni0, which holds its
// gateway; the backend 10.244.1.5 behind the VXLAN device flannel.1 over
// ens3, the default route's device; a DNAT for 10.96.50.10:80, none for
// 10.96.50.11:80), with what more runs in its node netns, and discovers it
// tracing both VIPs.
func flannelNode(t *testing.T, more ...string) (*nodeNS, *NodeInfo) {
	t.Helper()
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", append([]string{"link add ens3 type veth peer name eth0 netns " + n.name("gw"),
		"addr add 10.99.70.1/24 dev ens3", "link set ens3 up", "route add default via 10.99.70.254",
		"link add flannel.1 type vxlan id 1 dev ens3 local 10.99.70.1 dstport 8472 nolearning",
		"addr add 10.244.0.0/32 dev flannel.1", "link set flannel.1 up",
		"route add 10.244.1.0/24 via 10.244.1.0 dev flannel.1 onlink",
		"link add cni0 type bridge", "addr add 10.244.0.1/24 dev cni0", "link set cni0 up",
		"link add vethpod type veth peer name eth0 netns " + n.name("pod"), "link set vethpod master cni0 up"}, more...)...)
	n.run(t, "gw", "addr add 10.99.70.254/24 dev eth0", "link set eth0 up")
	n.run(t, "pod", "addr add 10.244.0.5/24 dev eth0", "link set eth0 up", "route add default via 10.244.0.1")
	addDNAT(t, n.path("node"), "10.96.50.10", 80, "10.244.1.5")
	ports := []ServicePort{{Addr: netip.MustParseAddr("10.96.50.10"), Port: 80, Proto: "udp"},
		{Addr: netip.MustParseAddr("10.96.50.11"), Port: 80, Proto: "udp"}}
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), ServicePorts: ports})
	if err != nil {
		t.Fatal(err)
	}
	return n, info
}

// TestFlannelUplinkVIPWithoutRule: on a flannel-style node (the Pod on
// cni0, which holds its gateway; the backends behind the VXLAN device
// flannel.1 over ens3, the default route's device), a traced Service without
// NAT rule (kube-proxy never programmed it, or its rules went away during
// the trace) leaves unrewritten by the VIP's route: the uplinks are
// flannel.1, for the backends, and ens3, for the VIPs, each said; the node
// block names the Service without a rule, and so does the node JSON.
func TestFlannelUplinkVIPWithoutRule(t *testing.T) {
	_, info := flannelNode(t)
	if len(info.Pods) != 1 {
		t.Fatalf("pods: got %+v, want one", info.Pods)
	}
	p := info.Pods[0]
	if !slices.Equal(p.Uplinks, []string{"flannel.1", "ens3"}) ||
		!strings.Contains(p.UplinkHow, "route to backend 10.244.1.5 (flannel.1), route to VIP 10.96.50.10, 10.96.50.11 (ens3)") {
		t.Errorf("uplinks %v (%s), want flannel.1 for the backend and ens3 for the VIPs", p.Uplinks, p.UplinkHow)
	}
	var ups []string
	for _, cp := range info.CapturePoints {
		if cp.Role == RoleUplink {
			ups = append(ups, cp.Ifname)
		}
	}
	if !slices.Equal(ups, []string{"flannel.1", "ens3"}) {
		t.Errorf("uplink capture points %v, want flannel.1 and ens3", ups)
	}
	var b strings.Builder
	if err := info.Table(&b); err != nil {
		t.Fatal(err)
	}
	if table := strings.Join(strings.Fields(b.String()), " "); !strings.Contains(table, "netfilter no DNAT rule for 10.96.50.11:80/udp") {
		t.Errorf("the node block does not name the Service without a rule:\n%s", b.String())
	}
	js, err := json.Marshal(info)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"services_without_nat":["10.96.50.11:80/udp"]`) {
		t.Errorf("node JSON lacks services_without_nat [10.96.50.11:80/udp]: %s", js)
	}
}

// TestSourceRoutedUplink: a node routing its Pods by source (AWS VPC CNI's
// `ip rule from POD lookup N` for Pods on a secondary interface) sends their
// packets out of that table's device: the uplink is looked up per Pod, as
// the kernel forwards the Pod's packets (from its address, in on its host
// veth, or on the bridge holding its gateway), strict reverse-path
// filtering on. The node's own traffic keeps its route, captured too.
func TestSourceRoutedUplink(t *testing.T) {
	n := newNodeNS(t, "node", "pod1", "pod2", "pod3", "gw1", "gw2")
	n.addTwoUplinks(t)
	// pod1 is routed by source through up2; pod2 is not.
	n.addRoutedPod(t, "pod1", "eni1", "10.99.21.5")
	n.addRoutedPod(t, "pod2", "eni2", "10.99.21.6")
	n.run(t, "node", "rule add to 10.99.21.5 lookup main priority 512", "rule add from 10.99.21.5 lookup 100 priority 1536")
	// pod3 sits on a bridge holding its gateway, routed by source through up2.
	n.run(t, "node", "link add cni0 type bridge", "addr add 10.99.60.1/24 dev cni0", "link set cni0 up",
		"link add veth3 type veth peer name eth0 netns "+n.name("pod3"), "link set veth3 master cni0 up",
		"rule add from 10.99.60.5 lookup 100 priority 1536")
	n.run(t, "pod3", "addr add 10.99.60.5/24 dev eth0", "link set eth0 up", "route add default via 10.99.60.1")
	if out, err := exec.Command("ip", "netns", "exec", n.name("node"), "sysctl", "-qw",
		"net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=1").CombinedOutput(); err != nil {
		t.Fatalf("sysctl: %v %s", err, out)
	}
	svcs := []netip.Addr{netip.MustParseAddr("10.120.0.10")}
	want := map[string]string{"eni1": "up2", "eni2": "up1", "veth3": "up2"}

	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: svcs})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 3 {
		t.Fatalf("pods: got %d, want 3", len(info.Pods))
	}
	for _, p := range info.Pods {
		t.Logf("%s: %v (%s)", p.HostPeer.Name, p.Uplinks, p.UplinkHow)
		if w := want[p.HostPeer.Name]; !slices.Equal(p.Uplinks, []string{w}) {
			t.Errorf("pod behind %s: uplinks %v (%s), want [%s]", p.HostPeer.Name, p.Uplinks, p.UplinkHow, w)
		}
	}
	// pod1 alone: its table's up2, and up1 for the node's own traffic.
	info, err = Node(context.Background(), Options{HostNetNS: n.path("node"), Services: svcs, PodIP: netip.MustParseAddr("10.99.21.5")})
	if err != nil {
		t.Fatal(err)
	}
	if p := info.Pods[0]; !slices.Equal(p.Uplinks, []string{"up2"}) {
		t.Errorf("pod1 selected: uplinks %v (%s), want [up2]", p.Uplinks, p.UplinkHow)
	}
	var ups []string
	for _, cp := range info.CapturePoints {
		if cp.Role == RoleUplink {
			ups = append(ups, cp.Ifname)
		}
	}
	t.Logf("pod1 selected: %v (%s); notes %q", info.Pods[0].Uplinks, info.Pods[0].UplinkHow, info.Notes)
	if !slices.Equal(ups, []string{"up2", "up1"}) || !slices.ContainsFunc(info.Notes, func(s string) bool { return strings.Contains(s, "node's own traffic") }) {
		t.Errorf("pod1 selected: uplink capture points %v, notes %q; want up2, then up1 for the node's own traffic", ups, info.Notes)
	}
}

// TestNodePortRulesOnNode: a NodePort traced as NODE-IP:PORT is found by
// the node's rules as kube-proxy writes them with iptables-legacy,
// iptables-nft (an xtables addrtype match) and nft (`fib daddr type
// local`); the node's address is told local from its routes.
func TestNodePortRulesOnNode(t *testing.T) {
	for _, tool := range []string{"iptables-legacy", "iptables-nft", "nft"} {
		t.Run(tool, func(t *testing.T) {
			if _, err := exec.LookPath(tool); err != nil {
				t.Skipf("%s is not installed", tool)
			}
			n := newNodeNS(t, "node", "pod", "gw")
			n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
				"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254")
			n.addRoutedPod(t, "pod", "cali1", "10.99.21.5")
			if tool == "nft" {
				rules := `table ip pttest-kp {
	chain services {
		fib daddr type local tcp dport 30080 goto svc
	}
	chain svc {
		meta l4proto tcp dnat to 10.99.30.7:8080
	}
	chain pre {
		type nat hook prerouting priority dstnat; policy accept;
		jump services
	}
}
`
				cmd := exec.Command("ip", "netns", "exec", n.name("node"), "nft", "-f", "-")
				cmd.Stdin = strings.NewReader(rules)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("nft: %v: %s", err, out)
				}
			} else {
				for _, rule := range []string{
					"-N KUBE-SERVICES", "-N KUBE-NODEPORTS", "-N KUBE-SVC-PTTEST",
					"-A PREROUTING -j KUBE-SERVICES",
					"-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
					"-A KUBE-NODEPORTS -p tcp -m tcp --dport 30080 -j KUBE-SVC-PTTEST",
					"-A KUBE-NODEPORTS -p tcp -m tcp --dport 30081 -j DNAT --to-destination 10.99.30.9:8080",
					"-A KUBE-SVC-PTTEST -p tcp -j DNAT --to-destination 10.99.30.7:8080",
				} {
					ipCmd(t, append([]string{"netns", "exec", n.name("node"), tool, "-t", "nat"}, strings.Fields(rule)...)...)
				}
			}
			info, err := Node(context.Background(), Options{HostNetNS: n.path("node"),
				ServicePorts: []ServicePort{{Addr: netip.MustParseAddr("10.99.20.1"), Port: 30080, Proto: "tcp"}}})
			if err != nil {
				t.Fatal(err)
			}
			var backends []string
			for _, r := range info.Netfilter.Rules {
				backends = append(backends, fmt.Sprintf("%s %s:%d => %s", r.Hook, r.Service, r.Port, r.Backend))
			}
			if want := []string{"prerouting 10.99.20.1:30080 => 10.99.30.7:8080"}; !slices.Equal(backends, want) {
				t.Errorf("rules %q, want %q", backends, want)
			}
		})
	}
}

// secondPod adds a Pod netns on the testbed's bridge (host veth hv1,
// 10.99.8.24/22, default route via the gateway) and returns its name.
func secondPod(t *testing.T, tb *testbed) string {
	t.Helper()
	pod2 := filepath.Base(tb.pod) + "2"
	bridgedPod(t, tb, pod2, "hv1", "10.99.8.24/22")
	return pod2
}

// bridgedPod makes a Pod of the testbed: the netns name, removed at the
// test's end, with its eth0 at addr behind the node's veth on br0, made with
// linkArgs too ("index", "N" to give it that ifindex).
func bridgedPod(t *testing.T, tb *testbed, name, veth, addr string, linkArgs ...string) {
	t.Helper()
	ipCmd(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	node := filepath.Base(tb.node)
	ipCmd(t, append(append([]string{"-n", node, "link", "add", veth}, linkArgs...), "type", "veth", "peer", "name", "eth0", "netns", name)...)
	ipCmd(t, "-n", node, "link", "set", veth, "master", "br0", "up")
	ipCmd(t, "-n", name, "addr", "add", addr, "dev", "eth0")
	ipCmd(t, "-n", name, "link", "set", "eth0", "up")
	ipCmd(t, "-n", name, "route", "add", "default", "via", gwIP)
}

// TestNodeAddressWithoutPort: an address the node's own connections leave
// from (its subnet route's source) traced without a port would make every
// reply to the node's connections a flow of its own: a usage error naming
// the NodePort form. With a port it is a NodePort; a VIP on a dummy /32
// (NodeLocal DNSCache's; here on lo: no dummy module) is fine without one.
func TestNodeAddressWithoutPort(t *testing.T) {
	n := newNodeNS(t, "node", "gw")
	n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
		"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254",
		"addr add 169.254.25.10/32 dev lo")
	node, cache := netip.MustParseAddr("10.99.20.1"), netip.MustParseAddr("169.254.25.10")
	_, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{node}})
	var ue *UsageError
	if !errors.As(err, &ue) || !strings.Contains(ue.Msg, "--svc 10.99.20.1:PORT") || strings.Contains(ue.Msg, "\n") {
		t.Errorf("the node's address without a port: got %v, want a one-line usage error naming --svc 10.99.20.1:PORT", err)
	}
	for name, opt := range map[string]Options{
		"NodePort":           {HostNetNS: n.path("node"), ServicePorts: []ServicePort{{Addr: node, Port: 30080, Proto: "tcp"}}},
		"local VIP, no port": {HostNetNS: n.path("node"), Services: []netip.Addr{cache}},
	} {
		if _, err := Node(context.Background(), opt); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestUplinkIsUnselectedNetkitPod: --uplink naming the netkit primary of a
// Pod the selection left out (Cilium's datapathMode=netkit) is refused as a
// veth's is: its peer's netns routes its default route through it. This
// kernel may lack netkit devices: the Pod's pair is a veth, its node end
// read back as the netkit primary it stands for (same attributes: peer
// ifindex, peer netns id).
func TestUplinkIsUnselectedNetkitPod(t *testing.T) {
	n := newNodeNS(t, "node", "pod")
	n.addRoutedPod(t, "pod", "lxc0123456789a", "10.99.21.7")
	host, err := openHost(n.path("node"))
	if err != nil {
		t.Fatal(err)
	}
	defer host.close()
	l, err := host.linkByName("lxc0123456789a")
	if err != nil {
		t.Fatal(err)
	}
	nk := &netlink.Netkit{LinkAttrs: *l.Attrs(), Mode: netlink.NETKIT_MODE_L3}
	host.links[nk.Index] = nk
	if !isVeth(nk) || nk.NetNsID < 0 {
		t.Fatalf("the stand-in netkit is no pair into another netns: %+v", nk.Attrs())
	}
	err = notPodVeth(context.Background(), host, Options{Uplink: nk.Name}, nk)
	var ue *UsageError
	if !errors.As(err, &ue) || !strings.Contains(ue.Msg, "host veth of a Pod") {
		t.Errorf("--uplink %s, a Pod's netkit primary: got %v, want a usage error naming a Pod's host veth", nk.Name, err)
	}
	// Its veth is refused (the check works on this node).
	if err := notPodVeth(context.Background(), host, Options{Uplink: l.Attrs().Name}, l); !errors.As(err, &ue) {
		t.Errorf("--uplink %s, a Pod's veth: got %v, want a usage error", l.Attrs().Name, err)
	}
}

// TestKubeProxy120MarkDropOnNode: kube-proxy 1.20's rules, restored with
// iptables-legacy-restore and iptables-nft-restore, drop an outside client
// of a NodePort of an externalTrafficPolicy: Local Service without a local
// endpoint through KUBE-MARK-DROP at NAT and KUBE-FIREWALL at input: that
// drop is read from either backend, with the Service's comment.
func TestKubeProxy120MarkDropOnNode(t *testing.T) {
	for _, tool := range []string{"iptables-legacy", "iptables-nft"} {
		t.Run(tool, func(t *testing.T) {
			if _, err := exec.LookPath(tool + "-restore"); err != nil {
				t.Skipf("%s-restore is not installed", tool)
			}
			n := newNodeNS(t, "node", "pod", "gw")
			n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
				"addr add 192.168.1.10/24 dev mgmt", "link set mgmt up", "route add default via 192.168.1.254")
			n.addRoutedPod(t, "pod", "cali1", "10.244.0.5")
			rules, err := os.Open("testdata/iptables-save-kube-proxy-1.20.txt")
			if err != nil {
				t.Fatal(err)
			}
			defer rules.Close()
			cmd := exec.Command("ip", "netns", "exec", n.name("node"), tool+"-restore")
			cmd.Stdin = rules
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("%s-restore: %v: %s", tool, err, out)
			}
			info, err := Node(context.Background(), Options{HostNetNS: n.path("node"),
				ServicePorts: []ServicePort{{Addr: netip.MustParseAddr("192.168.1.10"), Port: 30081, Proto: "tcp"}}})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range info.Netfilter.Rejects {
				got = append(got, fmt.Sprintf("%s %s:%d %s %s %q%s", r.Hook, r.Service, r.Port, strings.Join(r.Chains, ">"), r.Verdict, r.Comment, r.fromString()))
			}
			slices.Sort(got)
			want := []string{
				`input 192.168.1.10:30081 PREROUTING>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-XLB-LOCALXXXXXXXXXXX>KUBE-MARK-DROP>INPUT>KUBE-FIREWALL drop "default/local:http has no local endpoints" from not 10.244.0.0/16 and not local`,
				`output 192.168.1.10:30081 OUTPUT>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-XLB-LOCALXXXXXXXXXXX>KUBE-MARK-DROP>OUTPUT>KUBE-FIREWALL drop "default/local:http has no local endpoints" from not 10.244.0.0/16 and not local`,
			}
			if !slices.Equal(got, want) {
				t.Errorf("rejects:\n got %q\nwant %q", got, want)
			}
		})
	}
}
