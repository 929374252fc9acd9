package session

import (
	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// packetClass is what the consumer knows of the packets of one kind: one
// capture point, direction and tuple, hence one flow and one of its
// counters. The first packet of a kind goes through the engine's
// correlation; the next ones are only counted (flow.Engine.Repeat), and
// share the pcapng comment made for the kind while the flow's verdict holds.
type packetClass struct {
	h       flow.Handle
	comment string
	stamp   flow.Stamp // of comment; the zero Stamp never matches a live flow
}

type classKey struct {
	tap   uint16
	dir   obs.Dir
	tuple capture.Tuple
}

// maxClasses bounds the table of packet kinds: beyond it the table starts
// over, and kinds seen again are correlated again (correct, only slower).
const maxClasses = 1 << 13

// classify counts a captured frame in its flow and returns its class, nil
// for a frame that is no packet of a known flow (not IPv4 TCP/UDP, or its
// flow is not known yet: the engine keeps it waiting).
func (tr *tracer) classify(tapIdx int, p *capture.Packet) *packetClass {
	t, ok := p.Tuple()
	if !ok {
		return nil
	}
	tp := &tr.taps[tapIdx]
	k := classKey{uint16(tapIdx), p.Dir, t}
	if c := tr.classes[k]; c != nil && tr.eng.Repeat(c.h, tp.point, p.Time, p.Len) {
		return c
	}
	o, _ := p.Observation(tp.point)
	o.Ifname = tp.label
	h, ok := tr.eng.AddPacket(o)
	if !ok {
		delete(tr.classes, k)
		return nil
	}
	if len(tr.classes) >= maxClasses {
		clear(tr.classes)
	}
	c := &packetClass{h: h}
	tr.classes[k] = c
	return c
}

// comment is a frame's pcapng comment: its flow, before or after
// translation, and the flow's verdict as known now.
func (tr *tracer) comment(tapIdx int, f *frame) string {
	if c := f.class; c != nil {
		if c.comment != "" && tr.eng.StampOf(c.h) == c.stamp {
			return c.comment
		}
		if ref, stamp, ok := tr.eng.RefOf(c.h); ok {
			c.comment, c.stamp = ref.Comment(), stamp
			return c.comment
		}
		if c.h.Refused() {
			return "flow not followed: more flows than --max-flows"
		}
	}
	// Not classified when it arrived (it waited for its flow), or its flow
	// was merged since: classify it now, without counting it again.
	if o, ok := f.pkt.Observation(tr.taps[tapIdx].point); ok {
		if ref, ok := tr.eng.Classify(o); ok {
			return ref.Comment()
		}
	}
	return "no Service flow known for this packet"
}
