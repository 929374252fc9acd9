package discover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

func hasNote(info *NodeInfo, parts ...string) bool {
	return slices.ContainsFunc(info.Notes, func(n string) bool {
		for _, p := range parts {
			if !strings.Contains(n, p) {
				return false
			}
		}
		return true
	})
}

// TestHostVethChecked: --host-veth names a Pod's veth, else discovery says
// what is wrong in one line: not a veth (lo, a bridge), a veth within the
// node, or the veth towards the gateway (the netns behind it is no Pod),
// whichever Pod is selected.
func TestHostVethChecked(t *testing.T) {
	tb := newTestbed(t)
	node := filepath.Base(tb.node)
	ipCmd(t, "-n", node, "link", "add", "pair0", "type", "veth", "peer", "name", "pair1")
	svcs := []netip.Addr{netip.MustParseAddr("10.120.0.80")}
	for _, tc := range []struct {
		opt  Options
		want string
	}{
		{Options{HostNetNS: tb.node, HostVeth: "lo"}, "a loopback link, not a veth"},
		{Options{HostNetNS: tb.node, HostVeth: "br0"}, "a bridge link, not a veth"},
		{Options{HostNetNS: tb.node, HostVeth: "pair0"}, "in the node netns too"},
		{Options{HostNetNS: tb.node, HostVeth: "up0"}, "not a Pod's veth: the netns behind it, " + tb.gw},
		{Options{HostNetNS: tb.node, HostVeth: "up0", Services: svcs}, "no VIP through up0"},
		{Options{HostNetNS: tb.node, HostVeth: "up0", PodNetNS: tb.pod}, "not a Pod's veth"},
		{Options{HostNetNS: tb.node, HostVeth: "up0", PodIP: netip.MustParseAddr(podIP)}, "not a Pod's veth"},
	} {
		info, err := Node(context.Background(), tc.opt)
		var ue *UsageError
		if !errors.As(err, &ue) || strings.Contains(ue.Msg, "\n") || !strings.Contains(ue.Msg, tc.want) || !strings.Contains(ue.Msg, "--host-veth") {
			var pods []Pod
			if info != nil {
				pods = info.Pods
			}
			t.Errorf("--host-veth %s (pod netns %q, pod ip %v): got %v (%T) pods %+v, want a one-line usage error saying %q",
				tc.opt.HostVeth, tc.opt.PodNetNS, tc.opt.PodIP, err, err, pods, tc.want)
			continue
		}
		t.Logf("%s: %s", tc.opt.HostVeth, ue.Msg)
	}

	// A veth whose peer is in a netns no process nor /run/netns name holds:
	// captured on the node side only, as before.
	hidden := node + "-hidden"
	ipCmd(t, "netns", "add", hidden)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", hidden).Run() })
	ipCmd(t, "-n", node, "link", "add", "hvh", "type", "veth", "peer", "name", "eth0", "netns", hidden)
	f, err := os.Open("/run/netns/" + hidden) // keeps it alive unnamed
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ipCmd(t, "netns", "del", hidden)
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, HostVeth: "hvh"})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "hvh" || !hasNote(info, "no pod netns found behind it") {
		t.Errorf("veth to an unnamed netns: pods %+v notes %q, want its node side only", info.Pods, info.Notes)
	}
}

// TestPodOfAnotherNode: a Pod whose veth leads into another netns than the
// node's (pathtrace on a kind host without --host-netns) is told to give
// --host-netns with the netns holding the peer.
func TestPodOfAnotherNode(t *testing.T) {
	n := newNodeNS(t, "node", "kind", "pod")
	n.run(t, "kind", "link add hvk type veth peer name eth0 netns "+n.name("pod"), "link set hvk up",
		"route add 10.99.21.5/32 dev hvk")
	n.run(t, "pod", "addr add 10.99.21.5/32 dev eth0", "link set eth0 up",
		"route add 169.254.1.1 dev eth0 scope link", "route add default via 169.254.1.1 dev eth0")
	for _, opt := range []Options{
		{HostNetNS: n.path("node"), PodNetNS: n.path("pod")},
		{HostNetNS: n.path("node"), PodIP: netip.MustParseAddr("10.99.21.5")},
	} {
		info, err := Node(context.Background(), opt)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) != 1 || info.Pods[0].HostPeer != nil {
			t.Fatalf("pods: got %+v, want the pod without host peer", info.Pods)
		}
		if !hasNote(info, n.path("pod"), "--host-netns "+n.path("kind")) || hasNote(info, "--host-veth") {
			t.Errorf("pod netns %q, pod ip %v: notes %q, want --host-netns %s", opt.PodNetNS, opt.PodIP, info.Notes, n.path("kind"))
		}
		t.Logf("%q", info.Notes)
	}
}

// TestPodNetNSNotAPod: a --pod-netns (or --pod-pid) of the node netns
// itself, or of a netns with neither a veth into the node nor a default
// route, selects no Pod: refused in one line that names the flag, says
// why, and how to select a Pod. The second was a runtime error (exit 1).
func TestPodNetNSNotAPod(t *testing.T) {
	n := newNodeNS(t, "node", "lone")
	// A process of the lone netns (ip netns exec execs sleep: same PID).
	sleeper := exec.Command("ip", "netns", "exec", n.name("lone"), "sleep", "30")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })
	pid := sleeper.Process.Pid
	lone, err := nsutil.Inode(n.path("lone"))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if in, _ := nsutil.Inode(fmt.Sprintf("/proc/%d/ns/net", pid)); in == lone {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sleeper never joined the lone netns")
		}
	}
	for _, c := range []struct {
		opt  Options
		flag string
		why  string
	}{
		{Options{HostNetNS: n.path("node"), PodNetNS: n.path("node")}, "--pod-netns " + n.path("node"), "is the node netns itself"},
		{Options{HostNetNS: n.path("node"), PodNetNS: n.path("lone")}, "--pod-netns " + n.path("lone"), "no default route and no veth into the node netns"},
		{Options{HostNetNS: n.path("node"), PodPID: pid}, "--pod-pid " + strconv.Itoa(pid), "no default route and no veth into the node netns"},
	} {
		_, err := Node(context.Background(), c.opt)
		var ue *UsageError
		if !errors.As(err, &ue) || strings.Contains(ue.Msg, "\n") ||
			!strings.HasPrefix(ue.Msg, c.flag) || !strings.Contains(ue.Msg, c.why) || !strings.Contains(ue.Msg, "give its --pod-ip") {
			t.Errorf("%s: got %v (%T), want a one-line *UsageError saying %q and how to select a Pod", c.flag, err, err, c.why)
		}
	}
}

