package discover

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/vishvananda/netlink"
)

// PodWatch finds the Pods that start after discovery, when every Pod of the
// node is traced (no Pod selector): a Deployment rolled out during an
// incident brings new client Pods, whose flows would otherwise be left out.
// It looks only behind the node's veths that are new since the previous
// look, so a look on a quiet node costs one link dump.
type PodWatch struct {
	hostPath string
	vips     []netip.Addr
	// The bound on Pods (MaxPods): followed counts the Pods followed
	// (discovery's and the watch's), skippedOut the netns left out for
	// it. A bounded run's room is what remains of the bound once both
	// are counted: every Pod seen takes room, for the run. A run until
	// stopped's (GiveRoomBack) is the bound less the Pods followed now: a
	// Pod that went gives its room back.
	max, followed, skippedOut int
	giveBack                  bool
	progs                     *progCache
	// veths are the node's veths known: Pods', and those that proved no
	// Pod's, by ifindex, with what tells them from a veth that gets the
	// ifindex later (see vethID). pending are new ones not (yet) a Pod's,
	// by when first seen: a CNI plugin creates the veth before it
	// configures the Pod's netns.
	veths   map[int]vethID
	pending map[int]time.Time
	// behind are the netns the last look found behind pending veths
	// (scanPods).
	behind []netnsBehind
	// netns are the Pods' netns, by inode, with their host veth (a Pod
	// may have two veths) and cookie. The kernel gives a deleted netns's
	// inode to the next one made: a known inode whose Pod's veth is gone,
	// or whose cookie differs (a Pod made again between two looks, its
	// veth given the same ifindex), is a new Pod's.
	netns map[uint64]podNetNS
	// A new Pod's uplinks are found as discovery found those of the start
	// (--uplink, else the routes towards the Services and backends); the
	// ones not tapped yet (uplinks) are capture points of its own: on a
	// routed node a Pod's source may take another uplink.
	uplink             string
	services, backends []netip.Addr
	uplinks            map[int]bool
	// podIP, when valid, is the only address whose Pods are followed
	// (--pod-ip); Pods of others are known and left alone.
	podIP netip.Addr
}

// podNetNS is a followed Pod's netns: its host veth's ifindex and the
// netns's cookie (0: not read).
type podNetNS struct {
	veth   int
	cookie uint64
}

// netnsCookie is the cookie of the netns at path, 0 when it cannot be read
// (then a Pod is told by its netns's inode and veth alone).
func netnsCookie(path string) uint64 {
	c, _ := nsutil.Cookie(path)
	return c
}

// vethID tells a node veth from one that gets its ifindex later. The
// kernel gives a link moved into the node netns the ifindex it had in the
// netns it came from when that one is free (a CNI that makes the veth pair
// in the Pod's netns and moves the host side out, as Calico's does, or one
// that asks for an ifindex): a Pod deleted and made again can bring a host
// veth of its predecessor's ifindex, and of its name. Its peer's ifindex,
// the id of the peer's netns (the lowest free) and the MAC (Calico's are
// all ee:ee:ee:ee:ee:ee) can repeat too: a veth replaced between two looks
// with all of them the same is missed; one replaced over several looks is
// not (a look forgets the veths gone).
type vethID struct {
	name, mac  string
	peer, nsid int
}

func vethIDOf(l netlink.Link) vethID {
	a := l.Attrs()
	return vethID{name: a.Name, mac: a.HardwareAddr.String(), peer: a.ParentIndex, nsid: a.NetNsID}
}

// vethSettle is how long a new veth that leads to no Pod yet is looked at
// again: CNI plugins configure a Pod's netns within milliseconds to
// seconds.
const vethSettle = 30 * time.Second

