package session

import (
	"errors"
	"fmt"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
)

// pcapOut is the session's pcapng file: one interface per tap, in tap order.
type pcapOut struct {
	w      *export.Writer
	path   string
	perTap []uint64
	err    error // a write error other than the bounds (disk full, ...)
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
