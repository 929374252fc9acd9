package flow

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// A run that follows a node until stopped (a daemon) cannot keep every flow
// to its end: the engine retires the flows that are over, hands out their
// final snapshot and forgets them (Retire). What tells a flow is over is
// its evidence and the engine's clock (the newest observation's time, or a
// later time the caller gives: never the wall clock by itself, so that a
// scenario replays alike):
//   - a TCP connection closed (its first RST, or FINs both ways) and quiet
//     for closeQuiet since its last packet;
//   - any flow idle for the flow timeout (Config.FlowTimeout).
//
// A retired flow is never mutated again nor found for an observation: its
// later packets (a long idle connection that speaks again) make a new flow
// with a new id, which says what it continues (Flow.Continues). Handles to
// it that the caller still holds (packets written later) give its final
// verdict's comment.

// closeQuiet is how long after its last packet a closed TCP connection is
// retired: its last ACKs and retransmissions, and every source's reordered
// observations (reorderWindow each), are in by then.
const closeQuiet = 3 * reorderWindow

// DefaultFlowTimeout is the idle time after which Retire retires any flow
// when Config.FlowTimeout is 0.
const DefaultFlowTimeout = time.Minute

// retiredNote is what the engine remembers of a retired flow for a while,
// to tell its client endpoint's later packets that they continue it.
type retiredNote struct {
	id   int
	last int64 // its last observation (unix ns)
	// began is when its connection began (unix ns): its first sighting, or
	// that of the flow it continued.
	began int64
	// opening: a TCP connection whose client sent its SYN and got no
	// answer yet (nor acknowledged one): its SYN retransmissions after it
	// was retired continue it.
	opening bool
	// replied: a UDP connection that got a reply (with the flow it
	// continues); life: how long after last its conntrack entry stands
	// (udpLife).
	replied bool
	life    time.Duration
	// sock is what its socket's observers taught (nil: none): a facet of
	// the socket, not of the packets, true for the socket's life.
	sock *retiredSocket
}

// retiredSocket is what the socket observers taught of a retired flow, which
// the flow continuing it behind a socket LB keeps (carrySocket): the app's
// request and the socket layer's destinations (the rewrite, which no packet
// shows), its process.
type retiredSocket struct {
	cps      [cpPod]sighting // cpApp to cpSockEgress
	kind     obs.SockKind
	fromNode bool
	pid      uint32
	comm     string
	cgroup   uint64
}

// peerKey is a client endpoint and the backend it talked to.
type peerKey struct {
	clientKey
	peer netip.AddrPort
}

// retiredTotals counts the flows retired so far, for Summary.
type retiredTotals struct {
	n                      int
	places                 map[Place]int
	beforeReady, afterStop int
}

// Retire retires the flows that are over as of now (or of the newest
// observation, when later) and returns their final snapshots, sorted by
// first seen. Every reference the engine keeps to them is dropped; Summary
// still counts them. A zero now uses the newest observation's time.
func (e *Engine) Retire(now time.Time) []Flow {
	e.retiring = true
	clock := e.newest
	if now.After(clock) {
		clock = now
	}
	timeout := e.flowTimeout()
	// What waited for its flow that long has had its chance, as it would
	// have had at the next observation: a backend guess put off for a
	// flow is made (lastChance) before that flow is reported, on a node
	// quiet since.
	e.expireAt(clock)
	// The labels of capture points gone (Pods that went) that only the
	// flows retired now counted in are forgotten after them.
	defer e.sweepLabels()
	return e.retire(func(f *flowState) bool {
		if f.last.IsZero() {
			return false
		}
		quiet := clock.Sub(f.last)
		if quiet >= timeout {
			return true
		}
		return f.proto == obs.TCP && f.tcp.closed() != 0 && quiet >= closeQuiet
	})
}

// RetireAll retires every flow now (the end of a run that reports them so)
// and returns their snapshots: what Flows would return.
func (e *Engine) RetireAll() []Flow {
	e.Settle()
	return e.retire(func(*flowState) bool { return true })
}

// Open counts the flows the engine follows now (not retired).
func (e *Engine) Open() int { return e.nflows }

