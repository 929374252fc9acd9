package session

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// pcapOut is the session's pcapng file: one interface per tap, in tap order.
type pcapOut struct {
	w    *export.Writer
	path string
	err  error // a write error other than the bounds (disk full, ...)
	// queues holds, per tap in tap order, the batches with frames not
	// written yet, oldest first.
	queues [][]*batch
	// heads is a min-heap of the queues holding frames, by the time of
	// their oldest frame: the merge costs log(points with frames) per frame,
	// not a look at every capture point (a node's Pods bring hundreds).
	heads  []queueHead
	held   int // frames in queues
	newest time.Time
	// endsFileOnly: a reached bound ends the file, not the run
	// (Options.PcapBoundEndsFileOnly).
	endsFileOnly bool
	// endedAt is the capture time of the frame at which a bound ended the
	// file; notWritten counts the frames it had no room for from then on.
	endedAt    time.Time
	notWritten uint64
	// published: the file a bound ended while the run goes on was
	// closed and given its name then (endFile), not at the run's end.
	published bool
	// last is the comment of the last frame release wrote from a known
	// flow: the next frames of that flow, direction and side of the
	// translation share it (at every capture point) while the engine
	// learns nothing, which it does not during a release. byKind keeps the
	// same for the frames of each kind (frame.kindSlot: a hash of capture
	// point, direction and tuple), which are almost always counted under
	// one handle slot, which SharesComment tells from the slot alone: the
	// merge takes the points in turn and a point's requests and replies
	// alternate, so the frame before was mostly of another slot, for which
	// SharesComment had to work out on which side of the translation each
	// point is, and a busy client's flows in turn missed it (a fifth of the
	// user CPU per frame in BenchmarkConsume; 15% of pathtrace's CPU in a
	// lab capture). An entry holds while its gen is lastGen.
	last    lastComment
	byKind  [kindComments]lastComment
	lastGen uint64
	// frozen, once a run until stopped gives the slots of the taps it
	// forgot to others (after the file ended: see tracer.tapEnded), are
	// the file's interfaces' names and statistics as they were then.
	frozen []frozenIface
}

type frozenIface struct {
	label string
	stats export.InterfaceStats
}

// freeze keeps the file's interfaces' names and statistics as they are
// now, the first time: their taps' slots are about to change.
func (p *pcapOut) freeze(taps []tap) {
	if p.frozen != nil {
		return
	}
	p.frozen = make([]frozenIface, len(taps))
	for i, tp := range taps {
		if tp.t == nil {
			continue // a slot forgotten: its interface was frozen with it
		}
		st := tp.t.Stats()
		p.frozen[i] = frozenIface{label: tp.label, stats: export.InterfaceStats{Received: st.KernelPackets, Dropped: st.KernelDrops}}
	}
}

// kindComments is the size of pcapOut.byKind, a power of two.
const kindComments = 64

type lastComment struct {
	h   flow.Handle
	c   string
	ok  bool
	gen uint64 // byKind's: the release it was made in (pcapOut.lastGen)
}

// queueHead is a queue in pcapOut.heads and the time of its oldest frame.
type queueHead struct {
	at    int64 // Unix nanoseconds
	queue int
}

func openPcap(path string, lim export.Limits, taps []tap, snaplen int) (*pcapOut, error) {
	ifaces := make([]export.Interface, len(taps))
	for i, tp := range taps {
		ifaces[i] = pcapInterface(tp, snaplen)
	}
	w, err := export.Create(path, ifaces, lim)
	if err != nil {
		return nil, fmt.Errorf("pcapng %s: %w", path, err)
	}
	return &pcapOut{w: w, path: path, queues: make([][]*batch, len(taps))}, nil
}

// pcapInterface is the pcapng interface of a tap.
func pcapInterface(tp tap, snaplen int) export.Interface {
	return pcapInterfaceAt(tp, tp.t.Ifindex(), snaplen)
}

func pcapInterfaceAt(tp tap, ifindex, snaplen int) export.Interface {
	return export.Interface{
		Name:        tp.label,
		Description: fmt.Sprintf("%s: %s ifindex %d, netns %s", tp.role, tp.ifname, ifindex, tp.netns),
		Snaplen:     snaplen,
	}
}