// NewPodWatch returns the watch of the Pods of node that start later, or
// nil when opt selects Pods by netns, process or host veth (then only
// those are traced). With --pod-ip it watches for a Pod that gets that
// address in another netns: the selected Pod deleted and made again (a
// StatefulSet's keeps its address).
func NewPodWatch(node *NodeInfo, opt Options) *PodWatch {
	if opt.PodNetNS != "" || opt.PodPID != 0 || opt.HostVeth != "" {
		return nil
	}
	maxPods := opt.MaxPods
	if maxPods <= 0 {
		maxPods = DefaultMaxPods
	}
	w := &PodWatch{hostPath: node.HostNetNS.Path, vips: node.svcs.vips, max: maxPods, followed: len(node.Pods), skippedOut: node.PodsSkipped,
		progs: newProgCache(observerFilter(opt.IsObserver)), veths: map[int]vethID{}, pending: map[int]time.Time{}, netns: map[uint64]podNetNS{},
		behind: node.behind, // the netns discovery found behind the veths the first look looks behind again
		uplink: opt.Uplink, services: node.svcs.vips, backends: node.Backends(), uplinks: map[int]bool{}}
	for _, cp := range node.CapturePoints {
		if cp.Role == RoleUplink {
			w.uplinks[cp.Ifindex] = true
		}
	}
	// The node's other veths are looked behind as new ones are: one may
	// be a Pod's whose CNI was still setting it up at discovery.
	for _, p := range node.Pods {
		if p.HostPeer != nil {
			w.netns[p.NetNS.Inode] = podNetNS{veth: p.HostPeer.Ifindex, cookie: netnsCookie(p.NetNS.Path)}
			if id, ok := node.veths[p.HostPeer.Ifindex]; ok {
				w.veths[p.HostPeer.Ifindex] = id
			}
		}
	}
	if w.room() <= 0 || opt.PodIP.IsValid() {
		// Discovery reached the bound (and counted what it left out), or
		// found the Pod with the address (the others are not traced): no
		// veth of the start is looked behind again, nor counted again.
		maps.Copy(w.veths, node.veths)
	}
	w.podIP = opt.PodIP
	return w
}

// GiveRoomBack makes a Pod that went give its room under the bound back
// (a run until stopped: the bound is on the Pods followed at once, not on
// those seen over the run, on a node where CronJobs and rollouts bring a
// Pod a minute), and Look report the Pods that went (NewPods.Gone). A Pod
// went when its host veth did: its CNI deleted the pair, or the kernel did
// with the Pod's netns, which a capture that alone held it had to give up
// first (the session's release of gone Pods). A netns left out for the
// bound is not followed later, unless its veth was still waiting to be
// looked behind.
func (w *PodWatch) GiveRoomBack() { w.giveBack = true }

// room is how many more Pods may be followed.
func (w *PodWatch) room() int {
	if w.giveBack {
		return w.max - w.followed
	}
	return w.max - w.followed - w.skippedOut
}

// NewPods are the Pods a look found, with their capture points (eth0 and
// the host veth) and the tc programs on their host veths.
type NewPods struct {
	Pods          []Pod
	CapturePoints []CapturePoint
	TCPrograms    []TCProgram
	// TCRedirects are the mirred actions of the tc filters (not BPF) on
	// their host veths, read with the programs.
	TCRedirects []TCRedirect
	// Skipped counts the netns with a veth into the node left unexamined:
	// the bound on Pods (Options.MaxPods) reached; SkippedVeths names their
	// veths (at most MaxSkippedNamed).
	Skipped      int
	SkippedVeths []string
	// Gone are the netns inodes of the Pods followed whose host veth went
	// since the previous look (only with GiveRoomBack).
	Gone []uint64
}

