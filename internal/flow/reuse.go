package flow

import (
	"net/netip"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// A client port is reused: flows never end, so a later connection from the
// same client endpoint must not be taken for an earlier one. What tells
// them apart: the TCP flags of the packets (a new connection begins with a
// SYN after the earlier one closed, or after its client acknowledged the
// SYN-ACK) and, among the flows of one client endpoint, which began last
// before the packet.
const (
	// sameConnGap is how far apart two sightings of one connection can
	// lie in time for reasons other than the connection itself: the same
	// packet seen by sources with clocks of their own, a SYN and the
	// SYN-ACK retransmitted for it, the last ACKs after a close.
	sameConnGap = time.Second
	// synRetryWindow: a client retransmits an unanswered SYN for about a
	// minute (tcp_syn_retries=6 sends the last one 63 s after the first);
	// a SYN later than this after a flow's first is another connection.
	synRetryWindow = 3 * time.Minute
	// clockSlack is how much earlier than a flow's first sighting a
	// packet rewritten from it can be stamped (different sources' clocks).
	clockSlack = 10 * time.Millisecond
	// guessWindow: a packet after the rewrite is seen within this of the
	// same packet before it (the node's datapath, clocks of different
	// sources); what a client endpoint sends to two Services a
	// millisecond apart is told apart.
	guessWindow = 500 * time.Microsecond
	// idleGap: a flow idle this long when another of its client endpoint
	// began is taken to be over (UDP has no end to see; conntrack forgets
	// an unanswered UDP flow after 30 s).
	idleGap = 30 * time.Second
)

// TCP flags (obs.Observation.TCPFlags).
const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

// moment is what of an observation tells the connections of a reused client
// endpoint apart: when it was seen, its TCP flags (0: not a TCP packet, or
// not known) and its direction.
type moment struct {
	at    int64 // unix nanoseconds
	flags uint8
	reply bool
	// entry: a conntrack event of a TCP connection (no flags): conntrack
	// reports nothing of a connection once it has closed, so one well after
	// a flow's close is another connection's.
	entry bool
	// fresh: such an event of an entry that has seen no reply yet, the
	// first conntrack reports of a connection (its NEW): one for a flow
	// conntrack reported already is another connection's, however soon
	// after its close (a port reused at once; conntrack's events are read
	// ahead of the packets of that connection).
	fresh bool
	// aside: the client's bare RST (no ACK) to another destination than
	// the Service; direct: another packet of the client's to such a
	// destination where nothing on the node rewrote it yet (a socket LB's
	// client talks to the backend itself).
	aside, direct bool
	// untranslated: a reply on its way into the client's Pod (its host
	// veth's TX, its eth0) from another address than the Service's:
	// nothing translated it back, and no socket of the client connected
	// to the VIP takes it.
	untranslated bool
	// point: where the packet was seen; cp, atCP: the checkpoint it is at
	// as a request (elsewhere).
	point obs.Point
	cp    checkpoint
	atCP  bool
}

func momentOf(o *obs.Observation, reply bool) moment {
	m := moment{at: o.Time.UnixNano(), reply: reply, point: o.Point}
	if o.Proto == obs.TCP {
		m.flags = o.TCPFlags
	}
	return m
}

// opens tells whether the packet begins a connection: a SYN from the
// client, or the SYN-ACK answering it.
func (m moment) opens() bool {
	return m.flags&(tcpSYN|tcpRST) == tcpSYN && (m.flags&tcpACK != 0) == m.reply
}

// starts tells whether m can begin a flow of its own where the client
// endpoint's flow to the same Service is over.
func (m moment) starts() bool { return m.opens() || m.entry }

// tcpLife is what a flow's TCP flags told of its connection, each the
// earliest time (unix ns, 0 = never seen).
type tcpLife struct {
	syn   int64    // the client's SYN
	ack   int64    // a packet from the client acknowledging (the handshake done)
	fin   [2]int64 // a FIN from the client, from the server
	rst   int64    // a RST either way
	first int64    // the client's first packet with flags
	// next: the SYN of a later connection of the client endpoint to the
	// same VIP, for which this one was over: what is seen from then on is
	// not this connection's, be the later one a flow or refused.
	next int64
	// synAck, rstReply: the server's SYN-ACK, and a RST from the server;
	// a RST with no SYN-ACK before it refused the connection.
	synAck, rstReply int64
	// rstAside: the client's first bare RST to a backend's address
	// (moment.aside). Its kernel sends one where a segment with an ACK
	// matches no socket: the reset of a closed socket, or the refusal of a
	// reply that came back untranslated (a SYN-ACK from the backend's
	// address to a socket connected to the VIP), which ends nothing: the
	// socket retransmits its SYN to the VIP. A client whose replies come
	// back untranslated never completes its handshake, so the RST ends
	// the connection only when the client had acknowledged one (ack) or
	// talks to the backend itself (direct: a socket LB's).
	rstAside int64
	direct   bool
	// rstUntranslated: a RST from the server came towards the client
	// untranslated (moment.untranslated): the client's socket, connected
	// to the VIP, never got it, so no reset ends the connection (the
	// client retransmits its SYN; a client that never got a SYN-ACK sends
	// no RST of its own) unless it talks to the backend itself (direct).
	rstUntranslated bool
}

func earliest(t *int64, at int64) bool {
	if *t == 0 || at < *t {
		*t = at
		return true
	}
	return false
}

// note records a packet's flags; it reports whether the client's first
// packet or SYN changed.
func (l *tcpLife) note(m moment) bool {
	if m.flags == 0 {
		return false
	}
	changed := false
	dir := 0
	if m.reply {
		dir = 1
	} else {
		changed = earliest(&l.first, m.at)
		switch {
		case m.flags&(tcpSYN|tcpACK) == tcpSYN:
			changed = earliest(&l.syn, m.at) || changed
		case m.flags&(tcpSYN|tcpACK) == tcpACK:
			earliest(&l.ack, m.at)
		}
	}
	if m.flags&tcpFIN != 0 {
		earliest(&l.fin[dir], m.at)
	}
	l.direct = l.direct || m.direct
	if m.aside {
		earliest(&l.rstAside, m.at)
		return changed
	}
	if m.flags&tcpRST != 0 {
		earliest(&l.rst, m.at)
		if m.reply {
			earliest(&l.rstReply, m.at)
			l.rstUntranslated = l.rstUntranslated || m.untranslated
		}
	}
	if m.reply && m.flags&(tcpSYN|tcpACK|tcpRST) == tcpSYN|tcpACK {
		earliest(&l.synAck, m.at)
	}
	return changed
}

// refused tells whether the server answered the connection with a RST
// instead of a SYN-ACK: nothing listened on the backend's port (or a
// firewall rejected it). Not a connection seen from its middle on
// (midConnection): its SYN-ACK came before the run, and a RST then ends
// it, refusing nothing.
func (l *tcpLife) refused() bool {
	return l.rstReply != 0 && (l.synAck == 0 || l.rstReply < l.synAck) && !l.midConnection()
}

// midConnection tells whether the connection was seen from its middle on:
// its client's first packet seen was no SYN, and neither its SYN nor the
// server's SYN-ACK was seen (a SYN-ACK seen before its SYN, which another
// capture ring delivered later, is its handshake).
func (l *tcpLife) midConnection() bool {
	return l.first != 0 && l.syn == 0 && l.synAck == 0
}

func (l *tcpLife) merge(o tcpLife) {
	for _, p := range [...]struct {
		into *int64
		at   int64
	}{{&l.syn, o.syn}, {&l.ack, o.ack}, {&l.fin[0], o.fin[0]}, {&l.fin[1], o.fin[1]}, {&l.rst, o.rst}, {&l.first, o.first}, {&l.next, o.next},
		{&l.synAck, o.synAck}, {&l.rstReply, o.rstReply}, {&l.rstAside, o.rstAside}} {
		if p.at != 0 {
			earliest(p.into, p.at)
		}
	}
	l.direct = l.direct || o.direct
	l.rstUntranslated = l.rstUntranslated || o.rstUntranslated
}

// reset is the connection's first RST (0: none); a client's bare RST to a
// backend's address only when it cannot be the refusal of an untranslated
// reply (rstAside): the client had acknowledged a SYN-ACK before it (the
// ACK of a handshake that completed after it, its SYN retransmitted once
// the replies came back translated, ends nothing before it), or talks to
// the backend itself; the server's only when they reached the client
// translated (rstUntranslated).
func (l *tcpLife) reset() int64 {
	rst := l.rst
	if l.rstUntranslated && !l.direct {
		rst = 0
	}
	acked := l.ack != 0 && l.ack < l.rstAside+int64(clockSlack)
	if l.rstAside != 0 && (acked || l.direct) && (rst == 0 || l.rstAside < rst) {
		return l.rstAside
	}
	return rst
}

// closed is when the connection ended (0: not seen to): its first RST, or
// the later of the FINs both ways.
func (l *tcpLife) closed() int64 {
	if rst := l.reset(); rst != 0 {
		return rst
	}
	if l.fin[0] != 0 && l.fin[1] != 0 {
		return max(l.fin[0], l.fin[1])
	}
	return 0
}

// superseded tells whether m is seen once a later connection of the
// client endpoint began (next), as far as clocks tell: then it is not this
// connection's.
func (l *tcpLife) superseded(m moment) bool {
	return l.next != 0 && m.at >= l.next-int64(clockSlack)
}

// closedBefore tells whether the connection ended well before at.
func (l *tcpLife) closedBefore(at int64) bool {
	end := l.closed()
	return end != 0 && end < at-int64(sameConnGap)
}

// over tells whether a packet at m cannot be of this connection: it ended
// well before, or m opens a connection this one's client can no longer be
// opening (it acknowledged the SYN-ACK, or has retransmitted its SYN for
// longer than a client does). A client sends no SYN once it has
// acknowledged the SYN-ACK, nor once its connection was reset: a SYN later
// than that, by more than clocks can disagree, is another connection's,
// however soon its port was reused (a busy client, tcp_tw_reuse, a server
// that closed first, a retry after a refusal).
func (l *tcpLife) over(m moment) bool {
	if l.superseded(m) {
		return true
	}
	if m.flags == 0 && !m.entry {
		return false
	}
	if l.closedBefore(m.at) {
		return true
	}
	if !m.opens() || m.reply {
		return false
	}
	return l.ack != 0 && l.ack < m.at-int64(clockSlack) ||
		l.reset() != 0 && l.reset() < m.at-int64(clockSlack) ||
		l.syn != 0 && l.syn < m.at-int64(synRetryWindow)
}

// began is when f was first seen, for a flow not touched yet the moment
// it is being made at.
func (f *flowState) began(m moment) int64 {
	if f.first.IsZero() {
		return m.at
	}
	return f.first.UnixNano()
}

// latestBefore picks, of the flows ok accepts, the one that began last no
// later than limit, else the one that began first. limit is beyond m by
// how late a flow's first stamp can be (conntrack's is its receipt
// time); but a TCP flow whose client's SYN was seen began then, and a
// flow whose socket's connect or sendmsg was seen (kind) began no later,
// as every clock tells within clockSlack: a packet earlier than that is
// not its own (it is the previous socket's on a reused port, its packets
// delivered after the next socket's events).
func latestBefore(flows []*flowState, m moment, limit int64, ok func(*flowState) bool) *flowState {
	var latest, first *flowState
	for _, f := range flows {
		if !ok(f) {
			continue
		}
		b := f.began(m)
		if first == nil || b < first.began(m) {
			first = f
		}
		lim := limit
		switch {
		case f.tcp.syn != 0:
			b, lim = f.tcp.syn, m.at+int64(clockSlack)
		case f.kind != 0:
			lim = m.at + int64(clockSlack)
		}
		if b <= lim && (latest == nil || f.began(m) > latest.began(m)) {
			latest = f
		}
	}
	if latest != nil {
		return latest
	}
	return first
}

// withService returns the flow of the client endpoint's flows to service
// that a packet (or an observation of socket cookie, 0 for others) at m
// belongs to: of those a reused port made, the one that began last before
// it. A socket's observation is not another socket's flow's; while the port
// is not known, the cookie is all that tells sockets apart.
func withService(flows []*flowState, service netip.AddrPort, cookie uint64, m moment) *flowState {
	ok := func(f *flowState) bool {
		return f.service == service && (f.client.Port() != 0 || f.cookie == cookie) &&
			(cookie == 0 || f.sock == 0 || f.sock == cookie)
	}
	var found *flowState
	n := 0
	for _, f := range flows {
		if ok(f) {
			found = f
			n++
		}
	}
	if n <= 1 {
		return found
	}
	return latestBefore(flows, m, m.at+int64(sameConnGap), ok)
}

// toPeer returns the flow among a client endpoint's flows whose far end is
// peer (a backend it is known to use) for a packet at m, and when guess
// permits, one without a backend yet that the packet must be of: a client
// endpoint talks to one peer at a time. With one flow, that is the flow
// unless its connection is over. With several (a reused port, or an
// unconnected UDP socket talking to several Services), the one known to
// use peer that began last before the packet; but a flow without a
// backend that began just before the packet (within the reordering
// window), after that one had been idle for idleGap, takes it: what a
// reused port sends to a backend is the latest connection's. A guess is
// only a candidate: link makes it when plausible (plausibleGuess).
func toPeer(flows []*flowState, peer netip.AddrPort, m moment, guess bool) (f *flowState, guessed bool) {
	switch len(flows) {
	case 0:
		return nil, false
	case 1:
		f := flows[0]
		switch {
		case f.tcp.over(m):
			return nil, false
		case f.hasBackend(peer):
			return f, false
		case guess && f.guessable(m):
			return f, true
		}
		return nil, false
	}
	return amongSeveral(flows, peer, m, guess)
}

// amongSeveral is toPeer for a client endpoint with several flows.
func amongSeveral(flows []*flowState, peer netip.AddrPort, m moment, guess bool) (f *flowState, guessed bool) {
	limit := m.at + int64(clockSlack)
	known := latestBefore(flows, m, limit, func(f *flowState) bool {
		return f.hasBackend(peer) && !f.tcp.over(m) && !f.elsewhere(m)
	})
	// A connection's last packets do not make a backend of a newer flow.
	if !guess || m.flags&(tcpFIN|tcpRST) != 0 {
		return known, false
	}
	var fresh *flowState
	for _, f := range flows {
		b := f.began(m)
		if len(f.backends) == 0 && b <= m.at+int64(guessWindow) && m.at-b <= int64(reorderWindow) && !f.tcp.over(m) && !f.elsewhere(m) &&
			(fresh == nil || b > fresh.began(m)) {
			fresh = f
		}
	}
	if fresh != nil && (known == nil || known.began(m) < fresh.began(m) && known.last.UnixNano() < fresh.began(m)-int64(idleGap)) {
		return fresh, true
	}
	return known, false
}

// elsewhere tells whether a packet at m from or to f's client endpoint is
// another flow's (an unconnected UDP socket asks several VIPs, rewritten at
// different places, or not at all): past the client's host veth (before
// it, the client's own datagrams to a backend are its: sendsDirect), f's
// requests still went to its VIP at m's checkpoint or after it (a
// conntrack entry is at netfilter before NAT); and once conntrack moved f
// to another source (the SNAT, off a tuple another flow's entry holds),
// its packets carry that one on the uplink, and its replies until
// netfilter.
func (f *flowState) elsewhere(m moment) bool {
	if f.snat.IsValid() && f.snat != f.client && (m.point == obs.PointUplink || m.point == obs.PointNFBefore && m.reply) {
		return true
	}
	return !m.reply && m.atCP && m.cp > cpTCHead && f.vipFrom(m.cp) && !f.sendsDirect()
}

// vipFrom tells whether a checkpoint at cp or after it saw f's request go
// to its VIP.
func (f *flowState) vipFrom(cp checkpoint) bool {
	for c := cp; c < numCheckpoints; c++ {
		if f.cps[c].vip {
			return true
		}
	}
	return false
}
