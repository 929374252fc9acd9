package session

import (
	"context"
	"net/netip"
	"sync"
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
	opt        Options
	pr         *probe.Probe
	taps       []tap
	eng        *flow.Engine
	watch      []netip.Addr
	cgroupRoot string
	cgroupDone map[uint64]bool
	// filterErrors counts failed widenings (watch list or tap filter
	// updates): each one may lose the packets of a learned backend.
	filterErrors uint64
	// scope is the netns inodes of the traced Pods and the node: the socket
	// observers are host-wide and would also report other netns' clients.
	scope      map[uint64]bool
	outOfScope uint64
	pcap       *pcapOut // nil without --pcap
	batches    sync.Pool
}

// netnsScope is the set of network namespaces whose sockets are traced.
func netnsScope(node *discover.NodeInfo) map[uint64]bool {
	scope := map[uint64]bool{node.HostNetNS.Inode: true}
	for _, p := range node.Pods {
		scope[p.NetNS.Inode] = true
	}
	return scope
}

// add feeds the engine one observation that is within scope.
func (tr *tracer) add(o obs.Observation) {
	switch o.Point {
	case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
		if o.NetNS != 0 && !tr.scope[o.NetNS] {
			tr.outOfScope++
			return
		}
	}
	tr.eng.Add(o)
}

// run feeds every producer into the engine until the bound or ctx ends and
// says why it stopped.
func (tr *tracer) run(ctx context.Context) string {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := "interrupted"
	var timer <-chan time.Time
	if tr.opt.Duration > 0 {
		t := time.NewTimer(tr.opt.Duration)
		defer t.Stop()
		timer = t.C
	}

	// One consumer owns the engine; producers block when it lags, so the kernel
	// (ring full) counts what is lost instead of this process dropping silently.
	// Taps hand over a batch per ring block, not a send per packet.
	items := make(chan []item, 16) // at most 16 blocks of frames in flight
	var producers sync.WaitGroup
	producers.Add(1)
	go func() {
		defer producers.Done()
		_ = tr.pr.Run(runCtx, func(o obs.Observation) { send(items, []item{{o: o, isObs: true}}) })
	}()
	for i, tp := range tr.taps {
		producers.Add(1)
		go func(iface int, tp tap) {
			defer producers.Done()
			batch := tr.newBatch()
			flush := func() {
				if len(batch) > 0 {
					send(items, batch)
					batch = tr.newBatch()
				}
			}
			_ = tp.t.RunBlocks(runCtx, func(p *capture.Packet) {
				it := item{iface: iface}
				it.o, it.isObs = p.Observation(tp.point)
				it.o.Ifname = tp.label
				if tr.pcap != nil {
					it.pkt = p.Clone() // the ring slot is reused after this call
				}
				if it.isObs || it.pkt != nil {
					batch = append(batch, it)
				}
				if len(batch) == maxBatch {
					flush()
				}
			}, flush)
			flush()
		}(i, tp)
	}
	go func() { producers.Wait(); close(items) }()

	start := time.Now()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
loop:
	for {
		select {
		case batch, ok := <-items:
			if !ok {
				break loop
			}
			if reason := tr.consumeAll(batch); reason != "" {
				stop = reason
				break loop
			}
		case <-tick.C:
			if tr.pcap != nil {
				if reason := tr.pcap.release(time.Now().Add(-reorderWindow), tr.comment); reason != "" {
					stop = reason
					break loop
				}
			}
			tr.widen()
			tr.attributeCgroups()
			if tr.opt.Progress != nil {
				p := Progress{Elapsed: time.Since(start), Duration: tr.opt.Duration, Summary: tr.eng.Summary()}
				p.Packets, p.Drops = tr.counters()
				tr.opt.Progress(p)
			}
		case <-timer:
			stop = "duration"
			break loop
		case <-ctx.Done():
			break loop
		}
	}
	// Let in-flight events land, then drain what the producers still hold.
	time.Sleep(200 * time.Millisecond)
	cancel()
	for batch := range items {
		tr.consumeAll(batch)
	}
	if tr.pcap != nil {
		tr.pcap.release(time.Now().Add(time.Hour), tr.comment) // everything left
	}
	return stop
}

