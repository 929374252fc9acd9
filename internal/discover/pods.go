package discover

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// discoverPods fills info.Pods from the pod selector, or with every pod of the
// node (bounded by MaxPods), then applies the --host-veth override.
func discoverPods(ctx context.Context, host *hostNS, opt Options, info *NodeInfo) error {
	var hostVeth netlink.Link
	if opt.HostVeth != "" {
		l, err := checkHostVeth(ctx, host, opt.HostVeth, opt.Services)
		if err != nil {
			return err
		}
		hostVeth = l
	}

	switch {
	case opt.PodNetNS != "":
		inode, err := nsutil.Inode(opt.PodNetNS)
		if err != nil {
			return usagef("--pod-netns %s: %v", opt.PodNetNS, err)
		}
		sel := "--pod-netns " + opt.PodNetNS
		if opt.PodPID > 0 {
			sel = fmt.Sprintf("--pod-pid %d", opt.PodPID)
		}
		if inode == host.inode {
			return usagef("%s is the node netns itself, not a Pod's: the node's own processes (hostNetwork Pods) are always traced; for a Pod give its --pod-ip, or the PID of one of its processes (--pod-pid)", sel)
		}
		pod, err := inspectPod(host, holderOf(opt.PodNetNS, inode), netip.Addr{}, opt.Services)
		if errors.Is(err, errNotPod) {
			// Nothing in it leads out: no Pod's traffic to capture.
			return usagef("%s is not a Pod's netns: %v %s; for a Pod give its --pod-ip, or the PID of one of its processes (--pod-pid)", sel, err, host.path)
		}
		if err != nil {
			return err
		}
		info.Pods = []Pod{*pod}
	case opt.PodIP.IsValid():
		pod, err := podByIP(ctx, host, opt.PodIP, opt.Services)
		if err != nil {
			return err
		}
		info.Pods = []Pod{*pod}
	default:
		var only map[int]bool
		if hostVeth != nil {
			only = map[int]bool{hostVeth.Attrs().Index: true}
		}
		if err := scanPods(ctx, host, opt.MaxPods, only, nil, opt.Services, info, &info.behind); err != nil {
			return err
		}
	}
	for _, p := range info.Pods {
		switch {
		case p.HostPeer == nil && hostVeth == nil:
			info.notef("%s", noHostPeerNote(ctx, host, p))
		case p.HostPeer != nil && !p.viaEth0:
			info.notef("pod netns %s: %s: its traffic may not pass the node", p.NetNS.Path, notRoutedWhy(p, opt.Services))
		}
	}
	if hostVeth != nil {
		overrideHostVeth(host, hostVeth, info)
	}
	return nil
}

// noHostPeerNote says why a pod has no host veth, and what to do about it.
func noHostPeerNote(ctx context.Context, host *hostNS, p Pod) string {
	switch {
	case p.lower != 0:
		dev := host.name(p.lower)
		return fmt.Sprintf("pod netns %s: %s is a %s on the node's %s: no host veth to capture on (its packets leave through %s)", p.NetNS.Path, p.Eth0.Name, p.Eth0.Kind, dev, dev)
	case p.peerElsewhere:
		// A kind or k3d node is a container: its Pods' veths lead into the
		// node container's netns, not into pathtrace's.
		if c := netnsWithID(ctx, p.NetNS, p.peerNSID); c != nil {
			return fmt.Sprintf("pod netns %s: the veth peer of its %s is in the netns %s%s, not in the node netns %s: when that netns is the node running the Pod (kind, k3d), give --host-netns %s for its host veth, NAT rules and uplink",
				p.NetNS.Path, p.Eth0.Name, c.path, holderComm(*c), host.path, c.path)
		}
		return fmt.Sprintf("pod netns %s: the veth peer of its %s is in another netns than the node netns %s: give --host-netns with the netns of the node running the Pod (kind, k3d: /proc/PID/ns/net of a process of the node container) for its host veth, NAT rules and uplink",
			p.NetNS.Path, p.Eth0.Name, host.path)
	}
	return fmt.Sprintf("pod netns %s: %s has no veth peer in the node netns; host-side capture needs --host-veth", p.NetNS.Path, p.Eth0.Name)
}

