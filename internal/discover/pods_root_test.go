package discover

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
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
