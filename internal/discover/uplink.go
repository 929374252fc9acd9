package discover

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// bridgePort is a port of the master of a pod's host veth.
type bridgePort struct {
	index   int
	name    string
	kind    string // link type
	podPeer bool   // the host side of a known pod's veth
}

// fdbEntry is a MAC address a bridge has learned on one of its ports.
type fdbEntry struct {
	port int
	mac  string
}

// chooseBridgeUplink picks the uplink among the ports of a pod veth's master.
// Names and link kinds don't tell an uplink (in kind clusters and in the lab it
// is a veth too), the bridge's forwarding table does: the port on which the
// bridge learned the pod's gateway MAC. Without that (Open vSwitch keeps its
// MAC table out of the kernel's FDB), the ports that are not pod veths,
// preferring those that are not veths at all, and never the bridge's own
// internal ports while there is another.
func chooseBridgeUplink(master string, ports []bridgePort, fdb []fdbEntry, gwMAC string, podPort int) ([]int, string) {
	if gwMAC != "" {
		for _, p := range ports {
			if p.index == podPort {
				continue
			}
			if slices.Contains(fdb, fdbEntry{port: p.index, mac: gwMAC}) {
				return []int{p.index}, fmt.Sprintf("bridge FDB of %s: gateway MAC %s learned on this port", master, gwMAC)
			}
		}
	}
	var others, nonVeth, internal []int
	for _, p := range ports {
		switch {
		case p.index == podPort || p.podPeer:
		case p.kind == ovsInternal:
			// An Open vSwitch bridge's own interface into the node
			// (br-int, br-ex): the node's stack, not the way out.
			internal = append(internal, p.index)
		case p.kind != "veth" && p.kind != "netkit":
			nonVeth = append(nonVeth, p.index)
			others = append(others, p.index)
		default:
			others = append(others, p.index)
		}
	}
	// Said as of when the Pod was found: the row's gateway MAC may come
	// later (RefreshGatewayMACs), and reads as a contradiction otherwise.
	why := "gateway MAC not known yet when the Pod was found"
	if gwMAC != "" {
		why = "gateway MAC " + gwMAC + " not in the FDB yet when the Pod was found"
	}
	switch {
	case len(nonVeth) > 0:
		return nonVeth, fmt.Sprintf("ports of %s that are not veths (%s)", master, why)
	case len(others) > 0:
		return others, fmt.Sprintf("ports of %s that are not pod veths (%s)", master, why)
	case len(internal) > 0:
		return internal, fmt.Sprintf("the internal ports of %s, its only ports besides pod veths (%s)", master, why)
	}
	return nil, fmt.Sprintf("no port of %s besides pod veths", master)
}

// ovsInternal is the link kind of an Open vSwitch internal port.
const ovsInternal = "openvswitch"

// discoverUplinks sets each pod's uplinks and returns the node's uplink links,
// deduplicated: the --uplink override, else per pod the bridge/OVS port towards
// its gateway, or for a routed pod (no master, or a bridge that holds the
// gateway address itself) the devices of the node's routes.
func discoverUplinks(ctx context.Context, host *hostNS, opt Options, info *NodeInfo) ([]netlink.Link, error) {
	if opt.Uplink != "" {
		l, err := host.linkByName(opt.Uplink)
		if err != nil {
			return nil, usagef("--uplink %s: no such interface in the node netns %s; list them with `ip link` there", opt.Uplink, host.path)
		}
		if et := l.Attrs().EncapType; et != "ether" {
			return nil, usagef("--uplink %s: its link type is %s, not Ethernet, which pathtrace captures; give the Ethernet device the node's packets leave through", opt.Uplink, et)
		}
		for _, p := range info.Pods {
			// A Pod's own veth as the uplink would make its host point and
			// the uplink one interface: every flow would look rewritten
			// on the uplink side and never to leave the node.
			if p.HostPeer != nil && p.HostPeer.Ifindex == l.Attrs().Index {
				return nil, usagef("--uplink %s: the host veth of the Pod in %s (captured as its host point), not an uplink; give the device the node's packets leave through, or leave --uplink out", opt.Uplink, p.NetNS.Path)
			}
		}
		if err := notPodVeth(ctx, host, opt, l); err != nil {
			return nil, err
		}
		for i := range info.Pods {
			info.Pods[i].Uplinks, info.Pods[i].UplinkHow = []string{l.Attrs().Name}, "--uplink"
		}
		noteTunnelsOver(host, l, info)
		return []netlink.Link{l}, nil
	}

	// info.Pods lacks the Pods a selector, --host-veth or Options.MaxPods left
	// out: their host veths are found when a Pod's uplink needs them.
	partial := opt.PodIP.IsValid() || opt.PodNetNS != "" || opt.PodPID != 0 || opt.HostVeth != "" || info.PodsSkipped > 0
	return podUplinks(ctx, host, opt.Services, info.Backends(), info, nil, partial), nil
}

