package session

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// podFollow follows the Pods that start while the session runs, when every
// Pod of the node is traced: a Deployment rolled out during an incident
// replaces the client Pods, and their flows are the ones that matter. Each
// new Pod gets what the Pods of the start have: taps on its eth0 and host
// veth (and on its uplink when no Pod took that one yet), the tcx
// observers once its host veth has a tc program, its socket events in
// scope, and an interface of its own in the pcapng file.
type podFollow struct {
	watch   *discover.PodWatch
	node    *discover.NodeInfo // new Pods join its list
	next    time.Time          // no periodic look before
	last    time.Time          // the last look
	prog    *ebpf.Program      // the taps' eBPF filter (nil: classic)
	progErr error

	started []string // what the report says of each, bounded
	more    int      // Pods started beyond maxStartedListed
	skipped int      // Pods left out: the bound on Pods reached
	// skippedVeths names their host veths, with when each was left out
	// (discover.MaxSkippedNamed).
	skippedVeths []string
	maxPods      int      // that bound
	failed       []string // taps of new Pods that failed
	lookErr      string   // the last look that failed
	// untilStopped: a run until stopped, whose bound is on the Pods
	// followed at once (discover.PodWatch.GiveRoomBack). It lists the
	// last Pods started (earlier counts those it no longer lists),
	// forgets the Pods that went (went counts them) from the node's
	// lists, and counts the capture points it could not open for the
	// bound on taps (overTaps).
	untilStopped bool
	earlier      int
	went         int
	overTaps     int
}

const (
	// podWatchEvery is how often the node's veths are looked at, and
	// podHintGap the least time between two looks when a veth came (a
	// look behind a veth enters its netns: a node whose links churn must
	// not have the loop do only that).
	podWatchEvery = 2 * time.Second
	podHintGap    = 200 * time.Millisecond
	// maxStartedListed bounds the Pods the report lists one by one.
	maxStartedListed = 64
)

