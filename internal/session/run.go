package session

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/bpf"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// tracer is one running session's moving parts.
type tracer struct {
	// handed counts the taps' batches handed to the consumer (batch.seq);
	// caughtUp is its value when the consumer last caught up with the
	// observers (catchUpBefore).
	handed   atomic.Uint64
	caughtUp uint64

	opt        Options
	pr         *probe.Probe
	taps       []tap
	eng        *flow.Engine
	watch      []obs.Watch
	cgroupRoot string
	cgroupDone map[uint64]bool
	// cgroupNoLB: the client cgroups whose last read found no program at
	// connect or sendmsg, and when: while another sock_addr program is on
	// the node, their sockets' next connect or send to a Service has them
	// read again, once a second at most (a socket LB attached since; one
	// after the observers on their cgroup leaves the VIP they see).
	cgroupNoLB map[uint64]time.Time
	// filterErrors counts failed widenings (watch list or tap filter
	// updates, the socket observers' scope): each one may lose the packets
	// of a learned backend or client.
	filterErrors uint64
	// scope is the netns inodes of the traced Pods and the node: the socket
	// observers are host-wide and would also report other netns' clients.
	// The kernel has it too (probe.Scope): they learn from these only.
	scope map[uint64]bool
	// unscoped are the socket events of netns out of scope that a run
	// following the Pods that start keeps for a while (holdUnscoped).
	unscoped []obs.Observation
	// clients, with a Pod selected, are the addresses a flow's client may
	// have (that Pod's and the node's): the node-wide points (netfilter,
	// conntrack, the uplink) also see the other Pods' flows. Nil: every
	// client.
	clients map[netip.Addr]bool
	// clientVIPPorts, with a Pod selected, are the node's addresses that
	// are traced VIPs on these ports only (a NodePort traced as
	// NODE-IP:PORT): on any other port they are a node process's client
	// endpoint (discover.NodeInfo.NodeVIPPorts).
	clientVIPPorts map[netip.Addr][]uint16
	outOfScope     uint64
	// learnLost: the kernel observers lost some of what they learn
	// (kernel_learn_errors), which the engine was told (noteLearnLosses).
	learnLost bool
	// podCaptureLost: a Pod's tap lost frames, which the engine was told
	// (noteCaptureLosses).
	podCaptureLost bool
	// uplinkCaptureLost: the same for an uplink's tap (a node process's
	// SYN-ACK judged lost on the node by the ACK its tap did not see).
	uplinkCaptureLost bool
	// othersSNAT, with a Pod selected, are the sources the node's SNAT gave
	// other clients' flows (their conntrack entries, out of scope): on a
	// masquerading node their frames on the uplink carry the node's
	// address, a client's, and no traced flow claims them: they are left
	// out of scope (those that came before their entry go unmatched, and
	// their pcapng comment says whose they are); bounded (maxOthersSNAT).
	othersSNAT map[otherSNAT]bool
	pcap       *pcapOut  // nil without --pcap
	stopped    time.Time // when the run was asked to stop
	// events brings the observers' events to the consumer; nil once their
	// reader ended.
	events <-chan *batch
	// obsEnded is the same for the observers' event reader.
	obsEnded  string
	free      *batchPool // consumed frame batches, for reuse
	freeSmall *batchPool // ... small ones (smallBatch)
	freeObs   *batchPool // consumed observation batches, for reuse
	lb        *lbWatch
	tc        *tcWatch
	nat       *natWatch
	pods      *podFollow // nil when Pods were selected
	// gone, in a run until stopped, is what it keeps of the taps it
	// forgot (their capture ended); nil in a bounded run.
	gone    *goneTaps
	late    *tcLate
	classes *classTable
	// icmpKinds names the ICMP errors seen, by type<<8 | code.
	icmpKinds map[uint16]string
	// frags maps the datagrams whose first fragment was in a flow (per
	// capture point and direction) to that fragment's handle: the later
	// fragments carry no ports, only the datagram's IP ID.
	frags map[classKey]flow.Handle
	// node is the node as discovered (with the Pods that started since);
	// gatewaysRead, when retire last read their gateways' MACs;
	// neighborsRead, when it last read the uplinks' neighbour tables.
	node          *discover.NodeInfo
	drops         dropPlaces // names the places of the flows' kernel drops
	gatewaysRead  time.Time
	neighborsRead time.Time
	cpuWait       *cpuWaitSampler // set by run
}