// Look finds the Pods behind the veths that appeared since the previous
// look.
func (w *PodWatch) Look(ctx context.Context, now time.Time) (NewPods, error) {
	host, err := openHost(w.hostPath)
	if err != nil {
		return NewPods{}, err
	}
	defer host.close()
	// A known veth that went is forgotten, and one whose ifindex another
	// veth has now is not known: a Pod deleted and made again (a
	// StatefulSet's, with its address and often its host veth's name) can
	// get its predecessor's ifindex, and is a new Pod.
	for idx, id := range w.veths {
		if l := host.links[idx]; l == nil || vethIDOf(l) != id {
			delete(w.veths, idx)
		}
	}
	var gone []uint64
	for inode, ns := range w.netns {
		if host.links[ns.veth] == nil {
			delete(w.netns, inode) // its Pod went; the inode may come again
			if w.giveBack {
				w.followed--
				gone = append(gone, inode)
			}
		}
	}
	slices.Sort(gone)
	// A followed Pod's host veth no longer known (renamed, given another
	// MAC) is looked behind once whatever the room: it may lead to that
	// Pod still, which takes none (scanPods' followed).
	followedVeths := map[int]bool{}
	for _, ns := range w.netns {
		followedVeths[ns.veth] = true
	}
	only := map[int]bool{}
	skipped := 0
	var skippedVeths []string
	for idx, l := range host.links {
		if _, known := w.veths[idx]; known {
			continue
		}
		if !isVeth(l) || l.Attrs().NetNsID < 0 {
			continue
		}
		first, ok := w.pending[idx]
		if w.room() <= 0 && (ok || !followedVeths[idx]) {
			// The bound is reached: a new veth is not looked behind, and
			// counted once (a pending one was when scanPods skipped it).
			if !ok {
				skipped++
				skippedVeths = NameSkipped(skippedVeths, l.Attrs().Name)
			}
			w.veths[idx] = vethIDOf(l)
			delete(w.pending, idx)
			continue
		}
		if !ok {
			w.pending[idx], first = now, now
		}
		if now.Sub(first) > vethSettle {
			w.veths[idx] = vethIDOf(l) // no Pod's: looked at long enough
			delete(w.pending, idx)
			continue
		}
		only[idx] = true
	}
	for idx := range w.pending {
		if host.links[idx] == nil {
			delete(w.pending, idx) // gone
		}
	}
	if len(only) == 0 {
		return NewPods{Skipped: skipped, SkippedVeths: skippedVeths, Gone: gone}, nil
	}
	var info NodeInfo
	if err := scanPods(ctx, host, max(w.room(), 0), only, w.follows, w.vips, &info, &w.behind); err != nil {
		return NewPods{Gone: gone}, err
	}
	found := NewPods{Gone: gone}
	found.Skipped = info.PodsSkipped
	for _, name := range info.PodsSkippedVeths {
		found.SkippedVeths = NameSkipped(found.SkippedVeths, name)
	}
	for _, p := range info.Pods {
		idx := p.HostPeer.Ifindex
		delete(w.pending, idx)
		if l := host.links[idx]; l != nil {
			w.veths[idx] = vethIDOf(l)
		}
		// A second veth of a Pod followed, or its veth renamed (or given
		// another MAC): the same Pod. A known inode whose veth went is a
		// new Pod's (see netns).
		cookie := netnsCookie(p.NetNS.Path)
		if ns, ok := w.netns[p.NetNS.Inode]; ok && (ns.cookie == 0 || cookie == 0 || ns.cookie == cookie) {
			if _, live := w.veths[ns.veth]; ns.veth == idx || live {
				continue
			}
		}
		// A Pod followed whose host veth had this ifindex went: its veth
		// was replaced by this new Pod's (see vethID), whatever inode the
		// new netns got.
		for inode, ns := range w.netns {
			if ns.veth == idx {
				delete(w.netns, inode)
				if w.giveBack {
					w.followed--
					gone = append(gone, inode)
				}
			}
		}
		if w.podIP.IsValid() && !slices.ContainsFunc(p.Eth0.Addrs, func(a netip.Prefix) bool { return a.Addr() == w.podIP }) {
			continue // another Pod: not traced
		}
		w.netns[p.NetNS.Inode] = podNetNS{veth: p.HostPeer.Ifindex, cookie: cookie}
		found.Pods = append(found.Pods, p)
	}
	slices.Sort(gone)
	found.Gone = gone
	w.followed += len(found.Pods)
	w.skippedOut += found.Skipped
	if len(found.Pods) == 0 {
		return found, nil
	}
	found.CapturePoints = capturePoints(host, &NodeInfo{Pods: found.Pods}, w.newUplinks(ctx, host, found.Pods))
	found.TCPrograms = tcPrograms(host, found.CapturePoints, w.progs, &info)
	found.TCRedirects = info.TCRedirects
	found.TCPrograms = append(found.TCPrograms, podTCPrograms(found.Pods, w.progs, &info)...)
	if w.giveBack {
		// The programs of the Pods found are not asked about again (a
		// look goes behind new veths only): a run until stopped's cache
		// would keep those of every Pod that came (Cilium loads one per
		// Pod).
		w.progs.forget()
	}
	return found, nil
}

// follows tells whether the netns c is a Pod followed already, as Look
// tells one found again: the same inode, and the same cookie where both
// were read (the kernel gives a deleted netns's inode to the next one).
func (w *PodWatch) follows(c nsCandidate) bool {
	ns, ok := w.netns[c.inode]
	if !ok {
		return false
	}
	if ns.cookie == 0 {
		return true
	}
	cookie := netnsCookie(c.path)
	return cookie == 0 || cookie == ns.cookie
}

// newUplinks sets the uplinks of pods, and returns those not tapped yet.
func (w *PodWatch) newUplinks(ctx context.Context, host *hostNS, pods []Pod) []netlink.Link {
	if w.uplink != "" {
		for i := range pods {
			pods[i].Uplinks, pods[i].UplinkHow = []string{w.uplink}, "--uplink"
		}
		return nil
	}
	// The host veths of the Pods followed are no uplinks, nor those of the
	// Pods left out beyond the bound (partial: looked for, at the cost of
	// a look into every netns). What discovery would note of them, the
	// start's report did.
	var others []int
	for _, ns := range w.netns {
		others = append(others, ns.veth)
	}
	info := NodeInfo{Pods: pods} // its Pods are pods' elements: set in place
	var out []netlink.Link
	partial := w.room() <= 0 || w.podIP.IsValid() // the node's Pods are not all followed
	for _, l := range podUplinks(ctx, host, w.services, w.backends, &info, others, partial) {
		if idx := l.Attrs().Index; !w.uplinks[idx] {
			w.uplinks[idx] = true
			out = append(out, l)
		}
	}
	return out
}
