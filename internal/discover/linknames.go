package discover

import (
	"fmt"
	"iter"

	"github.com/vishvananda/netlink"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// maxLinkNames bounds the interface names kept of one netns at discovery
// (NodeInfo.LinkName): the others are looked up when needed (LinkNameIn).
const maxLinkNames = 4096

// linkNames maps the links' ifindexes to their names, at most maxLinkNames.
func linkNames(links iter.Seq[netlink.Link]) map[int]string {
	names := map[int]string{}
	for l := range links {
		if len(names) >= maxLinkNames {
			break
		}
		a := l.Attrs()
		names[a.Index] = a.Name
	}
	return names
}

// LinkName names the interface ifindex of the netns inode as discovery
// read it, when that netns is the node's or a traced Pod's: "" when the
// interface was not there then (or the netns is another).
func (n *NodeInfo) LinkName(inode uint64, ifindex int) string {
	if n == nil || inode == 0 || ifindex <= 0 {
		return ""
	}
	if inode == n.HostNetNS.Inode {
		return n.hostLinks[ifindex]
	}
	for _, p := range n.Pods {
		if p.NetNS.Inode != inode {
			continue
		}
		if name := p.links[ifindex]; name != "" {
			return name
		}
		if p.Eth0.Ifindex == ifindex {
			return p.Eth0.Name
		}
		for _, ifc := range p.OtherIfaces {
			if ifc.Ifindex == ifindex {
				return ifc.Name
			}
		}
	}
	return ""
}

// LinkNameIn asks the kernel for the name of the interface ifindex in the
// netns at path (one that appeared after discovery, or a netns discovery
// did not read).
func LinkNameIn(path string, ifindex int) (string, error) {
	var name string
	err := nsutil.Netlink(path, func(h *netlink.Handle) error {
		l, err := h.LinkByIndex(ifindex)
		if err != nil {
			return fmt.Errorf("ifindex %d: %w", ifindex, err)
		}
		name = l.Attrs().Name
		return nil
	})
	return name, err
}