// notRoutedWhy says that a pod with a veth into the node sends neither its
// default route nor a VIP through it.
func notRoutedWhy(p Pod, vips []netip.Addr) string {
	why := fmt.Sprintf("its default route leaves through %s, not through %s, its veth into the node (host side %s)", p.defaultDev, p.Eth0.Name, p.HostPeer.Name)
	if p.defaultDev == "" {
		why = fmt.Sprintf("it has no default route at all, through %s, its veth into the node (host side %s), or elsewhere (a router's netns behind the node's uplink?)", p.Eth0.Name, p.HostPeer.Name)
		if len(vips) > 0 {
			why += ", and its route to the VIPs does not leave through " + p.Eth0.Name
		}
		return why
	}
	if len(vips) > 0 {
		why += ", nor does its route to the VIPs"
	}
	return why
}

// holderComm is " (COMM)" for a netns held by a process, "" otherwise.
func holderComm(c nsCandidate) string {
	if c.comm == "" {
		return ""
	}
	return " (" + c.comm + ")"
}

// checkHostVeth turns the --host-veth name into its link: a veth of the node
// netns whose peer is in another netns, a Pod's (its default route, or its
// route to a VIP, leaves through the peer) when that netns is found. A netns
// pathtrace cannot find leaves the override its node side.
func checkHostVeth(ctx context.Context, host *hostNS, name string, vips []netip.Addr) (netlink.Link, error) {
	l, err := host.linkByName(name)
	if err != nil {
		hint := ""
		if host.path == nsutil.Self {
			hint = " (for a Pod of a kind or k3d node, give that node's netns with --host-netns too)"
		}
		return nil, usagef("--host-veth %s: no such interface in the node netns %s; list them with `ip link` there%s", name, host.path, hint)
	}
	const fix = "give the node side of the Pod's veth (in the Pod, `ip link show eth0` says eth0@ifN: N is its ifindex in the node netns), or leave --host-veth out"
	a := l.Attrs()
	if !isVeth(l) {
		kind := l.Type()
		if a.Flags&net.FlagLoopback != 0 {
			kind = "loopback"
		}
		return nil, usagef("--host-veth %s: a %s link, not a veth; %s", name, kind, fix)
	}
	if a.NetNsID < 0 {
		return nil, usagef("--host-veth %s: its veth peer %s is in the node netns too, not in a Pod; %s", name, host.name(a.ParentIndex), fix)
	}
	c, err := peerNetNS(ctx, host, a.NetNsID)
	if err != nil || c == nil {
		return l, nil
	}
	var routed bool
	var defDev string
	err = nsutil.Netlink(c.path, func(nl *netlink.Handle) error {
		_, routed = routeThrough(nl, a.ParentIndex, vips)
		if _, idx := defaultGateway(nl); idx != 0 {
			defDev = linkName(nl, idx)
		}
		return nil
	})
	if err != nil || routed {
		return l, nil
	}
	why := "has no default route"
	if defDev != "" {
		why = "sends its default route through " + defDev
	}
	if len(vips) > 0 {
		why += ", and no VIP through " + name
	}
	return nil, usagef("--host-veth %s: not a Pod's veth: the netns behind it, %s%s, %s (the node's uplink side?); %s", name, c.path, holderComm(*c), why, fix)
}

// peerNetNS finds the netns the node netns gives the id nsid, nil if none.
func peerNetNS(ctx context.Context, host *hostNS, nsid int) (*nsCandidate, error) {
	cands, err := listNetNS(host.inode)
	if err != nil {
		return nil, err
	}
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if host.netnsID(c.path) == nsid {
			return &c, nil
		}
	}
	return nil, nil
}

// netnsWithID finds the netns that the netns from gives the id nsid, nil
// when none (or it cannot be told).
func netnsWithID(ctx context.Context, from NetNS, nsid int) *nsCandidate {
	cands, err := listNetNS(from.Inode)
	if err != nil {
		return nil
	}
	var found *nsCandidate
	_ = nsutil.Netlink(from.Path, func(nl *netlink.Handle) error {
		for _, c := range cands {
			if ctx.Err() != nil {
				return nil
			}
			if netnsIDIn(nl, c.path) == nsid {
				found = &c
				return nil
			}
		}
		return nil
	})
	return found
}

// overrideHostVeth makes the --host-veth link the host side of the selected
// pod, or of a pod-less entry when no pod netns leads to it.
func overrideHostVeth(host *hostNS, l netlink.Link, info *NodeInfo) {
	peer := hostPeer(host, l)
	if len(info.Pods) == 0 {
		info.notef("--host-veth %s: no pod netns found behind it; capturing on the node side only", l.Attrs().Name)
		info.Pods = []Pod{{HostPeer: peer}}
		return
	}
	for i := range info.Pods {
		if old := info.Pods[i].HostPeer; old != nil && old.Ifindex != peer.Ifindex {
			info.notef("--host-veth %s overrides the discovered host veth %s", peer.Name, old.Name)
		}
		info.Pods[i].HostPeer = peer
	}
}