// item is one thing a producer hands the consumer: an observation, a
// captured frame for the pcapng file, or both.
type item struct {
	o     obs.Observation
	isObs bool
	iface int             // index of the tap in tracer.taps
	pkt   *capture.Packet // only with --pcap
}

// maxBatch bounds the frames a tap hands over at once.
const maxBatch = 256

// consumeAll consumes every item of a batch, gives the batch back for reuse
// and returns the first stop reason.
func (tr *tracer) consumeAll(batch []item) string {
	var stop string
	for i := range batch {
		if reason := tr.consume(batch[i]); reason != "" && stop == "" {
			stop = reason
		}
	}
	if cap(batch) == maxBatch {
		clear(batch)
		tr.batches.Put(batch[:0])
	}
	return stop
}

// newBatch returns an empty batch, reusing consumed ones: at tens of
// thousands of frames a second, fresh batches would keep the garbage
// collector busy.
func (tr *tracer) newBatch() []item {
	if b, ok := tr.batches.Get().([]item); ok {
		return b
	}
	return make([]item, 0, maxBatch)
}

// consume feeds the engine and the pcapng file; it returns a stop reason when
// the file reached a bound.
func (tr *tracer) consume(it item) string {
	if it.isObs {
		tr.add(it.o)
	}
	if it.pkt == nil {
		return ""
	}
	return tr.pcap.hold(heldFrame{iface: it.iface, pkt: it.pkt, o: it.o, isObs: it.isObs}, tr.comment)
}

// comment is a frame's pcapng comment: its flow, before or after
// translation, and the flow's verdict as known now.
func (tr *tracer) comment(f heldFrame) string {
	if f.isObs {
		if ref, ok := tr.eng.Classify(f.o); ok {
			return ref.Comment(tr.taps[f.iface].label)
		}
	}
	return "no Service flow known for this packet"
}

// attributeCgroups resolves the client cgroups seen on flows to the sock_addr
// programs effective there, for "by" of socket-layer rewrites.
func (tr *tracer) attributeCgroups() {
	if tr.cgroupDone == nil {
		tr.cgroupDone = map[uint64]bool{}
	}
	for _, id := range tr.eng.CgroupIDs() {
		if tr.cgroupDone[id] {
			continue
		}
		tr.cgroupDone[id] = true
		_, progs, err := discover.SockProgramsForCgroupID(tr.cgroupRoot, id, tr.pr.OwnProgramIDs)
		if err != nil {
			continue // the node-wide list from discovery stays the attribution
		}
		fps := make([]flow.SockProgram, len(progs))
		for i, p := range progs {
			fps[i] = flow.SockProgram{AttachType: p.Attach, Name: p.Name, ID: uint32(p.ID), Cgroup: p.Cgroup}
		}
		tr.eng.SetCgroupSockPrograms(id, fps)
	}
}

// send hands a batch to the consumer, which reads until every producer has
// stopped: nothing a tap counted is left out of the engine or the file.
func send(ch chan<- []item, batch []item) { ch <- batch }

// widen adds the backends the engine learned to the observers' watch list
// (which the eBPF tap filter shares) and to the classic tap filters, so
// post-rewrite packets are captured too. The observers already learn most
// of this in the kernel; widen covers what they could not (e.g. a backend
// only conntrack named). Failures are counted, never ignored.
func (tr *tracer) widen() {
	seen := make(map[netip.Addr]bool, len(tr.watch))
	for _, a := range tr.watch {
		seen[a] = true
	}
	var added []netip.Addr
	for _, b := range tr.eng.Backends() {
		if !seen[b] {
			seen[b] = true
			added = append(added, b)
		}
	}
	if len(added) == 0 {
		return
	}
	tr.watch = append(tr.watch, added...)
	if err := tr.pr.Watch(added...); err != nil {
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
		if ferr != nil || tp.t.SetFilter(f) != nil {
			tr.filterErrors++
		}
	}
}
