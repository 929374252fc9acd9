package discover

import (
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

func TestChooseBridgeUplink(t *testing.T) {
	const gw = "02:00:00:00:00:01"
	// Port 5 is the pod's veth, 6 another pod's, 7 a veth towards the
	// network (as in kind and the lab), 8 a physical NIC.
	pod := bridgePort{index: 5, name: "vethpod", kind: "veth", podPeer: true}
	other := bridgePort{index: 6, name: "vethother", kind: "veth", podPeer: true}
	vethUp := bridgePort{index: 7, name: "up0", kind: "veth"}
	nic := bridgePort{index: 8, name: "eno1", kind: "device"}
	// Open vSwitch: the bridge's internal port, and a bond as its uplink.
	brInt := bridgePort{index: 9, name: "br-int", kind: "openvswitch"}
	bond := bridgePort{index: 10, name: "bond0", kind: "bond"}
	for _, tc := range []struct {
		name    string
		ports   []bridgePort
		fdb     []fdbEntry
		gwMAC   string
		want    []int
		howWord string
	}{
		{"gateway MAC learned on a veth beats a NIC", []bridgePort{pod, other, vethUp, nic},
			[]fdbEntry{{5, "02:00:00:00:00:99"}, {7, gw}}, gw, []int{7}, "FDB"},
		{"gateway MAC on the pod's own port is ignored", []bridgePort{pod, vethUp},
			[]fdbEntry{{5, gw}}, gw, []int{7}, "not pod veths"},
		{"no FDB entry: non-veth ports", []bridgePort{pod, other, vethUp, nic}, nil, gw, []int{8}, "not veths"},
		{"no gateway MAC: ports that are not pod veths", []bridgePort{pod, other, vethUp}, []fdbEntry{{7, gw}}, "", []int{7}, "not pod veths"},
		{"only pod veths", []bridgePort{pod, other}, nil, gw, nil, "no port"},
		{"OVS (no FDB): the bond, not the internal port", []bridgePort{pod, brInt, bond}, nil, gw, []int{10}, "not veths"},
		{"OVS with a veth uplink: the veth, not the internal port", []bridgePort{pod, other, brInt, vethUp}, nil, gw, []int{7}, "not pod veths"},
		{"OVS with nothing but its internal port", []bridgePort{pod, brInt}, nil, gw, []int{9}, "internal ports"},
	} {
		got, how := chooseBridgeUplink("br0", tc.ports, tc.fdb, tc.gwMAC, 5)
		if !slices.Equal(got, tc.want) || !strings.Contains(how, tc.howWord) {
			t.Errorf("%s: got %v %q, want %v and a reason with %q", tc.name, got, how, tc.want, tc.howWord)
		}
	}
}

// TestTaggedLower: an uplink that is a VLAN device (the route's device on
// many bare-metal nodes) is captured on the device below it, where frames
// carry their tag, also below stacked tags; not across netns, not for other
// links. (This kernel has no 802.1Q module, so the links are built here.)
func TestTaggedLower(t *testing.T) {
	attrs := func(index, parent int, name string) netlink.LinkAttrs {
		a := netlink.NewLinkAttrs()
		a.Index, a.ParentIndex, a.Name = index, parent, name
		return a
	}
	bond := &netlink.Bond{LinkAttrs: attrs(2, 0, "bond0")}
	outer := &netlink.Vlan{LinkAttrs: attrs(3, 2, "bond0.100"), VlanId: 100}
	inner := &netlink.Vlan{LinkAttrs: attrs(4, 3, "bond0.100.200"), VlanId: 200}
	single := &netlink.Vlan{LinkAttrs: attrs(5, 2, "bond0.300"), VlanId: 300}
	elsewhere := &netlink.Vlan{LinkAttrs: attrs(6, 2, "vlan400"), VlanId: 400}
	elsewhere.NetNsID = 1 // its ParentIndex is an ifindex of another netns
	orphan := &netlink.Vlan{LinkAttrs: attrs(7, 99, "vlan500"), VlanId: 500}
	// Two VLAN devices each naming the other as parent: impossible in one
	// kernel dump, possible when a link re-read after the dump reuses an
	// ifindex. The descent must stop, not loop.
	loopA := &netlink.Vlan{LinkAttrs: attrs(8, 9, "loopa"), VlanId: 8}
	loopB := &netlink.Vlan{LinkAttrs: attrs(9, 8, "loopb"), VlanId: 9}
	links := map[int]netlink.Link{}
	for _, l := range []netlink.Link{bond, outer, inner, single, elsewhere, orphan, loopA, loopB} {
		links[l.Attrs().Index] = l
	}
	for _, tc := range []struct {
		index, want int
		why         []string // parts of the reason, none when the link stays
	}{
		{5, 2, []string{"bond0.300 (vlan 300)", "on bond0"}},
		{4, 2, []string{"bond0.100.200 (vlan 200) on bond0.100 (vlan 100)", "on bond0"}},
		{2, 2, nil},
		{6, 6, nil},
		{7, 7, nil},
		{8, 9, []string{"loopa (vlan 8)", "on loopb"}},
	} {
		var got int
		var why string
		done := make(chan struct{})
		go func() { got, why = taggedLower(links, tc.index); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: taggedLower never returned", links[tc.index].Attrs().Name)
		}
		if got != tc.want || (why == "") != (tc.why == nil) {
			t.Errorf("%s: got ifindex %d %q, want %d", links[tc.index].Attrs().Name, got, why, tc.want)
		}
		for _, w := range tc.why {
			if !strings.Contains(why, w) {
				t.Errorf("%s: reason %q lacks %q", links[tc.index].Attrs().Name, why, w)
			}
		}
	}
}

// TestRoutedPodsKeepVLANNote: routed Pods share the node's route (cached
// once); each Pod's uplink is the device below the route's VLAN device, and
// each says so. Replacing the VLAN device by its lower device in the cached
// route itself left the second Pod without the note.
func TestRoutedPodsKeepVLANNote(t *testing.T) {
	attrs := func(index, parent int, name string) netlink.LinkAttrs {
		a := netlink.NewLinkAttrs()
		a.Index, a.ParentIndex, a.Name = index, parent, name
		return a
	}
	host := &hostNS{links: map[int]netlink.Link{}}
	for _, l := range []netlink.Link{
		&netlink.Device{LinkAttrs: attrs(2, 0, "bond0")},
		&netlink.Vlan{LinkAttrs: attrs(3, 2, "bond0.200"), VlanId: 200},
		&netlink.Veth{LinkAttrs: attrs(10, 0, "cali1")},
		&netlink.Veth{LinkAttrs: attrs(11, 0, "cali2")},
	} {
		host.links[l.Attrs().Index] = l
	}
	info := &NodeInfo{Pods: []Pod{
		{HostPeer: &HostPeer{Iface: Iface{Name: "cali1", Ifindex: 10}}},
		{HostPeer: &HostPeer{Iface: Iface{Name: "cali2", Ifindex: 11}}},
	}}
	// The node has no source routing rules: every Pod shares the node's route.
	u := &uplinkFinder{host: host, podSide: map[int]bool{10: true, 11: true}, rulesRead: true,
		routes: map[routeKey]routeResult{{}: {idx: []int{3}, how: "route to 10.96.0.10"}}}
	uplinks := u.assign(info)
	if len(uplinks) != 1 || uplinks[0].Attrs().Name != "bond0" {
		t.Errorf("node uplinks: got %v, want bond0", uplinks)
	}
	for _, p := range info.Pods {
		if !slices.Equal(p.Uplinks, []string{"bond0"}) || !strings.Contains(p.UplinkHow, "captured below VLAN device bond0.200 (vlan 200)") {
			t.Errorf("pod behind %s: got %v (%s), want bond0, captured below bond0.200", p.HostPeer.Name, p.Uplinks, p.UplinkHow)
		}
	}
	if r := u.routes[routeKey{}]; !slices.Equal(r.idx, []int{3}) {
		t.Errorf("the cached route changed: %v", r.idx)
	}
}

// TestTunnelUplinkDescribed: an overlay device chosen as the uplink (a
// flannel node's flannel.1, Cilium's cilium_vxlan) says what it
// encapsulates in and over what, and the capture points table says that
// its frames are the inner ones: the VLAN and MAC of its flows are not the
// wire's.
func TestTunnelUplinkDescribed(t *testing.T) {
	host := &hostNS{links: map[int]netlink.Link{}}
	eth0 := netlink.NewLinkAttrs()
	eth0.Index, eth0.Name = 2, "eth0"
	host.links[2] = &netlink.Device{LinkAttrs: eth0}
	fl := netlink.NewLinkAttrs()
	fl.Index, fl.Name = 4, "flannel.1"
	flannel := &netlink.Vxlan{LinkAttrs: fl, VxlanId: 1, VtepDevIndex: 2, SrcAddr: net.ParseIP("192.168.50.1"), Port: 8472}
	cil := netlink.NewLinkAttrs()
	cil.Index, cil.Name = 5, "cilium_vxlan"
	cilium := &netlink.Vxlan{LinkAttrs: cil, FlowBased: true, Port: 8472}
	for _, tc := range []struct {
		l    netlink.Link
		want string
	}{
		{flannel, "vxlan id 1 over eth0, local 192.168.50.1, udp 8472"},
		{cilium, "vxlan, flow-based (each packet's program sets its VNI and remote), udp 8472"},
		{host.links[2], ""},
	} {
		var cp CapturePoint
		describeLink(host, tc.l, &cp)
		if cp.Tunnel != tc.want {
			t.Errorf("%s: tunnel %q, want %q", tc.l.Attrs().Name, cp.Tunnel, tc.want)
		}
	}
	var cp CapturePoint
	describeLink(host, flannel, &cp)
	cp.Role, cp.NetNS = RoleUplink, "/run/netns/node"
	var b strings.Builder
	if err := (&NodeInfo{CapturePoints: []CapturePoint{cp}}).Table(&b); err != nil {
		t.Fatal(err)
	}
	if want := "vxlan id 1 over eth0, local 192.168.50.1, udp 8472: its frames are the inner ones (their VLAN and MAC are not the wire's)"; !strings.Contains(b.String(), want) {
		t.Errorf("capture points table lacks %q:\n%s", want, b.String())
	}
}

// TestUplinkBelowTunnelNoted: --uplink naming the device a VXLAN overlay
// encapsulates over (a flannel node's eth0) is taken, with a note that the
// flows routed through the overlay show no uplink frame there and how to
// capture them; a device no overlay uses gets no such note.
func TestUplinkBelowTunnelNoted(t *testing.T) {
	host := &hostNS{links: map[int]netlink.Link{}}
	attrs := func(index int, name string) netlink.LinkAttrs {
		a := netlink.NewLinkAttrs()
		a.Index, a.Name, a.Flags = index, name, net.FlagUp
		return a
	}
	eth0 := &netlink.Device{LinkAttrs: attrs(2, "eth0")}
	eth1 := &netlink.Device{LinkAttrs: attrs(3, "eth1")}
	host.links[2], host.links[3] = eth0, eth1
	host.links[4] = &netlink.Vxlan{LinkAttrs: attrs(4, "flannel.1"), VxlanId: 1, VtepDevIndex: 2, Port: 8472}
	var info NodeInfo
	noteTunnelsOver(host, eth0, &info)
	if len(info.Notes) != 1 || !strings.Contains(info.Notes[0], "eth0 carries the traffic of flannel.1 (vxlan id 1 over eth0, udp 8472) encapsulated") ||
		!strings.Contains(info.Notes[0], "--uplink flannel.1 captures them before encapsulation") {
		t.Errorf("notes %q, want one naming flannel.1 over eth0", info.Notes)
	}
	info = NodeInfo{}
	noteTunnelsOver(host, eth1, &info)
	if len(info.Notes) != 0 {
		t.Errorf("notes %q for eth1, which no overlay uses", info.Notes)
	}
}

// Only flow-based tunnels that carry Ethernet frames are capture points: a
// VXLAN-GPE device (ip link add vx0 type vxlan external gpe: link/none)
// carries bare IP, which an Ethernet interface in the pcapng would mangle.
func TestFlowBasedTunnelsEthernetOnly(t *testing.T) {
	tunnel := func(index int, name, encap string, flowBased bool) netlink.Link {
		attrs := netlink.LinkAttrs{Index: index, Name: name, EncapType: encap, Flags: net.FlagUp}
		return &netlink.Vxlan{LinkAttrs: attrs, FlowBased: flowBased}
	}
	links := map[int]netlink.Link{
		3: tunnel(3, "cilium_vxlan", "ether", true),
		4: tunnel(4, "vx-gpe", "none", true),
		5: tunnel(5, "vx-routed", "ether", false),
		6: &netlink.Geneve{LinkAttrs: netlink.LinkAttrs{Index: 6, Name: "cilium_geneve", EncapType: "ether", Flags: net.FlagUp}, FlowBased: true},
	}
	var got []string
	for _, l := range flowBasedTunnels(links) {
		got = append(got, l.Attrs().Name)
	}
	if want := []string{"cilium_vxlan", "cilium_geneve"}; !slices.Equal(got, want) {
		t.Errorf("flowBasedTunnels = %v, want %v", got, want)
	}
}

// TestCombineRoutes: a routed Pod's uplinks are the devices of the routes
// towards the backends and towards each traced VIP that leaves the node,
// each once, backends' first: on a flannel node the backends are behind
// flannel.1 while a VIP without NAT rule (kube-proxy never programmed it)
// leaves unrewritten by the default route's eth0, which must be tapped too.
// The default route counts only without either; devices without Ethernet
// never do; the reason names what chose each device.
func TestCombineRoutes(t *testing.T) {
	attrs := func(index int, name, encap string) netlink.LinkAttrs {
		a := netlink.NewLinkAttrs()
		a.Index, a.Name, a.EncapType = index, name, encap
		return a
	}
	host := &hostNS{links: map[int]netlink.Link{}}
	for _, l := range []netlink.Link{
		&netlink.Device{LinkAttrs: attrs(2, "eth0", "ether")},
		&netlink.Device{LinkAttrs: attrs(3, "eth1", "ether")},
		&netlink.Vxlan{LinkAttrs: attrs(4, "flannel.1", "ether"), VxlanId: 1, VtepDevIndex: 2},
		&netlink.Iptun{LinkAttrs: attrs(5, "tunl0", "ipip")},
	} {
		host.links[l.Attrs().Index] = l
	}
	a := netip.MustParseAddr
	route := func(addr string, devs ...int) addrRoute { return addrRoute{a(addr), devs} }
	defaultVia := func(idx ...int) func() ([]int, string) {
		return func() ([]int, string) { return idx, "default route" }
	}
	for _, tc := range []struct {
		name     string
		backends []addrRoute
		vips     []addrRoute
		dflt     func() ([]int, string)
		want     []int
		how      string
	}{
		{"flannel: backends behind flannel.1, VIPs by eth0",
			[]addrRoute{route("10.244.1.5", 4), route("10.244.2.7", 4)},
			[]addrRoute{route("10.96.50.10", 2), route("10.96.50.11", 2)}, defaultVia(2),
			[]int{4, 2}, "route to backend 10.244.1.5, 10.244.2.7 (flannel.1), route to VIP 10.96.50.10, 10.96.50.11 (eth0)"},
		{"no NAT rule at all: the VIPs' routes",
			nil, []addrRoute{route("10.96.50.11", 2)}, defaultVia(3),
			[]int{2}, "route to VIP 10.96.50.11"},
		{"VIPs leave where the backends do: named by the backends alone",
			[]addrRoute{route("10.99.30.7", 2)}, []addrRoute{route("10.96.0.10", 2)}, defaultVia(2),
			[]int{2}, "route to backend 10.99.30.7"},
		{"one VIP on another device, a node-local VIP (no route out) not named",
			[]addrRoute{route("10.99.30.7", 2)}, []addrRoute{route("10.96.0.10", 2), route("192.168.1.5"), route("10.97.0.1", 3)}, defaultVia(2),
			[]int{2, 3}, "route to backend 10.99.30.7 (eth0), route to VIP 10.97.0.1 (eth1)"},
		{"many VIPs, in --svc order",
			nil, []addrRoute{route("10.96.0.9", 2), route("10.96.0.3", 2), route("10.96.0.5", 3), route("10.96.0.1", 3)}, defaultVia(2),
			[]int{2, 3}, "routes to 4 VIPs (10.96.0.9, 10.96.0.3, 10.96.0.5, ...)"},
		{"backends through IPIP: the VIP's route, tunl0 said",
			[]addrRoute{route("10.244.1.5", 5)}, []addrRoute{route("10.96.0.10", 2)}, defaultVia(2),
			[]int{2}, "route to VIP 10.96.0.10; the backends' routes go through tunl0 (ipip), without an Ethernet header to capture"},
		{"VIP through IPIP next to Ethernet backends",
			[]addrRoute{route("10.244.1.5", 4)}, []addrRoute{route("10.96.0.10", 5)}, defaultVia(2),
			[]int{4}, "route to backend 10.244.1.5; the VIPs' routes also go through tunl0 (ipip)"},
		{"the VIPs only through IPIP: give --uplink",
			nil, []addrRoute{route("10.96.0.10", 5)}, defaultVia(2),
			nil, "routes to the VIPs through tunl0 (ipip), not Ethernet: give --uplink"},
		{"no route out for anything: the default route",
			[]addrRoute{route("10.244.0.5")}, []addrRoute{route("192.168.1.5")}, defaultVia(3),
			[]int{3}, "default route"},
		{"a default route without Ethernet: give --uplink",
			nil, []addrRoute{route("192.168.1.5")}, defaultVia(5),
			nil, "default route: tunl0 has link type ipip, not Ethernet: give --uplink"},
	} {
		u := &uplinkFinder{host: host}
		got, how := u.combineRoutes(tc.backends, tc.vips, tc.dflt)
		if !slices.Equal(got, tc.want) || !strings.HasPrefix(how, tc.how) {
			t.Errorf("%s: got %v %q, want %v %q", tc.name, got, how, tc.want, tc.how)
		}
	}
}