// scanPods enumerates the pods of the node: netns whose default route (or,
// with it elsewhere, the route to a VIP) leaves through a veth whose peer is
// in the node netns. With only set, it keeps the pods behind those node
// veths (by ifindex).
//
// upstreamOnly: a netns that routes only the VIPs through its veth into the
// node, while the node's default route leads into that netns, is the node's
// upstream router, not a Pod. Routers learn the Service range (or the
// node's own address, a NodePort's) from the node where Calico, kube-router
// or MetalLB advertise them over BGP; taking one for a Pod would make the
// node's uplink its host veth.
//
// followed, when not nil, tells the netns of a Pod followed already (the
// Pod watch's): a look behind a veth of one (renamed, say) finds it again,
// and it takes no room under maxPods from a new Pod found in the same scan.
//
// behind, when not nil, holds the netns the previous scan found behind the
// veths it looked at, and is set to those of this one: when every veth of
// only leads into one of them still, those are looked into again without
// listing every process's netns (a look a second behind a veth that stays
// no Pod's, the node's veth to a gateway, cost most of that look, and more
// the more processes the node runs).
func scanPods(ctx context.Context, host *hostNS, maxPods int, only map[int]bool, followed func(nsCandidate) bool, vips []netip.Addr, info *NodeInfo, behind *[]netnsBehind) error {
	// The node's veths carry, from the node's view, the id of their peer's
	// netns: a candidate whose id is not among them has no veth to the node,
	// and is skipped without opening a netlink socket in it.
	peerIDs := map[int]bool{}
	for _, l := range host.links {
		if isVeth(l) && l.Attrs().NetNsID >= 0 {
			if only == nil || only[l.Attrs().Index] {
				peerIDs[l.Attrs().NetNsID] = true
			}
		}
	}
	if len(peerIDs) == 0 {
		return nil
	}
	var cands []nsCandidate
	if behind != nil {
		cands = stillBehind(host, *behind, peerIDs)
	}
	if cands == nil {
		var err error
		if cands, err = listNetNS(host.inode); err != nil {
			return err
		}
	}
	var found []netnsBehind
	if behind != nil {
		defer func() { *behind = found }()
	}
	// The netns behind the node's own default route (a kind node's eth0,
	// whose peer is in the host's netns) is its upstream, never a Pod's.
	unfound := maps.Clone(peerIDs)
	for _, l := range host.links {
		if a := l.Attrs(); a.NetNsID >= 0 && host.carriesDefault(a.Index) {
			delete(unfound, a.NetNsID)
		}
	}
	defer func() {
		if len(unfound) > 0 && ctx.Err() == nil {
			info.notef("%s", unfoundNetNSNote(host, unfound, only))
		}
	}()
	// A netns has one id in the node's view: a candidate whose id another
	// took already in this scan is that same netns, reached by another
	// path (a process that entered it, as `ip -n` does, between the
	// listing and this look), not a Pod to count as left out for the
	// bound.
	taken := map[int]bool{}
	counted := 0 // the Pods found that take room under maxPods
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			return err
		}
		id := host.netnsID(c.path)
		if !peerIDs[id] || taken[id] {
			continue
		}
		taken[id] = true
		found = append(found, netnsBehind{c: c, id: id})
		delete(unfound, id)
		again := followed != nil && followed(c)
		if !again && counted >= maxPods {
			info.PodsSkipped++
			for _, l := range host.links {
				if a := l.Attrs(); isVeth(l) && a.NetNsID == id && (only == nil || only[a.Index]) {
					info.PodsSkippedVeths = NameSkipped(info.PodsSkippedVeths, a.Name)
				}
			}
			continue
		}
		pod, err := inspectPod(host, c, netip.Addr{}, vips)
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) { // gone meanwhile: not a pod any more
				info.notef("pod netns %s: %v", c.path, err)
			}
			continue
		}
		if pod.HostPeer == nil || (only != nil && !only[pod.HostPeer.Ifindex]) {
			continue
		}
		// A pod routes through its veth into the node; a netns behind the
		// node's uplink (a gateway, the host of a kind node) has a veth
		// into the node too, but routes elsewhere, or nowhere. One that
		// looks like a Pod routing elsewhere (Multus's default route on
		// net1) is said: unless the node's own default route leaves
		// through that veth, which makes the netns the node's upstream.
		if !pod.viaEth0 {
			switch {
			case len(pod.Eth0.Addrs) == 0 && pod.defaultDev == "":
				info.notef("netns %s%s not taken for a Pod: its %s, a veth into the node (host side %s), has no IPv4 address (an IPv6-only Pod?): pathtrace traces IPv4 Services", c.path, holderComm(c), pod.Eth0.Name, pod.HostPeer.Name)
			case pod.defaultDev != "" && !host.carriesDefault(pod.HostPeer.Ifindex):
				info.notef("netns %s%s not taken for a Pod: %s", c.path, holderComm(c), notRoutedWhy(*pod, vips))
			}
			continue
		}
		if pod.vipRouteOnly && host.carriesDefault(pod.HostPeer.Ifindex) {
			continue // the node's upstream, see upstreamOnly
		}
		info.Pods = append(info.Pods, *pod)
		if !again {
			counted++
		}
	}
	if info.PodsSkipped > 0 {
		info.notef("%d netns with a veth into the node not examined: pathtrace follows at most %d Pods (select one with --pod-ip, --pod-netns or --pod-pid)", info.PodsSkipped, maxPods)
	}
	return nil
}

