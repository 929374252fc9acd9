package flow

import (
	"net/netip"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// waiting holds observations whose flow is not known yet: events reordered
// across sources, or packets to a backend that arrive before the rewrite
// observation naming it. Each is indexed by both endpoints, since either may be
// the client. Bounded in number (the oldest arrivals are evicted first) and in
// age (older than the reordering window behind the newest observation).
type waiting struct {
	queue  []*waitingObs // arrival order; done entries are skipped
	head   int
	byEnd  map[clientKey][]*waitingObs
	live   int
	pushes int // since the last rebuild: bounds the memory done entries hold
	limit  int
}

type waitingObs struct {
	o    obs.Observation
	done bool
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
	return waiting{byEnd: make(map[clientKey][]*waitingObs), limit: limit}
}

func (w *waiting) add(o obs.Observation, deferred bool) {
	w.push(&waitingObs{o: o, deferred: deferred})
}

// addICMP keeps the packet an ICMP error quotes waiting for its flow.
func (w *waiting) addICMP(o obs.Observation, note *icmpNote) {
	w.push(&waitingObs{o: o, icmp: note})
}

func (w *waiting) push(p *waitingObs) {
	w.queue = append(w.queue, p)
	w.index(p)
	w.live++
	w.pushes++
	if w.pushes > 4*w.limit {
		w.rebuild()
	}
}

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
	w.live--
}

// expire evicts from the oldest arrival: beyond the limit (overflow, a loss) or
// older than window behind newest (unmatched: nothing claimed it in time,
// unless a deferred one's last chance claims it; unclaimed is told of it,
// and counts tells whether it counts as unmatched).
func (w *waiting) expire(newest time.Time, window time.Duration, lastChance func(obs.Observation) bool, unclaimed func(obs.Observation), counts func(obs.Observation) bool) (overflow, unmatched uint64) {
	horizon := newest.Add(-window)
	for w.head < len(w.queue) {
		p := w.queue[w.head]
		if !p.done {
			switch {
			case p.icmp != nil && (w.live > w.limit || p.o.Time.Before(horizon)):
				// an ICMP error about no flow's packet: not an observation
			case w.live > w.limit:
				overflow++
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
				return overflow, unmatched
			}
			w.resolved(p)
		}
		w.queue[w.head] = nil
		w.head++
	}
	w.queue, w.head = w.queue[:0], 0
	return overflow, unmatched
}

// deferredLive returns the live observations whose guess was put off, oldest
// first.
func (w *waiting) deferredLive() []*waitingObs {
	var out []*waitingObs
	for _, p := range w.queue[w.head:] {
		if !p.done && p.deferred {
			out = append(out, p)
		}
	}
	return out
}

// unclaimedLive returns the live packets and events nothing claimed yet
// and no backend guess waits for, oldest first.
func (w *waiting) unclaimedLive() []*waitingObs {
	var out []*waitingObs
	for _, p := range w.queue[w.head:] {
		if !p.done && !p.deferred && p.icmp == nil {
			out = append(out, p)
		}
	}
	return out
}

// rebuild drops the done entries from the queue and the index.
func (w *waiting) rebuild() {
	live := make([]*waitingObs, 0, w.live)
	for _, p := range w.queue[w.head:] {
		if !p.done {
			live = append(live, p)
		}
	}
	w.queue, w.head, w.pushes = live, 0, 0
	w.byEnd = make(map[clientKey][]*waitingObs, len(live))
	for _, p := range live {
		w.index(p)
	}
}
