package discover

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// hostNS is the node's network namespace, opened once: a netns handle, a
// netlink socket inside it, and one dump of its links.
type hostNS struct {
	path  string
	inode uint64
	ns    netns.NsHandle
	nl    *netlink.Handle
	links map[int]netlink.Link // by ifindex
	// defaultDevs are the devices of the node's default routes, read on
	// first use (carriesDefault).
	defaultDevs map[int]bool
}

func openHost(path string) (*hostNS, error) {
	inode, err := nsutil.Inode(path)
	if err != nil {
		return nil, err
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open node netns %s: %w", path, err)
	}
	nl, err := nsutil.HandleAt(ns)
	if err != nil {
		ns.Close()
		return nil, fmt.Errorf("netlink in node netns %s: %w", path, err)
	}
	h := &hostNS{path: path, inode: inode, ns: ns, nl: nl}
	// Dumping the links also makes the kernel assign an id (from this netns's
	// view) to every netns holding a veth peer: pod scanning relies on it.
	links, err := linkList(nl)
	if err != nil {
		h.close()
		return nil, fmt.Errorf("list links in node netns %s: %w", path, err)
	}
	h.links = make(map[int]netlink.Link, len(links))
	for _, l := range links {
		h.links[l.Attrs().Index] = l
	}
	return h, nil
}

func (h *hostNS) close() {
	h.nl.Close()
	h.ns.Close()
}

// link returns the node link with that ifindex, asking the kernel again for
// links that appeared after the dump.
func (h *hostNS) link(index int) (netlink.Link, error) {
	if l, ok := h.links[index]; ok {
		return l, nil
	}
	l, err := h.nl.LinkByIndex(index)
	if err != nil {
		return nil, err
	}
	h.links[index] = l
	return l, nil
}

func (h *hostNS) linkByName(name string) (netlink.Link, error) {
	for _, l := range h.links {
		if l.Attrs().Name == name {
			return l, nil
		}
	}
	l, err := h.nl.LinkByName(name)
	if err != nil {
		return nil, err
	}
	h.links[l.Attrs().Index] = l
	return l, nil
}

func (h *hostNS) name(index int) string {
	if l, err := h.link(index); err == nil {
		return l.Attrs().Name
	}
	return fmt.Sprintf("if%d", index)
}

// linkList dumps links, retrying a few times when a concurrent change
// interrupted the dump (the result would be inconsistent).
func linkList(nl *netlink.Handle) ([]netlink.Link, error) {
	var err error
	for range 3 {
		var links []netlink.Link
		links, err = nl.LinkList()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return links, err
		}
	}
	return nil, err
}

// masterOf names a link's master and its kind: bridge, openvswitch (the
// ovs-system datapath), another link kind, or none.
func (h *hostNS) masterOf(l netlink.Link) (name, kind string) {
	idx := l.Attrs().MasterIndex
	if idx == 0 {
		return "", "none"
	}
	m, err := h.link(idx)
	if err != nil {
		return fmt.Sprintf("if%d", idx), "unknown"
	}
	return m.Attrs().Name, m.Type()
}

// routesFrom tells whether a route of the node's main table gives a as
// the source of what the node sends (the kernel's route to the subnet of
// an address of the uplink does): the node's own connections leave from
// it. A VIP put on a dummy device as a /32 (kube-ipvs0, NodeLocal
// DNSCache's) has only a route of the local table.
func (h *hostNS) routesFrom(a netip.Addr) bool {
	routes, err := h.nl.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(routes, func(r netlink.Route) bool {
		src, ok := netip.AddrFromSlice(r.Src)
		return ok && src.Unmap() == a
	})
}

// addrs are the node netns's addresses, of both families; complete false
// when some may be missing (the dump was interrupted by a change).
func (h *hostNS) addrs() (out []netip.Addr, complete bool) {
	list, err := h.nl.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
		return nil, false
	}
	for _, a := range list {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, err == nil
}

// localVIPs returns which of vips the node netns routes as its own
// (RTN_LOCAL, what `-m addrtype --dst-type LOCAL` and `fib daddr type
// local` test): a NodePort traced as NODE-IP:PORT, or a VIP a node-local
// cache binds (NodeLocal DNSCache puts kube-dns's ClusterIP on a dummy
// device), which the node delivers to its own processes unrewritten. Each
// comes with the device that holds the address, when one does.
func (h *hostNS) localVIPs(vips []netip.Addr) []LocalVIP {
	var local []LocalVIP
	for _, vip := range vips {
		routes, err := h.nl.RouteGet(net.IP(vip.AsSlice()))
		if err != nil || len(routes) == 0 || routes[0].Type != unix.RTN_LOCAL {
			continue
		}
		lv := LocalVIP{Addr: vip}
		if addrs, err := h.nl.AddrList(nil, netlink.FAMILY_V4); err == nil {
			for _, a := range addrs {
				if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == vip {
					lv.Device = h.name(a.LinkIndex)
					break
				}
			}
		}
		local = append(local, lv)
	}
	return local
}
