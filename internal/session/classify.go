package session

import (
	"net/netip"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// The consumer remembers, per kind of packet (capture point, direction and
// tuple, hence one flow and one of its counters), the engine's handle: the
// first packet of a kind goes through the engine's correlation, the next
// ones are only counted (flow.Engine.Repeat) and share their flow's comment.
// A kind is packed into two words: the map hashes it as 16 bytes of memory,
// where a struct of its fields took a hash field by field (with a new flow
// every few packets, the table's lookups and inserts were 7% of the CPU).
type classKey struct{ addrs, rest uint64 }

// kindOf adds the capture point and direction to the low bits capture.Tuple
// leaves free.
func kindOf(tap int, dir obs.Dir, t capture.Tuple) classKey {
	return classKey{addrs: t.Addrs, rest: t.Rest | uint64(dir)<<16 | uint64(uint16(tap))}
}

// maxClasses bounds the table of packet kinds: beyond it the table starts
// over, and kinds seen again are correlated again (correct, only slower).
const maxClasses = 1 << 13

// classTable maps packet kinds to handles. The kinds looked up are also
// kept in a small direct-mapped cache (a slot per hash of the kind), which
// is looked at first: one comparison instead of hashing for the map. A few
// recent kinds compared in turn served one flow's requests and replies, but
// a busy client's flows in turn (a ring block of 8 sockets' datagrams)
// missed them at every frame and paid the map and the replacement (12% of
// a traced run's CPU).
type classTable struct {
	m      map[classKey]flow.Handle
	recent [recentSlots]classEntry // by slotOf
}

// recentSlots is the size of classTable's cache, a power of two: 14 KiB.
const recentSlots = 256

type classEntry struct {
	k  classKey
	h  flow.Handle
	ok bool
}

// slotOf is k's slot in classTable.recent: a multiplicative hash of both
// words, its top bits.
func slotOf(k classKey) int {
	const golden = 0x9e3779b97f4a7c15
	return int(((k.addrs*golden)^k.rest)*golden>>(64-8)) & (recentSlots - 1)
}

func newClassTable() *classTable { return &classTable{m: map[classKey]flow.Handle{}} }

// get returns the handle of kind k, nil when it has none. The pointer is
// into the table's cache, valid until its next change (put, remove or a
// get that finds k in the map only): the handle is not copied through the
// stack, which cost a store-forwarding stall per packet.
func (c *classTable) get(k classKey) *flow.Handle {
	if e := &c.recent[slotOf(k)]; e.ok && e.k == k {
		return &e.h
	}
	h, ok := c.m[k]
	if !ok {
		return nil
	}
	return c.remember(k, h)
}

func (c *classTable) put(k classKey, h flow.Handle) {
	if len(c.m) >= maxClasses {
		clear(c.m)
		c.recent = [recentSlots]classEntry{}
	}
	c.m[k] = h
	c.remember(k, h)
}

// reset forgets every kind.
func (c *classTable) reset() {
	clear(c.m)
	c.recent = [recentSlots]classEntry{}
}

func (c *classTable) remove(k classKey) {
	delete(c.m, k)
	if e := &c.recent[slotOf(k)]; e.k == k {
		*e = classEntry{}
	}
}

// putRecent is put into the cache only: the map forgets what it had of k
// (a reused port's older flow), so that k falling out of the cache finds
// nothing rather than that.
func (c *classTable) putRecent(k classKey, h flow.Handle) {
	if len(c.m) > 0 {
		delete(c.m, k)
	}
	c.remember(k, h)
}

// remember keeps k's handle in its cache slot and returns where.
func (c *classTable) remember(k classKey, h flow.Handle) *flow.Handle {
	e := &c.recent[slotOf(k)]
	*e = classEntry{k: k, h: h, ok: true}
	return &e.h
}

// classify counts a captured frame in its flow and sets h to its handle,
// and kindSlot to a hash of its kind (0 without one);
// false for a frame that is no packet of a known flow (not IPv4 TCP/UDP,
// or its flow is not known yet: the engine keeps it waiting). This is the
// path of every captured packet: a packet of a kind seen before is only
// counted; the rest goes to correlate. The handle is set in place (the
// frame's), not returned: a handle returned through the stack cost a
// store-forwarding stall per packet.
func (tr *tracer) classify(tapIdx int, p *capture.Packet, h *flow.Handle, kindSlot *uint8) bool {
	*kindSlot = 0
	t, control, ok := p.Tuple()
	if !ok {
		var frag bool
		if *h, ok, frag = tr.laterFragment(tapIdx, p); frag {
			return ok
		}
		tr.noteICMPError(tapIdx, p)
		*h = flow.Handle{}
		return false
	}
	k := kindOf(tapIdx, p.Dir, t)
	*kindSlot = uint8(slotOf(k))
	// A TCP SYN, FIN or RST always goes to the engine: a SYN on a reused
	// client port begins a new flow, which counting it in the old one
	// would hide.
	if !control {
		if known := tr.classes.get(k); known != nil && tr.eng.Repeat(known, tr.taps[tapIdx].point, p.Time, p.Len) {
			*h = *known
			if t.FirstFragment() {
				tr.noteFirstFragment(tapIdx, p, *h)
			}
			return true
		}
	}
	*h, ok = tr.correlate(tapIdx, p, k, control)
	if ok && t.FirstFragment() {
		tr.noteFirstFragment(tapIdx, p, *h)
	}
	return ok
}

// maxFrags bounds the datagrams remembered for their later fragments;
// beyond it the table starts over (a datagram's fragments follow each
// other within microseconds).
const maxFrags = 1 << 10

// noteFirstFragment remembers the flow of a datagram's first fragment (the
// only one with ports), so that its later fragments are counted in the same
// flow and share its comment.
func (tr *tracer) noteFirstFragment(tapIdx int, p *capture.Packet, h flow.Handle) {
	fk, first, ok := p.Fragment()
	if !ok || !first {
		return
	}
	if tr.frags == nil || len(tr.frags) >= maxFrags {
		tr.frags = make(map[classKey]flow.Handle)
	}
	tr.frags[fragKind(tapIdx, p.Dir, fk)] = h
}

// fragKind is kindOf for a fragment's datagram.
func fragKind(tap int, dir obs.Dir, k capture.FragKey) classKey {
	return classKey{addrs: k.Addrs, rest: k.Rest | uint64(dir)<<16 | uint64(uint16(tap))}
}

// laterFragment counts an IPv4 fragment after the first in the flow of its
// datagram's first fragment, seen at the same capture point. One whose first
// fragment was in no flow (not seen, or not a Service's) goes to the engine
// as an observation without ports, which counts it as such (without_ports).
// frag is false for a frame that is no later fragment.
func (tr *tracer) laterFragment(tapIdx int, p *capture.Packet) (h flow.Handle, ok, frag bool) {
	fk, first, frag := p.Fragment()
	if !frag || first {
		return flow.Handle{}, false, false
	}
	point := tr.taps[tapIdx].point
	if h, ok := tr.frags[fragKind(tapIdx, p.Dir, fk)]; ok && tr.eng.Repeat(&h, point, p.Time, p.Len) {
		return h, true, true
	}
	src, dst := fk.Addrs4()
	if !tr.inScope(netip.AddrPortFrom(src, 0), netip.AddrPortFrom(dst, 0)) {
		return flow.Handle{}, false, true
	}
	tr.eng.AddPacket(obs.Observation{Time: p.Time, Point: point, Dir: p.Dir, Ifindex: p.Ifindex, Len: p.Len,
		Proto: fk.Proto(), Src: netip.AddrPortFrom(src, 0), Dst: netip.AddrPortFrom(dst, 0)})
	return flow.Handle{}, false, true
}

// correlate adds the first packet of a kind (or one its handle cannot
// count) to the engine and remembers the handle it gets for the kind. A
// TCP SYN, FIN or RST (control) always comes here, and the packets after it
// of its kind are few, or come soon (a handshake's ACK): its handle goes to
// the table's cache only, not its map (which forgets the kind's older
// handle: a reused port's). Short connections brought the map a
// new kind at almost every packet, and the map's inserts were 6% of the
// CPU per traced connection in the lab; a kind that falls out of the
// cache is correlated again, at its next packet.
func (tr *tracer) correlate(tapIdx int, p *capture.Packet, k classKey, control bool) (flow.Handle, bool) {
	tp := &tr.taps[tapIdx]
	o, _ := p.Observation(tp.point)
	if !tr.inScope(o.Src, o.Dst) || tr.leftOutAsOthersSNAT(o) || tr.leftOutAsServed(o) {
		return flow.Handle{}, false
	}
	o.Ifname = tp.label
	h, ok := tr.eng.AddPacket(o)
	if !ok {
		tr.classes.remove(k)
		return h, false
	}
	if control {
		tr.classes.putRecent(k, h)
	} else {
		tr.classes.put(k, h)
	}
	return h, true
}

// commentFlowNotYetKnown is the comment of a frame written while the engine
// still kept it waiting for its flow.
const commentFlowNotYetKnown = "no Service flow known for this packet yet: it still waited for its flow's evidence when written (if a flow claims it later, the report counts it there)"

// comment is a frame's pcapng comment: its flow, before or after
// translation, and the flow's verdict as known now; for an ICMP error, what
// it is and the flow of the packet it quotes (icmpComment).
func (tr *tracer) comment(tapIdx int, f *frame) string {
	if f.known {
		if c, ok := tr.eng.CommentOf(&f.h); ok {
			return c
		}
		if f.h.Refused() {
			return "flow not followed: more flows than --max-flows"
		}
		if f.h.ReplyOnly() {
			return flow.CommentReplyWithoutRequest
		}
	}
	// Not classified when it arrived (it waited for its flow), or its flow
	// was merged since: classify it now, without counting it again.
	if o, ok := f.pkt.Observation(tr.taps[tapIdx].point); ok {
		if ref, ok := tr.eng.Classify(o); ok {
			return ref.Comment()
		}
		if tr.eng.Waits(o) {
			// Written before its flow's evidence came (the held frames
			// reached maxHeld, or the engine's clock lags the wall clock's).
			return commentFlowNotYetKnown
		}
		if tr.eng.ReplyWithoutRequest(o) {
			return flow.CommentReplyWithoutRequest
		}
		if tr.clients != nil && !tr.isClient(o.Src) && !tr.isClient(o.Dst) {
			return "another client's packet, not traced: a Pod is selected"
		}
		if tr.isOthersSNAT(o) {
			return "another client's packet, with the source the node's SNAT gave it (conntrack), not traced: a Pod is selected"
		}
		if tr.isServedToOther(o) {
			return "another client's packet to the selected Pod as a Service's backend, not traced: a Pod is selected"
		}
	} else if e, ok := f.pkt.ICMPError(); ok {
		return tr.icmpComment(tapIdx, e)
	} else if _, first, ok := f.pkt.Fragment(); ok && !first {
		return "IP fragment after the first (no ports): the flow of its datagram's first fragment is not known"
	}
	return "no Service flow known for this packet"
}

// noteICMPError tells the engine about an ICMP error message (a frame with
// no tuple of its own) about a flow's packet: it answered the flow.
func (tr *tracer) noteICMPError(tapIdx int, p *capture.Packet) {
	e, ok := p.ICMPError()
	if !ok {
		return
	}
	o := e.Observation()
	if !tr.inScope(o.Src, o.Dst) || tr.leftOutAsOthersSNAT(o) || tr.leftOutAsServed(o) {
		return
	}
	o.Point, o.Dir, o.Time = tr.taps[tapIdx].point, p.Dir, p.Time
	tr.eng.NoteICMPError(o, tr.icmpKind(e), e.From)
}

// icmpKind is e.Kind(), made once per type and code: a flood answered by
// port unreachables brings one error per packet.
func (tr *tracer) icmpKind(e capture.ICMPError) string {
	k := uint16(e.Type)<<8 | uint16(e.Code)
	if s, ok := tr.icmpKinds[k]; ok {
		return s
	}
	if tr.icmpKinds == nil {
		tr.icmpKinds = map[uint16]string{}
	}
	s := e.Kind()
	tr.icmpKinds[k] = s
	return s
}

// icmpComment says what an ICMP error is, who sent it and which flow the
// packet it quotes belongs to, found as that packet would be (Classify on
// the quoted tuple), e.g. "ICMP destination unreachable (code 0: net
// unreachable) from 10.244.8.1 about flow 3 request to VIP (not
// translated); rewritten_at=nowhere". The error is not a packet of that
// flow and is not counted in it (classify never gets a handle for it). A
// quote no known flow claims is named by its tuple.
func (tr *tracer) icmpComment(tapIdx int, e capture.ICMPError) string {
	o := e.Observation()
	o.Point = tr.taps[tapIdx].point
	about := e.QuotedString() + " (no Service flow known for it)"
	if ref, ok := tr.eng.Classify(o); ok {
		about = ref.Comment()
	} else if tr.isOthersSNAT(o) {
		about = e.QuotedString() + " (another client's flow, with the source the node's SNAT gave it: not traced, a Pod is selected)"
	} else if tr.isServedToOther(o) {
		about = e.QuotedString() + " (another client's flow to the selected Pod as a Service's backend: not traced, a Pod is selected)"
	}
	return tr.icmpKind(e) + " from " + e.From.String() + " about " + about
}