// notPodVeth refuses l, the --uplink device, when it is the host veth of a
// Pod that the selection left out (--pod-ip, --host-veth, a bound): a veth
// whose peer's netns routes its default route or a VIP through it, as
// podHostVeths finds the Pods' veths (the node's upstream excluded, a veth
// too in kind and the lab). Captured as the uplink, it would see none of
// the traced flows, and the uplink side of every flow would be missing.
func notPodVeth(ctx context.Context, host *hostNS, opt Options, l netlink.Link) error {
	if !isVeth(l) || l.Attrs().NetNsID < 0 {
		return nil
	}
	veths, err := podHostVeths(ctx, host, opt.Services)
	if err != nil && ctx.Err() != nil {
		return err
	}
	if veths[l.Attrs().Index] {
		return usagef("--uplink %s: the host veth of a Pod (its peer's netns routes its traffic through it), not an uplink; give the device the node's packets leave through, or leave --uplink out", opt.Uplink)
	}
	return nil
}

// podUplinks sets the uplinks of info's Pods, found by the routes towards
// services and backends, and returns their links, each once. The host
// veths of info's Pods and of others (ifindexes) are not uplinks; partial
// tells that the node has Pods besides those: theirs are looked for.
func podUplinks(ctx context.Context, host *hostNS, services, backends []netip.Addr, info *NodeInfo, others []int, partial bool) []netlink.Link {
	u := uplinkFinder{host: host, services: services, backends: backends[:min(len(backends), maxBackendRoutes)], podSide: map[int]bool{}}
	veths := others
	for _, p := range info.Pods {
		if p.HostPeer != nil {
			veths = append(veths, p.HostPeer.Ifindex)
		}
	}
	for _, idx := range veths {
		u.podSide[idx] = true
		if l, err := host.link(idx); err == nil && l.Attrs().MasterIndex != 0 {
			u.podSide[l.Attrs().MasterIndex] = true
		}
	}
	if partial {
		u.scanPodSide = func() {
			veths, err := podHostVeths(ctx, host, services)
			maps.Copy(u.podSide, veths)
			if err != nil {
				info.notef("host veths of the Pods not selected not all found (they may be taken for uplinks): %v", err)
			}
		}
	}
	return u.assign(info)
}

// assign sets each pod's uplinks (below VLAN devices) and returns the node's
// uplink links, each once; without pods, those of the node's routes.
func (u *uplinkFinder) assign(info *NodeInfo) []netlink.Link {
	host := u.host
	var uplinks []netlink.Link
	add := func(idx int) {
		if slices.ContainsFunc(uplinks, func(l netlink.Link) bool { return l.Attrs().Index == idx }) {
			return
		}
		if l, err := host.link(idx); err == nil {
			uplinks = append(uplinks, l)
		}
	}
	tunnels := flowBasedTunnels(host.links)
	for i := range info.Pods {
		idx, how := u.forPod(&info.Pods[i])
		for _, x := range idx {
			lower, why := taggedLower(host.links, x)
			if why != "" {
				how += "; " + why
			}
			info.Pods[i].Uplinks = append(info.Pods[i].Uplinks, host.name(lower))
			add(lower)
		}
		if u.routedPod(&info.Pods[i]) {
			for _, t := range tunnels {
				if name := t.Attrs().Name; !slices.Contains(info.Pods[i].Uplinks, name) {
					info.Pods[i].Uplinks = append(info.Pods[i].Uplinks, name)
					how += "; and " + name + ", a flow-based tunnel device on no route, to which tc programs redirect encapsulated traffic"
					add(t.Attrs().Index)
				}
			}
		}
		info.Pods[i].UplinkHow = how
	}
	if u.bySource {
		// The node's own traffic (hostNetwork clients, traced too) follows
		// the routes of no Pod's source: its uplinks are captured as well.
		idx, how := u.routed(routeKey{})
		var more []string
		for _, x := range idx {
			lower, _ := taggedLower(host.links, x)
			n := len(uplinks)
			if add(lower); len(uplinks) > n {
				more = append(more, host.name(lower))
			}
		}
		if len(more) > 0 {
			info.notef("the node's own traffic leaves through %s (%s), not a Pod's uplink under the node's routing rules: captured too", strings.Join(more, ","), how)
		}
	}
	if len(info.Pods) == 0 {
		idx, how := u.routed(routeKey{})
		for _, x := range idx {
			lower, why := taggedLower(host.links, x)
			if why != "" {
				how += "; " + why
			}
			add(lower)
		}
		if len(idx) == 0 {
			info.notef("no pod found, and no uplink: %s", how)
		} else {
			info.notef("no pod found: uplink from the %s", how)
		}
	}
	if u.fdbErr != nil {
		info.notef("bridge FDB not read: %v", u.fdbErr)
	}
	return uplinks
}

