package flow

import (
	"net/netip"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// noteStray looks at a packet no flow claimed: one to a flow's client
// endpoint from the flow's Service or backend address, but from another
// port, is the flow's server answering from another socket (a UDP server
// that does not reply from the port it was asked on). Conntrack cannot
// match it to the flow, so it reaches the client unNATed and the client's
// socket drops it: the flow shows no reply although the server answered.
// It is counted with the flow (Flow.StrayReplies), once per packet: only at
// the capture point that reported the first one.
func (e *Engine) noteStray(o obs.Observation) {
	switch o.Point {
	case obs.PointPod, obs.PointHost, obs.PointUplink:
	default:
		return
	}
	// Of a reused client port's flows, the one that began last before
	// the answer: an earlier flow of the port is another socket's, done.
	m := momentOf(&o, true)
	f := latestBefore(e.clients[clientKey{o.Proto, o.Dst}], m, m.at+int64(sameConnGap), func(f *flowState) bool {
		return !f.merged && f.fromServerAddr(o.Src)
	})
	if f == nil {
		return
	}
	if f.stray == nil {
		f.stray = &StrayReplies{From: o.Src, Point: o.Point.String(), At: o.Time}
	}
	if f.stray.Point == o.Point.String() {
		f.stray.Packets++
	}
}

// fromServerAddr tells whether src is the address of f's Service or of one
// of its backends, on a port that is not theirs.
func (f *flowState) fromServerAddr(src netip.AddrPort) bool {
	if src == f.service {
		return false
	}
	if src.Addr() == f.service.Addr() {
		return true
	}
	addr := false
	for _, b := range f.backends {
		if b.addr == src {
			return false
		}
		addr = addr || b.addr.Addr() == src.Addr()
	}
	return addr
}