// TestPodDefaultRouteElsewhere: a Pod whose default route leaves through
// another interface (Multus's net1) but which routes the VIPs through its
// veth into the node is a Pod of the node; one that routes neither is not,
// and a note names it. A netns behind the node's own default route (its
// upstream) is no Pod either, and not noted.
func TestPodDefaultRouteElsewhere(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "ext", "gw", "wan")
	n.run(t, "node", "link add hvm type veth peer name eth0 netns "+n.name("pod"), "link set hvm up",
		"route add 10.99.21.5/32 dev hvm")
	n.run(t, "pod", "addr add 10.99.21.5/32 dev eth0", "link set eth0 up",
		"route add 169.254.1.1 dev eth0 scope link", "route add 10.120.0.0/16 via 169.254.1.1 dev eth0",
		"link add net1 type veth peer name eth0 netns "+n.name("ext"), "addr add 192.168.50.5/24 dev net1",
		"link set net1 up", "route add default via 192.168.50.1 dev net1")
	// The node's upstream: a gateway with its own default route elsewhere.
	n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
		"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254")
	n.run(t, "gw", "addr add 10.99.20.254/24 dev eth0", "link set eth0 up",
		"link add wan type veth peer name eth0 netns "+n.name("wan"), "addr add 192.168.60.1/24 dev wan",
		"link set wan up", "route add default via 192.168.60.254 dev wan")
	upstream := func(info *NodeInfo) {
		t.Helper()
		if hasNote(info, n.path("gw")) {
			t.Errorf("the node's upstream gateway is noted: %q", info.Notes)
		}
	}

	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "hvm" ||
		info.Pods[0].Gateway != netip.MustParseAddr("169.254.1.1") {
		t.Fatalf("VIP routed through eth0: pods %+v, want the pod behind hvm, gateway 169.254.1.1", info.Pods)
	}
	upstream(info)

	for _, svcs := range [][]netip.Addr{nil, {netip.MustParseAddr("10.130.0.1")}} {
		info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: svcs})
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) != 0 || !hasNote(info, n.path("pod"), "not taken for a Pod", "net1", "hvm") {
			t.Errorf("services %v: pods %+v notes %q, want none and a note on %s", svcs, info.Pods, info.Notes, n.path("pod"))
		}
		upstream(info)
		t.Logf("services %v: %q", svcs, info.Notes)
	}
}

// TestPodTwoVethsIntoNode: a Pod with two veths into the node (a Multus
// net1 on a node bridge) whose default route is on net1 but whose route to
// the VIPs leaves through eth0 is captured on eth0 and its host veth,
// where its Service traffic goes, not on the default route's veth.
func TestPodTwoVethsIntoNode(t *testing.T) {
	n := newNodeNS(t, "node", "pod")
	n.run(t, "node", "link add hve type veth peer name eth0 netns "+n.name("pod"), "link set hve up",
		"route add 10.99.21.5/32 dev hve",
		"link add hvn type veth peer name net1 netns "+n.name("pod"), "link set hvn up",
		"addr add 192.168.50.1/24 dev hvn")
	n.run(t, "pod", "addr add 10.99.21.5/32 dev eth0", "link set eth0 up",
		"route add 169.254.1.1 dev eth0 scope link", "route add 10.120.0.0/16 via 169.254.1.1 dev eth0",
		"addr add 192.168.50.5/24 dev net1", "link set net1 up", "route add default via 192.168.50.1 dev net1")
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || info.Pods[0].Eth0.Name != "eth0" || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "hve" {
		t.Fatalf("pods %+v, want one, on eth0 and its host veth hve (the VIPs' route), not net1", info.Pods)
	}
}

// TestIPv6OnlyPodNoted: a netns whose veth into the node has no IPv4
// address is no Pod pathtrace can trace, and a note says why instead of
// leaving it out unsaid.
func TestIPv6OnlyPodNoted(t *testing.T) {
	n := newNodeNS(t, "node", "pod")
	n.run(t, "node", "link add hv6 type veth peer name eth0 netns "+n.name("pod"), "link set hv6 up")
	n.run(t, "pod", "link set eth0 up", "-6 addr add fd00:99::5/64 dev eth0 nodad", "-6 route add default via fd00:99::1 dev eth0")
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 0 || !hasNote(info, n.path("pod"), "no IPv4 address", "IPv6-only") {
		t.Errorf("pods %+v notes %q; want none and a note on the IPv6-only netns", info.Pods, info.Notes)
	}
}

// TestFlowBasedTunnelUplink: a flow-based VXLAN device (Cilium's
// cilium_vxlan in tunnel mode) is on no route, its tc programs redirect
// encapsulated Pod traffic to it: a routed Pod's uplinks include it, next
// to the device of its routes, and it is a capture point; one that is down
// is not.
func TestFlowBasedTunnelUplink(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
		"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254",
		"link add ptvx type vxlan external dstport 8472", "link set ptvx up",
		"link add ptvxdown type vxlan external dstport 8473")
	n.addRoutedPod(t, "pod", "cali1", "10.99.21.5")
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.10")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || !slices.Equal(info.Pods[0].Uplinks, []string{"mgmt", "ptvx"}) {
		t.Fatalf("pods %+v, want one whose uplinks are mgmt and ptvx", info.Pods)
	}
	if !strings.Contains(info.Pods[0].UplinkHow, "flow-based tunnel") {
		t.Errorf("uplink_how %q does not say why ptvx", info.Pods[0].UplinkHow)
	}
	var uplinks []string
	for _, cp := range info.CapturePoints {
		if cp.Role == RoleUplink {
			uplinks = append(uplinks, cp.Ifname)
		}
	}
	if !slices.Equal(uplinks, []string{"mgmt", "ptvx"}) {
		t.Errorf("uplink capture points %v, want mgmt and ptvx", uplinks)
	}
}