// noteTunnelsOver notes the overlay devices (flannel.1, vxlan.calico) that
// encapsulate over the uplink l: its tap sees their traffic as UDP between
// the nodes, whose inner frames pathtrace does not decode, so the flows the
// node routes through them show no uplink frame there.
func noteTunnelsOver(host *hostNS, l netlink.Link, info *NodeInfo) {
	var ids []int
	for id := range host.links {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		t, ok := host.links[id].(*netlink.Vxlan)
		if !ok || t.VtepDevIndex != l.Attrs().Index || t.Attrs().Flags&net.FlagUp == 0 {
			continue
		}
		info.notef("%s carries the traffic of %s (%s) encapsulated, which pathtrace does not decode: the flows the node routes through %s show no uplink frame on %s's tap (VLAN and UPLINK DST MAC -); --uplink %s captures them before encapsulation",
			l.Attrs().Name, t.Attrs().Name, describeTunnel(host, t), t.Attrs().Name, l.Attrs().Name, t.Attrs().Name)
	}
}

// flowBasedTunnels are the node's VXLAN and Geneve devices that are up and
// flow-based (collect_md: Cilium's cilium_vxlan, cilium_geneve), whose
// destinations a BPF program sets per packet: no route leads to them. Only
// those carrying Ethernet frames: a VXLAN-GPE or an inner-protocol Geneve
// device carries bare IP (link/none), which the taps do not decode.
func flowBasedTunnels(links map[int]netlink.Link) []netlink.Link {
	var out []netlink.Link
	for _, l := range links {
		flowBased := false
		switch t := l.(type) {
		case *netlink.Vxlan:
			flowBased = t.FlowBased
		case *netlink.Geneve:
			flowBased = t.FlowBased
		}
		if flowBased && l.Attrs().Flags&net.FlagUp != 0 && l.Attrs().EncapType == "ether" {
			out = append(out, l)
		}
	}
	slices.SortFunc(out, func(a, b netlink.Link) int { return a.Attrs().Index - b.Attrs().Index })
	return out
}

// routedPod tells whether the node routes the Pod's traffic from a host veth
// of its own (no bridge): there, tc programs on that veth may redirect it
// to a tunnel device.
func (u *uplinkFinder) routedPod(p *Pod) bool {
	if p.HostPeer == nil {
		return false
	}
	hl, err := u.host.link(p.HostPeer.Ifindex)
	return err == nil && hl.Attrs().MasterIndex == 0
}

// taggedLower returns, for an uplink that is a VLAN device (bond0.200), the
// device below it (bond0, also below stacked tags) and why: the VLAN device
// hands its frames down untagged, so only below it does the capture show the
// tag the frames leave the node with. Another link comes back as is, with
// why "". A lower device in another netns (or unknown, or met already: links
// re-read after the dump can make a loop) stops the descent.
func taggedLower(links map[int]netlink.Link, index int) (int, string) {
	var vlans []string
	seen := []int{index}
	for {
		v, ok := links[index].(*netlink.Vlan)
		if !ok {
			break
		}
		a := v.Attrs()
		lower, ok := links[a.ParentIndex]
		if !ok || a.NetNsID >= 0 || slices.Contains(seen, a.ParentIndex) {
			break
		}
		seen = append(seen, a.ParentIndex)
		vlans = append(vlans, fmt.Sprintf("%s (vlan %d)", a.Name, v.VlanId))
		index = lower.Attrs().Index
	}
	if len(vlans) == 0 {
		return index, ""
	}
	return index, fmt.Sprintf("captured below VLAN device %s, on %s, where the frames carry the tag",
		strings.Join(vlans, " on "), links[index].Attrs().Name)
}

