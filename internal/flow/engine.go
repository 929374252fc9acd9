// Package flow correlates observations from every point of the datapath into
// flows (client IP:port <-> Service VIP:port) and decides, for each flow, where
// the VIP was rewritten to a backend by bracketing every mechanism between an
// observation just before it and one just after it (DESIGN.md §2).
package flow

import (
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// reorderWindow is how long an observation waits for the flow it belongs to:
// sources (ring buffers, packet rings, conntrack netlink) can be a second or so
// apart.
const reorderWindow = 3 * time.Second

// WaitWindow is how long behind the newest observation a packet that
// AddPacket kept waiting (Waits) may still be claimed and counted by its
// flow.
const WaitWindow = reorderWindow

// Drop counter names reported in Summary.Drops.
const (
	DropFlowsOverMax      = "flows_over_max"
	DropUnmatchedOverflow = "unmatched_overflow"
	DropFlowsJoined       = "flows_joined"
	DropUnrelatedOverflow = "unrelated_overflow"
)

// clientKey is one endpoint of one protocol: a flow's client, or either end of
// an observation that is still waiting for its flow.
type clientKey struct {
	proto  obs.Proto
	client netip.AddrPort
}

// flowKey identifies a flow refused because the table was full.
type flowKey struct {
	clientKey
	service netip.AddrPort
}

// Engine correlates observations into flows and decides their verdicts. It has
// no package-level state; it is not safe for concurrent use: one goroutine
// calls Add, Flows, Summary and Backends (or the caller serialises them).
type Engine struct {
	cfg      Config
	maxFlows int
	services map[netip.Addr][]Service

	clients map[clientKey][]*flowState
	// podFlows indexes the flows while snapshots are taken (podFlowsOf),
	// nil otherwise.
	podFlows map[podFlowKey][]*flowState
	// retiredUpstreams are, of the open connections their Pod redirected
	// to a local proxy, the retired flows that can be their proxy's
	// upstream (noteProxyUpstreams).
	retiredUpstreams map[*flowState][]proxyUpstream
	// redirectsSeen: some flow went to a loopback address (its Pod's own
	// NAT redirected it): only then does retiring a flow look for them.
	redirectsSeen bool
	nflows        int
	made          int // flows made so far (flowState.seq)
	nextID        int // the last id given (idOf)
	socks         sockTable
	waiting       waiting
	replays       []clientKey // endpoints whose waiting observations may now resolve
	// snat maps the source a SNAT gave flows (conntrack's reply
	// destination) to those flows: their packets beyond the SNAT (the
	// uplink's) carry that source instead of the client's. A flow is listed
	// under its current SNAT source only (setSNAT, merge).
	snat map[clientKey][]*flowState

	backends map[netip.Addr]bool
	// backendPorts are the learned backends' endpoints, ruleBackends the
	// NAT rules' and IPVS services' by address (nil: to be made): what
	// counted asks of an observation no flow claimed.
	backendPorts map[netip.AddrPort]bool
	// backendWatches are the learned backends' endpoints with their
	// protocol (BackendWatches).
	backendWatches map[obs.Watch]bool
	ruleBackends   map[netip.Addr][]uint16
	// ruleEnds are the endpoints of ruleEndpoints (nil: to be made).
	ruleEnds map[netip.AddrPort]bool
	// pairs are the Service and backend pairs checked against the NAT rules
	// and IPVS services; unlisted counts those none named (checkListed).
	pairs    map[[2]netip.AddrPort]struct{}
	unlisted uint64
	labels   labels // the capture points' labels (pointKey.iface)
	// commented are the flows that keep their packets' comments, the
	// one given them first at nextCommented (keepComments).
	commented     []*flowState
	nextCommented int
	// byNames are the verdicts' "by" strings as packet comments carry them,
	// one copy each (cachedVerdict).
	byNames  map[string]string
	newest   time.Time
	observed [256]uint64 // per obs.Point
	// gen counts changes to what every verdict depends on besides the flow's
	// own evidence (the active points, the attribution); see flowState.cached.
	gen uint64

	// refused are the flows refused recently, refusedClients their client
	// endpoints: bounded, see refuse.
	refused        recentSet[flowKey, refusedFlow]
	refusedClients recentSet[clientKey, struct{}]
	overMax        uint64
	// joined counts the flows of a socket taken into another socket's
	// flow of the same client endpoint and Service (joinOrSupersede).
	joined   uint64
	overflow uint64
	// otherOverflow counts the observations of other traffic (not
	// related) dropped from their own waiting room (waiting).
	otherOverflow uint64
	unmatched     uint64
	withoutPorts  uint64
	// replyOnly: the connections of which only replies were seen (no
	// flow: replyWithoutRequest).
	replyOnly replyOnly
	// ctLosses are the conntrack events the caller lost (SetConntrackLosses):
	// then conntrack's silence about a flow proves nothing.
	ctLosses uint64

	// stopped is when the run was asked to stop (zero while it runs): flows
	// that begin after it meet points that are already closing.
	stopped time.Time
	// captureLost: the points whose capture lost frames (CaptureLost).
	captureLost map[obs.Point]bool
	// watchesLost: the kernel observers lost some of what they learn
	// (WatchesLost).
	watchesLost bool
	// lateCounts are the flows' packets captured once the run was
	// stopping that lostOnTheWay leaves out.
	lateCounts map[*flowState]*lateCount

	// retiredKeys remembers the recently retired flows by client endpoint
	// and Service (bounded), retiredTotals counts every retired flow.
	retiredKeys recentSet[flowKey, retiredNote]
	// retiredPeers names the Service of a retired flow by its client
	// endpoint and backend (bounded as retiredKeys).
	retiredPeers  recentSet[peerKey, netip.AddrPort]
	retiredTotals retiredTotals
	// retiring: Retire was called (a run until stopped), so Summary
	// says how many flows were reported before it, 0 too.
	retiring bool
	// retiredForgotten is the latest last sighting (unix ns) of the
	// retired flows retiredKeys forgot, 0 while it forgot none.
	retiredForgotten int64
}

// NewEngine returns an engine for cfg.
func NewEngine(cfg Config) *Engine {
	maxFlows := cfg.MaxFlows
	if maxFlows <= 0 {
		maxFlows = DefaultMaxFlows
	}
	e := &Engine{
		cfg:            cfg,
		maxFlows:       maxFlows,
		services:       make(map[netip.Addr][]Service),
		clients:        make(map[clientKey][]*flowState),
		snat:           make(map[clientKey][]*flowState),
		socks:          newSockTable(max(4096, 2*maxFlows)),
		waiting:        newWaiting(max(4096, maxFlows)),
		backends:       make(map[netip.Addr]bool),
		backendPorts:   make(map[netip.AddrPort]bool),
		backendWatches: make(map[obs.Watch]bool),
		pairs:          make(map[[2]netip.AddrPort]struct{}),
		labels:         newLabels(),
	}
	// Two generations the size of the flow table remember the refused flows:
	// a flow is counted again only when seen after that many newer ones.
	e.refused = newRecentSet[flowKey, refusedFlow](max(4096, maxFlows))
	e.refusedClients = newRecentSet[clientKey, struct{}](max(4096, maxFlows))
	e.retiredKeys = newRecentSet[flowKey, retiredNote](max(4096, maxFlows))
	e.retiredPeers = newRecentSet[peerKey, netip.AddrPort](max(4096, maxFlows))
	e.replyOnly = newReplyOnly(max(4096, maxFlows))
	for _, s := range cfg.Services {
		e.services[s.Addr] = append(e.services[s.Addr], s)
	}
	return e
}

// SetConntrackLosses tells the engine how many conntrack events were lost
// so far (netlink receive errors such as ENOBUFS, events dropped by a reader
// behind): while none were, a flow conntrack did not report, seen from its
// start, was not tracked by netfilter, which then did not rewrite it.
func (e *Engine) SetConntrackLosses(n uint64) {
	if (n > 0) != (e.ctLosses > 0) {
		e.gen++ // verdicts that rested on conntrack's silence
	}
	e.ctLosses = n
}

// Stopping tells the engine the run was asked to stop at t; the
// observations of its last moments may still come. Flows and Summary then
// make the backend guesses still put off (plausibleGuess): no observation
// that could tell otherwise is to come.
func (e *Engine) Stopping(t time.Time) { e.stopped = t }

// CaptureLost tells the engine that the capture at point p lost frames (a
// tap's kernel_drops): what its tap did not see may have been there, so a
// flow's replies missing at the client's Pod while the uplink received
// them are not said to be lost on the node (repliesLostOnNode), which
// would turn a reply the client got into REPLY no. Once said, for the rest
// of the run.
func (e *Engine) CaptureLost(p obs.Point) {
	if e.captureLost == nil {
		e.captureLost = map[obs.Point]bool{}
	}
	e.captureLost[p] = true
}

// WatchesLost tells the engine that the kernel observers lost some of what
// they learn in the kernel (kernel_learn_errors): a socket's watch taken
// by others before its first packet (more sockets waiting to send at once
// than the kernel's table holds), or an address they could not add. A
// socket seen at its connect() alone may then have sent: its first packet
// went untied to it (neverSent). Once said, for the rest of the run.
func (e *Engine) WatchesLost() { e.watchesLost = true }

// late tells whether a packet captured at (Unix ns) was captured once the
// run was stopping: the taps go on capturing for a moment, each stopping
// on its own (lateCount).
func (e *Engine) late(at int64) bool { return !e.stopped.IsZero() && at >= e.stopped.UnixNano() }

// lateCount counts a flow's request packets its host veth's tap received
// once the run was stopping (at or after Engine.stopped), and those the
// uplink's TX tap saw later than stopTransit after it: the taps stop one
// after the other, so the uplink's may have stopped before the host veth's
// late packets went out (lostOnTheWay leaves both out). Kept by the engine
// (lateCounts), not in every flow: only the last moments have them.
type lateCount struct{ host, up uint64 }

func (l *lateCount) add(o lateCount) { l.host += o.host; l.up += o.up }

// lateOf is f's lateCount, made when it has none.
func (e *Engine) lateOf(f *flowState) *lateCount {
	l := e.lateCounts[f]
	if l == nil {
		if e.lateCounts == nil {
			e.lateCounts = map[*flowState]*lateCount{}
		}
		l = &lateCount{}
		e.lateCounts[f] = l
	}
	return l
}

// stopTransit is how long after the run began stopping the uplink's copies
// of the request packets its host veths received before are counted: the
// node's time to send them out (a qdisc's queue), well within the time
// every tap goes on capturing once the run is stopping (the session's
// stopGrace, 200 ms).
const stopTransit = 100 * time.Millisecond

// countLate counts a request packet of f captured once the run was
// stopping (late) at point p among those lostOnTheWay leaves out.
func (e *Engine) countLate(f *flowState, p obs.Point, dir obs.Dir, at int64) {
	switch {
	case p == obs.PointHost && dir == obs.DirIn:
		e.lateOf(f).host++
	case p == obs.PointUplink && dir == obs.DirOut && at >= e.stopped.Add(stopTransit).UnixNano():
		e.lateOf(f).up++
	}
}

// Settle gives the observations whose backend guess was put off their last
// chance once the run is stopping (after Stopping): what the last packets'
// comments say must agree with the report. Flows and Summary settle too.
func (e *Engine) Settle() {
	if e.stopped.IsZero() {
		return
	}
	for _, p := range e.waiting.deferredLive() {
		if !p.done && e.lastChance(p.o) {
			e.waiting.resolved(p)
		}
	}
	e.replay()
	// What nothing claimed by the end waits no longer for a flow: a
	// server's answers from another port are told now (they would be
	// when they expire), not left out of the report.
	for _, p := range e.waiting.unclaimedLive() {
		if !p.strayNoted {
			p.strayNoted = true
			e.noteStray(p.o)
		}
	}
}

// Waits tells whether the packet o, which AddPacket kept waiting for its
// flow, still does: a flow found within WaitWindow counts it.
func (e *Engine) Waits(o obs.Observation) bool { return e.waiting.has(o) }

// Add feeds one observation. Observations may arrive out of time order by up
// to a few seconds.
func (e *Engine) Add(o obs.Observation) { e.add(o) }

// add is Add; for a packet counted in a flow (or refused with it) it also
// returns the handle Repeat takes.
func (e *Engine) add(o obs.Observation) (Handle, bool) {
	e.note(o.Point, o.Time)
	done, deferred, h, ok := e.process(o, false)
	if !done {
		// One whose backend guess was put off has flows it may be of.
		related := deferred || e.related(o)
		if !e.waiting.add(o, deferred, related) {
			e.refusedWaiting(related)
		}
	}
	e.replay()
	e.expire()
	return h, ok
}

// refusedWaiting counts an observation its waiting room refused (one
// endpoint pair took its share of it): in unmatched_overflow when related
// (it may have been a watched flow's), unrelated_overflow otherwise.
func (e *Engine) refusedWaiting(related bool) {
	if related {
		e.overflow++
	} else {
		e.otherOverflow++
	}
}

// replay processes again the waiting observations of the endpoints whose
// flows changed.
func (e *Engine) replay() {
	for len(e.replays) > 0 {
		k := e.replays[len(e.replays)-1]
		e.replays = e.replays[:len(e.replays)-1]
		for _, p := range e.waiting.take(k) {
			switch {
			case p.done:
			case p.icmp != nil:
				if e.noteICMP(p.o, p.icmp) {
					e.waiting.resolved(p)
				} else {
					e.waiting.putBack(k, p)
				}
			default:
				if done, deferred, _, _ := e.process(p.o, false); done {
					e.waiting.resolved(p)
				} else {
					p.deferred = p.deferred || deferred
					e.waiting.putBack(k, p)
				}
			}
		}
	}
}

// note counts an observation at point p and advances the engine's clock.
func (e *Engine) note(p obs.Point, at time.Time) {
	if e.observed[p] == 0 {
		e.gen++ // the point is active from now on
	}
	e.observed[p]++
	if at.After(e.newest) {
		e.newest = at
	}
}

func (e *Engine) expire() { e.expireAt(e.newest) }

// expireAt is expire as of clock (the newest observation's time, or a
// later one: Retire's).
func (e *Engine) expireAt(clock time.Time) {
	overflow, other, unmatched := e.waiting.expire(clock, reorderWindow, e.lastChance, e.noteStray, e.counted)
	e.overflow += overflow
	e.otherOverflow += other
	e.unmatched += unmatched
	e.replay() // what the last chances taught
}

// lastChance processes an observation whose backend guess was deferred
// (link) once more as it leaves the waiting room: what could have named its
// flow otherwise had the reordering window to come, so the guess is made
// now if it still stands.
func (e *Engine) lastChance(o obs.Observation) bool {
	done, _, _, _ := e.process(o, true)
	return done
}

// process applies o to its flow and reports false when its flow is not known
// yet (the observation must wait); deferred then tells that a backend guess
// for it was put off (deferredLink). last is its last chance (lastChance):
// a guess is made, not put off. For a packet it also returns the handle of
// the counter it went to.
func (e *Engine) process(o obs.Observation, last bool) (done, deferred bool, h Handle, ok bool) {
	switch o.Point {
	case obs.PointNone:
		return true, false, h, false
	case obs.PointSockAddr:
		e.sockAddr(o)
		return true, false, h, false
	case obs.PointSockState, obs.PointSockEgress:
		done, deferred = e.sockTuple(o, last)
		return done, deferred, h, false
	case obs.PointConntrack:
		done, deferred = e.conntrack(o, last)
		return done, deferred, h, false
	case obs.PointDrop:
		done, deferred = e.noteDrop(o, last)
		return done, deferred, h, false
	}
	if !o.Src.IsValid() || !o.Dst.IsValid() {
		e.unmatched++
		return true, false, h, false
	}
	if !hasPorts(o) {
		e.withoutPorts++
		return true, false, h, false
	}
	e.socketPort(o)
	m := e.momentAt(&o)
	// A datagram to another peer than a Service where nothing on the node
	// rewrote it yet, as packetMoment has it: the client's own (guessable).
	if o.Proto == obs.UDP && !e.isService(o.Proto, o.Dst) {
		m.direct = m.atCP && (m.cp == cpPod || m.cp == cpHost || m.cp == cpTCHead)
	}
	f, reply, r := e.link(o.Proto, o.Src, o.Dst, 0, m, true, last)
	switch r {
	case linked:
		if slot := e.applyPacket(f, o, reply); slot >= 0 {
			return true, false, Handle{f: f, slot: slot, reply: reply, translated: translated(f, o, reply)}, true
		}
		return true, false, h, false
	case refused:
		return true, false, Handle{refused: true}, true
	case replyOnlyLinked:
		return true, false, Handle{ro: true, slot: e.replyOnly.gen, reply: true}, true
	}
	return false, r == deferredLink, h, false
}

// momentAt is momentOf for a packet whose direction is not known yet, with
// the checkpoint it is at as a request (elsewhere).
func (e *Engine) momentAt(o *obs.Observation) moment {
	m := momentOf(o, false)
	m.cp, m.atCP = e.requestCheckpoint(o)
	return m
}

// hasPorts tells whether a packet or conntrack observation has what a flow is
// made of, TCP or UDP ports: observers report ICMP (--svc with any
// protocol) and IP fragments after the first (no L4 header) with ports 0,
// which would make a flow of their own or join a socket's flow whose port
// is not known yet.
func hasPorts(o obs.Observation) bool {
	return (o.Proto == obs.TCP || o.Proto == obs.UDP) && o.Src.Port() != 0 && o.Dst.Port() != 0
}

// fewServices is how many Services isService compares one by one rather
// than hash a packet's address: every observation asks it of both ends.
const fewServices = 8

func (e *Engine) isService(proto obs.Proto, ap netip.AddrPort) bool {
	if len(e.cfg.Services) <= fewServices {
		for _, s := range e.cfg.Services {
			if s.matches(proto, ap) {
				return true
			}
		}
		return false
	}
	for _, s := range e.services[ap.Addr()] {
		if s.matches(proto, ap) {
			return true
		}
	}
	return false
}

func (e *Engine) active(p obs.Point) bool {
	return e.cfg.Points[p] || e.observed[p] > 0
}

// BackendWatches is what to watch of the backends learned so far and those
// the NAT rules and IPVS services of the traced Services name: the endpoint
// a backend serves when its port is known (a learned backend's, a DNAT
// target's, or the Service port a DNAT without a port keeps), every port of
// it otherwise (a DNAT to a port range, whose first port alone is known,
// a rule of any port without a target port, IPVS without a port). Sorted.
func (e *Engine) BackendWatches() []obs.Watch {
	set := make(map[obs.Watch]bool, len(e.backendWatches))
	for w := range e.backendWatches {
		set[w] = true
	}
	for _, r := range e.cfg.Attribution.NATRules {
		if !e.watches(r.Proto, r.VIP) {
			continue
		}
		for _, b := range r.Backends {
			w := obs.Watch{Addr: b.Addr(), Port: b.Port(), Proto: r.Proto}
			if w.Port == 0 {
				w.Port = r.VIP.Port() // kept by the DNAT; 0: any
			}
			if r.PortRange || w.Port == 0 {
				w.Port, w.Proto = 0, 0
			}
			set[w] = true
		}
	}
	for _, s := range e.cfg.Attribution.IPVS {
		if !e.watches(s.Proto, s.VIP) {
			continue
		}
		for _, b := range s.Backends {
			w := obs.Watch{Addr: b.Addr(), Port: b.Port(), Proto: s.Proto}
			if w.Port == 0 {
				w.Proto = 0
			}
			set[w] = true
		}
	}
	out := make([]obs.Watch, 0, len(set))
	for w := range set {
		out = append(out, w)
	}
	slices.SortFunc(out, compareWatch)
	return out
}

func compareWatch(a, b obs.Watch) int {
	if c := a.Addr.Compare(b.Addr); c != 0 {
		return c
	}
	if a.Port != b.Port {
		return int(a.Port) - int(b.Port)
	}
	return int(a.Proto) - int(b.Proto)
}

// watches tells whether a rule's VIP (port 0 = any) overlaps a watched Service.
func (e *Engine) watches(proto obs.Proto, vip netip.AddrPort) bool {
	for _, s := range e.services[vip.Addr()] {
		if (s.Port == 0 || vip.Port() == 0 || s.Port == vip.Port()) &&
			(s.Proto == 0 || proto == 0 || s.Proto == proto) {
			return true
		}
	}
	return false
}

// Flows returns a snapshot of every flow with its current verdict, sorted by
// first seen.
func (e *Engine) Flows() []Flow {
	e.Settle()
	fs := make([]*flowState, 0, e.nflows)
	for _, list := range e.clients {
		fs = append(fs, list...)
	}
	// Sorted before their snapshots: flows not shown yet get their ids in
	// the order listed.
	slices.SortFunc(fs, byFirstSeen)
	out := make([]Flow, len(fs))
	for i, f := range fs {
		out[i] = e.snapshot(f)
	}
	e.podFlows = nil
	return out
}

// byFirstSeen orders flows as the report lists them: by first sighting,
// then by the order they were made.
func byFirstSeen(a, b *flowState) int {
	if c := a.first.Compare(b.first); c != 0 {
		return c
	}
	return a.seq - b.seq
}

// idOf is f's id, given now if it has none yet.
func (e *Engine) idOf(f *flowState) int {
	if f.id == 0 {
		e.nextID++
		f.id = e.nextID
	}
	return f.id
}

// Summary counts flows per verdict, the engine's drops and observations per point.
func (e *Engine) Summary() Summary {
	e.Settle()
	t := e.retiredTotals
	s := Summary{
		Flows:       e.nflows + t.n,
		Retired:     t.n,
		RewrittenAt: make(map[Place]int),
		Drops: map[string]uint64{
			DropFlowsOverMax:      e.overMax,
			DropUnmatchedOverflow: e.overflow,
			DropFlowsJoined:       e.joined,
			DropUnrelatedOverflow: e.otherOverflow,
			DropRepliesForgotten:  e.replyOnly.forgotten,
		},
		Unmatched:             e.unmatched + e.unclaimedAtEnd(),
		WithoutPorts:          e.withoutPorts,
		RepliesWithoutRequest: e.repliesWithoutRequest(),
		RequestedAfterReplies: int(e.replyOnly.requestedLater),
		Observations:          make(map[string]uint64),
	}
	if e.retiring {
		n := t.n
		s.ReportedBefore = &n
	}
	for _, p := range Places() {
		s.RewrittenAt[p] = t.places[p]
	}
	s.UnknownBeforeReady, s.UnknownAfterStop = t.beforeReady, t.afterStop
	for _, list := range e.clients {
		for _, f := range list {
			place := e.cachedVerdict(f).place
			s.RewrittenAt[place]++
			if place == PlaceUnknown {
				switch e.window(f) {
				case beforeReady:
					s.UnknownBeforeReady++
				case afterStop:
					s.UnknownAfterStop++
				}
			}
		}
	}
	for p, n := range e.observed {
		if n > 0 {
			s.Observations[obs.Point(p).String()] = n
		}
	}
	return s
}

// unclaimedAtEnd counts the observations that still wait for a flow once
// the run is stopping (after Settle): nothing claims them any more, and
// they are unmatched as they would be had they expired.
func (e *Engine) unclaimedAtEnd() uint64 {
	if e.stopped.IsZero() {
		return 0
	}
	var n uint64
	for _, p := range e.waiting.liveWhere(func(p *waitingObs) bool { return p.icmp == nil }) {
		if e.counted(p.o) {
			n++
		}
	}
	return n
}

// Pending counts the flows Summary counts as unknown that began less than
// the reordering window before now, while the run goes on: the other
// points' observations of them may still be on their way (a tap hands over
// its frames a ring block at a time), so they are undecided, not unknown.
func (e *Engine) Pending(now time.Time) int {
	if !e.stopped.IsZero() {
		return 0
	}
	n := 0
	for _, list := range e.clients {
		for _, f := range list {
			if f.first.After(now.Add(-reorderWindow)) && e.cachedVerdict(f).place == PlaceUnknown {
				n++
			}
		}
	}
	return n
}