// netnsScope is the set of network namespaces whose sockets are traced.
func netnsScope(node *discover.NodeInfo) map[uint64]bool {
	scope := map[uint64]bool{node.HostNetNS.Inode: true}
	for _, p := range node.Pods {
		scope[p.NetNS.Inode] = true
	}
	return scope
}

// addScope puts the netns inode of a Pod found in the socket observers'
// scope.
func (tr *tracer) addScope(ino uint64) {
	tr.scope[ino] = true
	if tr.pr != nil && tr.pr.Scope(ino) != nil {
		tr.filterErrors++
	}
}

// unscope takes the netns inode of a Pod that went out of it: the kernel
// gives the inode to the next netns made.
func (tr *tracer) unscope(ino uint64) {
	delete(tr.scope, ino)
	if tr.pr != nil && tr.pr.Unscope(ino) != nil {
		tr.filterErrors++
	}
}

// add feeds the engine one observation that is within scope.
func (tr *tracer) add(o obs.Observation) {
	switch o.Point {
	case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
		if o.NetNS != 0 && !tr.scope[o.NetNS] {
			tr.outOfScope++
			tr.holdUnscoped(o)
			return
		}
	default:
		if !tr.inScope(o.Src, o.Dst) {
			if o.Point == obs.PointConntrack && o.NATSrc.IsValid() {
				tr.noteOtherSNAT(o)
			}
			return
		}
		if tr.leftOutAsOthersSNAT(o) || tr.leftOutAsServed(o) {
			return
		}
	}
	tr.eng.Add(o)
	if o.Cgroup != 0 && (!tr.cgroupDone[o.Cgroup] || tr.lbUnread(o)) {
		tr.attributeCgroup(o.Cgroup)
	}
}

// lbUnread tells whether o is a socket's connect or send on a client cgroup
// whose last read, a second ago or more, found no program that rewrites,
// while another sock_addr program is on the node.
func (tr *tracer) lbUnread(o obs.Observation) bool {
	at, ok := tr.cgroupNoLB[o.Cgroup]
	return ok && o.Point == obs.PointSockAddr && tr.lb.others() && time.Since(at) >= time.Second
}

// unscopedMax and unscopedAge bound tracer.unscoped: a Pod is found within
// podWatchEvery of its start, and a look takes some time.
const (
	unscopedMax = 1024
	unscopedAge = 2 * podWatchEvery
)

// holdUnscoped keeps a socket event of a netns out of scope when the run
// follows the Pods that start: a Pod's first connections, before the next
// look found it, are its flows (replayUnscoped), and with a socket or tc
// LB their socket events are the only ones that saw the VIP.
func (tr *tracer) holdUnscoped(o obs.Observation) {
	if tr.pods == nil {
		return
	}
	if len(tr.unscoped) == unscopedMax {
		// Full: the oldest quarter goes, and any older than unscopedAge,
		// in one copy (one per unscopedMax/4 events, not one each: with
		// a Pod selected, every other Pod's events come here).
		old := unscopedMax / 4
		for old < len(tr.unscoped) && o.Time.Sub(tr.unscoped[old].Time) >= unscopedAge {
			old++
		}
		tr.unscoped = tr.unscoped[:copy(tr.unscoped, tr.unscoped[old:])]
	}
	tr.unscoped = append(tr.unscoped, o)
}

// replayUnscoped adds the held socket events of the netns in scope now
// (Pods found), no longer out of scope, and forgets those older than
// unscopedAge at now. The observers learned nothing from them: no other
// point followed their sockets until then.
func (tr *tracer) replayUnscoped(now time.Time) {
	held := tr.unscoped
	tr.unscoped = nil
	for _, o := range held {
		switch {
		case tr.scope[o.NetNS]:
			tr.outOfScope--
			o.Unfollowed = true
			tr.add(o)
		case now.Sub(o.Time) < unscopedAge:
			tr.unscoped = append(tr.unscoped, o)
		}
	}
}

// inScope tells whether a packet or connection between src and dst may be
// a traced client's, and counts it as out of scope when not. One from an
// address to itself is the node's own: the kernel gives a socket talking to
// a local address (a node-local cache's VIP, which is no client address)
// that address as its source, and only the node has it.
func (tr *tracer) inScope(src, dst netip.AddrPort) bool {
	if tr.clients == nil || tr.isClient(src) || tr.isClient(dst) || src.Addr() == dst.Addr() {
		return true
	}
	tr.outOfScope++
	return false
}