// maxBackendRoutes bounds the route lookups towards backends.
const maxBackendRoutes = 64

// uplinkFinder caches what several pods share: the FDB dump and the routes.
type uplinkFinder struct {
	host     *hostNS
	services []netip.Addr
	backends []netip.Addr
	// podSide are the host veths of the pods and their masters: a route
	// through them stays on the node. scanPodSide, when set, adds those of
	// the Pods not in NodeInfo.Pods, on first use.
	podSide     map[int]bool
	scanPodSide func()

	fdb     []fdbEntry
	fdbRead bool
	fdbErr  error
	// viaBridge says, of a bridge's port taken for the bridge a route
	// leaves by (bridgePorts), why.
	viaBridge map[int]string
	// routes are the routed uplinks per lookup start.
	routes map[routeKey]routeResult
	// sourceRules: the node has routing rules on source addresses or input
	// interfaces (read once), so each Pod's packets are looked up apart.
	sourceRules, rulesRead bool
	// bySource: some Pod's uplinks came from such a lookup.
	bySource bool
}

// routeKey is where route lookups start: a Pod's packets forwarded by the
// node (from the Pod's address, in on iif), or, zero, the node's own.
type routeKey struct {
	src netip.Addr
	iif int
}

type routeResult struct {
	idx []int
	how string
}

// isPodSide tells whether the node link idx is a Pod's host veth or the
// master of one.
func (u *uplinkFinder) isPodSide(idx int) bool {
	if u.scanPodSide != nil {
		u.scanPodSide()
		u.scanPodSide = nil
	}
	return u.podSide[idx]
}

func (u *uplinkFinder) forPod(p *Pod) ([]int, string) {
	if p.HostPeer == nil {
		if p.lower != 0 {
			if _, err := u.host.link(p.lower); err == nil {
				// A macvlan or ipvlan Pod sends through this device itself,
				// past the node's stack.
				return []int{p.lower}, "the device below the Pod's " + p.Eth0.Kind
			}
		}
		return nil, "no host veth"
	}
	hl, err := u.host.link(p.HostPeer.Ifindex)
	if err != nil {
		return nil, fmt.Sprintf("host veth gone: %v", err)
	}
	master := hl.Attrs().MasterIndex
	if master == 0 {
		return u.routed(u.podKey(p, hl.Attrs().Index))
	}
	if gwDev, ok := u.localDevice(p.Gateway); ok {
		// The CNI bridge plugin's layout (flannel, kubenet, k3s): the
		// gateway is the bridge's own address, so the node routes the
		// pod's traffic, whatever else is plugged into the bridge. The
		// packets enter the node's IP stack on the device holding it.
		if gwDev == 0 || u.isLoopback(gwDev) {
			gwDev = master
		}
		idx, how := u.routed(u.podKey(p, gwDev))
		return idx, fmt.Sprintf("the node routes it (gateway %s is an address of the node); %s", p.Gateway, how)
	}
	var ports []bridgePort
	for _, l := range u.host.links {
		if a := l.Attrs(); a.MasterIndex == master {
			ports = append(ports, bridgePort{index: a.Index, name: a.Name, kind: l.Type(), podPeer: u.isPodSide(a.Index)})
		}
	}
	slices.SortFunc(ports, func(a, b bridgePort) int { return a.index - b.index })
	var fdb []fdbEntry
	if p.HostPeer.MasterKind == "bridge" {
		fdb = u.bridgeFDB(master)
	}
	return chooseBridgeUplink(p.HostPeer.Master, ports, fdb, p.GatewayMAC, p.HostPeer.Ifindex)
}

// bridgeFDB returns the MACs the bridge with ifindex master learned on its
// ports (AF_BRIDGE neighbour dump, read once).
func (u *uplinkFinder) bridgeFDB(master int) []fdbEntry {
	if !u.fdbRead {
		u.fdbRead = true
		neighs, err := u.host.nl.NeighList(0, unix.AF_BRIDGE)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			u.fdbErr = err
		}
		for _, n := range neighs {
			if n.MasterIndex != 0 && len(n.HardwareAddr) > 0 {
				u.fdb = append(u.fdb, fdbEntry{port: n.LinkIndex, mac: n.HardwareAddr.String()})
			}
		}
	}
	// Entries carry their bridge in MasterIndex; ports belong to one bridge,
	// so filtering by port is done by chooseBridgeUplink's port list.
	return u.fdb
}