// netnsBehind is a netns a scan found behind a node veth: id is the id the
// node gives it, the veth's NetNsID.
type netnsBehind struct {
	c  nsCandidate
	id int
}

// MaxSkippedNamed bounds the host veths of Pods left out named
// (NodeInfo.PodsSkippedVeths, NewPods.SkippedVeths): the counts hold them all.
const MaxSkippedNamed = 16

// NameSkipped adds the host veth name to those named of the Pods left out,
// while fewer than MaxSkippedNamed are.
func NameSkipped(names []string, name string) []string {
	if len(names) >= MaxSkippedNamed {
		return names
	}
	return append(names, name)
}

// stillBehind returns the netns of prev behind the veths whose peers' ids
// are peerIDs, in their order, when each of those ids has one that still
// opens the same netns (the same inode, the same id from the node: the
// process whose /proc path it is may have gone, its PID taken by another's);
// nil otherwise.
func stillBehind(host *hostNS, prev []netnsBehind, peerIDs map[int]bool) []nsCandidate {
	var out []nsCandidate
	for _, b := range prev {
		if !peerIDs[b.id] {
			continue
		}
		if inode, err := nsutil.Inode(b.c.path); err != nil || inode != b.c.inode || host.netnsID(b.c.path) != b.id {
			return nil
		}
		out = append(out, b.c)
	}
	if len(out) != len(peerIDs) {
		return nil
	}
	return out
}

// unfoundNetNSNote says which of the node's veths (of only, when set) lead
// into a netns that no process nor mount pathtrace sees holds (nsids):
// their Pods, if any, are not traced.
func unfoundNetNSNote(host *hostNS, nsids map[int]bool, only map[int]bool) string {
	var names []string
	for _, l := range host.links {
		a := l.Attrs()
		if isVeth(l) && nsids[a.NetNsID] && (only == nil || only[a.Index]) {
			names = append(names, a.Name)
		}
	}
	slices.Sort(names)
	shown := names[:min(len(names), 8)]
	list := strings.Join(shown, ", ")
	if len(names) > len(shown) {
		list += fmt.Sprintf(" and %d more", len(names)-len(shown))
	}
	return fmt.Sprintf("veths of the node lead into netns that no process nor mount visible to pathtrace holds (%s): Pods behind them are not traced; give such a Pod's netns with --pod-netns PATH, or its host veth with --host-veth for the node side%s%s", list, ptraceHint(deniedNetNSLinks()), containerHint(ownPIDNamespace(), len(procMounts(mountInfoPath)) > 0))
}

// ptraceHint says why processes' netns could not be read: another user's
// /proc/PID/ns/net needs CAP_SYS_PTRACE, which a container given only the
// capabilities pathtrace requires lacks (a Pod's pause process runs as
// 65535): the Pods' netns are then found only by their names.
func ptraceHint(denied int) string {
	if denied == 0 || hasCapSysPtrace() {
		return ""
	}
	return fmt.Sprintf("; the netns of %d processes could not be read (permission denied: another user's or a non-dumpable process's /proc/PID/ns/net needs CAP_SYS_PTRACE, which pathtrace lacks: add it, or mount the Pods' netns directory, /run/netns, in)", denied)
}

// hasCapSysPtrace tells whether pathtrace may read any process's netns link
// (some, a sandbox's init, stay denied even to it: not its lack).
func hasCapSysPtrace() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if unix.Capget(&hdr, &data[0]) != nil {
		return false
	}
	return data[0].Effective&(1<<unix.CAP_SYS_PTRACE) != 0
}