// followNewPods looks, every podWatchEvery, or sooner when hinted that a
// veth came (the Pod's first connections follow its CNI's set-up at once),
// for Pods that started, and follows them; startTap runs the producer of a
// new tap. A new Pod's uplink not tapped yet (a routed node's rules can
// send a Pod's source elsewhere) is tapped too. It returns a stop reason
// when the capture file reached a bound.
func (tr *tracer) followNewPods(ctx context.Context, now time.Time, hinted bool, startTap func(int)) (stop string) {
	pf := tr.pods
	if pf == nil || (!hinted && now.Before(pf.next)) || (hinted && now.Sub(pf.last) < podHintGap) {
		return ""
	}
	pf.next, pf.last = now.Add(podWatchEvery), now
	found, err := pf.watch.Look(ctx, now)
	tr.forgetGonePods(now, found.Gone)
	if err != nil {
		if ctx.Err() == nil { // not the run's end
			pf.lookErr = fmt.Sprintf("%s: %v", now.Format("15:04:05"), err)
		}
		return ""
	}
	pf.skipped += found.Skipped
	for _, name := range found.SkippedVeths {
		// When: a run until stopped leaves a Pod out while another is
		// followed, and follows the next one once that one went.
		pf.skippedVeths = discover.NameSkipped(pf.skippedVeths, name+" at "+now.Format("15:04:05"))
	}
	if len(found.Pods) == 0 {
		return ""
	}
	for _, p := range found.Pods {
		tr.addScope(p.NetNS.Inode)
	}
	// The node as the report and an incident's snapshot describe it after
	// the run: its Pods, their capture points and tc programs.
	pf.node.Pods = append(pf.node.Pods, found.Pods...)
	pf.node.CapturePoints = append(pf.node.CapturePoints, found.CapturePoints...)
	pf.node.TCPrograms = append(pf.node.TCPrograms, found.TCPrograms...)
	pf.node.TCRedirects = append(pf.node.TCRedirects, found.TCRedirects...)
	// The observers first, as at the start: a flow then meets the tcx
	// observers before the taps miss its first packets. A veth without a
	// tc program gets them once one appears there (tracer.observeTC).
	tr.late.newVeths(found.CapturePoints)
	tr.observeTC(now, found.TCPrograms)
	for _, cp := range found.CapturePoints {
		if cp.Role == discover.RoleHost && cp.TCUnread {
			tr.observeVeth(now, cp.Ifindex, cp.Ifname, tcBoth, "its tc programs could not be read")
		}
	}
	tr.tc.add(found.CapturePoints, found.TCPrograms, now, tr.eng)
	var hostIfindexes []int
	routed := map[int]bool{}
	for _, cp := range found.CapturePoints {
		if cp.Role == discover.RoleHost {
			hostIfindexes = append(hostIfindexes, cp.Ifindex)
			routed[cp.Ifindex] = cp.MasterKind == "none"
		}
	}
	tr.eng.SetHostVethsRouted(routed)
	tr.eng.AddPodHostSides(podHostSides(found.Pods))
	tr.eng.AddPodTCPrograms(now, hostIfindexes, podTCPrograms(found.TCPrograms))
	// The new veths' tc redirects, read with their programs: a nowhere
	// flow of the Pod names the one that takes its packets past netfilter.
	tr.eng.AddHostRedirects(now, hostRedirects(found.TCRedirects))
	// The nftables chains on the new veths, listed with the node's.
	tr.nat.podsAdded(tr.eng)
	tr.replayUnscoped(now)
	// The Pods' points share a bounded budget of rings, as at the start:
	// each new one gets the share of a node with that many points (the
	// rings open cannot shrink, so the total grows slowly with every Pod).
	podPoints := 0
	for _, tp := range tr.taps {
		if tp.t != nil && tp.role != discover.RoleUplink { // a slot forgotten has none
			podPoints++
		}
	}
	taps, tapAtts := openTaps(&discover.NodeInfo{Pods: found.Pods, CapturePoints: found.CapturePoints}, podPoints, tr.watch, tr.opt.Snaplen, tr.opt.RingBytes, tr.opt.CaptureBehind, pf.prog, pf.progErr)
	tr.late.keep(tapAtts...)

	all := append(append([]tap(nil), tr.taps...), taps...)
	labels := pointLabels(all, pf.node.Pods)
	taken := tr.labelsTaken()
	first := len(tr.taps)
	for i := range taps {
		// A Pod that came back with the address of one that went (a
		// StatefulSet's) is a capture point of its own: the report counts
		// per label and the pcapng names interfaces by it.
		base := labels[first+i]
		if taps[i].role == discover.RoleHost {
			base = taps[i].role + ":" + taps[i].ifname // the node's veths have names of their own
		}
		taps[i].label = tr.newLabel(base, taken)
	}
	var opened []tap
	for _, tp := range taps {
		if stop != "" {
			tp.t.Close()
			continue
		}
		slot := tr.tapSlot()
		if slot < 0 {
			tp.t.Close()
			pf.overTaps++
			continue
		}
		if tr.pcap != nil && slot == len(tr.taps) { // a slot reused: the file ended, see tapEnded
			if stop = tr.pcap.addInterface(tp, tr.opt.Snaplen); stop != "" {
				// The file reached its bound: the run ends, as for a packet.
				tp.t.Close()
				continue
			}
		}
		if slot == len(tr.taps) {
			tr.taps = append(tr.taps, tp)
		} else {
			tr.taps[slot] = tp
		}
		startTap(slot)
		opened = append(opened, tp)
	}
	for _, p := range found.Pods {
		pf.note(p, now, opened)
	}
	for _, a := range tapAtts {
		if a.Err != nil {
			if len(pf.failed) < maxStartedListed { // the report lists no more
				pf.failed = append(pf.failed, fmt.Sprintf("%s %s: %v", a.Observer, a.Where, a.Err))
			}
		}
	}
	return stop
}