func (e *Engine) retire(over func(*flowState) bool) []Flow {
	var fs []*flowState
	for _, list := range e.clients {
		for _, f := range list {
			if over(f) {
				fs = append(fs, f)
			}
		}
	}
	if len(fs) == 0 {
		return nil
	}
	// In the order Flows lists them: ids not given yet are given so.
	slices.SortFunc(fs, byFirstSeen)
	out := make([]Flow, len(fs))
	for i, f := range fs {
		out[i] = e.snapshot(f)
		e.count(f, out[i].RewrittenAt)
		// Its verdict is final: the comments of its packets still held
		// (CommentOf) say it, whatever the engine learns later.
		f.cached, f.cachedOK = placeBy{place: out[i].RewrittenAt, by: e.byName(out[i].By)}, true
		f.retired = true
	}
	if e.redirectsSeen {
		for _, f := range fs {
			e.noteProxyUpstreams(f)
		}
	}
	e.podFlows = nil
	for _, f := range fs {
		e.forget(f)
	}
	return out
}

// count adds a retired flow to the totals Summary reports.
func (e *Engine) count(f *flowState, place Place) {
	t := &e.retiredTotals
	if t.places == nil {
		t.places = map[Place]int{}
	}
	t.n++
	t.places[place]++
	if place == PlaceUnknown {
		switch e.window(f) {
		case beforeReady:
			t.beforeReady++
		case afterStop:
			t.afterStop++
		}
	}
}

// forget drops every reference the engine keeps to f: its client
// endpoint's index, its SNAT source's, its sockets', the late packet
// counts; the comment keepers let it go in their turn (keepComments).
func (e *Engine) forget(f *flowState) {
	k := f.key()
	e.unindex(f)
	e.dropSNAT(f)
	delete(e.retiredUpstreams, f)
	delete(e.lateCounts, f)
	if len(e.lateCounts) == 0 {
		e.lateCounts = nil // a map keeps its buckets once grown
	}
	if s := e.socks.m[f.sock]; s != nil {
		s.flows = slices.DeleteFunc(s.flows, func(g *flowState) bool { return g == f })
	}
	e.nflows--
	// The other flows of its endpoint and Service no longer have it for a
	// sibling (ctMayBeOthers).
	for _, g := range e.clients[k] {
		if g.service == f.service {
			g.evidenceChanged()
		}
	}
	// A closed TCP connection continues in no later flow: only the others
	// are remembered, and its close ended the connection of a flow of its
	// client endpoint and Service retired before (the one it continues, or
	// one whose close went unseen), which no later flow continues either.
	if f.client.Port() != 0 && f.proto == obs.TCP && f.tcp.closed() != 0 {
		e.retiredKeys.forget(flowKey{k, f.service})
	}
	if f.client.Port() != 0 && (f.proto != obs.TCP || f.tcp.closed() == 0) {
		// A reset that went to the client untranslated refused nothing it
		// heard of: it goes on retransmitting its SYN.
		opening := f.proto == obs.TCP && f.tcp.syn != 0 && f.tcp.synAck == 0 && f.tcp.ack == 0 &&
			(f.tcp.rstReply == 0 || f.tcp.rstUntranslated && !f.tcp.direct)
		r := retiredNote{id: f.id, last: f.last.UnixNano(), began: f.connStart(), opening: opening, sock: retiredSocketOf(f), replied: f.reply}
		if prev, ok := e.retiredKeys.get(flowKey{k, f.service}); ok && f.continues != 0 && f.continues == prev.id {
			r.replied = r.replied || prev.replied
		}
		r.life = e.udpLife(f, r)
		e.rememberRetired(flowKey{k, f.service}, r)
		// Its backends too: behind a socket LB no packet of its
		// endpoint names the VIP, only the backend (resumed).
		for _, b := range f.backends {
			e.retiredPeers.put(peerKey{k, b.addr}, f.service)
		}
	}
}

// retiredSocketOf is what the socket observers taught of f, nil if nothing.
func retiredSocketOf(f *flowState) *retiredSocket {
	r := &retiredSocket{kind: f.kind, fromNode: f.fromNode, pid: f.pid, comm: f.comm, cgroup: f.cgroup}
	copy(r.cps[:], f.cps[:cpPod])
	seen := f.kind != 0 || !f.procAt.IsZero()
	for _, s := range r.cps {
		seen = seen || s.any()
	}
	if !seen {
		return nil
	}
	return r
}