// containerHint is what a pathtrace in a container's own PID namespace,
// which sees none of the node's processes, lacks to find the Pods' netns.
func containerHint(ownPIDNS, hostProc bool) string {
	if !ownPIDNS || hostProc {
		return ""
	}
	return "; pathtrace runs in a PID namespace of its own (a container's) and sees none of the node's processes: run it with hostPID, or mount the host's /proc into the container (a hostPath volume, anywhere: pathtrace reads it) and /run/netns with mountPropagation HostToContainer"
}

// podHostVeths returns the node's veths that are a Pod's host veth, for
// every Pod of the node as scanPods finds them (a netns whose default route,
// or route to a VIP, leaves through the veth's peer), and their masters:
// what a selector or a bound left out of info.Pods still stays on the node.
// It reads only each candidate netns's routes, and only of netns holding a
// peer of a node veth.
func podHostVeths(ctx context.Context, host *hostNS, vips []netip.Addr) (map[int]bool, error) {
	byID := map[int][]netlink.Link{} // node veths by the id of their peer's netns
	for _, l := range host.links {
		if isVeth(l) && l.Attrs().NetNsID >= 0 {
			byID[l.Attrs().NetNsID] = append(byID[l.Attrs().NetNsID], l)
		}
	}
	out := map[int]bool{}
	if len(byID) == 0 {
		return out, nil
	}
	cands, err := listNetNS(host.inode)
	if err != nil {
		return out, err
	}
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		id := host.netnsID(c.path)
		veths := byID[id]
		if len(veths) == 0 {
			continue
		}
		delete(byID, id)
		_ = nsutil.Netlink(c.path, func(nl *netlink.Handle) error {
			for _, l := range veths {
				a := l.Attrs()
				if _, idx := defaultGateway(nl); idx != a.ParentIndex && host.carriesDefault(a.Index) {
					continue // the node's upstream, see upstreamOnly
				}
				if _, ok := routeThrough(nl, a.ParentIndex, vips); ok {
					out[a.Index] = true
					if a.MasterIndex != 0 {
						out[a.MasterIndex] = true
					}
				}
			}
			return nil
		})
		if len(byID) == 0 {
			break
		}
	}
	return out, nil
}

// netnsID is the id the node netns gives the netns at path, -1 when none.
func (h *hostNS) netnsID(path string) int { return netnsIDIn(h.nl, path) }

// netnsIDIn is the id the netns of nl gives the netns at path, -1 when none.
func netnsIDIn(nl *netlink.Handle, path string) int {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return -1
	}
	defer ns.Close()
	id, err := nl.GetNetNsIdByFd(int(ns))
	if err != nil {
		return -1
	}
	return id
}

// podByIP finds the netns (other than the node's) with ip on an interface.
func podByIP(ctx context.Context, host *hostNS, ip netip.Addr, vips []netip.Addr) (*Pod, error) {
	if hasAddr(host.nl, ip) {
		return nil, usagef("--pod-ip %s is an address of the node netns %s, not of a pod; for a hostNetwork Pod leave --pod-ip out: node processes are traced as clients, each flow names its process", ip, host.path)
	}
	cands, err := listNetNS(host.inode)
	if err != nil {
		return nil, err
	}
	// The same IP can live in several netns (other nodes' pods on a host that
	// runs several, like kind or the lab): the pod of this node is the one
	// whose veth leads into the node netns.
	var detached *Pod
	for _, c := range cands {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		found, err := netnsHasAddr(c.path, ip)
		if err != nil || !found {
			continue // gone meanwhile, or not the one
		}
		pod, err := inspectPod(host, c, ip, vips)
		if err != nil {
			continue
		}
		if pod.HostPeer != nil {
			return pod, nil
		}
		if detached == nil {
			detached = pod
		}
	}
	if detached != nil {
		return detached, nil
	}
	return nil, usagef("--pod-ip %s: no pod has this address (%d netns checked); give the IP of a pod running on this node%s", ip, len(cands), hiddenPodHint(host, ip))
}

// hiddenPodHint is, when the node routes ip through a veth into another
// netns, what to give instead of --pod-ip: that netns is held by nothing
// pathtrace sees (a process of another PID namespace, a mount of another
// mount namespace).
func hiddenPodHint(host *hostNS, ip netip.Addr) string {
	routes, err := host.nl.RouteGet(net.IP(ip.AsSlice()))
	if err != nil || len(routes) == 0 || routes[0].Type == unix.RTN_LOCAL {
		return ""
	}
	l, err := host.link(routes[0].LinkIndex)
	if err != nil || !isVeth(l) || l.Attrs().NetNsID < 0 || host.carriesDefault(l.Attrs().Index) {
		return ""
	}
	name := l.Attrs().Name
	return fmt.Sprintf("; but the node routes it through %s, a veth into a netns that no process nor mount visible to pathtrace holds: give that netns with --pod-netns PATH, or --host-veth %s for the node side", name, name)
}

