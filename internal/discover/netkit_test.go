package discover

import (
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestNetkitPodIface: a Pod of Cilium's netkit datapath has a netkit peer
// as its eth0, whose primary is in the node netns (ParentIndex, NetNsID,
// as a veth's): that is its interface towards the node, with a host side,
// even when its default route leaves through another interface (Multus's
// net1, a macvlan). A macvlan is no pair.
func TestNetkitPodIface(t *testing.T) {
	const hostID = 0
	eth0 := &netlink.Netkit{LinkAttrs: netlink.LinkAttrs{Name: "eth0", Index: 2, ParentIndex: 7, NetNsID: hostID}, Mode: netlink.NETKIT_MODE_L3}
	net1 := &netlink.Macvlan{LinkAttrs: netlink.LinkAttrs{Name: "net1", Index: 3, ParentIndex: 4, NetNsID: hostID}}
	links := []netlink.Link{net1, eth0}
	if got := pickPodIface(nil, links, hostID, net1.Index, nil, netip.Addr{}); got != eth0 {
		t.Errorf("pod interface %v, want eth0, the netkit into the node", got.Attrs().Name)
	}
	if !isVethTo(eth0, hostID) || isVethTo(eth0, 5) {
		t.Errorf("isVethTo(netkit into netns %d): want it a pair into that netns only", hostID)
	}
	if isVeth(net1) {
		t.Errorf("a macvlan taken for a pair")
	}
}
