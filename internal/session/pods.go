package session

import (
	"context"
	"fmt"
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
	next    time.Time          // no look before
	prog    *ebpf.Program      // the taps' eBPF filter (nil: classic)
	progErr error

	started []string // what the report says of each, bounded
	more    int      // Pods started beyond maxStartedListed
	skipped int      // Pods left out: the bound on Pods reached
	maxPods int      // that bound
	failed  []string // taps of new Pods that failed
	lookErr string   // the last look that failed
}

const (
	// podWatchEvery is how often the node's veths are looked at.
	podWatchEvery = 2 * time.Second
	// maxStartedListed bounds the Pods the report lists one by one.
	maxStartedListed = 64
)

// followNewPods looks, every podWatchEvery, for Pods that started, and
// follows them; startTap runs the producer of a new tap. A new Pod's
// uplink not tapped yet (a routed node's rules can send a Pod's source
// elsewhere) is tapped too. It returns a stop reason when the capture file
// reached a bound.
func (tr *tracer) followNewPods(ctx context.Context, now time.Time, startTap func(int)) (stop string) {
	pf := tr.pods
	if pf == nil || now.Before(pf.next) {
		return ""
	}
	pf.next = now.Add(podWatchEvery)
	found, err := pf.watch.Look(ctx, now)
	if err != nil {
		if ctx.Err() == nil { // not the run's end
			pf.lookErr = fmt.Sprintf("%s: %v", now.Format("15:04:05"), err)
		}
		return ""
	}
	pf.skipped += found.Skipped
	if len(found.Pods) == 0 {
		return ""
	}
	for _, p := range found.Pods {
		tr.scope[p.NetNS.Inode] = true
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
	for _, cp := range found.CapturePoints {
		if cp.Role == discover.RoleHost {
			hostIfindexes = append(hostIfindexes, cp.Ifindex)
		}
	}
	tr.eng.AddPodTCPrograms(now, hostIfindexes, podTCPrograms(found.TCPrograms))
	// The new veths' tc redirects, read with their programs: a nowhere
	// flow of the Pod names the one that takes its packets past netfilter.
	tr.eng.AddHostRedirects(now, hostRedirects(found.TCRedirects))
	// The Pods' points share a bounded budget of rings, as at the start:
	// each new one gets the share of a node with that many points (the
	// rings open cannot shrink, so the total grows slowly with every Pod).
	podPoints := 0
	for _, tp := range tr.taps {
		if tp.role != discover.RoleUplink {
			podPoints++
		}
	}
	taps, tapAtts := openTaps(&discover.NodeInfo{Pods: found.Pods, CapturePoints: found.CapturePoints}, podPoints, tr.watch, tr.opt.Snaplen, tr.opt.RingBytes, pf.prog, pf.progErr)
	tr.late.atts = append(tr.late.atts, tapAtts...)

	all := append(append([]tap(nil), tr.taps...), taps...)
	labels := pointLabels(all, pf.node.Pods)
	taken := map[string]bool{}
	for _, tp := range tr.taps {
		taken[tp.label] = true
	}
	first := len(tr.taps)
	for i := range taps {
		// A Pod that came back with the address of one that went (a
		// StatefulSet's) is a capture point of its own: the report counts
		// per label and the pcapng names interfaces by it.
		base := labels[first+i]
		if taps[i].role == discover.RoleHost {
			base = taps[i].role + ":" + taps[i].ifname // the node's veths have names of their own
		}
		label := base
		for n := 2; taken[label]; n++ {
			label = fmt.Sprintf("%s#%d", base, n)
		}
		taken[label] = true
		taps[i].label = label
	}
	var opened []tap
	for _, tp := range taps {
		if stop != "" {
			tp.t.Close()
			continue
		}
		if tr.pcap != nil {
			if stop = tr.pcap.addInterface(tp, tr.opt.Snaplen); stop != "" {
				// The file reached its bound: the run ends, as for a packet.
				tp.t.Close()
				continue
			}
		}
		tr.taps = append(tr.taps, tp)
		startTap(len(tr.taps) - 1)
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

// note records a started Pod for the report: who it is, when it was found
// and which of the taps opened follow it.
func (pf *podFollow) note(p discover.Pod, at time.Time, opened []tap) {
	if len(pf.started) >= maxStartedListed {
		pf.more++
		return
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
	if pf.more > 0 {
		out = append(out, fmt.Sprintf("%d more", pf.more))
	}
	if pf.skipped > 0 {
		out = append(out, fmt.Sprintf("%d not followed: pathtrace follows at most %d Pods", pf.skipped, pf.maxPods))
	}
	for _, f := range pf.failed {
		out = append(out, "not attached: "+f)
	}
	if pf.lookErr != "" {
		out = append(out, "the last look for new Pods failed at "+pf.lookErr)
	}
	return out
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
	var gone []int
	for i, tp := range tr.taps {
		if tp.role != discover.RolePod || tp.inode == 0 || *tp.released != "" {
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
		delete(tr.scope, tp.inode)
		// Close waits for the tap's producer to leave the ring, and the
		// producer may be waiting for this goroutine, the consumer, to
		// take its batch.
		go tp.t.Close()
	}
}
