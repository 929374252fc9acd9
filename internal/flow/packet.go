package flow

import (
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// Handle is where a packet observation was counted: a per-point counter of
// one flow, or the refusal of a flow beyond MaxFlows. A later packet of the
// same kind (same capture point, direction and addresses, hence the same
// flow) changes nothing but that counter and the flow's last-seen time, so a
// caller that recognises it passes it to Repeat instead of correlating it
// again: at tens of thousands of packets a second per point, that is most of
// the cost of following them.
type Handle struct {
	f                 *flowState // nil when refused
	slot              int        // index in f.points
	reply, translated bool
	refused           bool
	// at is the time of the packet the handle was made for. Everything but
	// the counters keeps the earliest observation (sightings, the uplink
	// frame, a learned backend's time), so a packet no earlier than that
	// one cannot change it.
	at time.Time
}

// Refused tells whether the packets of h belong to a flow refused beyond
// MaxFlows.
func (h Handle) Refused() bool { return h.refused }

// AddPacket is Add for a packet observation. It also returns the packet's
// handle when the packet was counted in a flow or refused with one; not
// when it waits for its flow (then the next packet like it must be added
// again).
func (e *Engine) AddPacket(o obs.Observation) (Handle, bool) {
	h, ok := e.add(o)
	h.at = o.Time
	return h, ok
}

// Repeat counts one more packet (wire length n, seen at) like the one h was
// returned for. It reports false when h is stale (its flow was merged into
// another) or the packet is older than h's: the packet was not counted, the
// caller must Add it.
func (e *Engine) Repeat(h Handle, p obs.Point, at time.Time, n int) bool {
	if at.Before(h.at) {
		return false
	}
	if h.refused {
		e.note(p, at)
		return true
	}
	if h.f.merged {
		return false
	}
	e.note(p, at)
	h.f.touch(at)
	h.f.points[h.slot].packets++
	h.f.points[h.slot].bytes += uint64(n)
	if len(e.replays) > 0 || e.waiting.live > 0 {
		e.expire()
	}
	return true
}

// Stamp changes whenever the Ref of a handle may have changed: a caller
// keeps what it made of a Ref (a packet comment) while the stamp holds. The
// zero Stamp is never the stamp of a live flow.
type Stamp struct{ evidence, gen uint64 }

// RefOf is Classify for the packets of h, and the Stamp it is valid for.
// Refused flows have no Ref (false).
func (e *Engine) RefOf(h Handle) (Ref, Stamp, bool) {
	if h.f == nil || h.f.merged {
		return Ref{}, Stamp{}, false
	}
	r := e.ref(h.f, h.reply, h.translated)
	return r, e.StampOf(h), true
}

// StampOf is the current stamp of h's flow.
func (e *Engine) StampOf(h Handle) Stamp {
	if h.f == nil || h.f.merged {
		return Stamp{}
	}
	return Stamp{h.f.evidence, e.gen + 1}
}