// pcapHeaderFits refuses, before anything is attached, a --max-bytes that
// cannot hold the file's header with the interfaces of node's capture
// points: found when the file was made, it came once the observers and
// taps were in place on the node, to be taken down at once.
func pcapHeaderFits(path string, lim export.Limits, node *discover.NodeInfo, snaplen int) error {
	if path == "" || lim.MaxBytes <= 0 {
		return nil
	}
	points := tapPoints(node)
	taps := make([]tap, len(points))
	for i, cp := range points {
		inode, _ := nsutil.Inode(cp.NetNS)
		taps[i] = tap{role: cp.Role, ifname: cp.Ifname, ifindex: cp.Ifindex, netns: cp.NetNS, inode: inode}
	}
	ifaces := make([]export.Interface, len(taps))
	for i, label := range pointLabels(taps, node.Pods) {
		taps[i].label = label
		ifaces[i] = pcapInterfaceAt(taps[i], taps[i].ifindex, snaplen)
	}
	n, err := export.HeaderSize(path != "-", ifaces)
	if err != nil || n <= lim.MaxBytes {
		return nil // no interface: the file's creation says so
	}
	return fmt.Errorf("pcapng %s: %w: the header alone, with the %d capture points' descriptions, takes %d bytes, more than the maximum of %d", path, export.ErrLimit, len(ifaces), n, lim.MaxBytes)
}

// addInterface adds the interface of a tap opened while the session runs,
// the next in tap order (the file declares it with its first frame, after
// the older frames held for the merge); a bound reached before that ends
// the run, or a write error, returns the stop reason.
func (p *pcapOut) addInterface(tp tap, snaplen int) string {
	if p.err != nil {
		return "pcap-error"
	}
	if p.published { // the file ended: the tap's frames are counted (hold)
		p.queues = append(p.queues, nil)
		return ""
	}
	if err := p.w.AddInterface(pcapInterface(tp, snaplen)); err != nil {
		if !errors.Is(err, export.ErrLimit) {
			p.err = err
			return "pcap-error"
		}
		if reason := p.boundStop(); reason != "" {
			return reason
		}
		// The file ended: the tap's frames are counted, never queued (hold).
	}
	p.queues = append(p.queues, nil)
	return ""
}

// full says a bound ended the file: no frame is written from then on.
func (p *pcapOut) full() bool { return p.w.StopReason() != "" }

// boundStop is the stop reason a reached bound gives the run: none when it
// ends the file only.
func (p *pcapOut) boundStop() string {
	if p.endsFileOnly {
		return ""
	}
	return p.w.StopReason()
}

// dropHeld counts the frames held as not written, once a bound ended the
// file, and gives their batches back; it returns boundStop.
func (p *pcapOut) dropHeld(tr *tracer) string {
	for i, q := range p.queues {
		for _, b := range q {
			p.notWritten += uint64(len(b.frames) - b.next)
			tr.putBatch(b)
		}
		p.queues[i] = nil
	}
	p.heads, p.held = p.heads[:0], 0
	return p.boundStop()
}

// streamGrace is how long a --pcap - reader has, once the run is due to end,
// to take the rest of the capture.
const streamGrace = 5 * time.Second

// giveUpAfter gives the stream up streamGrace after due ends. A reader that
// stops reading (a hung Wireshark, a stalled ssh) blocks the write in
// progress, and with it the consumer, which then sees neither the signal nor
// the duration: without this, the trace would wait for that reader forever
// and never print its report. A file is not concerned.
func (p *pcapOut) giveUpAfter(due context.Context) {
	context.AfterFunc(due, func() { time.AfterFunc(streamGrace, p.w.Abandon) })
}

// write appends one frame through the held writer; a reached bound or a
// write error returns the stop reason (the file ends, and the report says
// why).
func (p *pcapOut) write(w export.Held, iface int, pkt *capture.Packet, comment string) string {
	if p.err != nil {
		return "pcap-error"
	}
	if err := w.WritePacket(iface, pkt, comment); err != nil {
		if !errors.Is(err, export.ErrLimit) {
			p.err = err
			return "pcap-error"
		}
		p.notWritten++
	}
	reason := p.w.StopReason()
	if reason != "" && p.endedAt.IsZero() {
		p.endedAt = pkt.Time
	}
	return reason
}

// endFile closes the file a bound ended while the run goes on (a run until
// stopped) and gives it its name now: PATH, complete, for days, rather than
// PATH.partial until the run stops (and forever if it is killed). Its
// interfaces' statistics are those of then.
func (p *pcapOut) endFile(taps []tap) {
	if !p.endsFileOnly || p.published || !p.full() || p.held > 0 {
		return
	}
	p.published = true
	stats, _ := p.interfaces(taps)
	if err := p.w.Close(stats); err != nil {
		p.err = err // as close says
	}
}

