package flow

import (
	"cmp"
	"encoding/binary"
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// waiting holds observations whose flow is not known yet: events reordered
// across sources, or packets to a backend that arrive before the rewrite
// observation naming it. Each is indexed by both endpoints, since either may be
// the client. Bounded in number (the oldest arrivals are evicted first) and in
// age (older than the reordering window behind the newest observation).
//
// Two rooms share the index: the main one for the observations that may be
// a watched flow's by what is known when they arrive (an end is a watched
// Service's, a served backend endpoint, a traced client's: Engine.related),
// and a smaller one for the others (other traffic to or from a backend's
// address, on other ports: the taps and observers watch addresses on any
// port), so that heavy other traffic to a backend cannot evict the traced
// flows' observations. One endpoint pair cannot take either room: the
// other room holds at most otherPairCap of its observations at each point;
// the main one, once three quarters full, refuses those of a pair that has
// a quarter of it (heavy direct traffic to a backend's served port, which
// may be a traced flow's until the window says otherwise; below that, a
// traced bulk flow's packets that wait for its flow all stay). The first
// ones are kept, the later ones refused and counted: a flow's first packets
// are what its verdict needs (a socket LB's flow whose backend port is not
// learned yet waits in the other room until its socket events come), the
// later ones only its counts.
type waiting struct {
	queue  []*waitingObs // arrival order; done entries are skipped
	head   int
	byEnd  map[clientKey][]*waitingObs
	live   int
	pushes int // since the last rebuild: bounds the memory done entries hold
	limit  int

	// others is the other room's queue, otherLive and otherLimit its
	// count and bound; pairs counts each room's observations per
	// endpoint pair and point.
	others     []*waitingObs
	otherHead  int
	otherLive  int
	otherLimit int
	pairs      map[pairKey]int
	seq        uint64 // arrival number of the last pushed (waitingObs.seq)
}

// otherPairCap is how many observations of one endpoint pair at one point
// the other room holds (waiting): a flow's first packets at a point, enough
// for its verdict and its handshake; the rest are refused (counted).
const otherPairCap = 64

// pairKey is an endpoint pair (unordered) of one protocol in one room, at
// one capture point or observer in the other room (at any in the main one):
// each address folded to 64 bits (exact for IPv4; two IPv6 pairs may share
// a count, which only bounds them together), the ports and the rest in
// meta, so that the map hashes plain words (every waiting observation
// counts in it).
type pairKey struct{ a, b, meta uint64 }

func fold(a netip.Addr) uint64 {
	b := a.As16()
	return binary.BigEndian.Uint64(b[:8]) ^ binary.BigEndian.Uint64(b[8:])
}

func pairOf(p *waitingObs) pairKey {
	a, b := p.o.Src, p.o.Dst
	if b.Compare(a) < 0 {
		a, b = b, a
	}
	meta := uint64(a.Port())<<48 | uint64(b.Port())<<32 | uint64(p.o.Proto)<<16
	if p.other {
		meta |= uint64(p.o.Point)<<8 | 1
	}
	return pairKey{fold(a.Addr()), fold(b.Addr()), meta}
}

// full tells whether the room of p refuses another observation of its
// endpoint pair and point, which has n waiting there.
func (w *waiting) full(p *waitingObs, n int) bool {
	if p.other {
		return n >= otherPairCap
	}
	return 4*w.live >= 3*w.limit && n >= w.limit/4
}

type waitingObs struct {
	o    obs.Observation
	done bool
	// other: it waits in the other room (waiting.others).
	other bool
	seq   uint64 // arrival order across both rooms
	// deferred: its flow is known but was not taken for sure (a backend
	// guess put off): it has a last chance as it expires.
	deferred bool
	// icmp: o is the packet an ICMP error quotes (NoteICMPError), not an
	// observation: it is neither counted nor processed as one.
	icmp *icmpNote
	// strayNoted: the run ended with it unclaimed, and it was looked at as
	// a stray reply then (Engine.Settle); once is enough.
	strayNoted bool
}

// icmpNote is what an ICMP error message says, besides the packet it quotes.
type icmpNote struct {
	message string
	from    netip.Addr
}

func newWaiting(limit int) waiting {
	return waiting{byEnd: make(map[clientKey][]*waitingObs), limit: limit,
		otherLimit: max(1024, limit/4), pairs: make(map[pairKey]int)}
}

// add keeps o waiting, in the other room unless related; false when its
// room refused it (full): the caller counts it.
func (w *waiting) add(o obs.Observation, deferred, related bool) bool {
	return w.push(&waitingObs{o: o, deferred: deferred, other: !related})
}

// addICMP keeps the packet an ICMP error quotes waiting for its flow; false
// as add.
func (w *waiting) addICMP(o obs.Observation, note *icmpNote, related bool) bool {
	return w.push(&waitingObs{o: o, icmp: note, other: !related})
}

func (w *waiting) push(p *waitingObs) bool {
	k := pairOf(p)
	if w.full(p, w.pairs[k]) {
		return false
	}
	w.pairs[k]++
	if p.other {
		w.others = append(w.others, p)
		w.otherLive++
	} else {
		w.queue = append(w.queue, p)
		w.live++
	}
	w.seq++
	p.seq = w.seq
	w.index(p)
	w.pushes++
	if w.pushes > 4*w.limit { // both rooms: the other is smaller
		w.rebuild()
	}
	return true
}

// has tells whether the observation o (a point's, at its time, between its
// endpoints) waits, in either room.
func (w *waiting) has(o obs.Observation) bool {
	for _, p := range w.byEnd[clientKey{o.Proto, o.Src}] {
		if !p.done && p.icmp == nil && p.o.Point == o.Point && p.o.Time.Equal(o.Time) && p.o.Src == o.Src && p.o.Dst == o.Dst {
			return true
		}
	}
	return false
}

// waits tells whether any observation waits, in either room.
func (w *waiting) waits() bool { return w.live > 0 || w.otherLive > 0 }

func (w *waiting) index(p *waitingObs) {
	src, dst := clientKey{p.o.Proto, p.o.Src}, clientKey{p.o.Proto, p.o.Dst}
	w.byEnd[src] = append(w.byEnd[src], p)
	if dst != src {
		w.byEnd[dst] = append(w.byEnd[dst], p)
	}
}

// take removes and returns the live observations waiting on endpoint k, oldest
// first. The caller marks each one resolved or puts it back.
func (w *waiting) take(k clientKey) []*waitingObs {
	list, ok := w.byEnd[k]
	if !ok {
		return nil
	}
	delete(w.byEnd, k)
	live := list[:0]
	for _, p := range list {
		if !p.done {
			live = append(live, p)
		}
	}
	return live
}

func (w *waiting) putBack(k clientKey, p *waitingObs) {
	w.byEnd[k] = append(w.byEnd[k], p)
}

func (w *waiting) resolved(p *waitingObs) {
	p.done = true
	if p.other {
		w.otherLive--
	} else {
		w.live--
	}
	k := pairOf(p)
	if w.pairs[k] <= 1 {
		delete(w.pairs, k)
	} else {
		w.pairs[k]--
	}
}

// expire evicts from the oldest arrival of each room: beyond the room's
// limit (overflow, a loss: the main room's counted in overflow, the other
// room's in otherOverflow) or older than window behind newest (unmatched:
// nothing claimed it in time, unless a deferred one's last chance claims
// it; unclaimed is told of it, and counts tells whether it counts as
// unmatched).
func (w *waiting) expire(newest time.Time, window time.Duration, lastChance func(obs.Observation) bool, unclaimed func(obs.Observation), counts func(obs.Observation) bool) (overflow, otherOverflow, unmatched uint64) {
	horizon := newest.Add(-window)
	room := func(queue *[]*waitingObs, head *int, live *int, limit int, overflow *uint64) {
		for *head < len(*queue) {
			p := (*queue)[*head]
			if !p.done {
				switch {
				case p.icmp != nil && (*live > limit || p.o.Time.Before(horizon)):
					// an ICMP error about no flow's packet: not an observation
				case *live > limit:
					*overflow++
				case p.o.Time.Before(horizon):
					if !p.deferred || !lastChance(p.o) {
						if counts(p.o) {
							unmatched++
						}
						if !p.strayNoted {
							unclaimed(p.o)
						}
					}
				default:
					return
				}
				if !p.done { // a last chance may have resolved it by a replay
					w.resolved(p)
				}
			}
			(*queue)[*head] = nil
			*head++
		}
		*queue, *head = (*queue)[:0], 0
	}
	room(&w.queue, &w.head, &w.live, w.limit, &overflow)
	room(&w.others, &w.otherHead, &w.otherLive, w.otherLimit, &otherOverflow)
	return overflow, otherOverflow, unmatched
}

// live returns the live observations of both rooms that keep, oldest
// first.
func (w *waiting) liveWhere(keep func(*waitingObs) bool) []*waitingObs {
	var out []*waitingObs
	for _, p := range w.queue[w.head:] {
		if !p.done && keep(p) {
			out = append(out, p)
		}
	}
	n := len(out)
	for _, p := range w.others[w.otherHead:] {
		if !p.done && keep(p) {
			out = append(out, p)
		}
	}
	if n > 0 && n < len(out) {
		slices.SortStableFunc(out, func(a, b *waitingObs) int { return cmp.Compare(a.seq, b.seq) })
	}
	return out
}

// deferredLive returns the live observations whose guess was put off, oldest
// first.
func (w *waiting) deferredLive() []*waitingObs {
	return w.liveWhere(func(p *waitingObs) bool { return p.deferred })
}

// unclaimedLive returns the live packets and events nothing claimed yet
// and no backend guess waits for, oldest first.
func (w *waiting) unclaimedLive() []*waitingObs {
	return w.liveWhere(func(p *waitingObs) bool { return !p.deferred && p.icmp == nil })
}

// rebuild drops the done entries from the queues and the index.
func (w *waiting) rebuild() {
	compact := func(queue []*waitingObs, head, live int) []*waitingObs {
		out := make([]*waitingObs, 0, live)
		for _, p := range queue[head:] {
			if !p.done {
				out = append(out, p)
			}
		}
		return out
	}
	w.queue, w.head = compact(w.queue, w.head, w.live), 0
	w.others, w.otherHead = compact(w.others, w.otherHead, w.otherLive), 0
	w.pushes = 0
	w.byEnd = make(map[clientKey][]*waitingObs, len(w.queue)+len(w.others))
	for _, p := range w.queue {
		w.index(p)
	}
	for _, p := range w.others {
		w.index(p)
	}
}