// resumed is the flow that the packet of client to (from, with reply) peer
// at m continues, made now, when nothing else names its flow: the client
// endpoint's retired flow went to peer, its backend, and the packet may
// continue it (continues). Behind a socket LB the packets of a long idle
// connection that speaks again never name the VIP: without this they
// would be matched to no flow, lost to the flow log.
func (e *Engine) resumed(client, peer netip.AddrPort, proto obs.Proto, cookie uint64, m moment, last bool) (*flowState, linkResult) {
	k := clientKey{proto, client}
	svc, ok := e.retiredPeers.get(peerKey{k, peer})
	if !ok {
		return nil, unlinked
	}
	r, ok := e.retiredKeys.get(flowKey{k, svc})
	if !ok || !r.continuedBy(proto, m) {
		return nil, unlinked
	}
	made := e.made
	f, res := e.flowFor(proto, client, svc, cookie, m, last)
	if res == linked {
		if e.made != made && f.continues == r.id {
			e.carrySocket(f, r, time.Unix(0, m.at))
		}
		e.learnBackend(f, peer, time.Unix(0, m.at))
	}
	return f, res
}

// udpLife is how long conntrack keeps the entry of r, the retired UDP flow
// f, after its last packet (nf_conntrack_udp_packet): the stream timeout
// once the entry saw a reply and then a packet more than udpStreamAfter
// after it began, the plain one before. A last packet that was the first
// reply counts too (the flow does not tell), and so does the unseen
// beginning of one that began before the run: the longer life only makes
// a later datagram continue it, where conntrack's silence then proves
// nothing.
func (e *Engine) udpLife(f *flowState, r retiredNote) time.Duration {
	plain, stream := e.udpTimeouts()
	if r.replied && (r.last-r.began > int64(udpStreamAfter) || e.window(f) == beforeReady) {
		return stream
	}
	return plain
}

// rememberRetired puts a retired flow in retiredKeys. When that forgets a
// generation of them, forgotten is moved to the latest of their last
// sightings: a flow first seen within udpEntryLife of it may continue one
// of them, which the engine can no longer tell (conntrackBlind).
func (e *Engine) rememberRetired(k flowKey, r retiredNote) {
	s := &e.retiredKeys
	if _, ok := s.cur[k]; !ok && len(s.cur) >= s.limit {
		latest := e.retiredForgotten
		for _, o := range s.old {
			latest = max(latest, o.last)
		}
		if latest != e.retiredForgotten {
			e.retiredForgotten = latest
			e.gen++ // verdicts that rested on conntrack's silence
		}
	}
	s.put(k, r)
}

// mayContinueForgotten tells whether f, a UDP flow not known to continue
// a retired one, may yet continue one the engine forgot (a busy node
// retires more flows than it remembers): it was first seen less than
// udpEntryLife after the last sighting of a forgotten one.
func (e *Engine) mayContinueForgotten(f *flowState) bool {
	return e.retiredForgotten != 0 && f.continues == 0 && f.first.UnixNano()-e.retiredForgotten < int64(e.udpEntryLife())
}

// continued notes, of a flow f made at m, the retired flow of its client
// endpoint and Service it continues, if any (a closed TCP connection's
// is not remembered: its late packets continue nothing): not a TCP
// connection opening (a SYN is another connection), unless the retired
// one was still sending its SYN unanswered (a retransmission: a client
// retries for up to synRetryWindow, with gaps that double), nor, for UDP, one idle for longer than conntrack keeps an entry
// (udpLife): a datagram then makes a new entry, as a new flow's.
func (e *Engine) continued(f *flowState, m moment) {
	if r, ok := e.retiredBefore(flowKey{f.key(), f.service}, m); ok && !e.tcpClosedSince(f) {
		f.continues, f.continuesLast, f.connBegan = r.id, r.last, r.began
	}
}

// connStart is when f's connection began: its first sighting, or for a
// flow that continues a retired one, that one's connection's beginning.
func (f *flowState) connStart() int64 {
	return cmp.Or(f.connBegan, f.first.UnixNano())
}