// labelsTaken are the capture point labels a new tap must not take: the
// taps', and those of the gone taps the report lists (capture_ended). A
// run until stopped forgets a gone Pod's taps, and reuses their slots.
func (tr *tracer) labelsTaken() map[string]bool {
	taken := map[string]bool{}
	for _, tp := range tr.taps {
		taken[tp.label] = true
	}
	if g := tr.gone; g != nil {
		for _, e := range g.ended {
			taken[e.label] = true
		}
	}
	return taken
}

// newLabel is the label of a new tap named base: base, or base#2, #3...
// when taken, or when an open flow counts at it (a gone Pod's, listed no
// more); it takes it.
func (tr *tracer) newLabel(base string, taken map[string]bool) string {
	label := base
	for n := 2; taken[label] || tr.eng.CountsAt(label); n++ {
		label = fmt.Sprintf("%s#%d", base, n)
	}
	taken[label] = true
	return label
}

// note records a started Pod for the report: who it is, when it was found
// and which of the taps opened follow it.
func (pf *podFollow) note(p discover.Pod, at time.Time, opened []tap) {
	if len(pf.started) >= maxStartedListed {
		if !pf.untilStopped {
			pf.more++
			return
		}
		// A run until stopped lists the last ones.
		pf.started = slices.Delete(pf.started, 0, 1)
		pf.earlier++
	}
	who := p.NetNS.Path
	if len(p.Eth0.Addrs) > 0 {
		who = fmt.Sprintf("%s (netns %s)", p.Eth0.Addrs[0].Addr(), p.NetNS.Path)
	}
	var mine []string
	for _, tp := range opened {
		if tp.netns == p.NetNS.Path && tp.ifname == p.Eth0.Name || p.HostPeer != nil && tp.role == discover.RoleHost && tp.ifname == p.HostPeer.Name ||
			tp.role == discover.RoleUplink && slices.Contains(p.Uplinks, tp.ifname) {
			mine = append(mine, tp.label)
		}
	}
	taps := "none opened"
	if len(mine) > 0 {
		taps = strings.Join(mine, ", ")
	}
	pf.started = append(pf.started, fmt.Sprintf("%s at %s, taps %s", who, at.Format("15:04:05"), taps))
}

// summary says which Pods started and were followed, for the report; nil
// when none did.
func (pf *podFollow) summary() []string {
	if pf == nil {
		return nil
	}
	out := pf.started
	if pf.earlier > 0 {
		out = append([]string{fmt.Sprintf("%d earlier (the last %d listed)", pf.earlier, len(pf.started))}, out...)
	}
	if pf.more > 0 {
		out = append(out, fmt.Sprintf("%d more", pf.more))
	}
	if pf.went > 0 {
		out = append(out, fmt.Sprintf("%d Pods followed went during the run", pf.went))
	}
	if pf.skipped > 0 {
		line := fmt.Sprintf("%d not followed: pathtrace follows at most %d Pods", pf.skipped, pf.maxPods)
		if pf.untilStopped {
			line += " at once"
		}
		out = append(out, line+skippedVethsSaid(pf.skippedVeths, pf.skipped))
	}
	if pf.overTaps > 0 {
		out = append(out, fmt.Sprintf("%d capture points of new Pods not opened: a run has at most %d open at once (with --pcap, until the file ends, every capture point of the run counts)", pf.overTaps, maxTaps))
	}
	for _, f := range pf.failed {
		out = append(out, "not attached: "+f)
	}
	if pf.lookErr != "" {
		out = append(out, "the last look for new Pods failed at "+pf.lookErr)
	}
	return out
}

// skippedVethsSaid names the host veths of the Pods not followed, of the
// count in all.
func skippedVethsSaid(names []string, count int) string {
	if len(names) == 0 {
		return ""
	}
	s := " (host veth " + strings.Join(names, ", ")
	if len(names) > 1 {
		s = " (host veths " + strings.Join(names, ", ")
	}
	if count > len(names) {
		s += fmt.Sprintf(", %d more", count-len(names))
	}
	return s + ")"
}

