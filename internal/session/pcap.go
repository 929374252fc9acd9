package session

import (
	"container/heap"
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
	err    error // a write error other than the bounds (disk full, ...)
	held   frameHeap
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
	return &pcapOut{w: w, path: path, perTap: make([]uint64, len(taps))}, nil
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

type frameHeap []heldFrame

func (h frameHeap) Len() int           { return len(h) }
func (h frameHeap) Less(i, j int) bool { return h[i].pkt.Time.Before(h[j].pkt.Time) }
func (h frameHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *frameHeap) Push(x any)        { *h = append(*h, x.(heldFrame)) }
func (h *frameHeap) Pop() any {
	old := *h
	f := old[len(old)-1]
	*h = old[:len(old)-1]
	return f
}

// hold queues a frame and writes every frame older than the reorder window
// (or the oldest ones beyond maxHeld). The comment is computed when the frame
// is written, so it carries the most the engine knows by then.
func (p *pcapOut) hold(f heldFrame, comment func(heldFrame) string) string {
	heap.Push(&p.held, f)
	if f.pkt.Time.After(p.newest) {
		p.newest = f.pkt.Time
	}
	return p.release(p.newest.Add(-reorderWindow), comment)
}

// release writes the held frames captured before t; it returns a stop reason
// when the file reached a bound or failed.
func (p *pcapOut) release(t time.Time, comment func(heldFrame) string) string {
	for len(p.held) > 0 && (p.held[0].pkt.Time.Before(t) || len(p.held) > maxHeld) {
		f := heap.Pop(&p.held).(heldFrame)
		if reason := p.write(f.iface, f.pkt, comment(f)); reason != "" {
			return reason
		}
	}
	return ""
}