// interfaces are the file's interfaces: the kernel's counts of each tap,
// for the file's statistics, and their names; those frozen when the taps'
// slots went to others (freeze) as they were then.
func (p *pcapOut) interfaces(taps []tap) ([]export.InterfaceStats, []string) {
	stats := make([]export.InterfaceStats, len(taps))
	labels := make([]string, len(taps))
	for i, tp := range taps {
		if tp.t == nil {
			continue // a slot forgotten (frozen holds its interface)
		}
		st := tp.t.Stats()
		stats[i] = export.InterfaceStats{Received: st.KernelPackets, Dropped: st.KernelDrops}
		labels[i] = tp.label
	}
	if p.frozen != nil {
		stats, labels = stats[:len(p.frozen)], labels[:len(p.frozen)]
		for i, f := range p.frozen {
			stats[i], labels[i] = f.stats, f.label
		}
	}
	return stats, labels
}

// close writes each interface's statistics and publishes the file.
func (p *pcapOut) close(taps []tap) *export.Summary {
	res := &export.Summary{Path: p.path, PerInterface: map[string]uint64{}}
	stats, labels := p.interfaces(taps)
	// A failed close (a reader that went away from "-", a full disk) is
	// reported with the rest, never at the cost of the report. The counts
	// are read after it: a failed write makes them what the file holds.
	// Close repeats an earlier write error, naming the file as it is now
	// (PATH once renamed).
	if !p.published {
		if err := p.w.Close(stats); err != nil {
			p.err = err
		}
	}
	for i, n := range p.w.PerInterface() {
		res.PerInterface[labels[i]] = n
	}
	if p.err != nil {
		res.Error = p.err.Error()
	}
	res.Packets, res.Bytes, res.StopReason = p.w.Packets(), p.w.Bytes(), p.w.StopReason()
	res.EndedAt, res.FramesNotWritten = p.endedAt, p.notWritten
	return res
}

// Frames reach the consumer in ring-block batches per capture point (a block
// retires after at most 100 ms), so frames of different points arrive out of
// time order. Holding each frame for reorderWindow lets the file list them in
// time order across points, as Wireshark users expect; maxHeld bounds memory.
const (
	reorderWindow = 200 * time.Millisecond
	maxHeld       = 8192
)

// hold queues a batch of frames and writes every frame older than the
// reorder window (or the oldest ones beyond maxHeld). A frame's comment is
// made when it is written, so it carries the most the engine knows by then;
// one the engine keeps waiting for its flow is held up to flow.WaitWindow
// (flowComing), as long as the engine may count it in a flow.
// Once a bound ended the file, frames are only counted: an incident's run
// goes on for many more.
func (p *pcapOut) hold(b *batch, tr *tracer) string {
	if len(b.frames) == 0 {
		tr.putBatch(b)
		return ""
	}
	if p.full() {
		p.notWritten += uint64(len(b.frames))
		tr.putBatch(b)
		return p.boundStop()
	}
	if len(p.queues[b.tap]) == 0 {
		p.pushHead(b.tap, b.frames[0].pkt.Time.UnixNano())
	}
	p.queues[b.tap] = append(p.queues[b.tap], b)
	p.held += len(b.frames)
	if last := b.frames[len(b.frames)-1].pkt.Time; last.After(p.newest) {
		p.newest = last
	}
	return p.release(p.newest.Add(-reorderWindow), tr)
}

// nextDue is when the oldest frame held is due to be written; false when
// none is held. A burst's last frames have no later frame to release them
// (hold): the run releases them at that time.
func (p *pcapOut) nextDue() (time.Time, bool) {
	if len(p.heads) == 0 || p.full() {
		return time.Time{}, false
	}
	return time.Unix(0, p.heads[0].at).Add(reorderWindow), true
}

