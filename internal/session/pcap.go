package session

import (
	"errors"
	"fmt"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
)

// pcapOut is the session's pcapng file: one interface per tap, in tap order.
type pcapOut struct {
	w      *export.Writer
	path   string
	perTap []uint64
	err    error // a write error other than the bounds (disk full, ...)
	// queues holds, per tap in tap order, the batches with frames not
	// written yet, oldest first.
	queues [][]*batch
	held   int // frames in queues
	newest time.Time
}

func openPcap(path string, lim export.Limits, taps []tap, snaplen int) (*pcapOut, error) {
	ifaces := make([]export.Interface, len(taps))
	for i, tp := range taps {
		ifaces[i] = export.Interface{
			Name:        tp.label,
			Description: fmt.Sprintf("%s: %s ifindex %d, netns %s", tp.role, tp.ifname, tp.t.Ifindex(), tp.netns),
			Snaplen:     snaplen,
		}
	}
	w, err := export.Create(path, ifaces, lim)
	if err != nil {
		return nil, fmt.Errorf("pcapng %s: %w", path, err)
	}
	return &pcapOut{w: w, path: path, perTap: make([]uint64, len(taps)), queues: make([][]*batch, len(taps))}, nil
}

// write appends one frame; a reached bound or a write error returns the stop
// reason (the trace ends, and its report says why).
func (p *pcapOut) write(iface int, pkt *capture.Packet, comment string) string {
	if p.err != nil {
		return "pcap-error"
	}
	err := p.w.WritePacket(iface, pkt, comment)
	switch {
	case err == nil:
		p.perTap[iface]++
	case errors.Is(err, export.ErrLimit):
	default:
		p.err = err
		return "pcap-error"
	}
	return p.w.StopReason()
}

// close writes each interface's statistics and publishes the file.
func (p *pcapOut) close(taps []tap) *export.Summary {
	stats := make([]export.InterfaceStats, len(taps))
	res := &export.Summary{Path: p.path, PerInterface: map[string]uint64{}}
	for i, tp := range taps {
		st := tp.t.Stats()
		stats[i] = export.InterfaceStats{Received: st.Packets, Dropped: st.KernelDrops}
		res.PerInterface[tp.label] = p.perTap[i]
	}
	// A failed close (a reader that went away from "-", a full disk) is
	// reported with the rest, never at the cost of the report.
	if err := p.w.Close(stats); err != nil && p.err == nil {
		p.err = err
	}
	if p.err != nil {
		res.Error = p.err.Error()
	}
	res.Packets, res.Bytes, res.StopReason = p.w.Packets(), p.w.Bytes(), p.w.StopReason()
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
// made when it is written, so it carries the most the engine knows by then.
func (p *pcapOut) hold(b *batch, tr *tracer) string {
	if len(b.frames) == 0 {
		tr.putBatch(b)
		return ""
	}
	p.queues[b.tap] = append(p.queues[b.tap], b)
	p.held += len(b.frames)
	if last := b.frames[len(b.frames)-1].pkt.Time; last.After(p.newest) {
		p.newest = last
	}
	return p.release(p.newest.Add(-reorderWindow), tr)
}

// head is the time of the oldest frame not written of queue i.
func (p *pcapOut) head(i int) (time.Time, bool) {
	q := p.queues[i]
	if len(q) == 0 {
		return time.Time{}, false
	}
	return q[0].frames[q[0].next].pkt.Time, true
}

// release writes the held frames captured before t, oldest first across the
// capture points (a tap delivers its own frames in time order, so merging
// the queues' heads orders the file); it returns a stop reason when the file
// reached a bound or failed.
func (p *pcapOut) release(t time.Time, tr *tracer) string {
	for p.held > 0 {
		// The queue with the oldest head writes until it passes the head of
		// the next oldest one.
		oldest, second := -1, -1
		var oldestAt, secondAt time.Time
		for i := range p.queues {
			at, ok := p.head(i)
			switch {
			case !ok:
			case oldest < 0 || at.Before(oldestAt):
				second, secondAt = oldest, oldestAt
				oldest, oldestAt = i, at
			case second < 0 || at.Before(secondAt):
				second, secondAt = i, at
			}
		}
		for {
			at, ok := p.head(oldest)
			if !ok || second >= 0 && secondAt.Before(at) {
				break
			}
			if !at.Before(t) && p.held <= maxHeld {
				return ""
			}
			if reason := p.writeHead(oldest, tr); reason != "" {
				return reason
			}
		}
	}
	return ""
}

// writeHead writes the oldest held frame of queue i, and gives its batch
// back once every frame of it is written.
func (p *pcapOut) writeHead(i int, tr *tracer) string {
	q := p.queues[i]
	b := q[0]
	f := &b.frames[b.next]
	reason := p.write(i, &f.pkt, tr.comment(i, f))
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
