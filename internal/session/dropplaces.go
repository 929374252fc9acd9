package session

import (
	"fmt"
	"strings"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// dropPlaces names the places where the kernel dropped the flows' packets
// (flow.KernelDrop.Where), which the drop observer gives as a netns inode
// and an ifindex: a capture point's label where one sits there
// ("uplink:bond0"), else the node's netns or the netns's name, with the
// ifindex. Names of netns not traced are looked up once each (a listing of
// the machine's netns), at most maxNetnsLookups times a run.
type dropPlaces struct {
	netns   map[uint64]string // inode → name, "" when none found
	lookups int
}

const maxNetnsLookups = 16

// nameDrops sets Where of the kernel drops of fs, and the function of
// those whose events came before the probe had named it; the flow's reason,
// which the engine wrote with the drops unnamed, then names them as the
// table under it does.
func (tr *tracer) nameDrops(fs []flow.Flow) {
	for i := range fs {
		for j := range fs[i].KernelDrops {
			d := &fs[i].KernelDrops[j]
			unnamed := d.String()
			d.Where = tr.dropPlace(d.NetNS, d.Ifindex)
			if d.Function == "" && d.Location != 0 && tr.pr != nil {
				d.Function = tr.pr.DropFunc(d.Location)
			}
			if named := d.String(); named != unnamed {
				fs[i].Reason = strings.ReplaceAll(fs[i].Reason, ": "+unnamed, ": "+named)
			}
		}
	}
}

// dropPlace names the device ifindex in the netns inode.
func (tr *tracer) dropPlace(inode uint64, ifindex int) string {
	for _, tp := range tr.taps {
		if tp.label != "" && tp.inode == inode && tp.ifindex == ifindex {
			return tp.label
		}
	}
	ns := tr.netnsName(inode)
	if ns == "" {
		return ""
	}
	if ifindex == 0 {
		return ns // a packet of a local socket, on no device yet
	}
	return fmt.Sprintf("%s, ifindex %d", ns, ifindex)
}

// netnsName names the netns inode: the node's, a traced Pod's, or the
// path that holds it (/run/netns/NAME); "" when none is found.
func (tr *tracer) netnsName(inode uint64) string {
	if inode == 0 {
		return ""
	}
	if node := tr.node; node != nil {
		if node.HostNetNS.Inode == inode {
			return "the node's netns"
		}
		for _, p := range node.Pods {
			if p.NetNS.Inode == inode {
				return "Pod netns " + p.NetNS.Path
			}
		}
	}
	if name, ok := tr.drops.netns[inode]; ok {
		return name
	}
	if tr.drops.lookups >= maxNetnsLookups {
		return ""
	}
	tr.drops.lookups++
	held, err := discover.HeldNetNS()
	if err != nil {
		return ""
	}
	if tr.drops.netns == nil {
		tr.drops.netns = map[uint64]string{}
	}
	name := held[inode]
	if name != "" {
		name = "netns " + name
	}
	tr.drops.netns[inode] = name
	return name
}