// routed returns the devices of the node's routes towards the backends the
// NAT rules and IPVS name (where the translated packets go: an overlay's
// tunnel device, say) and towards each traced VIP that is routed out of the
// node (where its packets go unrewritten: a Service kube-proxy never
// programmed, or whose rules go away while the trace runs, leaves by the
// VIP's route, on a flannel node the default route's eth0, not flannel.1);
// without either, of the default route(s). Routes that stay on the node (a
// local backend pod, a node-local VIP) do not count.
//
// A Pod's key (see podKey) looks routes up as the node forwards the Pod's
// packets, the zero key as the node sends its own; each is looked up once.
func (u *uplinkFinder) routed(k routeKey) ([]int, string) {
	if r, ok := u.routes[k]; ok {
		return r.idx, r.how
	}
	if u.routes == nil {
		u.routes = map[routeKey]routeResult{}
	}
	var fwd fwdLookups
	backends := make([]addrRoute, 0, len(u.backends))
	for _, b := range u.backends {
		backends = append(backends, addrRoute{b, u.routeOut(b, k, &fwd)})
	}
	vips := make([]addrRoute, 0, len(u.services))
	for _, vip := range u.services {
		vips = append(vips, addrRoute{vip, u.routeOut(vip, k, &fwd)})
	}
	route, how := u.combineRoutes(backends, vips, u.defaultRoute)
	for _, idx := range route {
		if why, ok := u.viaBridge[idx]; ok {
			how += "; " + why
		}
	}
	if k.src.IsValid() {
		if fwd.ok > 0 {
			u.bySource = true
			how += fmt.Sprintf(" from %s in on %s (the node routes by source or input interface)", k.src, u.host.name(k.iif))
		}
		if fwd.err != nil {
			how += fmt.Sprintf("; forwarded from %s in on %s: %v, so the node's own route", k.src, u.host.name(k.iif), fwd.err)
		}
	}
	u.routes[k] = routeResult{idx: route, how: how}
	return route, how
}

// addrRoute is an address and the devices of the node's route to it that
// leave the node (routeOut), none when it stays on the node or has no route.
type addrRoute struct {
	addr netip.Addr
	devs []int
}

// combineRoutes gives routed's uplinks from the routes towards the backends
// and towards the VIPs: the devices of the backends' routes, then those the
// VIPs' routes add, each once, in that order; without any, defaultRoute's.
// A device without Ethernet (IPIP's tunl0, WireGuard) hands the capture
// bare IP packets, where the file and the decoder expect Ethernet: it is
// left out, and said. The reason names the backends and the VIPs whose
// routes chose the devices (with the devices when both did).
func (u *uplinkFinder) combineRoutes(backends, vips []addrRoute, defaultRoute func() ([]int, string)) ([]int, string) {
	var route []int
	var notEther []string
	ether := func(idx int) bool {
		l, err := u.host.link(idx)
		if err != nil || l.Attrs().EncapType == "ether" {
			return true
		}
		if name := l.Attrs().Name + " (" + l.Attrs().EncapType + ")"; !slices.Contains(notEther, name) {
			notEther = append(notEther, name)
		}
		return false
	}
	// collect adds the Ethernet devices of each route, and returns the
	// addresses whose routes added one (any of theirs, with all) and the
	// devices added.
	collect := func(rs []addrRoute, all bool) (via []netip.Addr, added []int) {
		for _, r := range rs {
			out := false
			for _, idx := range r.devs {
				if !ether(idx) {
					continue
				}
				if !slices.Contains(route, idx) {
					route = append(route, idx)
					added = append(added, idx)
					out = true
				} else if all || slices.Contains(added, idx) {
					out = true
				}
			}
			if out && !slices.Contains(via, r.addr) {
				via = append(via, r.addr)
			}
		}
		return via, added
	}
	viaBackends, byBackends := collect(backends, true)
	backendNotEther := notEther
	notEther = nil
	viaVIPs, byVIPs := collect(vips, false)
	vipNotEther := notEther

	var parts []string
	if len(viaBackends) > 0 {
		// Named in address order: the rules' order (an nftables map's)
		// says nothing.
		slices.SortFunc(viaBackends, netip.Addr.Compare)
		parts = append(parts, namedAddrs("route to backend ", "routes to %d backends (%s, ...)", viaBackends))
	}
	if len(viaVIPs) > 0 {
		// Named in --svc order.
		parts = append(parts, namedAddrs("route to VIP ", "routes to %d VIPs (%s, ...)", viaVIPs))
	}
	if len(parts) == 2 {
		parts[0] += " (" + u.names(byBackends) + ")"
		parts[1] += " (" + u.names(byVIPs) + ")"
	}
	how := strings.Join(parts, ", ")
	switch {
	case len(route) > 0:
		if len(vipNotEther) > 0 {
			how += "; the VIPs' routes also go through " + strings.Join(vipNotEther, ", ") + ", without an Ethernet header to capture"
		}
	case len(vipNotEther) > 0:
		// The VIPs leave through no device to capture: the default
		// route's would not see them either.
		how = "routes to the VIPs through " + strings.Join(vipNotEther, ", ") + ", not Ethernet: give --uplink"
	default:
		route, how = defaultRoute()
		for _, idx := range route {
			if l, err := u.host.link(idx); err == nil && l.Attrs().EncapType != "ether" {
				route, how = nil, fmt.Sprintf("%s: %s has link type %s, not Ethernet: give --uplink", how, l.Attrs().Name, l.Attrs().EncapType)
				break
			}
		}
	}
	if len(viaBackends) == 0 && len(backendNotEther) > 0 {
		how += "; the backends' routes go through " + strings.Join(backendNotEther, ", ") + ", without an Ethernet header to capture"
	}
	return route, how
}