// TestUpstreamRoutesVIPsToNode: the node's upstream router learned the
// Service range (or the node's own address, for a NodePort) through the
// node, as it does where Calico, kube-router or MetalLB advertise Service
// IPs over BGP. Its route to the VIP leaves through its veth into the node,
// yet it is the netns the node's default route leads to: no Pod, and the
// node's side of that veth stays the uplink, whether the Pods are all
// discovered or one is selected.
func TestUpstreamRoutesVIPsToNode(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", "link add mgmt type veth peer name eth0 netns "+n.name("gw"),
		"addr add 10.99.20.1/24 dev mgmt", "link set mgmt up", "route add default via 10.99.20.254")
	n.run(t, "gw", "addr add 10.99.20.254/24 dev eth0", "link set eth0 up",
		"route add 10.120.0.0/16 via 10.99.20.1")
	n.addRoutedPod(t, "pod", "cali1", "10.99.21.5")
	addDNAT(t, n.path("node"), "10.120.0.10", 53, "10.99.30.7")

	for _, vip := range []string{"10.120.0.10", "10.99.20.1"} {
		// The node's own address is traced as a NodePort, with its port
		// (without one it is a usage error: TestNodeAddressWithoutPort).
		svcs, ports := []netip.Addr{netip.MustParseAddr(vip)}, []ServicePort(nil)
		if vip == "10.99.20.1" {
			svcs, ports = nil, []ServicePort{{Addr: netip.MustParseAddr(vip), Port: 30053, Proto: "udp"}}
		}
		for _, opt := range []Options{
			{HostNetNS: n.path("node"), Services: svcs, ServicePorts: ports},
			{HostNetNS: n.path("node"), Services: svcs, ServicePorts: ports, PodIP: netip.MustParseAddr("10.99.21.5")},
		} {
			info, err := Node(context.Background(), opt)
			if err != nil {
				t.Fatal(err)
			}
			if len(info.Pods) != 1 || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "cali1" {
				t.Fatalf("VIP %s, pod ip %v: pods %+v, want only the Pod behind cali1", vip, opt.PodIP, info.Pods)
			}
			if p := info.Pods[0]; !slices.Equal(p.Uplinks, []string{"mgmt"}) {
				t.Errorf("VIP %s, pod ip %v: uplinks %v (%s), want [mgmt]", vip, opt.PodIP, p.Uplinks, p.UplinkHow)
			}
			for _, cp := range info.CapturePoints {
				if cp.Ifname == "mgmt" && cp.Role != RoleUplink {
					t.Errorf("VIP %s, pod ip %v: mgmt is a %s capture point, want the uplink only", vip, opt.PodIP, cp.Role)
				}
			}
		}
	}
}

// TestPodWatch: a Pod that starts after discovery is found by the next look
// once its netns routes through its veth, also when the first look came
// while the CNI had created the veth but not yet configured the netns; a
// look finds each Pod once; a Pod selector turns the watch off.
func TestPodWatch(t *testing.T) {
	tb := newTestbed(t)
	node := filepath.Base(tb.node)
	opt := Options{HostNetNS: tb.node}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	if w := NewPodWatch(info, Options{HostNetNS: tb.node, PodNetNS: tb.pod}); w != nil {
		t.Error("a watch with a Pod selector")
	}
	w := NewPodWatch(info, opt)
	t0 := time.Now()
	if found, err := w.Look(context.Background(), t0); err != nil || len(found.Pods) != 0 {
		t.Fatalf("look on an unchanged node: %+v, %v", found, err)
	}
	late := node + "-late"
	ipCmd(t, "netns", "add", late)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", late).Run() })
	ipCmd(t, "-n", node, "link", "add", "hv9", "type", "veth", "peer", "name", "eth0", "netns", late)
	ipCmd(t, "-n", node, "link", "set", "hv9", "master", "br0", "up")
	// The CNI has not configured the Pod's netns yet.
	if found, err := w.Look(context.Background(), t0.Add(2*time.Second)); err != nil || len(found.Pods) != 0 {
		t.Fatalf("look before the netns routes through its veth: %+v, %v", found, err)
	}
	ipCmd(t, "-n", late, "addr", "add", "10.99.8.99/22", "dev", "eth0")
	ipCmd(t, "-n", late, "link", "set", "eth0", "up")
	ipCmd(t, "-n", late, "route", "add", "default", "via", gwIP)
	listings := netnsListings.Load()
	found, err := w.Look(context.Background(), t0.Add(4*time.Second))
	if err != nil || len(found.Pods) != 1 || found.Pods[0].NetNS.Path != "/run/netns/"+late {
		t.Fatalf("look after the Pod's netns was set up: %+v, %v", found.Pods, err)
	}
	// The netns behind hv9 was found by the look before: looked into
	// again, without listing every process's.
	if n := netnsListings.Load() - listings; n != 0 {
		t.Errorf("the look behind a veth already looked behind listed the netns %d times", n)
	}
	var roles []string
	for _, cp := range found.CapturePoints {
		roles = append(roles, cp.Role+":"+cp.Ifname)
	}
	if !slices.Equal(roles, []string{RolePod + ":eth0", RoleHost + ":hv9"}) {
		t.Errorf("capture points of the new Pod %v, want its eth0 and host veth", roles)
	}
	if found, err := w.Look(context.Background(), t0.Add(6*time.Second)); err != nil || len(found.Pods) != 0 {
		t.Errorf("the next look found %+v, %v; want nothing new", found.Pods, err)
	}
}