// tcpClosedSince tells whether f, a TCP flow being made, has an open
// sibling (its client endpoint and Service) whose connection closed: the
// retired flow's connection ended with it at the latest, so f, made after,
// is a later connection's (a conntrack event of its port's next
// connection, delivered ahead of its SYN, has no flags to tell).
func (e *Engine) tcpClosedSince(f *flowState) bool {
	if f.proto != obs.TCP {
		return false
	}
	for _, g := range e.clients[f.key()] {
		if g != f && g.service == f.service && g.tcp.closed() != 0 {
			return true
		}
	}
	return false
}

// retiredBefore is the retired flow k whose connection an observation at
// m may continue (continuedBy), if any.
func (e *Engine) retiredBefore(k flowKey, m moment) (retiredNote, bool) {
	r, ok := e.retiredKeys.get(k)
	return r, ok && r.continuedBy(k.proto, m)
}

// carrySocket gives f, made by resumed from packets that never name the
// VIP, what the socket observers taught of the retired flow it continues
// (r.sock): a socket LB's rewrite, which none of its packets shows. Not
// its socket: packets do not tell sockets apart, and a new socket that
// reused the port (a resolver's socket per query) claims the flow with
// its own events, as it would a flow its packets made.
func (e *Engine) carrySocket(f *flowState, r retiredNote, at time.Time) {
	s := r.sock
	if s == nil {
		return
	}
	for cp := range s.cps {
		f.cps[cp].merge(s.cps[cp])
	}
	if f.kind == 0 {
		f.kind = s.kind
	}
	f.fromNode = f.fromNode || s.fromNode
	// As of now: a new socket's own events, earlier, name its process.
	f.noteProc(s.pid, s.comm, s.cgroup, at)
	f.evidenceChanged()
}

// continuedBy tells whether an observation of proto at m of the client
// endpoint and Service of the retired flow r may continue it (continued).
func (r retiredNote) continuedBy(proto obs.Proto, m moment) bool {
	if proto == obs.TCP {
		return !m.opens() || r.opening && !m.reply && m.at-r.last <= int64(synRetryWindow)
	}
	return m.at-r.last <= int64(r.life)
}

// continuesNote says, of a flow that continues a retired one, that its
// beginning was reported with that one.
func (f *flowState) continuesNote() string {
	if f.continues == 0 {
		return ""
	}
	return fmt.Sprintf("it continues flow %d, reported when it had been idle for the flow timeout (last seen at %s): its connection began then, before this part of it; ",
		f.continues, time.Unix(0, f.continuesLast).UTC().Format("15:04:05.000"))
}

// flowTimeout is how long a flow may be idle before Retire retires it.
func (e *Engine) flowTimeout() time.Duration {
	if e.cfg.FlowTimeout <= 0 {
		return DefaultFlowTimeout
	}
	return e.cfg.FlowTimeout
}

// refusalOver tells whether an observation at m (of socket sock) of the
// flow k refused as r is of a later flow (refusedFlow.another), or, once
// flows are retired (a run until stopped), of a UDP flow that came after
// r was silent for the flow timeout: an admitted flow would have been
// retired then, and the endpoint's next datagram begun a flow of its own.
// Without that, a UDP client endpoint refused in a burst stayed refused,
// and uncounted, for the rest of the run when no socket observer named
// its sockets (an outside client's, a NodePort's).
func (e *Engine) refusalOver(k flowKey, r refusedFlow, sock uint64, m moment) bool {
	return r.another(sock, m) ||
		e.retiredTotals.n > 0 && k.proto == obs.UDP && r.last != 0 && m.at-r.last > int64(e.flowTimeout())
}

// stillRefused tells whether a flow refused beyond MaxFlows (k, seen again
// at m, of socket sock) stays refused although there is room now: once
// flows are retired (a run until stopped), a retired flow's room does not
// take in the rest of a flow refused before, whose beginning was lost (its
// packets after the rewrite would stay refused with its client: an
// "unknown" flow made of its packets before the rewrite). A later flow of
// the endpoint (refusedFlow.another) is a flow of its own. A run that
// retires nothing keeps taking back the refusals a merge made room for
// (unrefuse).
func (e *Engine) stillRefused(k flowKey, sock uint64, m moment) bool {
	if e.retiredTotals.n == 0 || k.client.Port() == 0 {
		return false
	}
	r, ok := e.refused.get(k)
	return ok && !e.refusalOver(k, r, sock, m)
}