// namedAddrs names addrs after one (one + the address), or a count and the
// first three (many).
func namedAddrs(one, many string, addrs []netip.Addr) string {
	names := make([]string, min(len(addrs), 3))
	for i := range names {
		names[i] = addrs[i].String()
	}
	if len(addrs) > 3 {
		return fmt.Sprintf(many, len(addrs), strings.Join(names, ", "))
	}
	return one + strings.Join(names, ", ")
}

// names are the names of the node links idx, comma-separated.
func (u *uplinkFinder) names(idx []int) string {
	s := make([]string, len(idx))
	for i, x := range idx {
		s[i] = u.host.name(x)
	}
	return strings.Join(s, ",")
}

// defaultRoute returns the devices of the default route(s) of the main
// table.
func (u *uplinkFinder) defaultRoute() ([]int, string) {
	var idx []int
	routes, _ := u.host.nl.RouteList(nil, netlink.FAMILY_V4)
	for _, r := range routes {
		if !isDefaultRoute(r) {
			continue
		}
		for _, x := range u.bridgePorts(r, netip.Addr{}) {
			if !slices.Contains(idx, x) {
				idx = append(idx, x)
			}
		}
	}
	if len(idx) == 0 {
		return nil, "no default route in the node netns"
	}
	return idx, "default route"
}

// routeOut are the devices of the node's route to a, when it leaves the
// node: not a local address, not through a pod's veth or its bridge. A
// multipath route gives each next hop's device (the kernel spreads flows
// over them).
func (u *uplinkFinder) routeOut(a netip.Addr, k routeKey, fwd *fwdLookups) []int {
	r, ok := u.lookup(a, k, fwd)
	if !ok || r.Type == unix.RTN_LOCAL {
		return nil
	}
	return slices.DeleteFunc(u.bridgePorts(r, a), func(idx int) bool { return u.isLoopback(idx) || u.isPodSide(idx) })
}

// bridgePorts are the devices of r's next hops (towards dst, invalid for
// a default route), each Linux bridge among them (the node's address on
// br0, its NIC a port of it) replaced by its port towards that next hop:
// the one on which the bridge learned the MAC of the next hop's neighbour
// entry. A bridge's own taps never see what it switches between its
// ports, as an outside client's request DNATed at PREROUTING
// (bridge-nf-call-iptables=1) to a backend behind it. A bridge whose port
// is not known so stays.
func (u *uplinkFinder) bridgePorts(r netlink.Route, dst netip.Addr) []int {
	idx := nextHopDevices(r)
	for i, dev := range idx {
		l, err := u.host.link(dev)
		if err != nil || l.Type() != "bridge" {
			continue
		}
		hop := dst
		for _, nh := range append([]*netlink.NexthopInfo{{LinkIndex: r.LinkIndex, Gw: r.Gw}}, r.MultiPath...) {
			if a, ok := netip.AddrFromSlice(nh.Gw); ok && nh.LinkIndex == dev {
				hop = a.Unmap()
			}
		}
		if port, ok := u.portTowards(dev, hop); ok {
			idx[i] = port
		}
	}
	return idx
}