func netnsHasAddr(path string, ip netip.Addr) (bool, error) {
	found := false
	err := nsutil.Netlink(path, func(nl *netlink.Handle) error {
		found = hasAddr(nl, ip)
		return nil
	})
	return found, err
}

func hasAddr(nl *netlink.Handle, ip netip.Addr) bool {
	addrs, err := nl.AddrList(nil, netlink.FAMILY_V4)
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return false
	}
	for _, a := range addrs {
		if ad, ok := netip.AddrFromSlice(a.IP); ok && ad.Unmap() == ip {
			return true
		}
	}
	return false
}

// errNotPod is inspectPod's for a netns with neither a veth into the node
// netns nor a default route.
var errNotPod = errors.New("it has no default route and no veth into the node netns")

// inspectPod reads a pod netns: its interface towards the node (see
// pickPodIface), addresses, the route through it (see routeThrough) with
// its gateway and gateway MAC, and the host peer.
func inspectPod(host *hostNS, c nsCandidate, want netip.Addr, vips []netip.Addr) (*Pod, error) {
	ns, err := netns.GetFromPath(c.path)
	if err != nil {
		return nil, fmt.Errorf("open pod netns: %w", err)
	}
	defer ns.Close()
	nl, err := nsutil.HandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in pod netns: %w", err)
	}
	defer nl.Close()

	links, err := linkList(nl)
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	// Both ids exist once each side has dumped its links (done above and in openHost).
	hostID, err := nl.GetNetNsIdByFd(int(host.ns))
	if err != nil {
		return nil, fmt.Errorf("node netns id seen from the pod: %w", err)
	}
	podID, err := host.nl.GetNetNsIdByFd(int(ns))
	if err != nil {
		return nil, fmt.Errorf("pod netns id seen from the node: %w", err)
	}
	gw, gwIndex := defaultGateway(nl)

	eth0 := pickPodIface(nl, links, hostID, gwIndex, vipRouteDevs(nl, vips), want)
	if eth0 == nil {
		return nil, errNotPod
	}
	pod := &Pod{
		NetNS:  NetNS{Path: c.path, Inode: c.inode},
		PID:    c.pid,
		Comm:   c.comm,
		NSName: c.name,
		Eth0:   iface(nl, eth0),
		links:  linkNames(slices.Values(links)),
	}
	if gwIndex != 0 && gwIndex != eth0.Attrs().Index {
		pod.defaultDev = linkName(nl, gwIndex)
	}
	pod.OtherIfaces = otherIfaces(nl, links, eth0.Attrs().Index)
	pod.vipsElsewhere = vipsElsewhere(nl, eth0.Attrs().Index, vips)
	if gwIndex != eth0.Attrs().Index {
		gw, pod.viaEth0 = vipRouteThrough(nl, eth0.Attrs().Index, vips)
		pod.vipRouteOnly = pod.viaEth0
	} else {
		pod.viaEth0 = true
	}
	if pod.viaEth0 {
		pod.Gateway = gw
		pod.GatewayMAC = neighbourMAC(nl, eth0.Attrs().Index, gw)
	}
	switch a := eth0.Attrs(); {
	case isVethTo(eth0, hostID):
		if hl, err := host.link(a.ParentIndex); err == nil && isVethTo(hl, podID) && hl.Attrs().ParentIndex == a.Index {
			pod.HostPeer = hostPeer(host, hl)
		}
	case isStackedOn(eth0, hostID):
		pod.lower, pod.lowerName = a.ParentIndex, host.name(a.ParentIndex)
	case isVeth(eth0) && a.NetNsID >= 0:
		pod.peerElsewhere, pod.peerNSID = true, a.NetNsID
	}
	return pod, nil
}

// maxVIPRoutes bounds the route lookups towards VIPs in one netns.
const maxVIPRoutes = 16

// routeThrough tells whether the netns of nl sends through its interface
// index, and the gateway it sends to: by its default route, else (when that
// leaves elsewhere, as a Multus Pod's on net1, or is missing) by its route to
// one of the VIPs. The gateway is zero for an on-link route.
func routeThrough(nl *netlink.Handle, index int, vips []netip.Addr) (netip.Addr, bool) {
	if gw, idx := defaultGateway(nl); idx == index {
		return gw, true
	}
	return vipRouteThrough(nl, index, vips)
}

