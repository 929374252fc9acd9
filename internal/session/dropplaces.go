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
// interface's name when known and the ifindex ("the node's netns, cni0
// (ifindex 4)"). Names of netns not traced are looked up once each (a
// listing of the machine's netns), at most maxNetnsLookups times a run;
// interfaces discovery did not read (one that appeared during the run, one
// of a netns not traced) once each, at most maxIfaceLookups a run.
type dropPlaces struct {
	netns   map[uint64]heldNetNS // inode → name and path, "" when none found
	lookups int
	// ifaces are the interface names looked up, "" when none was found.
	ifaces map[ifaceKey]string
	// linkName looks an interface up in the netns at path; nil:
	// discover.LinkNameIn (tests set another).
	linkName func(path string, ifindex int) (string, error)
}

// heldNetNS is a netns not traced: its name in the report ("netns PATH")
// and the path that opens it.
type heldNetNS struct{ name, path string }

// ifaceKey is an interface of some netns.
type ifaceKey struct {
	inode   uint64
	ifindex int
}

const (
	maxNetnsLookups = 16
	maxIfaceLookups = 64
)

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
	ns, path := tr.netnsName(inode)
	if ns == "" {
		return ""
	}
	if ifindex == 0 {
		return ns // a packet of a local socket, on no device yet
	}
	if name := tr.ifaceName(inode, ifindex, path); name != "" {
		return fmt.Sprintf("%s, %s (ifindex %d)", ns, name, ifindex)
	}
	return fmt.Sprintf("%s, ifindex %d", ns, ifindex)
}

// ifaceName names the interface ifindex of the netns inode, which path
// opens: as discovery read the node's and the traced Pods' netns, else as
// the kernel names it now (once per interface, at most maxIfaceLookups a
// run); "" when neither does.
func (tr *tracer) ifaceName(inode uint64, ifindex int, path string) string {
	if name := tr.node.LinkName(inode, ifindex); name != "" {
		return name
	}
	k := ifaceKey{inode, ifindex}
	if name, ok := tr.drops.ifaces[k]; ok {
		return name
	}
	if path == "" || len(tr.drops.ifaces) >= maxIfaceLookups {
		return ""
	}
	lookup := tr.drops.linkName
	if lookup == nil {
		lookup = discover.LinkNameIn
	}
	name, err := lookup(path, ifindex)
	if err != nil {
		name = ""
	}
	if tr.drops.ifaces == nil {
		tr.drops.ifaces = map[ifaceKey]string{}
	}
	tr.drops.ifaces[k] = name
	return name
}

// netnsName names the netns inode: the node's, a traced Pod's, or the
// path that holds it (/run/netns/NAME); "" when none is found. path opens
// it.
func (tr *tracer) netnsName(inode uint64) (name, path string) {
	if inode == 0 {
		return "", ""
	}
	if node := tr.node; node != nil {
		if node.HostNetNS.Inode == inode {
			return "the node's netns", node.HostNetNS.Path
		}
		for _, p := range node.Pods {
			if p.NetNS.Inode == inode {
				return "Pod netns " + p.NetNS.Path, p.NetNS.Path
			}
		}
	}
	if h, ok := tr.drops.netns[inode]; ok {
		return h.name, h.path
	}
	if tr.drops.lookups >= maxNetnsLookups {
		return "", ""
	}
	tr.drops.lookups++
	held, err := discover.HeldNetNS()
	if err != nil {
		return "", ""
	}
	if tr.drops.netns == nil {
		tr.drops.netns = map[uint64]heldNetNS{}
	}
	var h heldNetNS
	if p := held[inode]; p != "" {
		h = heldNetNS{name: "netns " + p, path: p}
	}
	tr.drops.netns[inode] = h
	return h.name, h.path
}