// isClient tells whether ep may be a traced client's endpoint: an address
// of the selected Pod or of the node, or of the node on a port other than
// the traced NodePort's when that address is the NodePort's (port 0, a
// packet without ports, is no Service's).
func (tr *tracer) isClient(ep netip.AddrPort) bool {
	if tr.clients[ep.Addr()] {
		return true
	}
	ports, ok := tr.clientVIPPorts[ep.Addr()]
	return ok && !slices.Contains(ports, ep.Port())
}

// maxOthersSNAT bounds tracer.othersSNAT: past it the set starts again (a
// frame of a forgotten entry is then commented as one of no known flow).
const maxOthersSNAT = 4096

// otherSNAT is another client's connection as its packets after the node's
// SNAT carry it: the source the SNAT gave it and its peer (the backend).
// The whole tuple, not the node's port alone: a node process's connection
// to another backend, or of the other protocol, may be given that port too.
type otherSNAT struct {
	proto      obs.Proto
	node, peer netip.AddrPort
}

// noteOtherSNAT remembers the source the node's SNAT gave another
// client's flow, from its conntrack entry (tracer.othersSNAT).
func (tr *tracer) noteOtherSNAT(ct obs.Observation) {
	if tr.othersSNAT == nil || len(tr.othersSNAT) >= maxOthersSNAT {
		tr.othersSNAT = map[otherSNAT]bool{}
	}
	peer := ct.Dst
	if ct.NATDst.IsValid() {
		peer = ct.NATDst
	}
	tr.othersSNAT[otherSNAT{ct.Proto, ct.NATSrc, peer}] = true
}

// isOthersSNAT tells whether o, a packet either way, is of another
// client's connection after the node's SNAT (othersSNAT).
func (tr *tracer) isOthersSNAT(o obs.Observation) bool {
	return tr.othersSNAT[otherSNAT{o.Proto, o.Src, o.Dst}] || tr.othersSNAT[otherSNAT{o.Proto, o.Dst, o.Src}]
}

// leftOutAsOthersSNAT counts o out of scope when it is another client's
// after the node's SNAT: the node's address on it is no node process's.
func (tr *tracer) leftOutAsOthersSNAT(o obs.Observation) bool {
	if !tr.isOthersSNAT(o) {
		return false
	}
	tr.outOfScope++
	return true
}

// isServedToOther tells whether o, a packet either way, is of another
// client's connection to a traced client's address as a backend: with a
// Pod selected that is itself a Service's backend, its eth0 and host veth
// (and the node-wide points after DNAT) see the other Pods' connections
// to it, whose ends are its address, in scope, and a port it serves, and
// an address that is no traced client's. Its own flows stay: a hairpin
// (itself through the VIP) has its own address or the node's as the peer,
// or the source conntrack gave its flow (flow.Engine.ServesOtherClient).
func (tr *tracer) isServedToOther(o obs.Observation) bool {
	if tr.clients == nil {
		return false
	}
	served := func(server, peer netip.AddrPort) bool {
		return tr.isClient(server) && !tr.isClient(peer) && tr.eng.ServesOtherClient(o.Proto, server, peer)
	}
	return served(o.Dst, o.Src) || served(o.Src, o.Dst)
}

// leftOutAsServed counts o out of scope when it is another client's
// connection to the selected Pod as a backend (isServedToOther).
func (tr *tracer) leftOutAsServed(o obs.Observation) bool {
	if !tr.isServedToOther(o) {
		return false
	}
	tr.outOfScope++
	return true
}

// clientScope is tracer.clients for a run that selected a Pod, nil for one
// that follows every Pod of the node.
func clientScope(opt discover.Options, node *discover.NodeInfo) map[netip.Addr]bool {
	if !opt.PodIP.IsValid() && opt.PodNetNS == "" && opt.PodPID == 0 {
		return nil
	}
	return node.ClientAddrs()
}

// clientVIPPortScope is clientScope's NodeVIPPorts: nil without a Pod
// selected (every client is traced).
func clientVIPPortScope(opt discover.Options, node *discover.NodeInfo) map[netip.Addr][]uint16 {
	if !opt.PodIP.IsValid() && opt.PodNetNS == "" && opt.PodPID == 0 {
		return nil
	}
	return node.NodeVIPPorts()
}

