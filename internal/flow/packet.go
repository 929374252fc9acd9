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
	f *flowState // nil when refused or ro
	// slot is the index in f.points; of an ro handle, the reply-only
	// connections' generation it was made in (replyOnly.gen).
	slot              int
	reply, translated bool
	refused           bool
	// ro: a reply counted with its connection, none of whose requests
	// was seen (replyOnly); stale once a request came for one of them.
	ro bool
	// tcpFlags: the packet was TCP with its flags reported (a capture's
	// always are): the packets like it Repeat counts are then neither
	// SYN, FIN nor RST (the caller adds those), so they carry an ACK.
	tcpFlags bool
	// at is the time of the packet the handle was made for (Unix ns: the
	// handle is copied at every packet, and a time.Time is three words).
	// Everything but the counters keeps the earliest observation
	// (sightings, the uplink frame, a learned backend's time), so a packet
	// no earlier than that one cannot change it.
	at int64
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
	h.at = o.Time.UnixNano()
	h.tcpFlags = o.Proto == obs.TCP && o.TCPFlags != 0
	return h, ok
}

// refusedRecheck: once flows are retired, a refused flow's packets go to
// Add at least this often, which keeps its last sighting (refusedFlow.last)
// this close to the truth: a UDP flow silent for the flow timeout is over.
const refusedRecheck = time.Second

// Repeat counts one more packet (wire length n, seen at) like the one h was
// returned for. It reports false when h is stale (its flow was merged into
// another), the packet is older than h's, or h's TCP connection closed
// well before it (its client port may be reused): the packet was not
// counted, the caller must Add it. A TCP SYN, FIN or RST must be added,
// never repeated: they tell a connection's life (reuse.go). h is taken by
// address, as by CommentOf: a handle passed by value was copied through the
// stack at every packet, with a store-forwarding stall.
func (e *Engine) Repeat(h *Handle, p obs.Point, at time.Time, n int) bool {
	if at.UnixNano() < h.at {
		return false
	}
	if h.refused {
		if e.retiredTotals.n > 0 && at.UnixNano()-h.at > int64(refusedRecheck) {
			return false // Add notes it: the refusal's last sighting (refusalOver)
		}
		e.note(p, at)
		return true
	}
	if h.ro {
		if h.slot != e.replyOnly.gen {
			return false // its connection may have a flow now: link tells
		}
		e.note(p, at)
		if len(e.replays) > 0 || e.waiting.waits() {
			e.expire() // as Add would: the clock moved
		}
		return true
	}
	if ns := at.UnixNano(); h.f.merged || h.f.retired || h.f.tcp.closedBefore(ns) || h.f.tcp.superseded(moment{at: ns}) {
		return false // a closed connection's port reused: link tells
	}
	e.note(p, at)
	e.touch(h.f, at)
	if h.tcpFlags && !h.reply {
		// The client's ACK: it acknowledged the handshake (tcpLife.over).
		earliest(&h.f.tcp.ack, at.UnixNano())
	}
	pt := &h.f.points[h.slot]
	pt.packets++
	pt.bytes += uint64(n)
	if !pt.reply && e.late(at.UnixNano()) {
		e.countLate(h.f, pt.point, pt.dir, at.UnixNano())
	}
	if len(e.replays) > 0 || e.waiting.waits() {
		e.expire()
	}
	return true
}

// CommentOf is the pcapng comment of the packets of h (Ref.Comment), made
// once per flow and kind (request or reply, before or after translation)
// while the flow's verdict holds: every packet of a flow at every capture
// point shares it. The maxCommented flows that were given comments last
// keep them; an earlier one's are made again when its packets come back.
// False for a refused flow or one merged into another. A retired flow's
// (Retire) is its final verdict's.
func (e *Engine) CommentOf(h *Handle) (string, bool) {
	f := h.f
	if f == nil || f.merged {
		return "", false
	}
	if f.commentsEvidence != f.evidence || f.commentsGen != e.gen {
		f.comments = [6]string{}
		f.commentsEvidence, f.commentsGen = f.evidence, e.gen
	}
	i := 0
	if h.reply {
		i |= 1
	}
	if h.translated {
		i |= 2
	}
	// Told now, not when h was made: whether the client addressed the VIP
	// at its Pod may be learned after the packet.
	untranslated := f.untranslatedSlot(h.slot)
	if untranslated {
		i = 4 + i&1
	}
	if f.comments[i] == "" {
		r := e.ref(f, h.reply, h.translated)
		r.Untranslated, r.Direct = untranslated && !f.sendsDirect(), untranslated && f.sendsDirect()
		f.comments[i] = r.Comment()
		if !f.commented {
			e.keepComments(f)
		}
	}
	return f.comments[i], true
}

// SharesComment tells whether the packets of h and o have the same comment
// (CommentOf) for as long as the engine learns nothing new: they are of
// the same flow, direction and side of the translation, and neither or
// both are untranslated at their capture points (a reply that entered the
// client's Pod from the backend's address is commented apart from the same
// reply at the uplink). False for a refused flow's.
func (h *Handle) SharesComment(o *Handle) bool {
	if h.f == nil || h.f != o.f || h.reply != o.reply || h.translated != o.translated {
		return false
	}
	return h.slot == o.slot || h.f.untranslatedSlot(h.slot) == h.f.untranslatedSlot(o.slot)
}

// maxCommented bounds the flows that keep their packets' comments (a few
// hundred bytes each, six kinds): most flows' packets are all written
// within seconds, and thousands of quiet flows' comments were 4.6 MiB of
// the live heap at the default --max-flows under churn.
const maxCommented = 1024

// keepComments notes that f holds comments now; the flow that was given
// comments maxCommented flows ago gives its own up.
func (e *Engine) keepComments(f *flowState) {
	f.commented = true
	if len(e.commented) < maxCommented {
		e.commented = append(e.commented, f)
		return
	}
	old := e.commented[e.nextCommented]
	old.comments, old.commented = [6]string{}, false
	e.commented[e.nextCommented] = f
	e.nextCommented = (e.nextCommented + 1) % maxCommented
}