// portTowards is the port of bridge br on which it learned hop's MAC (the
// node's neighbour entry of hop on br, the bridge's FDB), noted in
// u.viaBridge.
func (u *uplinkFinder) portTowards(br int, hop netip.Addr) (int, bool) {
	if !hop.IsValid() {
		return 0, false
	}
	neighs, _ := u.host.nl.NeighList(br, netlink.FAMILY_V4)
	for _, n := range neighs {
		a, ok := netip.AddrFromSlice(n.IP)
		if !ok || a.Unmap() != hop || len(n.HardwareAddr) == 0 {
			continue
		}
		mac := n.HardwareAddr.String()
		for _, e := range u.bridgeFDB(br) {
			if p, err := u.host.link(e.port); e.mac == mac && err == nil && p.Attrs().MasterIndex == br {
				if u.viaBridge == nil {
					u.viaBridge = map[int]string{}
				}
				u.viaBridge[e.port] = fmt.Sprintf("%s: the port of %s on which it learned next hop %s's MAC %s", p.Attrs().Name, u.host.name(br), hop, mac)
				return e.port, true
			}
		}
	}
	return 0, false
}

// fwdLookups counts the forwarded lookups of a routeKey that succeeded,
// and keeps the first error of one that did not.
type fwdLookups struct {
	ok  int
	err error
}

// lookup is the node's route to a as the FIB holds it (RTM_F_FIB_MATCH):
// with every next hop of a multipath route, where a plain lookup gives the
// one next hop this lookup's hash picked. A Pod's key looks it up as the
// kernel forwards the Pod's packets (ip route get A from SRC iif DEV), which
// the routing rules on source and input interface apply to; when that fails
// (forwarding off, reverse-path filter), the node's own route is taken.
func (u *uplinkFinder) lookup(a netip.Addr, k routeKey, fwd *fwdLookups) (netlink.Route, bool) {
	dst := net.IP(a.AsSlice())
	if k.src.IsValid() {
		routes, err := u.host.nl.RouteGetWithOptions(dst, &netlink.RouteGetOptions{
			SrcAddr: net.IP(k.src.AsSlice()), IifIndex: k.iif, FIBMatch: true})
		if err == nil && len(routes) > 0 {
			fwd.ok++
			return routes[0], true
		}
		if fwd.err == nil && err != nil {
			fwd.err = err
		}
	}
	routes, err := u.host.nl.RouteGetWithOptions(dst, &netlink.RouteGetOptions{FIBMatch: true})
	if err != nil || len(routes) == 0 {
		return netlink.Route{}, false
	}
	return routes[0], true
}

// podKey is where the lookups for a Pod's packets start: from its address,
// in on iif, when the node has routing rules on sources or input
// interfaces; else the node's own lookups, which all Pods then share.
func (u *uplinkFinder) podKey(p *Pod, iif int) routeKey {
	if !u.rulesRead {
		u.rulesRead = true
		rules, err := u.host.nl.RuleList(netlink.FAMILY_V4)
		// Unread rules: look up per Pod, which is right either way.
		u.sourceRules = err != nil || slices.ContainsFunc(rules, selectsSource)
	}
	if !u.sourceRules {
		return routeKey{}
	}
	for _, a := range p.Eth0.Addrs {
		if a.Addr().Is4() {
			return routeKey{src: a.Addr(), iif: iif}
		}
	}
	return routeKey{}
}

// selectsSource tells whether a routing rule can treat a Pod's forwarded
// packets apart from the node's own: one on the source address or the
// input interface, or one without a table (l3mdev, VRFs).
func selectsSource(r netlink.Rule) bool {
	return r.Src != nil || r.IifName != "" || (r.Table == 0 && r.Goto == 0)
}

// nextHopDevices are the devices of a route's next hops, each once.
func nextHopDevices(r netlink.Route) []int {
	var idx []int
	if r.LinkIndex != 0 {
		idx = append(idx, r.LinkIndex)
	}
	for _, nh := range r.MultiPath {
		if nh.LinkIndex != 0 && !slices.Contains(idx, nh.LinkIndex) {
			idx = append(idx, nh.LinkIndex)
		}
	}
	return idx
}

// localDevice tells whether a is an address of the node netns, and the
// device holding it (0 when unknown).
func (u *uplinkFinder) localDevice(a netip.Addr) (int, bool) {
	if !a.IsValid() {
		return 0, false
	}
	r, ok := u.lookup(a, routeKey{}, &fwdLookups{})
	if !ok || r.Type != unix.RTN_LOCAL {
		return 0, false
	}
	return r.LinkIndex, true
}