// TestPodWatchSetUpAtDiscovery: a Pod whose veth was there at discovery but
// whose netns its CNI had not set up yet (the trace started during a
// rollout) is found once it is; the node's veth to its gateway is looked
// behind for vethSettle, then no more.
func TestPodWatchSetUpAtDiscovery(t *testing.T) {
	tb := newTestbed(t)
	node := filepath.Base(tb.node)
	late := node + "-late"
	ipCmd(t, "netns", "add", late)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", late).Run() })
	ipCmd(t, "-n", node, "link", "add", "hv9", "type", "veth", "peer", "name", "eth0", "netns", late)
	ipCmd(t, "-n", node, "link", "set", "hv9", "master", "br0", "up")
	opt := Options{HostNetNS: tb.node}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 {
		t.Fatalf("discovery found %d Pods, want the testbed's only", len(info.Pods))
	}
	w := NewPodWatch(info, opt)
	t0 := time.Now()
	ipCmd(t, "-n", late, "addr", "add", "10.99.8.99/22", "dev", "eth0")
	ipCmd(t, "-n", late, "link", "set", "eth0", "up")
	ipCmd(t, "-n", late, "route", "add", "default", "via", gwIP)
	listings := netnsListings.Load()
	found, err := w.Look(context.Background(), t0)
	if err != nil || len(found.Pods) != 1 || found.Pods[0].NetNS.Path != "/run/netns/"+late {
		t.Fatalf("look once the Pod's netns was set up: %+v, %v; want the Pod behind hv9", found.Pods, err)
	}
	// Discovery found the netns behind hv9 and the gateway's veth: the
	// look went into them without listing every process's netns.
	if n := netnsListings.Load() - listings; n != 0 {
		t.Errorf("the first look listed the netns %d times", n)
	}
	w.Look(context.Background(), t0.Add(vethSettle+time.Second))
	if len(w.pending) != 0 {
		t.Errorf("veths still looked behind after %s: %v", vethSettle, w.pending)
	}
}

// TestPodWatchBound: once the bound on Pods is reached, a new veth is not
// looked behind, and counted once as left out.
func TestPodWatchBound(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node, MaxPods: 1}
	w := podWatchOn(t, opt)
	secondPod(t, tb)
	t0 := time.Now()
	skipped := 0
	for i := range 3 {
		found, err := w.Look(context.Background(), t0.Add(time.Duration(i)*2*time.Second))
		if err != nil || len(found.Pods) != 0 {
			t.Fatalf("look %d: %+v, %v; want no Pod beyond the bound", i, found.Pods, err)
		}
		skipped += found.Skipped
	}
	if skipped != 1 {
		t.Errorf("3 looks counted %d netns left out, want the new Pod's once", skipped)
	}
}

// TestPodWatchNetNSReused: a Pod deleted and another one made later whose
// netns the kernel gave the deleted one's inode (it gives the lowest free)
// is a new Pod, not the first one's second veth.
func TestPodWatchNetNSReused(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node}
	w := podWatchOn(t, opt)
	pod2 := secondPod(t, tb)
	t0 := time.Now()
	found, err := w.Look(context.Background(), t0)
	if err != nil || len(found.Pods) != 1 {
		t.Fatalf("look after the second Pod started: %+v, %v", found.Pods, err)
	}
	first := found.Pods[0].NetNS.Inode
	// The Pod goes with its veth.
	node := filepath.Base(tb.node)
	deletePod := func() {
		ipCmd(t, "netns", "del", pod2)
		for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", node, "link", "show", "hv1").Run() == nil; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("hv1 still there 10 s after its netns was deleted")
			}
		}
	}
	deletePod()
	// Netns made meanwhile hold the inodes below its own, which other
	// netns deleted before left free; then another Pod starts in a netns
	// that gets its inode.
	for i := 0; ; i++ {
		filler := fmt.Sprintf("%s-fill%d", pod2, i)
		ipCmd(t, "netns", "add", filler)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", filler).Run() })
		ino, err := nsutil.Inode("/run/netns/" + filler)
		if err == nil && ino == first {
			ipCmd(t, "netns", "del", filler) // the lowest free again
		}
		if err == nil && ino >= first {
			break
		}
		if i == 1000 {
			t.Skip("no netns made got the deleted one's inode")
		}
	}
	for try := 0; ; try++ {
		secondPod(t, tb)
		if ino, err := nsutil.Inode("/run/netns/" + pod2); err == nil && ino == first {
			break
		}
		if try == 50 {
			t.Skip("the kernel did not give the new netns the deleted one's inode")
		}
		deletePod()
	}
	found, err = w.Look(context.Background(), t0.Add(2*time.Second))
	if err != nil || len(found.Pods) != 1 {
		t.Fatalf("look after the Pod was replaced in a netns of the same inode: %+v, %v; want the new Pod", found.Pods, err)
	}
}

// TestPodWatchRoutedUplink: on a routed node whose routing rules send a
// Pod's source through another uplink than the Pods of the start, a Pod
// that starts later gets that uplink as a capture point of its own; a
// Pod through an uplink already tapped gets none, but its uplink named.
func TestPodWatchRoutedUplink(t *testing.T) {
	n := newNodeNS(t, "node", "pod1", "pod2", "pod3", "gw1", "gw2")
	n.addTwoUplinks(t)
	if out, err := exec.Command("ip", "netns", "exec", n.name("node"), "sysctl", "-qw", "net.ipv4.ip_forward=1").CombinedOutput(); err != nil {
		t.Fatalf("sysctl: %v %s", err, out)
	}
	n.addRoutedPod(t, "pod1", "eni1", "10.99.21.5")
	opt := Options{HostNetNS: n.path("node"), Services: []netip.Addr{netip.MustParseAddr("10.120.0.10")}}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || !slices.Equal(info.Pods[0].Uplinks, []string{"up1"}) {
		t.Fatalf("the start's Pods: %+v, want pod1 through up1", info.Pods)
	}
	w := NewPodWatch(info, opt)
	t0 := time.Now()
	look := func(at time.Duration, veth string, wantUplink string, wantPoints []string) {
		t.Helper()
		found, err := w.Look(context.Background(), t0.Add(at))
		if err != nil || len(found.Pods) != 1 || found.Pods[0].HostPeer.Name != veth {
			t.Fatalf("look: %+v, %v; want the Pod behind %s", found.Pods, err, veth)
		}
		if p := found.Pods[0]; !slices.Equal(p.Uplinks, []string{wantUplink}) {
			t.Errorf("the Pod behind %s: uplinks %v (%s), want [%s]", veth, p.Uplinks, p.UplinkHow, wantUplink)
		}
		var points []string
		for _, cp := range found.CapturePoints {
			points = append(points, cp.Role+":"+cp.Ifname)
		}
		if !slices.Equal(points, wantPoints) {
			t.Errorf("capture points of the Pod behind %s: %v, want %v", veth, points, wantPoints)
		}
	}
	// pod2's source is routed through up2, which no Pod of the start took.
	n.addRoutedPod(t, "pod2", "eni2", "10.99.21.6")
	n.run(t, "node", "rule add to 10.99.21.6 lookup main priority 512", "rule add from 10.99.21.6 lookup 100 priority 1536")
	look(2*time.Second, "eni2", "up2", []string{RolePod + ":eth0", RoleHost + ":eni2", RoleUplink + ":up2"})
	// pod3 goes through up1, tapped since the start.
	n.addRoutedPod(t, "pod3", "eni3", "10.99.21.7")
	look(4*time.Second, "eni3", "up1", []string{RolePod + ":eth0", RoleHost + ":eni3"})
}