// releaseGone closes the taps of the Pods whose netns went: a Pod deleted
// without its veth (the runtime dropped the netns, the CNI did not delete
// the link) leaves a netns that only the tap's socket keeps alive, with its
// veth pair, on the node's bridge, for as long as the capture would run.
// A netns is gone when its path no longer opens it (the bind mount
// removed, the process that held it exited) and no process or name holds
// it any more: an app container that restarts in a Pod that lives on does
// not count.
func (tr *tracer) releaseGone(now time.Time) {
	tr.forgetEnded()
	var gone []int
	for i, tp := range tr.taps {
		if tp.role != discover.RolePod || tp.inode == 0 || *tp.released != "" || !tp.t.StillBound() {
			// An unbound tap ends by itself (capture.Tap.RunBlocks): its
			// interface went, as a CNI deletes a Pod's veth before the
			// runtime its netns; it did not keep the netns alive.
			continue
		}
		if ino, err := nsutil.Inode(tp.netns); err != nil || ino != tp.inode {
			gone = append(gone, i) // gone, or another netns (a reused PID) or file now
		}
	}
	if len(gone) == 0 {
		return
	}
	held, err := discover.HeldNetNS()
	if err != nil {
		return // looked at again next time
	}
	for _, i := range gone {
		tp := tr.taps[i]
		if path, ok := held[tp.inode]; ok {
			// Its path was a process that exited in a Pod that lives on
			// (an app container restarted): look at another from now on.
			tr.taps[i].netns = path
			continue
		}
		*tp.released = fmt.Sprintf("released at %s: its Pod's netns was deleted; the capture alone kept it (and its veth pair) alive", now.Format("15:04:05"))
		// Its socket events are out of scope from now on: once the tap,
		// the last holder, closes, the kernel frees the netns and gives
		// its inode number to the next netns made on the machine, which
		// is no Pod of this run (or one the Pod watch finds and adds).
		tr.unscope(tp.inode)
		// Close waits for the tap's producer to leave the ring, and the
		// producer may be waiting for this goroutine, the consumer, to
		// take its batch.
		go tp.t.Close()
	}
}

// maxTaps bounds the slots of tracer.taps: the consumer's packet kinds
// name a capture point by its slot in 16 bits (kindOf). A bounded run's
// taps take a slot each; a run until stopped reuses the slots of the taps
// it forgot (tapEnded), so only the capture points open at once count
// (two per Pod followed, at most discover.DefaultMaxPods of them, and the
// uplinks), except while its pcapng file takes frames: the file's
// interfaces are the slots, and it cannot remove one.
const maxTaps = 1 << 16

// tapSlot is the slot in tracer.taps of the next tap opened: a forgotten
// tap's, else a new one at the end; -1 when none is left (maxTaps).
func (tr *tracer) tapSlot() int {
	if g := tr.gone; g != nil && len(g.free) > 0 {
		i := g.free[len(g.free)-1]
		g.free = g.free[:len(g.free)-1]
		return i
	}
	if len(tr.taps) >= maxTaps {
		return -1
	}
	return len(tr.taps)
}

// goneTaps is what a run until stopped keeps of the taps it forgot. A tap
// whose capture ended before the run (its Pod went: the veth went away, or
// the session released it) is forgotten once the consumer has its last
// frames: its counts go to the totals of the points gone (goneLabel), why
// it ended to a bounded list, its slot in tracer.taps to the next tap
// opened.
type goneTaps struct {
	free []int // slots to reuse
	// waiting are taps ended while the pcapng file takes frames: their
	// slots are the file's interfaces. They are forgotten once it ended
	// (a run until stopped's file is bounded, --max-bytes).
	waiting                            []int
	n                                  int // taps forgotten
	packets, kernelDrops, decodeErrors uint64
	ended                              []goneTap // the last maxGoneListed
}

// goneTap is a forgotten capture point's label and why its capture ended.
type goneTap struct{ label, why string }

// goneLabel names the capture points forgotten in the counts per point.
const goneLabel = "points-gone"

// maxGoneListed bounds the forgotten capture points the report lists.
const maxGoneListed = 64