func (u *uplinkFinder) isLoopback(idx int) bool {
	l, err := u.host.link(idx)
	return err == nil && l.Attrs().Flags&net.FlagLoopback != 0
}

// describeLink fills a capture point's link facts: kind, master, bond members,
// VLAN parent.
func describeLink(host *hostNS, l netlink.Link, cp *CapturePoint) {
	a := l.Attrs()
	cp.Ifname, cp.Ifindex, cp.MAC, cp.Kind = a.Name, a.Index, a.HardwareAddr.String(), l.Type()
	if a.MasterIndex != 0 {
		cp.Master, cp.MasterKind = host.masterOf(l)
	}
	if _, ok := l.(*netlink.Bond); ok {
		for _, m := range host.links {
			if m.Attrs().MasterIndex == a.Index {
				cp.BondMembers = append(cp.BondMembers, m.Attrs().Name)
			}
		}
		slices.Sort(cp.BondMembers)
	}
	if v, ok := l.(*netlink.Vlan); ok {
		cp.VLANParent, cp.VLANID = host.name(a.ParentIndex), v.VlanId
	}
	cp.Tunnel = describeTunnel(host, l)
}

// describeTunnel says what an overlay device encapsulates in and over what
// (CapturePoint.Tunnel), "" for another device.
func describeTunnel(host *hostNS, l netlink.Link) string {
	var parts []string
	switch t := l.(type) {
	case *netlink.Vxlan:
		if t.FlowBased {
			parts = append(parts, "vxlan, flow-based (each packet's program sets its VNI and remote)")
		} else {
			parts = append(parts, fmt.Sprintf("vxlan id %d", t.VxlanId))
		}
		if t.VtepDevIndex != 0 {
			parts[0] += " over " + host.name(t.VtepDevIndex)
		}
		if len(t.SrcAddr) > 0 && !t.SrcAddr.IsUnspecified() {
			parts = append(parts, "local "+t.SrcAddr.String())
		}
		if t.Port != 0 {
			parts = append(parts, fmt.Sprintf("udp %d", t.Port))
		}
	case *netlink.Geneve:
		if t.FlowBased {
			parts = append(parts, "geneve, flow-based (each packet's program sets its VNI and remote)")
		} else {
			parts = append(parts, fmt.Sprintf("geneve id %d", t.ID))
		}
		if t.Dport != 0 {
			parts = append(parts, fmt.Sprintf("udp %d", t.Dport))
		}
	default:
		return ""
	}
	return strings.Join(parts, ", ")
}

// capturePoints lists pod, host and uplink points, each interface once.
func capturePoints(host *hostNS, info *NodeInfo, uplinks []netlink.Link) []CapturePoint {
	var cps []CapturePoint
	for _, p := range info.Pods {
		if p.NetNS.Path == "" {
			continue
		}
		cps = append(cps, CapturePoint{Role: RolePod, NetNS: p.NetNS.Path, Ifname: p.Eth0.Name,
			Ifindex: p.Eth0.Ifindex, MAC: p.Eth0.MAC, Kind: p.Eth0.Kind})
	}
	seen := map[int]bool{}
	for _, p := range info.Pods {
		if p.HostPeer == nil || seen[p.HostPeer.Ifindex] {
			continue
		}
		seen[p.HostPeer.Ifindex] = true
		cp := CapturePoint{Role: RoleHost, NetNS: host.path}
		if l, err := host.link(p.HostPeer.Ifindex); err == nil {
			describeLink(host, l, &cp)
		} else {
			cp.Ifname, cp.Ifindex, cp.MAC, cp.Kind = p.HostPeer.Name, p.HostPeer.Ifindex, p.HostPeer.MAC, p.HostPeer.Kind
		}
		cps = append(cps, cp)
	}
	for _, l := range uplinks {
		cp := CapturePoint{Role: RoleUplink, NetNS: host.path}
		describeLink(host, l, &cp)
		if cp.MasterKind == "bridge" {
			cp.Hairpin = hairpin(host, l, info)
		}
		cps = append(cps, cp)
	}
	return cps
}

// hairpin is the hairpin mode of l, a bridge port (its AF_BRIDGE
// protinfo), nil and noted when unread.
func hairpin(host *hostNS, l netlink.Link, info *NodeInfo) *bool {
	pi, err := host.nl.LinkGetProtinfo(l)
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		info.notef("hairpin mode of uplink %s, a port of %s, not read: %v", l.Attrs().Name, host.name(l.Attrs().MasterIndex), err)
		return nil
	}
	return &pi.Hairpin
}