// vipRouteThrough tells whether the route of the netns of nl to one of the
// VIPs leaves through its interface index, and that route's gateway.
func vipRouteThrough(nl *netlink.Handle, index int, vips []netip.Addr) (netip.Addr, bool) {
	for _, vip := range vips[:min(len(vips), maxVIPRoutes)] {
		routes, err := nl.RouteGet(net.IP(vip.AsSlice()))
		if err != nil || len(routes) == 0 || routes[0].Type == unix.RTN_LOCAL {
			continue
		}
		if r := routes[0]; r.LinkIndex == index {
			gw, _ := netip.AddrFromSlice(r.Gw)
			return gw.Unmap(), true
		}
	}
	return netip.Addr{}, false
}

// otherIfaces are the interfaces among links with an IPv4 address but
// index's and loopback's.
func otherIfaces(nl *netlink.Handle, links []netlink.Link, index int) []Iface {
	var out []Iface
	for _, l := range links {
		if l.Attrs().Index == index || l.Attrs().Flags&net.FlagLoopback != 0 {
			continue
		}
		if ifc := iface(nl, l); len(ifc.Addrs) > 0 {
			out = append(out, ifc)
		}
	}
	return out
}

// vipsElsewhere says which of the VIPs the netns of nl routes through
// another interface than index ("10.120.0.10 through net1"), "" when none.
func vipsElsewhere(nl *netlink.Handle, index int, vips []netip.Addr) string {
	var out []string
	for _, vip := range vips[:min(len(vips), maxVIPRoutes)] {
		routes, err := nl.RouteGet(net.IP(vip.AsSlice()))
		if err != nil || len(routes) == 0 || routes[0].Type == unix.RTN_LOCAL || routes[0].LinkIndex == index {
			continue
		}
		out = append(out, fmt.Sprintf("%s through %s", vip, linkName(nl, routes[0].LinkIndex)))
	}
	return strings.Join(out, ", ")
}

// vipRouteDevs are the interfaces the netns of nl routes the VIPs through
// (the first maxVIPRoutes of them).
func vipRouteDevs(nl *netlink.Handle, vips []netip.Addr) map[int]bool {
	devs := map[int]bool{}
	for _, vip := range vips[:min(len(vips), maxVIPRoutes)] {
		if routes, err := nl.RouteGet(net.IP(vip.AsSlice())); err == nil && len(routes) > 0 && routes[0].Type != unix.RTN_LOCAL {
			devs[routes[0].LinkIndex] = true
		}
	}
	return devs
}

// linkName names the link with that ifindex in the netns of nl.
func linkName(nl *netlink.Handle, index int) string {
	if l, err := nl.LinkByIndex(index); err == nil {
		return l.Attrs().Name
	}
	return fmt.Sprintf("if%d", index)
}

// carriesDefault tells whether the node's default route leaves through the
// node link index or its master.
func (h *hostNS) carriesDefault(index int) bool {
	if h.defaultDevs == nil {
		h.defaultDevs = map[int]bool{}
		routes, _ := h.nl.RouteList(nil, netlink.FAMILY_V4)
		for _, r := range routes {
			if isDefaultRoute(r) {
				for _, idx := range nextHopDevices(r) {
					h.defaultDevs[idx] = true
				}
			}
		}
	}
	if h.defaultDevs[index] {
		return true
	}
	l, err := h.link(index)
	return err == nil && l.Attrs().MasterIndex != 0 && h.defaultDevs[l.Attrs().MasterIndex]
}

// pickPodIface chooses the pod's interface towards the node: the one with want
// if given, else the veth into the node netns its route to a traced VIP
// leaves through (vipDevs: a Multus Pod whose default route is on net1
// still reaches Services through eth0), else the one carrying the default
// route, else the first such veth.
func pickPodIface(nl *netlink.Handle, links []netlink.Link, hostID, gwIndex int, vipDevs map[int]bool, want netip.Addr) netlink.Link {
	if want.IsValid() {
		addrs, _ := nl.AddrList(nil, netlink.FAMILY_V4)
		for _, a := range addrs {
			if ad, ok := netip.AddrFromSlice(a.IP); ok && ad.Unmap() == want {
				for _, l := range links {
					if l.Attrs().Index == a.LinkIndex {
						return l
					}
				}
			}
		}
		return nil
	}
	var first, viaDefault netlink.Link
	for _, l := range links {
		if !isVethTo(l, hostID) {
			continue
		}
		switch idx := l.Attrs().Index; {
		case vipDevs[idx]:
			return l
		case idx == gwIndex:
			viaDefault = l
		case first == nil:
			first = l
		}
	}
	if viaDefault != nil {
		return viaDefault
	}
	if first != nil {
		return first
	}
	// No veth into the node (macvlan, ipvlan...): the default route's interface
	// still gives a pod-side capture point.
	for _, l := range links {
		if l.Attrs().Index == gwIndex {
			return l
		}
	}
	return nil
}