// TestPodWatchVethIndexReused: a Pod deleted and made again whose host veth
// got its predecessor's ifindex and name, and whose netns may get its
// predecessor's inode (the kernel keeps a veth's ifindex
// when it is moved into the node netns and that one is free, as Calico's
// CNI moves it; a StatefulSet's Pod keeps its name) is a new Pod, whether a
// look came between the two or not.
func TestPodWatchVethIndexReused(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node}
	w := podWatchOn(t, opt)
	node := filepath.Base(tb.node)
	pod2 := secondPod(t, tb)
	index := strings.SplitN(ipCmd(t, "-n", node, "-o", "link", "show", "hv1"), ":", 2)[0]
	t0 := time.Now()
	found, err := w.Look(context.Background(), t0)
	if err != nil || len(found.Pods) != 1 {
		t.Fatalf("look after the second Pod started: %+v, %v", found.Pods, err)
	}
	deletePod := func() {
		t.Helper()
		ipCmd(t, "netns", "del", pod2)
		for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", node, "link", "show", "hv1").Run() == nil; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("hv1 still there 10 s after its netns was deleted")
			}
		}
	}
	remake := func() {
		t.Helper()
		bridgedPod(t, tb, pod2, "hv1", "10.99.8.24/22", "index", index)
	}
	at := 2 * time.Second
	for _, lookBetween := range []bool{true, false} {
		deletePod()
		if lookBetween {
			if found, err := w.Look(context.Background(), t0.Add(at)); err != nil || len(found.Pods) != 0 {
				t.Fatalf("look after the Pod was deleted: %+v, %v", found.Pods, err)
			}
			at += 2 * time.Second
		}
		remake()
		if !lookBetween {
			// The kernel gives a deleted netns's inode to the next one
			// made, often but not always: make it so, as if it had.
			inode, err := nsutil.Inode(filepath.Join("/run/netns", pod2))
			if err != nil {
				t.Fatal(err)
			}
			for old, ns := range w.netns {
				if strconv.Itoa(ns.veth) == index {
					delete(w.netns, old)
					w.netns[inode] = ns
				}
			}
		}
		found, err := w.Look(context.Background(), t0.Add(at))
		at += 2 * time.Second
		if err != nil || len(found.Pods) != 1 || found.Pods[0].HostPeer.Name != "hv1" || strconv.Itoa(found.Pods[0].HostPeer.Ifindex) != index {
			t.Fatalf("look after the Pod was made again with its host veth's ifindex %s (a look between: %v): %+v, %v; want the new Pod",
				index, lookBetween, found.Pods, err)
		}
		if found, err := w.Look(context.Background(), t0.Add(at)); err != nil || len(found.Pods) != 0 {
			t.Fatalf("the next look found %+v, %v; want nothing new", found.Pods, err)
		}
		at += 2 * time.Second
	}
}

// TestPodNetNSMountedElsewhere: a Pod whose netns only a bind mount outside
// /run/netns holds (CRI-O's namespaces_dir, containerd's sandbox state
// directory, Docker's /var/run/docker/netns; no process in it) is found by
// --pod-ip and among the node's Pods, named by its mount.
func TestPodNetNSMountedElsewhere(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", "link add up1 type veth peer name eth0 netns "+n.name("gw"), "addr add 10.99.40.1/24 dev up1",
		"link set up1 up", "route add default via 10.99.40.254")
	n.addRoutedPod(t, "pod", "cali0123456789a", "10.99.21.5")
	mnt := filepath.Join(t.TempDir(), "cni-6c0e3f4a-0b1d-4c2e-9f5a-1d2e3f4a5b6c")
	if err := os.WriteFile(mnt, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "--bind", n.path("pod"), mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount --bind: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", mnt).Run() })
	ipCmd(t, "netns", "del", n.name("pod")) // the mount alone holds it now
	for _, opt := range []Options{
		{HostNetNS: n.path("node"), PodIP: netip.MustParseAddr("10.99.21.5")},
		{HostNetNS: n.path("node")},
	} {
		info, err := Node(context.Background(), opt)
		if err != nil {
			t.Fatalf("pod ip %v: %v", opt.PodIP, err)
		}
		if len(info.Pods) != 1 || info.Pods[0].NetNS.Path != mnt || info.Pods[0].NSName != mnt ||
			info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "cali0123456789a" {
			t.Errorf("pod ip %v: pods %+v, want the Pod behind cali0123456789a in %s", opt.PodIP, info.Pods, mnt)
		}
	}
}

// TestSelectedPodHeldBy: a Pod whose netns a name and a process both hold
// says both in HELD BY however it is selected, as when the node's Pods are
// scanned: selected by its name it read as held by no process (as a Pod
// between its containers' restarts is), and by its process, by no name.
func TestSelectedPodHeldBy(t *testing.T) {
	tb := newTestbed(t)
	sleep := exec.Command("ip", "netns", "exec", filepath.Base(tb.pod), "sleep", "60")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sleep.Process.Kill(); _ = sleep.Wait() })
	pid := sleep.Process.Pid
	inode, err := nsutil.Inode(tb.pod)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if in, _ := nsLinkInode(fmt.Sprintf("/proc/%d/ns/net", pid)); in == inode && procComm(pid) == "sleep" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d never ran sleep in %s", pid, tb.pod)
		}
	}
	for _, opt := range []Options{{HostNetNS: tb.node}, {HostNetNS: tb.node, PodNetNS: tb.pod}, {HostNetNS: tb.node, PodPID: pid}} {
		info, err := Node(context.Background(), opt)
		if err != nil || len(info.Pods) != 1 {
			t.Fatalf("%+v: pods %+v, %v; want the testbed's Pod", opt, info, err)
		}
		if p := info.Pods[0]; p.PID != pid || p.Comm != "sleep" || p.NSName != filepath.Base(tb.pod) {
			t.Errorf("pod netns %q, pod pid %d: held by pid %d %q and name %q; want pid %d sleep and name %s",
				opt.PodNetNS, opt.PodPID, p.PID, p.Comm, p.NSName, pid, filepath.Base(tb.pod))
		}
	}
}