// release writes the held frames captured before t, oldest first across the
// capture points (a tap delivers its own frames in time order, so merging
// the queues' heads orders the file); it returns a stop reason when the file
// failed or reached a bound that ends the run. Once a bound ended the file,
// the frames held are counted as not written.
func (p *pcapOut) release(t time.Time, tr *tracer) string {
	if p.full() {
		return p.dropHeld(tr)
	}
	before := t.UnixNano()
	p.last.ok = false // the engine may have learned since the last release
	p.lastGen++
	var w export.Held // held from the first frame due to the last
	held := false
	defer func() {
		if held {
			w.Release()
		}
	}()
	for len(p.heads) > 0 {
		top := p.heads[0]
		if top.at >= before && p.held <= maxHeld {
			return ""
		}
		if p.held <= maxHeld && p.flowComing(tr, top.queue, t) {
			// Its flow may still come (a Pod found after its first
			// packets): its comment waits for it, and the frames after it
			// for the file's time order, within the engine's window.
			return ""
		}
		if !held {
			w, held = p.w.Hold(), true
		}
		reason := p.writeHead(w, top.queue, tr)
		if q := p.queues[top.queue]; len(q) == 0 {
			p.popHead()
		} else {
			p.heads[0].at = q[0].frames[q[0].next].pkt.Time.UnixNano()
			p.siftDown(0)
		}
		// A bound that ended the file made the write return its stop
		// reason: the file is looked at only then.
		if reason != "" {
			if p.full() {
				return p.dropHeld(tr)
			}
			return reason
		}
	}
	return ""
}

// flowComing tells whether the oldest frame of queue i waits in the engine
// for a flow that may still claim it at t (flow.WaitWindow).
func (p *pcapOut) flowComing(tr *tracer, i int, t time.Time) bool {
	b := p.queues[i][0]
	f := &b.frames[b.next]
	if f.known || t.Sub(f.pkt.Time) >= flow.WaitWindow {
		return false
	}
	o, ok := f.pkt.Observation(tr.taps[i].point)
	return ok && tr.eng.Waits(o)
}

func (p *pcapOut) pushHead(queue int, at int64) {
	p.heads = append(p.heads, queueHead{at: at, queue: queue})
	for i := len(p.heads) - 1; i > 0; {
		parent := (i - 1) / 2
		if !p.heads[i].before(p.heads[parent]) {
			break
		}
		p.heads[i], p.heads[parent] = p.heads[parent], p.heads[i]
		i = parent
	}
}

func (p *pcapOut) popHead() {
	last := len(p.heads) - 1
	p.heads[0] = p.heads[last]
	p.heads = p.heads[:last]
	p.siftDown(0)
}

func (p *pcapOut) siftDown(i int) {
	for {
		least, l := i, 2*i+1
		if l < len(p.heads) && p.heads[l].before(p.heads[least]) {
			least = l
		}
		if r := l + 1; r < len(p.heads) && p.heads[r].before(p.heads[least]) {
			least = r
		}
		if least == i {
			return
		}
		p.heads[i], p.heads[least] = p.heads[least], p.heads[i]
		i = least
	}
}

// before orders equal times by capture point, as the points are listed
// (Pod, host, uplink: the order a request crosses them), so the file's
// order does not depend on which batch came first.
func (h queueHead) before(o queueHead) bool {
	return h.at < o.at || h.at == o.at && h.queue < o.queue
}

// writeHead writes the oldest held frame of queue i, and gives its batch
// back once every frame of it is written.
func (p *pcapOut) writeHead(w export.Held, i int, tr *tracer) string {
	q := p.queues[i]
	b := q[0]
	f := &b.frames[b.next]
	reason := p.write(w, i, &f.pkt, p.comment(tr, i, f))
	b.next++
	p.held--
	if b.next == len(b.frames) {
		copy(q, q[1:])
		q[len(q)-1] = nil
		p.queues[i] = q[:len(q)-1]
		tr.putBatch(b)
	}
	return reason
}

// comment is tr.comment(i, f), the last one made again when f's flow,
// direction and side of the translation are those of the frame before, or
// of the last frame of its kind (the engine cannot have changed since: see
// pcapOut.last).
func (p *pcapOut) comment(tr *tracer, i int, f *frame) string {
	if !f.known {
		return tr.comment(i, f)
	}
	k := &p.byKind[f.kindSlot&(kindComments-1)]
	if k.gen == p.lastGen && k.ok && f.h.SharesComment(&k.h) {
		return k.c
	}
	c, ok := "", false
	if p.last.ok && f.h.SharesComment(&p.last.h) {
		c, ok = p.last.c, true
	} else if c, ok = tr.eng.CommentOf(&f.h); !ok {
		return tr.comment(i, f)
	}
	p.last = lastComment{h: f.h, c: c, ok: true}
	*k = lastComment{h: f.h, c: c, ok: true, gen: p.lastGen}
	return c
}
