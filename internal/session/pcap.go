package session

import (
	"errors"
	"fmt"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// pcapOut is the session's pcapng file: one interface per tap, in tap order.
type pcapOut struct {
	w      *export.Writer
	path   string
	perTap []uint64
	err    error  // a write error other than the bounds (disk full, ...)
	queues []fifo // per tap, in tap order
	held   int
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
	return &pcapOut{w: w, path: path, perTap: make([]uint64, len(taps)), queues: make([]fifo, len(taps))}, nil
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
// retires after at most 50 ms), so frames of different points arrive out of
// time order. Holding each frame for reorderWindow lets the file list them in
// time order across points, as Wireshark users expect; maxHeld bounds memory.
const (
	reorderWindow = 200 * time.Millisecond
	maxHeld       = 8192
)

// heldFrame is a frame waiting for its turn, with what classifies it.
type heldFrame struct {
	iface int
	pkt   *capture.Packet
	o     obs.Observation
	isObs bool
}

// fifo is one capture point's held frames, already in time order (a tap
// delivers its frames in order): merging the points' fifos orders the file.
type fifo struct {
	frames []heldFrame
	head   int
}

func (q *fifo) len() int { return len(q.frames) - q.head }

func (q *fifo) pop() heldFrame {
	f := q.frames[q.head]
	q.frames[q.head] = heldFrame{}
	q.head++
	// Reuse the space of popped frames: under steady traffic the queue never
	// runs empty, and appending after a dead prefix would grow it forever.
	if q.head == len(q.frames) || q.head >= 1024 && q.head > len(q.frames)/2 {
		n := copy(q.frames, q.frames[q.head:])
		clear(q.frames[n:])
		q.frames, q.head = q.frames[:n], 0
	}
	return f
}

// hold queues a frame and writes every frame older than the reorder window
// (or the oldest ones beyond maxHeld). The comment is computed when the frame
// is written, so it carries the most the engine knows by then.
func (p *pcapOut) hold(f heldFrame, comment func(heldFrame) string) string {
	q := &p.queues[f.iface]
	q.frames = append(q.frames, f)
	p.held++
	if f.pkt.Time.After(p.newest) {
		p.newest = f.pkt.Time
	}
	return p.release(p.newest.Add(-reorderWindow), comment)
}

// release writes the held frames captured before t, oldest first across the
// capture points; it returns a stop reason when the file reached a bound or
// failed.
func (p *pcapOut) release(t time.Time, comment func(heldFrame) string) string {
	for p.held > 0 {
		oldest := -1
		for i := range p.queues {
			q := &p.queues[i]
			if q.len() > 0 && (oldest < 0 || q.frames[q.head].pkt.Time.Before(p.queues[oldest].frames[p.queues[oldest].head].pkt.Time)) {
				oldest = i
			}
		}
		q := &p.queues[oldest]
		if !q.frames[q.head].pkt.Time.Before(t) && p.held <= maxHeld {
			return ""
		}
		f := q.pop()
		p.held--
		if reason := p.write(f.iface, f.pkt, comment(f)); reason != "" {
			return reason
		}
	}
	return ""
}