// TestPodNetNSHidden: a Pod whose netns nothing pathtrace sees holds (a
// process of another PID namespace, a mount of another mount namespace;
// here an open file) is not traced, and discovery says so: the node's
// Pods in a note naming its host veth, --pod-ip in its error, with what to
// give instead.
func TestPodNetNSHidden(t *testing.T) {
	n := newNodeNS(t, "node", "pod", "gw")
	n.run(t, "node", "link add up1 type veth peer name eth0 netns "+n.name("gw"), "addr add 10.99.40.1/24 dev up1",
		"link set up1 up", "route add default via 10.99.40.254")
	n.run(t, "gw", "addr add 10.99.40.254/24 dev eth0", "link set eth0 up")
	n.addRoutedPod(t, "pod", "cali0123456789a", "10.99.21.5")
	f, err := os.Open(n.path("pod")) // keeps it alive unnamed
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ipCmd(t, "netns", "del", n.name("pod"))
	info, err := Node(context.Background(), Options{HostNetNS: n.path("node")})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 0 || !hasNote(info, "cali0123456789a", "--pod-netns") || hasNote(info, "up1") {
		t.Errorf("pods %+v, notes %q; want none, and a note naming cali0123456789a (not up1, the node's uplink)", info.Pods, info.Notes)
	}
	_, err = Node(context.Background(), Options{HostNetNS: n.path("node"), PodIP: netip.MustParseAddr("10.99.21.5")})
	var ue *UsageError
	if !errors.As(err, &ue) || !strings.Contains(ue.Msg, "--host-veth cali0123456789a") || strings.Contains(ue.Msg, "\n") {
		t.Errorf("--pod-ip of the hidden Pod: %v, want a one-line usage error naming --host-veth cali0123456789a", err)
	}
	t.Log(ue.Msg)
}

// TestPodWatchPodIP: with --pod-ip, the watch follows a Pod that gets that
// address in a new netns (the Pod deleted and made again, as a
// StatefulSet's keeps its address), and no other Pod that starts.
func TestPodWatchPodIP(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)}
	w := podWatchOn(t, opt)
	if w == nil {
		t.Fatal("no watch with --pod-ip")
	}
	t0 := time.Now()
	secondPod(t, tb)
	if found, err := w.Look(context.Background(), t0); err != nil || len(found.Pods) != 0 {
		t.Fatalf("look after another Pod started: %+v, %v; want none followed", found.Pods, err)
	}
	node, pod := filepath.Base(tb.node), filepath.Base(tb.pod)
	ipCmd(t, "netns", "del", pod)
	for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", node, "link", "show", "hv0").Run() == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("hv0 still there 10 s after its netns was deleted")
		}
	}
	ipCmd(t, "netns", "add", pod)
	ipCmd(t, "-n", node, "link", "add", "hv7", "type", "veth", "peer", "name", "eth0", "netns", pod)
	ipCmd(t, "-n", node, "link", "set", "hv7", "master", "br0", "up")
	ipCmd(t, "-n", pod, "addr", "add", podIP+"/22", "dev", "eth0")
	ipCmd(t, "-n", pod, "link", "set", "eth0", "up")
	ipCmd(t, "-n", pod, "route", "add", "default", "via", gwIP)
	found, err := w.Look(context.Background(), t0.Add(2*time.Second))
	if err != nil || len(found.Pods) != 1 || found.Pods[0].HostPeer.Name != "hv7" {
		t.Fatalf("look after the Pod was made again with %s: %+v, %v; want it behind hv7", podIP, found.Pods, err)
	}
	var points []string
	for _, cp := range found.CapturePoints {
		points = append(points, cp.Role+":"+cp.Ifname)
	}
	if !slices.Equal(points, []string{RolePod + ":eth0", RoleHost + ":hv7"}) {
		t.Errorf("capture points of the Pod made again: %v, want its eth0 and hv7 (the uplink tapped already)", points)
	}
}

// TestSelectedNetNSNotRouted: a netns selected with --pod-netns that routes
// nothing through its veth into the node, not even by a default route (the
// gateway's, behind the node's uplink: a wrong netns given), is traced as
// asked, and a note says its traffic may not pass the node.
func TestSelectedNetNSNotRouted(t *testing.T) {
	tb := newTestbed(t)
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodNetNS: tb.gw,
		Services: []netip.Addr{netip.MustParseAddr("10.120.0.80")}})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "up0" {
		t.Fatalf("pods %+v, want the selected netns behind up0", info.Pods)
	}
	if !hasNote(info, tb.gw, "no default route at all", "host side up0", "may not pass the node") {
		t.Errorf("notes %q, want one saying %s routes nothing through up0", info.Notes, tb.gw)
	}
	t.Logf("%q", info.Notes)
}