// isStackedOn tells whether l is a macvlan or ipvlan whose lower device is
// in the netns with that id.
func isStackedOn(l netlink.Link, nsid int) bool {
	switch l.(type) {
	case *netlink.Macvlan, *netlink.Macvtap, *netlink.IPVlan:
		return nsid >= 0 && l.Attrs().NetNsID == nsid && l.Attrs().ParentIndex != 0
	}
	return false
}

// isVethTo tells whether l is a veth whose peer is in the netns with that id.
func isVethTo(l netlink.Link, nsid int) bool {
	return isVeth(l) && nsid >= 0 && l.Attrs().NetNsID == nsid
}

// isVeth tells whether l is one end of a pair of devices whose other end
// is ParentIndex in the netns NetNsID: a veth, or a netkit (Cilium's
// datapathMode=netkit, its primary on the node, its peer the Pod's eth0),
// which links its ends the same way. A netkit's BPF programs run inside
// the pair, between its two ends' taps (see NetkitChain).
func isVeth(l netlink.Link) bool {
	switch l.(type) {
	case *netlink.Veth, *netlink.Netkit:
		return true
	}
	return false
}

func hostPeer(host *hostNS, l netlink.Link) *HostPeer {
	master, kind := host.masterOf(l)
	return &HostPeer{Iface: iface(host.nl, l), Master: master, MasterKind: kind}
}

func iface(nl *netlink.Handle, l netlink.Link) Iface {
	a := l.Attrs()
	ifc := Iface{Name: a.Name, Ifindex: a.Index, MAC: a.HardwareAddr.String(), Kind: l.Type()}
	addrs, _ := nl.AddrList(l, netlink.FAMILY_V4)
	for _, ad := range addrs {
		if ip, ok := netip.AddrFromSlice(ad.IP); ok && ad.IPNet != nil {
			ones, _ := ad.Mask.Size()
			ifc.Addrs = append(ifc.Addrs, netip.PrefixFrom(ip.Unmap(), ones))
		}
	}
	return ifc
}

// defaultGateway returns the IPv4 default route's gateway and device.
func defaultGateway(nl *netlink.Handle) (netip.Addr, int) {
	routes, _ := nl.RouteList(nil, netlink.FAMILY_V4)
	for _, r := range routes {
		if !isDefaultRoute(r) {
			continue
		}
		gw, _ := netip.AddrFromSlice(r.Gw)
		if r.LinkIndex == 0 && len(r.MultiPath) > 0 {
			gw, _ = netip.AddrFromSlice(r.MultiPath[0].Gw)
			return gw.Unmap(), r.MultiPath[0].LinkIndex
		}
		return gw.Unmap(), r.LinkIndex
	}
	return netip.Addr{}, 0
}

func isDefaultRoute(r netlink.Route) bool {
	if r.Dst == nil {
		return true
	}
	ones, _ := r.Dst.Mask.Size()
	return ones == 0
}

// neighbourMAC reads ip's MAC from the neighbour table (read-only: an entry
// that is not resolved yet gives "").
func neighbourMAC(nl *netlink.Handle, index int, ip netip.Addr) string {
	if !ip.IsValid() {
		return ""
	}
	neighs, _ := nl.NeighList(index, netlink.FAMILY_V4)
	for _, n := range neighs {
		if n.IP.Equal(net.IP(ip.AsSlice())) && len(n.HardwareAddr) > 0 && n.State&(unix.NUD_INCOMPLETE|unix.NUD_FAILED) == 0 {
			return n.HardwareAddr.String()
		}
	}
	return ""
}

// RefreshGatewayMACs re-reads each Pod's gateway MAC from its neighbour table:
// a Pod that had not talked to its gateway yet when discovery ran has resolved
// it since.
func RefreshGatewayMACs(node *NodeInfo) {
	for i := range node.Pods {
		p := &node.Pods[i]
		if p.GatewayMAC != "" || !p.Gateway.IsValid() {
			continue
		}
		_ = nsutil.Netlink(p.NetNS.Path, func(nl *netlink.Handle) error {
			p.GatewayMAC = neighbourMAC(nl, p.Eth0.Ifindex, p.Gateway)
			return nil
		})
	}
}