// stopGrace is how long the producers go on after the run ends: events for
// packets already seen wait in the observers' ring for the reader's next
// poll (every 100 ms at most). The flow engine counts the uplink's copies
// of packets sent before the end for its lost_on_node within less than
// this (flow's stopTransit, 100 ms): keep it longer.
const stopGrace = 200 * time.Millisecond

// dueWait is the least wait before the run releases held frames by their
// due time again: a frame whose flow may still come stays held past it.
const dueWait = 50 * time.Millisecond

// run feeds every producer into the engine until the bound or ctx ends and
// says why it stopped.
func (tr *tracer) run(ctx context.Context) string {
	// The producers outlive ctx by the grace below: what the kernel took
	// before the stop is still delivered.
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	stop := "interrupted"
	var timer <-chan time.Time
	if tr.opt.Duration > 0 {
		t := time.NewTimer(tr.opt.Duration)
		defer t.Stop()
		timer = t.C
	}
	stopFor := func(reason string) string { return reason }
	if tr.pcap != nil {
		// due ends when the run is due to: ctx, the duration, or run's return.
		due, end := context.WithCancel(ctx)
		if tr.opt.Duration > 0 {
			due, end = context.WithTimeout(ctx, tr.opt.Duration)
		}
		defer end()
		tr.pcap.giveUpAfter(due)
		stopFor = func(reason string) string { return dueStop(reason, due, ctx) }
	}

	// One consumer owns the engine; producers block when it lags, so the kernel
	// (ring full) counts what is lost instead of this process dropping silently.
	// Taps hand over a batch per ring block, not a send per packet. The
	// observers' events come on a channel of their own: the consumer takes
	// them before a tap's frames (catchUp).
	items := make(chan *batch, 16) // at most 16 batches in flight
	events := make(chan *batch, 16)
	tr.events = events
	go func() {
		defer close(events)
		err := tr.pr.RunBatches(runCtx, func(o []obs.Observation) {
			b := tr.newBatch(-1, false)
			b.obs = append(b.obs, o...)
			events <- b
		})
		if err != nil { // the flows after it lack their observer evidence
			tr.obsEnded = fmt.Sprintf("ended at %s: %v", time.Now().Format("15:04:05"), err)
		}
	}()
	var producers sync.WaitGroup
	// startTap runs the producer of tap i (the taps of Pods that start later
	// too: the loop below holds the group open while it may add them, even
	// once every producer has ended).
	producers.Add(1)
	startTap := func(i int) {
		producers.Add(1)
		tp := tr.taps[i] // read here: the consumer appends to tr.taps
		go func() {
			defer producers.Done()
			tr.produce(runCtx, i, tp, items)
		}()
	}
	for i := range tr.taps {
		startTap(i)
	}
	go func() { producers.Wait(); close(items) }()

	start := time.Now()
	tr.cpuWait = newCPUWaitSampler("/proc/self/task", start)
	nextInterval := start.Add(tr.opt.ReportEvery)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var podHints <-chan struct{} // nil: no Pod watch
	if tr.pods != nil {
		podHints = tr.pods.watch.Hints(runCtx)
	}
	// Held frames are written once due, also when no later frame comes to
	// release them: a burst's last ones waited for the tick, up to a second
	// more, lost to a SIGKILL and late for a live reader.
	due := time.NewTimer(time.Hour)
	due.Stop()
	defer due.Stop()
	dueSet := false
loop:
	for {
		if tr.pcap != nil && !dueSet {
			if at, ok := tr.pcap.nextDue(); ok {
				due.Reset(max(time.Until(at), dueWait))
				dueSet = true
			}
		}
		select {
		case <-due.C:
			dueSet = false
			if len(items) > 0 {
				break // their frames may be older: hold releases with them
			}
			if reason := tr.pcap.release(time.Now().Add(-reorderWindow), tr); reason != "" {
				stop = stopFor(reason)
				break loop
			}
		case b, ok := <-tr.events:
			tr.takeEvents(b, ok)
		case b := <-items: // open until the loop ends
			if reason := tr.consume(b); reason != "" {
				stop = stopFor(reason)
				break loop
			}
		case <-tick.C:
			if tr.pcap != nil {
				if reason := tr.pcap.release(time.Now().Add(-reorderWindow), tr); reason != "" {
					stop = stopFor(reason)
					break loop
				}
				if tr.opt.Duration == 0 { // until stopped: an incident's file is its bundle's
					tr.pcap.endFile(tr.taps)
				}
			}
			tr.cpuWait.sample(time.Now())
			tr.noteConntrackLosses()
			tr.noteCaptureLosses()
			tr.noteLearnLosses()
			tr.retire(time.Now())
			tr.interval(time.Now(), &nextInterval)
			tr.widen()
			if tr.lb.check(time.Now()) {
				// A socket LB may have come on a client's cgroup:
				// each is read again when next seen.
				clear(tr.cgroupDone)
				clear(tr.cgroupNoLB)
			}
			tr.observeTC(time.Now(), tr.tc.check(time.Now(), tr.eng))
			tr.nat.check(ctx, time.Now(), tr.eng, false)
			tr.releaseGone(time.Now())
			if reason := tr.followNewPods(ctx, time.Now(), false, startTap); reason != "" {
				stop = stopFor(reason)
				break loop
			}
			if tr.opt.Progress != nil {
				p := Progress{Elapsed: time.Since(start), Duration: tr.opt.Duration, Summary: tr.eng.Summary(), Pending: tr.eng.Pending(time.Now())}
				p.Packets, p.Drops = tr.counters()
				tr.opt.Progress(p)
			}
		case <-podHints:
			if reason := tr.followNewPods(ctx, time.Now(), true, startTap); reason != "" {
				stop = stopFor(reason)
				break loop
			}
		case <-timer:
			stop = "duration"
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	producers.Done() // no tap starts from here on
	tr.stopped = time.Now()
	tr.cpuWait.sample(tr.stopped)
	tr.eng.Stopping(tr.stopped)
	// Let in-flight events land, still consuming, then stop the producers:
	// each tap then delivers the block the kernel was filling (within
	// capture.DrainTimeout), and everything they hold is consumed.
	grace := time.NewTimer(stopGrace)
	defer grace.Stop()
settle:
	for {
		select {
		case b, ok := <-tr.events:
			tr.takeEvents(b, ok)
		case b, ok := <-items:
			if !ok {
				break settle
			}
			tr.consume(b)
		case <-grace.C:
			break settle
		}
	}
	cancel()
	for items != nil || tr.events != nil {
		select {
		case b, ok := <-tr.events:
			tr.takeEvents(b, ok)
		case b, ok := <-items:
			if !ok {
				items = nil
				continue
			}
			tr.consume(b)
		}
	}
	// Before the last comments are made: flows of the last seconds may have
	// reached backends of rules made since the previous look.
	lookCtx, lookDone := context.WithTimeout(context.WithoutCancel(ctx), natLookTimeout)
	tr.nat.check(lookCtx, time.Now(), tr.eng, true)
	lookDone()
	if tr.pcap != nil {
		// The backend guesses put off until the end are made before the
		// last frames' comments, as the report will make them.
		tr.eng.Settle()
		tr.pcap.release(time.Now().Add(time.Hour), tr) // everything left
	}
	return stop
}

// retireLag is how far behind the wall clock the engine's clock is pushed
// for retiring flows: the flow engine's reordering window, what the
// sources may still deliver late.
const retireLag = 3 * time.Second

// gatewaysEvery bounds how often retire reads the gateways' MACs of the
// Pods whose gateway has none yet (one netlink request in each netns).
const gatewaysEvery = 5 * time.Second

// retire hands the flows that are over to Options.Finished (a run that
// reports them as they end). The engine's clock is pushed to now less
// retireLag: a quiet node's last flows end too.
func (tr *tracer) retire(now time.Time) {
	if tr.opt.Finished == nil {
		return
	}
	// A flow reported now says whether its uplink frame went to its Pod's
	// gateway: the Pods' neighbour entries are read as the run goes on, not
	// only at its end (a Pod resolves its gateway as it first sends).
	if tr.node != nil && now.Sub(tr.gatewaysRead) >= gatewaysEvery {
		tr.gatewaysRead = now
		discover.RefreshGatewayMACs(tr.node)
		tr.eng.SetGatewayMACs(gatewayMACs(tr.node))
	}
	if fs := tr.eng.Retire(now.Add(-retireLag)); len(fs) > 0 {
		tr.nameUplinkNeighbors(now, fs)
		tr.nameDrops(fs)
		tr.opt.Finished(fs)
	}
}

// neighborsEvery bounds how often the uplinks' neighbour tables are read
// again for flows whose uplink frame went to a MAC they did not name.
const neighborsEvery = 5 * time.Second

// nameUplinkNeighbors reads the uplinks' neighbour tables again, at most
// once per neighborsEvery, when one of the flows reported went to a MAC
// they did not name (a routed node resolves its next hop with the first
// packet, after discovery), and names it in those flows.
func (tr *tracer) nameUplinkNeighbors(now time.Time, fs []flow.Flow) {
	if tr.node == nil || now.Sub(tr.neighborsRead) < neighborsEvery ||
		!slices.ContainsFunc(fs, func(f flow.Flow) bool { return f.UplinkNeighborMissing() }) {
		return
	}
	tr.neighborsRead = now
	_ = discover.RefreshUplinkNeighbors(tr.node)
	tr.eng.SetUplinkNeighbors(uplinkNeighbors(tr.node))
	tr.eng.NameUplinkNeighbors(fs)
}

// interval gives Options.Interval the counts so far when next is due.
func (tr *tracer) interval(now time.Time, next *time.Time) {
	if tr.opt.Interval == nil || tr.opt.ReportEvery <= 0 || now.Before(*next) {
		return
	}
	// Keep to the schedule, not to when the tick came: a tick a little
	// earlier in its second than the last would otherwise wait a whole
	// tick more (every other line of --report-every 2s 3 s apart). After a
	// stall, one line, then the schedule again.
	for !next.After(now) {
		*next = next.Add(tr.opt.ReportEvery)
	}
	s := tr.eng.Summary()
	s.OutOfScope = tr.outOfScope
	packets, drops := tr.counters()
	if tr.pods != nil && tr.pods.skipped > 0 {
		// Said at the end among the Pods started; a run until stopped
		// says it as it goes.
		drops["pods_not_followed"] = uint64(tr.pods.skipped)
	}
	tr.opt.Interval(s, drops, packets, tr.cpuWait.result())
}

// produce hands the frames of tap iface to the consumer in batches until
// ctx ends or the tap's interface goes away.
func (tr *tracer) produce(ctx context.Context, iface int, tp tap, items chan<- *batch) {
	// A tap takes a batch when frames come, not while it waits: a node's
	// quiet Pods' taps would each hold one (a few hundred KiB reused from
	// the pool), all live heap for the collector.
	var b *batch
	small := true // until the tap hands over more (newBatch)
	flush := func() {
		if b != nil && len(b.frames) > 0 {
			small = len(b.frames) <= smallBatch
			b.seq = tr.handed.Add(1)
			tr.handOver(items, b)
			b = nil
		}
	}
	err := tp.t.RunBlocks(ctx, func(p *capture.Packet) {
		if b == nil {
			b = tr.newBatch(iface, small)
		}
		b.add(p)
		if b.full() {
			flush()
		}
	}, flush)
	flush()
	if err != nil { // the interface went down or away (a Pod deleted)
		*tp.ended = fmt.Sprintf("ended at %s: %v", time.Now().Format("15:04:05"), err)
		// Give its ring back now, and the deleted Pod's netns, which the
		// socket keeps alive; the counters stay readable.
		tp.t.Close()
	}
	if err != nil || ctx.Err() == nil { // ended before the run: failed, or released
		// After its frames: a run until stopped forgets the tap once the
		// consumer has them (tapEnded).
		items <- &batch{tap: iface, ended: true}
	}
}

// handOver queues a tap's batch for the consumer. A queue that stays full
// for behindWait says the consumer is behind the taps
// (Options.CaptureBehind), again every behindWait it stays so: the ring's
// own backlog (capture.Config.Behind) shows only when the tap reads its
// next block, which it does not while it waits here. A queue full for
// less is the consumer's passing pause (a collection, a write of the file,
// its thread preempted on busy CPUs): at 20k datagrams a second in the lab
// the queue filled a few times a second, and saying so at once gave the
// capture its second thread for the rest of the run, and 10-25% more CPU
// per captured packet. At the lab's highest rates the queue (16 batches)
// holds 5 ms of frames, the rings 80.
func (tr *tracer) handOver(items chan<- *batch, b *batch) {
	select {
	case items <- b:
		return
	default:
	}
	if tr.opt.CaptureBehind == nil {
		items <- b
		return
	}
	wait := time.NewTimer(behindWait)
	defer wait.Stop()
	for {
		select {
		case items <- b:
			return
		case <-wait.C:
			tr.opt.CaptureBehind()
			wait.Reset(behindWait)
		}
	}
}

// behindWait is how long a tap waits on the consumer's full queue before
// the capture is behind (handOver): half the time a ring's backlog takes
// to reach its own mark at the lab's highest rates (a quarter of a 4 MiB
// ring, 20 ms). A variable for tests.
var behindWait = 10 * time.Millisecond

// dueStop is the stop reason of a run whose capture file reported reason:
// a stream given up once the run was due (its reader stopped reading, see
// pcapOut.giveUpAfter) cut the file, but the run ended for why it was due,
// ctx or its duration; the file's own summary keeps the error.
func dueStop(reason string, due, ctx context.Context) string {
	switch {
	case reason != "pcap-error" || due.Err() == nil:
		return reason
	case ctx.Err() != nil:
		return "interrupted"
	}
	return "duration"
}

// consume feeds a batch to the engine and the pcapng file; it returns a stop
// reason when the file reached a bound.
func (tr *tracer) consume(b *batch) string {
	if b.ended {
		tr.tapEnded(b.tap)
		return ""
	}
	if b.tap < 0 {
		for _, o := range b.obs {
			tr.add(o)
		}
		tr.putBatch(b)
		return ""
	}
	tr.catchUpBefore(b)
	for i := range b.frames {
		f := &b.frames[i]
		f.known = tr.classify(b.tap, &f.pkt, &f.h, &f.kindSlot)
	}
	if tr.pcap == nil {
		tr.putBatch(b)
		return ""
	}
	return tr.pcap.hold(b, tr)
}

// catchUpBefore catches up with the observers' events before b's frames,
// unless b was handed over before the last catch-up began: that one took
// every event submitted before it, so before any of b's frames was
// captured (the observers run before a packet reaches a tap). One catch-up
// then covers all the batches that queued up meanwhile (a busy consumer,
// several taps), where each took one (a wake-up of the reader, a round trip
// of goroutines). A batch no tap numbered (seq 0) always takes one; a
// catch-up that timed out covers nothing.
func (tr *tracer) catchUpBefore(b *batch) {
	if b.seq != 0 && b.seq <= tr.caughtUp {
		return
	}
	handed := tr.handed.Load()
	if tr.catchUp() {
		tr.caughtUp = handed
	}
}

// catchUpWait bounds how long a tap's frames wait for the observers'
// reader to hand over what their ring holds (it takes microseconds when
// the reader gets a CPU).
const catchUpWait = 20 * time.Millisecond

// catchUp consumes the observers' events that precede a tap's frames
// before them: what the ring holds now, and what its reader read but has
// not handed over (probe.Probe.CatchUp). A flow is linked as its
// observations come, and its socket's events tell a reused port's sockets
// apart. It reports false when it gave up waiting (catchUpWait).
func (tr *tracer) catchUp() (caughtUp bool) {
	done := tr.pr.CatchUp()
	if done == nil {
		return true
	}
	wait := time.NewTimer(catchUpWait)
	defer wait.Stop()
	for {
		select {
		case b, ok := <-tr.events:
			if !tr.takeEvents(b, ok) {
				return true // the reader ended: no event is left to come
			}
		case <-done:
			// The reader handed its batches over before it closed done:
			// they are queued.
			for {
				select {
				case b, ok := <-tr.events:
					if !tr.takeEvents(b, ok) {
						return true
					}
				default:
					return true
				}
			}
		case <-wait.C:
			return false
		}
	}
}

// takeEvents consumes a batch of observer events received from tr.events;
// ok false, the channel closed (the reader ended: obsEnded says why), makes
// it forget the channel and report false.
func (tr *tracer) takeEvents(b *batch, ok bool) bool {
	if !ok {
		tr.events = nil
		return false
	}
	tr.consume(b)
	return true
}

// noteConntrackLosses tells the engine how many conntrack events were lost:
// only while none were does conntrack's silence about a flow mean netfilter
// did not track it.
func (tr *tracer) noteConntrackLosses() {
	tr.eng.SetConntrackLosses(tr.pr.ConntrackLosses())
}

// noteCaptureLosses tells the engine which capture points lost frames (a
// tap's kernel_drops), before it judges flows by what their taps did not
// see: a Pod's tap whose ring dropped a reply the client got must not make
// it a reply lost on the node, nor an uplink's that dropped a node
// process's ACK. A forgotten tap (a Pod gone) may have been a
// Pod's: its losses count as the Pods'.
func (tr *tracer) noteCaptureLosses() {
	if tr.podCaptureLost && tr.uplinkCaptureLost {
		return // said once, for the rest of the run
	}
	pod := tr.gone != nil && tr.gone.kernelDrops > 0
	uplink := false
	for _, tp := range tr.taps {
		if tp.t == nil || tp.t.Stats().KernelDrops == 0 {
			continue
		}
		switch tp.point {
		case obs.PointPod:
			pod = true
		case obs.PointUplink:
			uplink = true
		}
	}
	if pod && !tr.podCaptureLost {
		tr.podCaptureLost = true
		tr.eng.CaptureLost(obs.PointPod)
	}
	if uplink && !tr.uplinkCaptureLost {
		tr.uplinkCaptureLost = true
		tr.eng.CaptureLost(obs.PointUplink)
	}
}

// noteLearnLosses tells the engine once the kernel observers have lost some
// of what they learn (a socket's watch before its first packet): a socket
// seen at its connect() alone may then have sent after all.
func (tr *tracer) noteLearnLosses() {
	if !tr.learnLost && tr.pr.LearnErrors() > 0 {
		tr.learnLost = true
		tr.eng.WatchesLost()
	}
}

// attributeCgroup resolves a client cgroup, when an observation first names
// it, to the sock_addr programs effective there, for "by" of socket-layer
// rewrites: before the flow's frames are written with their comments (held
// 200 ms for the merge), and while a short-lived Pod's cgroup still exists.
func (tr *tracer) attributeCgroup(id uint64) {
	if tr.cgroupDone == nil {
		tr.cgroupDone = map[uint64]bool{}
	}
	if tr.gone != nil && len(tr.cgroupDone) >= maxCgroupsDone {
		// A run until stopped sees the cgroups of every Pod that ever
		// came: those of no open flow are forgotten, and resolved again
		// when seen again.
		clear(tr.cgroupDone)
		clear(tr.cgroupNoLB)
		tr.eng.ForgetCgroups()
	}
	tr.cgroupDone[id] = true
	_, progs, err := discover.SockProgramsForCgroupID(tr.cgroupRoot, id, tr.pr.IsObserver)
	if err != nil {
		return // the node-wide list from discovery stays the attribution
	}
	fps := make([]flow.SockProgram, len(progs))
	lb := false
	for i, p := range progs {
		fps[i] = flow.SockProgram{AttachType: p.Attach, Name: p.Name, ID: uint32(p.ID), Cgroup: p.Cgroup, Since: tr.lb.since(p.ID)}
		lb = lb || strings.HasPrefix(p.Attach, "connect") || strings.HasPrefix(p.Attach, "sendmsg")
	}
	if tr.cgroupNoLB == nil {
		tr.cgroupNoLB = map[uint64]time.Time{}
	}
	if lb {
		delete(tr.cgroupNoLB, id)
	} else {
		tr.cgroupNoLB[id] = time.Now()
	}
	tr.eng.SetCgroupSockPrograms(id, fps)
}

// maxCgroupsDone bounds the client cgroups a run until stopped keeps
// resolved (attributeCgroup).
const maxCgroupsDone = 4096

// widen adds the backends the engine learned, and those the NAT rules and
// IPVS services name, to the observers' watch list (which the eBPF tap
// filter shares) and to the classic tap filters, so post-rewrite packets
// are captured too: the endpoint a backend serves when its port is known,
// every port of it otherwise. The observers already learn most of this in
// the kernel; widen covers what they could not (e.g. a backend only
// conntrack named). Failures are counted, never ignored.
func (tr *tracer) widen() {
	seen := make(map[obs.Watch]bool, len(tr.watch))
	for _, w := range tr.watch {
		seen[w] = true
	}
	var added []obs.Watch
	for _, w := range tr.eng.BackendWatches() {
		if !seen[w] {
			seen[w] = true
			added = append(added, w)
		}
	}
	if len(added) == 0 {
		return
	}
	tr.watch = append(tr.watch, added...)
	if err := tr.pr.WatchEndpoints(added...); err != nil {
		tr.filterErrors++
	}
	var f []bpf.RawInstruction
	var ferr error
	for _, tp := range tr.taps {
		if !tp.classic {
			continue
		}
		if f == nil && ferr == nil {
			f, ferr = capture.FilterFor(tr.watch, tr.opt.Snaplen)
		}
		if ferr != nil {
			tr.filterErrors++
		} else if err := tp.t.SetFilter(f); err != nil && !errors.Is(err, capture.ErrClosed) {
			tr.filterErrors++ // a closed tap's interface went away: nothing to filter
		}
	}
}