// tapEnded is called once the consumer has the last frames of tap i, whose
// capture ended before the run: a run until stopped forgets it.
func (tr *tracer) tapEnded(i int) {
	g := tr.gone
	if g == nil {
		return // a bounded run reports every capture point
	}
	if tr.pcap != nil && !tr.pcap.full() {
		g.waiting = append(g.waiting, i)
		return
	}
	tr.forgetTap(i)
}

// forgetEnded forgets the taps that ended while the pcapng file took
// frames, once it ended.
func (tr *tracer) forgetEnded() {
	if g := tr.gone; g != nil && len(g.waiting) > 0 && tr.pcap != nil && tr.pcap.full() {
		for _, i := range g.waiting {
			tr.forgetTap(i)
		}
		g.waiting = nil
	}
}

func (tr *tracer) forgetTap(i int) {
	g := tr.gone
	tp := tr.taps[i]
	if tr.pcap != nil {
		tr.pcap.freeze(tr.taps) // its interfaces as they are: the slots change now
	}
	st := tp.t.Stats()
	g.packets += st.Packets
	g.kernelDrops += st.KernelDrops
	g.decodeErrors += st.DecodeErrors
	ended, gap := captureEnd(cmp.Or(*tp.released, *tp.ended), st)
	if len(g.ended) >= maxGoneListed {
		g.ended = slices.Delete(g.ended, 0, 1)
	}
	g.ended = append(g.ended, goneTap{tp.label, cmp.Or(ended, gap)})
	g.n++
	tr.taps[i] = tap{}
	g.free = append(g.free, i)
	// The packet kinds and fragments remembered name capture points by
	// slot: the next tap in this one must not find the old one's.
	tr.classes.reset()
	clear(tr.frags)
}

// forgetGonePods drops the Pods that went (discover.NewPods.Gone) from the
// node's lists, with their capture points, tc programs and redirects, and
// their netns from the socket observers' scope: a run until stopped's
// lists follow the node as it is. Their taps end by themselves (their
// interfaces went) or were released (releaseGone).
func (tr *tracer) forgetGonePods(now time.Time, gone []uint64) {
	pf := tr.pods
	if len(gone) == 0 || pf == nil {
		return
	}
	node := pf.node
	type point struct {
		netns   string
		ifindex int
	}
	eth0s, veths := map[point]bool{}, map[int]bool{}
	node.Pods = slices.DeleteFunc(node.Pods, func(p discover.Pod) bool {
		if !slices.Contains(gone, p.NetNS.Inode) {
			return false
		}
		eth0s[point{p.NetNS.Path, p.Eth0.Ifindex}] = true
		if p.HostPeer != nil {
			veths[p.HostPeer.Ifindex] = true
		}
		pf.went++
		return true
	})
	node.CapturePoints = slices.DeleteFunc(node.CapturePoints, func(cp discover.CapturePoint) bool {
		return cp.Role == discover.RolePod && eth0s[point{cp.NetNS, cp.Ifindex}] || cp.Role == discover.RoleHost && veths[cp.Ifindex]
	})
	node.TCPrograms = slices.DeleteFunc(node.TCPrograms, func(p discover.TCProgram) bool {
		return p.Role == discover.RoleHost && veths[p.Ifindex] || p.Role == discover.RolePod && veths[p.HostIfindex]
	})
	node.TCRedirects = slices.DeleteFunc(node.TCRedirects, func(r discover.TCRedirect) bool {
		return r.Role == discover.RoleHost && veths[r.Ifindex]
	})
	for _, ino := range gone {
		tr.unscope(ino)
	}
	if tr.eng != nil {
		tr.eng.PodsGone(now, slices.Sorted(maps.Keys(veths)))
	}
	for idx := range veths {
		if _, ok := tr.late.observed[idx]; ok && tr.pr != nil && tr.tc != nil {
			// Its observers went with it: their links are let go.
			tr.pr.ForgetTC(tr.tc.look.HostNetNS(), idx)
		}
		delete(tr.late.observed, idx)
	}
}