// TestPodWatchMirredRedirect: a Pod that starts after discovery gets the
// mirred redirects of the tc filters on its host veth read with its tc
// programs, as the Pods of the start do (NodeInfo.TCRedirects).
func TestPodWatchMirredRedirect(t *testing.T) {
	tb := newTestbed(t)
	node := filepath.Base(tb.node)
	opt := Options{HostNetNS: tb.node}
	w := podWatchOn(t, opt)
	late := node + "-late"
	ipCmd(t, "netns", "add", late)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", late).Run() })
	ipCmd(t, "-n", node, "link", "add", "hv9", "type", "veth", "peer", "name", "eth0", "netns", late)
	ipCmd(t, "-n", node, "link", "set", "hv9", "master", "br0", "up")
	ipCmd(t, "-n", late, "addr", "add", "10.99.8.99/22", "dev", "eth0")
	ipCmd(t, "-n", late, "link", "set", "eth0", "up")
	ipCmd(t, "-n", late, "route", "add", "default", "via", gwIP)
	for _, args := range [][]string{
		{"qdisc", "add", "dev", "hv9", "clsact"},
		{"filter", "add", "dev", "hv9", "ingress", "pref", "10", "protocol", "ip", "u32", "match", "u32", "0", "0",
			"action", "mirred", "egress", "redirect", "dev", "up0"},
	} {
		if out, err := exec.Command("ip", append([]string{"netns", "exec", node, "tc"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("tc %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	found, err := w.Look(context.Background(), time.Now())
	if err != nil || len(found.Pods) != 1 {
		t.Fatalf("look after the Pod started: %+v, %v", found.Pods, err)
	}
	hv9 := slices.IndexFunc(found.CapturePoints, func(cp CapturePoint) bool { return cp.Role == RoleHost })
	if hv9 < 0 {
		t.Fatalf("no host veth among %+v", found.CapturePoints)
	}
	want := []TCRedirect{{Ifname: "hv9", Ifindex: found.CapturePoints[hv9].Ifindex, Role: RoleHost, Dir: "ingress",
		Filter: "u32 pref 10", Action: "egress redirect", To: "up0"}}
	if !slices.Equal(found.TCRedirects, want) {
		t.Errorf("tc redirects of the new Pod's veth:\n got %+v\nwant %+v", found.TCRedirects, want)
	}
}

// TestPodRoutesAVIPThroughNet1: a Pod with a Multus net1 on a node bridge
// beside eth0 that routes one traced VIP through net1 is found once, on
// eth0; its net1 address is one of its client addresses (a --pod-ip run
// otherwise leaves the node-wide points' sightings of its flows out of
// scope, and those flows read unknown), and a note says which VIP's flows
// its captured interface does not carry.
func TestPodRoutesAVIPThroughNet1(t *testing.T) {
	n := newNodeNS(t, "node", "pod")
	n.run(t, "node", "link add hve type veth peer name eth0 netns "+n.name("pod"), "link set hve up",
		"route add 10.99.21.5/32 dev hve",
		"link add hvn type veth peer name net1 netns "+n.name("pod"), "link set hvn up",
		"addr add 192.168.50.1/24 dev hvn")
	n.run(t, "pod", "addr add 10.99.21.5/32 dev eth0", "link set eth0 up",
		"route add 169.254.1.1 dev eth0 scope link", "route add default via 169.254.1.1 dev eth0",
		"addr add 192.168.50.5/24 dev net1", "link set net1 up", "route add 10.120.9.9/32 via 192.168.50.1 dev net1")
	vips := []netip.Addr{netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.9.9")}
	for _, opt := range []Options{
		{HostNetNS: n.path("node"), Services: vips},
		{HostNetNS: n.path("node"), Services: vips, PodIP: netip.MustParseAddr("10.99.21.5")},
	} {
		info, err := Node(context.Background(), opt)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Pods) != 1 || info.Pods[0].Eth0.Name != "eth0" || info.Pods[0].HostPeer == nil || info.Pods[0].HostPeer.Name != "hve" {
			t.Fatalf("pod ip %v: pods %+v, want one, on eth0 and its host veth hve", opt.PodIP, info.Pods)
		}
		if got := info.Pods[0].OtherIfaces; len(got) != 1 || got[0].Name != "net1" || !slices.Equal(got[0].Addrs, []netip.Prefix{netip.MustParsePrefix("192.168.50.5/24")}) {
			t.Errorf("pod ip %v: other interfaces %+v, want net1 with 192.168.50.5/24", opt.PodIP, got)
		}
		clients := info.ClientAddrs()
		if !clients[netip.MustParseAddr("192.168.50.5")] || !clients[netip.MustParseAddr("10.99.21.5")] {
			t.Errorf("pod ip %v: client addresses %v, want the Pod's eth0 and net1 addresses", opt.PodIP, clients)
		}
		if !hasNote(info, n.path("pod"), "10.120.9.9 through net1", "not through eth0") || hasNote(info, "10.120.0.80 through") {
			t.Errorf("pod ip %v: notes %q, want one saying 10.120.9.9 goes through net1", opt.PodIP, info.Notes)
		}
	}
}

// TestPodWatchRoomBack: a run until stopped (GiveRoomBack) bounds the Pods
// followed at once: once a Pod followed went, a Pod that starts is
// followed although the bound was reached, and the look says which went; a
// netns left out when the bound was reached stays left out. A bounded run
// keeps counting every Pod seen.
func TestPodWatchRoomBack(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node, MaxPods: 1}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 {
		t.Fatalf("discovery found %d Pods, want the testbed's only", len(info.Pods))
	}
	first := info.Pods[0].NetNS.Inode
	bounded, w := NewPodWatch(info, opt), NewPodWatch(info, opt)
	w.GiveRoomBack()
	t0 := time.Now()
	look := func(w *PodWatch, at time.Duration) NewPods {
		t.Helper()
		found, err := w.Look(context.Background(), t0.Add(at))
		if err != nil {
			t.Fatal(err)
		}
		return found
	}
	secondPod(t, tb)
	for _, w := range []*PodWatch{bounded, w} {
		if found := look(w, 0); len(found.Pods) != 0 || found.Skipped != 1 || !slices.Equal(found.SkippedVeths, []string{"hv1"}) || len(found.Gone) != 0 {
			t.Fatalf("look with the bound reached: %+v; want the second Pod (hv1) left out", found)
		}
	}
	// The testbed's Pod goes (its netns deleted, its veth pair with it).
	node := filepath.Base(tb.node)
	ipCmd(t, "netns", "del", filepath.Base(tb.pod))
	for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", node, "link", "show", "hv0").Run() == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("hv0 still there 10 s after its netns was deleted")
		}
	}
	if found := look(w, 2*time.Second); len(found.Pods) != 0 || !slices.Equal(found.Gone, []uint64{first}) {
		t.Fatalf("look once the first Pod went: %+v; want it gone (inode %d), nothing new", found, first)
	}
	look(bounded, 2*time.Second)
	// A third Pod starts: followed by the run until stopped only.
	pod3 := filepath.Base(tb.pod) + "3"
	bridgedPod(t, tb, pod3, "hv3", "10.99.8.33/22")
	if found := look(w, 4*time.Second); len(found.Pods) != 1 || found.Pods[0].NetNS.Path != "/run/netns/"+pod3 || found.Skipped != 0 {
		t.Fatalf("look after a third Pod started: %+v; want it followed", found)
	}
	if found := look(bounded, 4*time.Second); len(found.Pods) != 0 || found.Skipped != 1 || !slices.Equal(found.SkippedVeths, []string{"hv3"}) || len(found.Gone) != 0 {
		t.Fatalf("bounded run's look after a third Pod started: %+v; want it (hv3) left out, no Pod reported gone", found)
	}
	// The bound holds: a fourth is left out while the third is there.
	ipCmd(t, "-n", node, "link", "del", "hv1") // the second Pod's veth: it was never followed
	if found := look(w, 6*time.Second); len(found.Pods) != 0 || len(found.Gone) != 0 {
		t.Fatalf("look after a Pod never followed went: %+v; want nothing", found)
	}
	if w.room() != 0 {
		t.Errorf("room %d with the third Pod followed, want 0", w.room())
	}
}

// TestPodWatchFollowedFoundAgain: a look that goes behind a followed Pod's
// veth again (renamed: a veth known is told by its name, among others) and
// behind a new Pod's finds the followed one again, which takes no room
// under the bound: the new Pod is followed, not also counted as left out.
// With the bound reached, the renamed veth is no Pod left out either.
func TestPodWatchFollowedFoundAgain(t *testing.T) {
	// renamed returns a watch of the testbed's node, its Pod followed, once
	// that Pod's host veth was renamed.
	renamed := func(t *testing.T, maxPods int, giveBack bool) (*testbed, *PodWatch) {
		tb := newTestbed(t)
		opt := Options{HostNetNS: tb.node, MaxPods: maxPods}
		w := podWatchOn(t, opt)
		if giveBack {
			w.GiveRoomBack()
		}
		node := filepath.Base(tb.node)
		ipCmd(t, "-n", node, "link", "set", "hv0", "down")
		ipCmd(t, "-n", node, "link", "set", "hv0", "name", "hv0r")
		ipCmd(t, "-n", node, "link", "set", "hv0r", "up")
		return tb, w
	}
	t.Run("bound reached", func(t *testing.T) {
		_, w := renamed(t, 1, true)
		t0 := time.Now()
		for i := range 2 {
			found, err := w.Look(context.Background(), t0.Add(time.Duration(i)*2*time.Second))
			if err != nil || len(found.Pods) != 0 || found.Skipped != 0 || len(found.SkippedVeths) != 0 || len(found.Gone) != 0 {
				t.Fatalf("look %d after the followed Pod's veth was renamed, the bound reached: %+v, %v; want nothing new, none left out", i, found, err)
			}
		}
		if len(w.pending) != 0 {
			t.Errorf("veths still looked behind: %v", w.pending)
		}
	})
	for _, giveBack := range []bool{false, true} {
		t.Run(fmt.Sprintf("give room back %v", giveBack), func(t *testing.T) {
			tb, w := renamed(t, 2, giveBack)
			pod2 := secondPod(t, tb)
			found, err := w.Look(context.Background(), time.Now())
			if err != nil || len(found.Pods) != 1 || found.Pods[0].NetNS.Path != "/run/netns/"+pod2 || found.Skipped != 0 || len(found.SkippedVeths) != 0 {
				t.Fatalf("look after the first Pod's veth was renamed and a second Pod started: %+v, %v; want the second Pod followed, none left out", found, err)
			}
			if w.room() != 0 {
				t.Errorf("room %d with two Pods followed under a bound of 2, want 0", w.room())
			}
		})
	}
}

// TestPodWatchVethIndexReusedRoomBack: in a run until stopped, a Pod
// deleted and made again between two looks, whose new host veth got its
// predecessor's ifindex, is a new Pod and the old one went: the look says
// so, and the old one gives its room back, so a Pod that starts next is
// followed while the bound is not reached.
func TestPodWatchVethIndexReusedRoomBack(t *testing.T) {
	tb := newTestbed(t)
	opt := Options{HostNetNS: tb.node, MaxPods: 3}
	w := podWatchOn(t, opt)
	w.GiveRoomBack()
	node := filepath.Base(tb.node)
	pod2 := secondPod(t, tb)
	index := strings.SplitN(ipCmd(t, "-n", node, "-o", "link", "show", "hv1"), ":", 2)[0]
	t0 := time.Now()
	found, err := w.Look(context.Background(), t0)
	if err != nil || len(found.Pods) != 1 {
		t.Fatalf("look after the second Pod started: %+v, %v", found.Pods, err)
	}
	old := found.Pods[0].NetNS.Inode
	// The second Pod is deleted and made again before the next look, its
	// host veth with the same ifindex.
	ipCmd(t, "netns", "del", pod2)
	for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", node, "link", "show", "hv1").Run() == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("hv1 still there 10 s after its netns was deleted")
		}
	}
	bridgedPod(t, tb, pod2, "hv1", "10.99.8.24/22", "index", index)
	found, err = w.Look(context.Background(), t0.Add(2*time.Second))
	if err != nil || len(found.Pods) != 1 || strconv.Itoa(found.Pods[0].HostPeer.Ifindex) != index {
		t.Fatalf("look after the Pod was made again: %+v, %v; want the new Pod", found.Pods, err)
	}
	if !slices.Contains(found.Gone, old) {
		t.Errorf("look after the Pod was made again: gone %v, want the old Pod's netns %d", found.Gone, old)
	}
	// Two Pods on the node, a bound of 3: a third that starts is followed.
	pod3 := filepath.Base(tb.pod) + "3"
	bridgedPod(t, tb, pod3, "hv3", "10.99.8.33/22")
	found, err = w.Look(context.Background(), t0.Add(4*time.Second))
	if err != nil || len(found.Pods) != 1 || found.Skipped != 0 {
		t.Errorf("look after a third Pod started, two on the node, bound 3: pods %+v skipped %d (%v), %v; want it followed", found.Pods, found.Skipped, found.SkippedVeths, err)
	}
}

// podWatchOn discovers the node of opt and returns a PodWatch of it.
func podWatchOn(t *testing.T, opt Options) *PodWatch {
	t.Helper()
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	return NewPodWatch(info, opt)
}
