package flow

import (
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

type linkResult uint8

const (
	unlinked linkResult = iota // no flow claims it yet: it waits
	linked
	refused // its flow would exceed MaxFlows
	// deferredLink: no flow claims it for sure yet: a backend guess (or a
	// conntrack event's flow, ctFlow) was put off. It waits as unlinked
	// does and has a last chance as it leaves the waiting room (lastChance).
	deferredLink
	// replyOnlyLinked: a reply of a connection none of whose requests was
	// seen, counted with it (replyWithoutRequest): no flow.
	replyOnlyLinked
)

// link finds the flow of an observation with addresses src -> dst seen at m
// (its time and TCP flags; its direction is link's to tell), of the socket
// cookie names (0: not a socket's observation), and tells
// whether it travels in the reply direction. A VIP on either end names the
// flow (creating it); otherwise the other end must be a backend the flow is
// known to use. Failing that, when the client endpoint has exactly one flow
// and that flow has no backend yet, the other end is its backend: a client
// endpoint (a socket's local address and port) talks to one peer. A client
// port is reused: of a client endpoint's flows, a packet goes to the one it
// can belong to by time and TCP flags (toPeer, withService). A guess not
// plausible yet is put off (deferredLink) unless this is the observation's
// last chance (last).
func (e *Engine) link(proto obs.Proto, src, dst netip.AddrPort, cookie uint64, m moment, replies, last bool) (*flowState, bool, linkResult) {
	var g guesses
	if f, reply, r := e.lookup(proto, src, dst, cookie, m, replies, last, &g); r != unlinked {
		return f, reply, r
	}
	// A flow the uplink's TX tap saw leave with its VIP left unrewritten:
	// whatever else its client endpoint sends is another connection's (a
	// node socket whose port the masquerade of a Pod's flow shares), not
	// its backend.
	if g.out != nil && g.out.cps[cpUplink].vip {
		g.out = nil
	}
	if g.in != nil && g.in.cps[cpUplink].vip {
		g.in = nil
	}
	at := time.Unix(0, m.at)
	rep := m
	rep.reply = true
	if g.out != nil && e.plausibleGuess(g.out, m, last) && !e.doubtfulGuess(g.out, src, m, last) {
		e.learnBackend(g.out, dst, at)
		return g.out, false, linked
	}
	if g.in != nil && e.plausibleGuess(g.in, m, last) && !e.doubtfulGuess(g.in, dst, rep, last) {
		e.learnBackend(g.in, src, at)
		return g.in, true, linked
	}
	// The client end of a refused flow: its packets after the rewrite (and
	// their replies) are refused with it, not kept waiting for a flow that
	// will never exist.
	if e.refusedClients.has(clientKey{proto, src}) || replies && e.refusedClients.has(clientKey{proto, dst}) {
		return nil, false, refused
	}
	if g.out != nil || g.in != nil {
		return nil, false, deferredLink
	}
	switch f, r := e.renatSYN(proto, src, dst, m, last); r {
	case linked:
		e.learnBackend(f, dst, at)
		return f, false, linked
	case deferredLink:
		return nil, false, deferredLink
	}
	return nil, false, unlinked
}

// renatSYN is the flow of src whose connection a SYN from src to dst at m
// opened before its retransmission was NATed anew (renatable): dst is one
// of its VIP's NAT rules' backends, which that SYN went to before the node
// dropped it, and the flow was seen going to other backends only after m
// (their packets, or conntrack's event, delivered ahead of this SYN's).
// nil otherwise. Not a SYN seen where nothing on the node rewrote it yet
// (its socket, its Pod's eth0, its host veth, tc head), nor one sent before
// the flow's client sent its first SYN to the VIP: the client's own
// connection to that backend (the kernel picks a client's port per
// destination, so one port can serve both at once, or one soon after the
// other). That first SYN may be delivered later: until its last chance
// (last) the SYN waits for it (deferredLink). For UDP, the same of a
// datagram the kernel dropped (seen after NAT only, its drop tells it went
// nowhere: a datagram the client sent to that backend itself would not be
// taken for the flow's) within the UDP entry life before those backends
// (udpRenatted tells whether conntrack's entry names one of them).
func (e *Engine) renatSYN(proto obs.Proto, src, dst netip.AddrPort, m moment, last bool) (*flowState, linkResult) {
	switch {
	case m.reply:
		return nil, unlinked
	case proto == obs.TCP && m.opens():
		if m.atCP && m.cp <= cpTCHead {
			return nil, unlinked
		}
	case proto == obs.UDP && m.point == obs.PointDrop:
	default:
		return nil, unlinked
	}
	plain, _ := e.udpTimeouts()
	wait := false
	for _, f := range e.clients[clientKey{proto, src}] {
		if len(f.backends) == 0 || f.hasBackend(dst) || f.tcp.superseded(m) || len(e.natRulesFor(f, dst)) == 0 {
			continue
		}
		if proto == obs.TCP && (f.tcp.syn == 0 || f.tcp.syn > m.at+int64(clockSlack)) {
			// No SYN of the flow's to the VIP seen before it (yet).
			wait = wait || !last
			continue
		}
		later := true
		for _, b := range f.backends {
			later = later && b.at.UnixNano() > m.at && (proto == obs.TCP || b.at.UnixNano()-m.at < int64(plain))
		}
		if later {
			f.renat = proto == obs.TCP || e.udpRenatted(f)
			f.evidenceChanged()
			return f, linked
		}
	}
	if wait {
		return nil, deferredLink
	}
	return nil, unlinked
}

// udpRenatted tells whether f, a UDP flow whose VIP conntrack reported
// DNATed to ctFinal, sent datagrams before that were NATed to other
// backends of its VIP's NAT rules and dropped on the node before
// conntrack confirmed an entry for them (a bridge refusing a hairpin, a
// filter rule): no entry bound those, so a later datagram of its socket
// was NATed anew. Each such backend was first seen before ctFinal, less
// than conntrack's UDP entry life before it (an entry that expired lets a
// flow change backend for real, and conntrack reported it first), never
// answered, and was not one the client sent to itself (renatted also
// looks, at each report, at whether a datagram to it left the node).
func (e *Engine) udpRenatted(f *flowState) bool {
	if f.proto != obs.UDP || !f.ctFinal.IsValid() || len(f.backends) < 2 {
		return false
	}
	i := slices.IndexFunc(f.backends, func(b backendSeen) bool { return b.addr == f.ctFinal })
	if i < 0 {
		return false
	}
	reached := f.backends[i].at.UnixNano()
	plain, _ := e.udpTimeouts()
	for _, b := range f.backends {
		at := b.at.UnixNano()
		if b.addr == f.ctFinal {
			continue
		}
		if at >= reached || reached-at >= int64(plain) || f.repliedFrom(b.addr) ||
			f.sendsDirect() && f.directBackend() == b.addr || len(e.natRulesFor(f, b.addr)) == 0 {
			return false
		}
	}
	return true
}

// guesses are link's candidates for a backend guess (lookup): a flow of the
// source endpoint (out) or of the destination endpoint (in) without a
// backend yet that the packet may be for; the other end would be its
// backend (toPeer).
type guesses struct{ out, in *flowState }

// lookup finds the flow of an observation src -> dst at m, in the one order
// link and find (Classify) both follow, and tells whether it travels in the
// reply direction:
//
//  1. a Service on dst, or with replies on src, names the flow of the
//     client endpoint at the other end (withService), or beyond the node's
//     SNAT, unrewritten, the flow the SNAT gave it (snattedTo);
//  2. otherwise the flow of src known to use dst as backend, then with
//     replies the flow of dst known to use src (toPeer);
//  3. then the flow a SNAT gave src going to dst, with replies the one it
//     gave dst going to src.
//
// With g (link's mode, learning) step 1 is flowFor, which makes the flow
// when there is none (linked, or refused beyond MaxFlows; unless last, a
// packet put off, deferredLink, for a socket that may be its flow), and step 2 also
// fills g with the candidates for a backend guess, which link may take
// when nothing was found (unlinked). Without g lookup changes nothing and
// offers no guess (toPeer guesses only when asked).
func (e *Engine) lookup(proto obs.Proto, src, dst netip.AddrPort, cookie uint64, m moment, replies, last bool, g *guesses) (f *flowState, reply bool, r linkResult) {
	learn := g != nil
	client, service, toService := src, dst, true
	switch {
	case e.isService(proto, dst) && !(replies && e.clientOnVIP(proto, dst)):
		m.reply = false
	case replies && e.isService(proto, src) && !e.clientOnVIP(proto, src):
		client, service, reply, m.reply = dst, src, true, true
		// A socket sending from the Service is the server's (a node-local
		// listener): its cookie tells the client's sockets nothing.
		cookie = 0
	default:
		toService = false
	}
	if toService {
		if learn {
			f, r = e.flowFor(proto, client, service, cookie, m, last)
			return f, reply, r
		}
		if f = withService(e.clients[clientKey{proto, client}], service, 0, m); f == nil {
			f = e.snattedTo(proto, client, service, m) // beyond the node's SNAT, unrewritten
		}
		if f == nil {
			return nil, reply, unlinked
		}
		return f, reply, linked
	}
	req, rep := m, m
	req.reply, rep.reply = false, true
	fOut, guessOut := toPeer(e.clients[clientKey{proto, src}], dst, req, learn)
	if fOut != nil && !guessOut {
		return fOut, false, linked
	}
	if guessOut {
		g.out = fOut
	}
	if replies {
		fIn, guessIn := toPeer(e.clients[clientKey{proto, dst}], src, rep, learn)
		if fIn != nil && !guessIn {
			return fIn, true, linked
		}
		if guessIn {
			g.in = fIn
		}
	}
	if f := e.snattedTo(proto, src, dst, req); f != nil {
		return f, false, linked
	}
	if replies {
		if f := e.snattedTo(proto, dst, src, rep); f != nil {
			return f, true, linked
		}
	}
	// Beyond the node's SNAT, to a peer conntrack does not name: a flow
	// that left netfilter with its VIP (conntrack's reply source) and was
	// rewritten after it, by a tc program on the uplink's egress. Its
	// SNAT source talks to one peer, as a client endpoint does.
	// (toPeer guesses only when learning, with g.)
	if fOut == nil && (g == nil || g.out == nil) {
		if f, guessed := toPeer(e.snatUnrewritten(proto, src), dst, req, learn); f != nil && !guessed {
			return f, false, linked
		} else if guessed {
			g.out = f
		}
	}
	if replies && (g == nil || g.in == nil) {
		if f, guessed := toPeer(e.snatUnrewritten(proto, dst), src, rep, learn); f != nil && !guessed {
			return f, true, linked
		} else if guessed {
			g.in = f
		}
	}
	// The rest of a retired flow, its endpoint talking to its backend.
	if learn && g.out == nil && g.in == nil {
		if f, r := e.resumed(src, dst, proto, cookie, req, last); r != unlinked {
			return f, false, r
		}
		if replies {
			if f, r := e.resumed(dst, src, proto, 0, rep, last); r != unlinked {
				return f, true, r
			}
		}
		// A request to a backend's address from a client endpoint seen
		// by its replies alone makes its flow (its copy to the VIP, if a
		// point saw one, may come later); a reply from one is counted with
		// them (before the node translated it back). With an XDP program
		// on an uplink, so does a connection's opening request to any
		// address just before its first reply: XDP rewrites an outside
		// client's request before every point, to a backend no rule names.
		// Not a request that cannot be that connection's (ownRequest).
		if c := e.replyOnly.get(clientKey{proto, src}); c != nil && c.ownRequest(dst, req) && (e.watchedAddr(dst.Addr()) || e.openedBeforeXDP(proto, c, req)) {
			f, r := e.flowFor(proto, src, c.service, cookie, req, last)
			if r == linked {
				e.learnBackend(f, dst, time.Unix(0, m.at))
			}
			return f, false, r
		}
		if replies && e.replyToReplyOnly(proto, src, dst, m.at) {
			return nil, true, replyOnlyLinked
		}
	}
	return nil, false, unlinked
}

// clientOnVIP tells whether ap, an endpoint on a traced VIP's address, is
// a flow's client endpoint: a node socket that connects to a VIP which is
// an address of the node (traced without port) has that address as its
// source. What it sends to its backend, and the backend's answers, are its
// flow's, not requests to the VIP on the socket's port (or answers to them).
// Only a node with a traced VIP among its addresses has such sockets: on
// the others, packets to a VIP skip the lookup.
func (e *Engine) clientOnVIP(proto obs.Proto, ap netip.AddrPort) bool {
	return len(e.cfg.Attribution.LocalVIPs) > 0 && len(e.clients[clientKey{proto, ap}]) > 0
}

// plausibleGuess tells whether a packet at m to (or from) a peer f does not
// know can be taken for f's backend now: f was active within guessWindow
// of m. Otherwise the guess is put off: f's next activity, or the flow of
// another Service the client endpoint talks to (an unconnected UDP socket
// sends to several), can come within the reordering window; the guess is
// made as the packet leaves the waiting room if it still stands (last).
func (e *Engine) plausibleGuess(f *flowState, m moment, last bool) bool {
	if last || f.began(m)-int64(guessWindow) <= m.at && m.at <= f.last.UnixNano()+int64(guessWindow) {
		return true
	}
	f.deferred = true
	return false
}

// doubtfulGuess tells whether the backend guess of f for a packet at m from
// or to end must wait (unless this is its last chance), as another flow of
// f's client endpoint, end, may be the packet's (an unconnected UDP socket
// asks several VIPs at once): f's requests went on to its VIP past m's
// checkpoint, or another flow, to another VIP and without a backend, may
// as well be it. What the points see of them next tells them apart
// (elsewhere).
func (e *Engine) doubtfulGuess(f *flowState, end netip.AddrPort, m moment, last bool) bool {
	if last || end != f.client {
		return false
	}
	doubt := f.elsewhere(m)
	for _, h := range e.clients[f.key()] {
		if h != f && h.service != f.service && len(h.backends) == 0 && !h.tcp.over(m) && !h.elsewhere(m) && !h.cps[cpUplink].vip &&
			h.began(m)-int64(guessWindow) <= m.at && m.at-h.began(m) <= int64(reorderWindow) {
			h.deferred, doubt = true, true
		}
	}
	if doubt {
		f.deferred = true
	}
	return doubt
}

// touch notes that f was active at t: a backend guess put off for it may
// stand now.
func (e *Engine) touch(f *flowState, t time.Time) {
	f.touch(t)
	if f.deferred {
		f.deferred = false
		e.replays = append(e.replays, f.key())
	}
}

// snattedTo is the flow a SNAT gave the source ap whose packets beyond the
// SNAT go to far (conntrack's reply source: its backend, or its VIP when
// it left unrewritten), if any; of several (a reused port), the one that
// began last before the packet at m. Masquerade keeps a source port when
// it can, so flows of several Pods to different backends share a source.
func (e *Engine) snattedTo(proto obs.Proto, ap, far netip.AddrPort, m moment) *flowState {
	list := e.snat[clientKey{proto, ap}]
	if len(list) == 0 {
		return nil
	}
	return latestBefore(list, m, m.at+int64(sameConnGap), func(f *flowState) bool { return f.snatDst == far })
}

// snatUnrewritten are the flows a SNAT gave the source ap that left
// netfilter unrewritten (conntrack's reply source is their VIP) on a node
// whose uplink has a tc egress program of their time: a packet from ap to
// another peer was rewritten after the SNAT, where only such a program
// runs. Without one, nothing rewrites there: a packet of ap to another
// peer is another socket's that the SNAT's port collides with.
func (e *Engine) snatUnrewritten(proto obs.Proto, ap netip.AddrPort) []*flowState {
	list := e.snat[clientKey{proto, ap}]
	if len(list) == 0 {
		return nil
	}
	var out []*flowState
	for _, f := range list {
		if f.snatDst == f.service && e.hasUplinkEgressTC(f) {
			out = append(out, f)
		}
	}
	return out
}

// hasUplinkEgressTC tells whether an uplink had a tc egress program at f's
// time.
func (e *Engine) hasUplinkEgressTC(f *flowState) bool {
	for _, p := range e.cfg.Attribution.UplinkTCPrograms {
		if p.Direction == "egress" && presentAt(p, f.first) {
			return true
		}
	}
	return false
}

// setSNAT records that conntrack says f leaves the node from src to dst.
func (e *Engine) setSNAT(f *flowState, src, dst netip.AddrPort) {
	e.dropSNAT(f)
	f.snat, f.snatDst = src, dst
	f.evidenceChanged()
	k := clientKey{f.proto, src}
	e.snat[k] = append(e.snat[k], f)
	e.replays = append(e.replays, k)
}

// dropSNAT forgets f's SNAT source in the index (not in f).
func (e *Engine) dropSNAT(f *flowState) {
	if !f.snat.IsValid() {
		return
	}
	k := clientKey{f.proto, f.snat}
	list := slices.DeleteFunc(e.snat[k], func(g *flowState) bool { return g == f })
	if len(list) == 0 {
		delete(e.snat, k)
		return
	}
	e.snat[k] = list
}

// soleWithoutBackend is the one flow of flows when it has no backend yet.
func soleWithoutBackend(flows []*flowState) *flowState {
	if len(flows) == 1 && len(flows[0].backends) == 0 {
		return flows[0]
	}
	return nil
}

// owesEntry tells whether the conntrack event at m is f's own, late: f's
// connection closed within the reordering window before it, and conntrack,
// which reports a connection from its SYN, reported none of f's yet. Its
// events are stamped when read, and a reader kept off the CPUs reads them
// after the close; a later connection of the port finds f's reported, or
// was seen opening (superseded).
func (f *flowState) owesEntry(m moment) bool {
	return m.entry && !f.ctSeen && f.tcp.syn != 0 && !f.tcp.superseded(m) && m.at-f.tcp.closed() <= int64(reorderWindow)
}

// otherEntry tells whether the conntrack event at m reports another
// connection's entry than f's: a new entry's (moment.fresh), conntrack
// having reported f's already, and f's connection closed. (Without seeing
// it close, f may be a flow made of conntrack's events alone, which are
// read ahead of the packets: the packets tell such flows apart.)
func (f *flowState) otherEntry(m moment) bool {
	return m.fresh && f.ctSeen && f.tcp.closed() != 0
}

// flowFor returns the flow client -> service of a packet (or socket event
// of socket cookie, 0 for others) at m, creating it within MaxFlows. A
// client without a port (socket layer before bind) is told apart by
// cookie. Where the flow is over, a new flow begins: a reused client port.
// A TCP connection is over for a packet (or conntrack event) opening
// another; a flow of one socket for an observation of another
// (joinOrSupersede). Beyond MaxFlows a packet that a socket whose port is
// not known yet may have sent waits for that socket's tuple (awaitsPort)
// rather than be refused, unless this is its last chance (last).
func (e *Engine) flowFor(proto obs.Proto, client, service netip.AddrPort, cookie uint64, m moment, last bool) (*flowState, linkResult) {
	k := clientKey{proto, client}
	f := withService(e.clients[k], service, cookie, m)
	if f != nil && f.tcp.superseded(m) && e.refused.has(flowKey{k, service}) {
		// The later connection of the port, refused beyond MaxFlows
		// (had it a flow, withService would have found it); refuse counts
		// a connection after it again.
		e.refuse(flowKey{k, service}, cookie, m)
		return nil, refused
	}
	if f != nil && !(m.starts() && (f.tcp.over(m) || f.otherEntry(m)) && !f.owesEntry(m)) {
		return f, linked
	}
	if f != nil && (m.opens() && !m.reply || m.fresh) {
		// A later connection of the port (its SYN, or conntrack's new
		// entry): the rest of what is seen of it is not f's, even when it
		// is refused beyond MaxFlows.
		earliest(&f.tcp.next, m.at)
	}
	if f == nil && cookie != 0 && client.Port() != 0 {
		if g, joined := e.joinOrSupersede(k, service, cookie, m); joined {
			return g, linked
		}
	}
	// Beyond the node's SNAT a flow that left unrewritten carries the
	// source conntrack says the SNAT gave it: not a flow from the node.
	if f == nil && client.Port() != 0 {
		if f := e.snattedTo(proto, client, service, m); f != nil {
			return f, linked
		}
	}
	if _, resumes := e.retiredBefore(flowKey{k, service}, m); m.reply && !resumes {
		// A reply of a flow refused beyond MaxFlows is refused with it
		// (refuse notes its FIN or RST, counts nothing again).
		if r, ok := e.refused.get(flowKey{k, service}); ok && !e.refusalOver(flowKey{k, service}, r, cookie, m) {
			e.refuse(flowKey{k, service}, cookie, m)
			return nil, refused
		}
		// No flow is made of a reply: it has no request to decide on
		// (unless its connection's requests were seen, with a flow
		// reported as ended: it continues that one).
		return nil, e.replyWithoutRequest(proto, client, service, m)
	}
	if e.nflows >= e.maxFlows && cookie == 0 && !last && e.awaitsPort(proto, client, service, m) {
		return nil, deferredLink
	}
	return e.newFlow(proto, client, service, cookie, m)
}

// awaitsPort tells whether a flow made from a socket's connect or sendmsg
// before its port was known (keyed without it: index) may be the flow of a
// packet from client to service at m: the socket's tuple, which names the
// port and rekeys the flow, comes from another source than the packet and
// may be delivered after it. Beyond MaxFlows the packet would otherwise be
// refused as a flow of its own, and its socket's flow lose it. Only the
// latest such flows (index appends) are looked at: sockets whose port never
// came (a connect that failed early) stay there, and a flood of refused
// packets must not scan them all.
func (e *Engine) awaitsPort(proto obs.Proto, client, service netip.AddrPort, m moment) bool {
	const latest = 32
	unbound := [...]netip.AddrPort{{}, netip.AddrPortFrom(client.Addr(), 0), netip.AddrPortFrom(netip.IPv4Unspecified(), 0)}
	for _, p := range [...]obs.Proto{proto, 0} {
		for _, a := range unbound {
			list := e.clients[clientKey{p, a}]
			for _, f := range list[max(len(list)-latest, 0):] {
				if b := f.began(m); f.service == service && b <= m.at+int64(clockSlack) && m.at-b <= int64(reorderWindow) {
					return true
				}
			}
		}
	}
	return false
}

// joinOrSupersede takes the observation at m of socket cookie on a client
// endpoint and Service whose flows are other sockets' (withService found
// none of its own): the port was reused by a new socket. The latest of
// those flows, g, is superseded from m on: what is seen of the endpoint
// from then on is the new socket's, whether its flow is followed or
// refused. But a UDP g seen active since m took the new socket's packets
// already (delivered before its socket's events: nothing in a datagram
// tells the sockets apart, and they share conntrack's entry, hence the
// backend): the socket joins g (true), counted in flows_joined so that
// it is not lost silently.
func (e *Engine) joinOrSupersede(k clientKey, service netip.AddrPort, cookie uint64, m moment) (*flowState, bool) {
	var g *flowState
	for _, f := range e.clients[k] {
		if f.service == service && f.sock != 0 && f.sock != cookie && (g == nil || f.began(m) > g.began(m)) {
			g = f
		}
	}
	switch {
	case g == nil:
		return nil, false
	case k.proto == obs.UDP && !g.tcp.superseded(m) && g.last.UnixNano() >= m.at-int64(clockSlack):
		e.joined++
		return g, true
	}
	earliest(&g.tcp.next, m.at)
	return nil, false
}

// newFlow makes the flow client -> service of socket cookie (0: not
// known) seen at m within MaxFlows.
func (e *Engine) newFlow(proto obs.Proto, client, service netip.AddrPort, cookie uint64, m moment) (*flowState, linkResult) {
	k := clientKey{proto, client}
	e.replyOnly.requested(k, service, m.at)
	if e.nflows >= e.maxFlows || e.stillRefused(flowKey{k, service}, cookie, m) {
		e.refuse(flowKey{k, service}, cookie, m)
		return nil, refused
	}
	e.made++
	f := &flowState{seq: e.made, proto: proto, client: client, service: service, sock: cookie}
	if client.Port() == 0 {
		f.cookie = cookie
	}
	e.continued(f, m)
	e.index(f)
	e.nflows++
	e.unrefuse(flowKey{k, service}, cookie, m)
	return f, linked
}

// unrefuse takes back the refusal of the flow k, made now: it was refused
// while a socket's flow whose port was not known yet took one of the
// MaxFlows places, which its first packet then gave back (merging it into
// the flow of its port). Counted as a flow, it is no longer counted as
// refused, nor are its client's packets refused with it.
func (e *Engine) unrefuse(k flowKey, sock uint64, m moment) {
	r, ok := e.refused.get(k)
	if !ok || k.client.Port() == 0 || e.refusalOver(k, r, sock, m) {
		return
	}
	e.refused.forget(k)
	e.refusedClients.forget(k.clientKey)
	e.overMax--
}

// refusedFlow is what the engine remembers of a flow refused beyond
// MaxFlows, to tell its later observations from those of a later flow of
// the same client endpoint and Service (a reused port), which is counted
// too.
type refusedFlow struct {
	sock     uint64 // its socket's cookie, 0 while no socket observer named it
	syn, end int64  // TCP: its client's first SYN, its first FIN or RST (unix ns; 0 not seen)
	entry    int64  // TCP: conntrack's first report of its entry (moment.fresh)
	// last is the latest observation of it (unix ns), as Repeat lets
	// through at least every refusedRecheck (Engine.refusalOver).
	last int64
}

// another tells whether an observation at m of socket sock (0: not a
// socket's) is of a later flow than r: another socket's, or a TCP SYN
// opening a connection after r's ended, or later than a client
// retransmits its SYN. A refused flow's SYN, FIN and RST are always seen
// here (the capture path never counts them as repeats), its ACKs not.
func (r refusedFlow) another(sock uint64, m moment) bool {
	if sock != 0 && r.sock != 0 && sock != r.sock {
		return true
	}
	if m.fresh && r.entry != 0 && r.entry < m.at {
		return true // a second entry: another connection (moment.fresh)
	}
	if !m.opens() || m.reply {
		return false
	}
	return r.end != 0 && r.end < m.at-int64(sameConnGap) || r.syn != 0 && r.syn < m.at-int64(synRetryWindow)
}

func (r *refusedFlow) note(sock uint64, m moment) {
	if r.sock == 0 {
		r.sock = sock
	}
	r.last = max(r.last, m.at)
	if m.fresh {
		earliest(&r.entry, m.at)
	}
	if m.opens() && !m.reply {
		earliest(&r.syn, m.at)
	}
	if m.flags&(tcpFIN|tcpRST) != 0 {
		earliest(&r.end, m.at)
	}
}

// refuse counts a flow beyond MaxFlows (k, of socket sock, seen at m)
// once, as far as a bounded set of the recently refused ones remembers it
// (recentSet); a later flow of the same client endpoint and Service
// (refusedFlow.another) is counted again. The set also names the refused
// flows' client endpoints, whose later packets link refuses too. A socket
// not bound yet (client port 0) is not counted: its first packet names
// its port, and the flow is counted then.
func (e *Engine) refuse(k flowKey, sock uint64, m moment) {
	if k.client.Port() == 0 {
		return
	}
	r, ok := e.refused.get(k)
	if ok && !e.refusalOver(k, r, sock, m) {
		r.note(sock, m)
		e.refused.put(k, r)
		return
	}
	r = refusedFlow{}
	r.note(sock, m)
	e.refused.put(k, r)
	e.refusedClients.put(k.clientKey, struct{}{})
	e.overMax++
	// Its packets beyond the rewrite (and their replies) that came first
	// wait for it: they are refused with it now, not left unmatched.
	e.replays = append(e.replays, k.clientKey)
}

func (e *Engine) index(f *flowState) {
	k := f.key()
	e.clients[k] = append(e.clients[k], f)
	if f.client.Port() != 0 {
		e.replays = append(e.replays, k)
	}
}

func (e *Engine) unindex(f *flowState) {
	k := f.key()
	list := e.clients[k]
	for i, g := range list {
		if g == f {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(e.clients, k)
		return
	}
	e.clients[k] = list
}

func (e *Engine) learnBackend(f *flowState, b netip.AddrPort, at time.Time) {
	if !b.IsValid() || b == f.service || !f.addBackend(b, at) {
		return
	}
	e.backends[b.Addr()] = true
	e.backendPorts[b] = true
	e.redirectsSeen = e.redirectsSeen || b.Addr().IsLoopback()
	w := obs.Watch{Addr: b.Addr(), Port: b.Port(), Proto: f.proto}
	if f.proto != obs.TCP && f.proto != obs.UDP {
		w.Port, w.Proto = 0, 0 // no ports: every port of it
	}
	e.backendWatches[w] = true
	e.checkListed(f, b)
	if !f.renat && e.udpRenatted(f) {
		// Conntrack's backend came before this one's datagrams did.
		f.renat = true
		f.evidenceChanged()
	}
	if f.client.Port() != 0 {
		e.replays = append(e.replays, f.key())
	}
}

// sight records at checkpoint cp that the request went to dst (the VIP or a
// backend, which the flow then learns).
func (e *Engine) sight(f *flowState, cp checkpoint, dst netip.AddrPort, from obs.Point, at time.Time) {
	e.sightPacket(f, cp, dst, from, at, false)
}

// sightPacket is sight for a request packet; reset: it was the client's
// bare TCP reset (clientReset).
func (e *Engine) sightPacket(f *flowState, cp checkpoint, dst netip.AddrPort, from obs.Point, at time.Time, reset bool) {
	isVIP := dst == f.service
	if !isVIP {
		e.learnBackend(f, dst, at)
	}
	s, bit := &f.cps[cp], uint16(1)<<cp
	if isVIP && !s.vip && (cp == cpPod || cp == cpHost || cp == cpTCHead) && f.proto == obs.UDP && len(f.backends) > 0 {
		// The client's own datagrams to another peer, put off there, are
		// the flow's now (guessable).
		e.replays = append(e.replays, f.key())
	}
	if !isVIP && s.backend {
		switch byReset := f.resetOnly&bit != 0; {
		case reset && !byReset:
			return // a request's sighting stands
		case !reset && byReset:
			s.backend = false // a request's sighting replaces the reset's
		}
	}
	if s.see(isVIP, endpointOf(dst), from, at.UnixNano()) {
		if !isVIP && reset {
			f.resetOnly |= bit
		} else if !isVIP {
			f.resetOnly &^= bit
		}
		f.evidenceChanged()
	}
}

func (e *Engine) applyPacket(f *flowState, o obs.Observation, reply bool) (slot int) {
	e.touch(f, o.Time)
	syn := f.tcp.syn
	if o.TCPFlags != 0 && o.Proto == obs.TCP && f.tcp.note(e.packetMoment(f, &o, reply)) {
		f.evidenceChanged() // whether it was seen from its start (conntrackBlind)
		if f.tcp.syn != syn && f.client.Port() != 0 {
			// A SYN NATed before this one's may wait for it (renatSYN).
			e.replays = append(e.replays, f.key())
		}
	}
	slot = f.count(pointKey{point: o.Point, dir: o.Dir, reply: reply, iface: e.labels.indexOf(o.Ifname)}, endpointOf(o.Src), endpointOf(o.Dst), endpoint{}, 1, uint64(o.Len))
	if !reply && e.late(o.Time.UnixNano()) {
		e.countLate(f, o.Point, o.Dir, o.Time.UnixNano())
	}
	if reply {
		f.reply = true
		if o.Point == obs.PointUplink {
			f.uplinkReply.note(o)
			if o.Dir == obs.DirOut && o.Src == f.service && !f.wireAnswered {
				f.wireAnswered = true
				f.evidenceChanged() // takenAtUplinkIn
			}
		}
		if o.Point == obs.PointPod && o.Dir == obs.DirIn && o.Src != f.service &&
			(f.untranslated == nil || o.Time.Before(f.untranslated.At)) {
			// Into the client's Pod from a backend's address: untranslated
			// when its requests left the Pod to the VIP (untranslatedReplies).
			f.untranslated = &StrayReplies{From: o.Src, Point: o.Point.String(), At: o.Time}
			f.evidenceChanged()
		}
		return slot
	}
	if cp, ok := e.requestCheckpoint(&o); ok {
		if e.afterIPVS(f, cp, o) {
			cp = cpConfirm
		}
		if (cp == cpHost || cp == cpTCHead || cp == cpTCTail) && f.hostIfindex == 0 && o.Ifindex > 0 {
			f.hostIfindex = o.Ifindex
			f.evidenceChanged() // names the tc programs of the flow's veth
		}
		if (cp == cpNFBefore || cp == cpNFAfter) && f.natHook == "" {
			f.natHook = natHookName(o.Hook)
			f.evidenceChanged() // names the rules of that hook
		}
		e.sightPacket(f, cp, o.Dst, o.Point, o.Time, clientReset(cp, o))
	}
	if o.Point == obs.PointUplink && o.Dir != obs.DirIn {
		f.uplink.note(o)
	}
	if o.Point == obs.PointUplink && o.Dir == obs.DirIn && !f.uplinkIn.seen {
		f.uplinkIn.note(o)
		f.evidenceChanged() // uplinkXDPNote
	}
	if o.Point == obs.PointUplink && o.Dir == obs.DirIn && o.Dst == f.service && !f.wireVIP {
		f.wireVIP = true
		f.evidenceChanged()
	}
	return slot
}

// afterIPVS tells whether o, seen by a netfilter observer at cp, is a
// request IPVS already rewrote: IPVS's NAT sends the packet it rewrote (at
// LOCAL_IN for a Pod's request, at LOCAL_OUT after the observers for the
// node's own) through the LOCAL_OUT hook again, where the observers see it
// with the backend as destination, after they saw the VIP on either side
// of NAT. Taken for what it is, that sighting is past IPVS (cpConfirm's
// place), not before NAT: there it made the VIP, seen after NAT, come
// after the backend ("inconsistent"). Only for a Service IPVS serves: a
// node process's request that netfilter's own DNAT at OUTPUT rewrote keeps
// its place.
func (e *Engine) afterIPVS(f *flowState, cp checkpoint, o obs.Observation) bool {
	if (cp != cpNFBefore && cp != cpNFAfter) || o.Hook != obs.HookLocalOut || o.Dst == f.service {
		return false
	}
	for _, s := range e.cfg.Attribution.IPVS {
		if vipMatches(s.VIP, s.Proto, f) {
			return true
		}
	}
	return false
}

// packetMoment is momentOf for a packet of f, with what tells a client's
// refusal of an untranslated reply from a reset that ends its connection
// (tcpLife.rstAside), and a server's reset that reached the client
// untranslated from one that did (tcpLife.rstUntranslated).
func (e *Engine) packetMoment(f *flowState, o *obs.Observation, reply bool) moment {
	m := momentOf(o, reply)
	switch {
	case reply:
		// Past every place on the node that translates replies back: the
		// client's Pod's eth0, its host veth towards it.
		towardsClient := (o.Point == obs.PointPod && o.Dir == obs.DirIn) || (o.Point == obs.PointHost && o.Dir == obs.DirOut)
		m.untranslated = towardsClient && o.Src != f.service
	case o.Dst == f.service:
	case o.TCPFlags&(tcpRST|tcpACK|tcpSYN) == tcpRST:
		m.aside = true
	default:
		if cp, ok := e.requestCheckpoint(o); ok && (cp == cpPod || cp == cpHost || cp == cpTCHead) {
			m.direct = true
		}
	}
	return m
}

// clientReset tells whether o is a bare TCP reset (RST without SYN) seen
// where the client's requests are before anything on the node can rewrite
// them (its Pod's eth0, the host veth's tap and tc head), or before
// netfilter's NAT. Sent to a backend by a client whose requests went to
// the VIP there, it is the client's kernel answering a reply that came
// back untranslated (a SYN-ACK from the backend's address, which no socket
// of the client is connected to): on a bridge that holds the client and
// the backend Pod with bridge-nf-call-iptables 0, the backend's replies
// are switched straight to the client and never meet the conntrack entry
// that would have translated them back; on a routed node (a notrack rule
// kept them from it) the resets pass PREROUTING too. Such a reset says
// nothing of where the request was rewritten (sighting.sawBackend).
func clientReset(cp checkpoint, o obs.Observation) bool {
	switch cp {
	case cpPod, cpHost, cpTCHead, cpNFBefore:
		return o.Proto == obs.TCP && o.TCPFlags&(tcpRST|tcpSYN) == tcpRST
	}
	return false
}

// sockAddr handles a connect4/sendmsg4 observation: ReqDst is what the
// application asked for, Dst what the socket uses. The client port is often not
// known yet (TCP and UDP connect run before the port is bound).
func (e *Engine) sockAddr(o obs.Observation) {
	svc := o.ReqDst
	if !svc.IsValid() {
		svc = o.Dst // no syscall observer: only the socket's view
	}
	s := e.socks.get(o.Cookie)
	proto, client := o.Proto, o.Src
	if s != nil {
		s.noteProc(o)
		if s.src.Port() != 0 {
			client = s.src
		}
		if proto == 0 {
			proto = s.proto
		}
	}
	if proto == 0 && o.Kind == obs.SockSendmsg {
		proto = obs.UDP // the sendmsg4 hook runs for UDP only
	}
	if s != nil && s.src.Port() != 0 && o.Time.After(s.srcAt) && proto == obs.TCP && (o.Kind == obs.SockConnect || o.Kind == obs.SockConnect6) {
		// connect4 runs on an unconnected socket only: a TCP socket
		// that connects again after its port was seen (its last
		// attempt refused) opens another connection, from another
		// port, maybe to another backend.
		s.src, s.flows, client = netip.AddrPort{}, nil, o.Src
	}
	if !e.isService(proto, svc) {
		return
	}
	var f *flowState
	if s != nil {
		f = s.flowTo(svc)
	}
	if f == nil {
		var r linkResult
		// A socket's own event never waits for a socket (last).
		if f, r = e.flowFor(proto, client, svc, o.Cookie, momentOf(&o, false), true); r != linked {
			return
		}
	}
	if s != nil {
		s.add(f)
	}
	f.claim(o.Cookie)
	e.touch(f, o.Time)
	f.noteProc(o.PID, o.Comm, o.Cgroup, o.Time)
	e.noteNodeSocket(f, o)
	if f.kind == 0 && o.Kind != 0 {
		f.kind = o.Kind
		f.evidenceChanged()
	}
	f.count(pointKey{point: o.Point}, endpointOf(o.Src), endpointOf(o.Dst), endpointOf(o.ReqDst), 1, 0)
	if o.ReqDst.IsValid() {
		e.sight(f, cpApp, o.ReqDst, o.Point, o.Time)
	}
	if o.Dst.IsValid() {
		e.sight(f, cpSockAddr, o.Dst, o.Point, o.Time)
	}
}

// sockTuple handles an observation of a socket's actual 4-tuple
// (inet_sock_set_state, cgroup_skb egress). Its cookie links it to the
// sockaddr observations of the same socket.
func (e *Engine) sockTuple(o obs.Observation, last bool) (done, deferred bool) {
	if !o.Src.IsValid() || !o.Dst.IsValid() {
		e.unmatched++
		return true, false
	}
	s := e.socks.get(o.Cookie)
	var f *flowState
	if s != nil {
		s.noteProc(o)
		if o.Src.Port() != 0 && (s.src != o.Src || s.proto != o.Proto) {
			s.src, s.proto, s.srcAt = o.Src, o.Proto, o.Time
			e.rekey(s, o.Cookie)
		} else if o.Src.Port() == 0 && s.src.Port() != 0 && s.src.Addr() == o.Src.Addr() {
			// Its port is known already (netfilter at OUTPUT named the
			// socket before this event came): the SYN_SENT event's is 0.
			o.Src = s.src
		}
		f = s.flowTo(o.Dst)
		if f != nil && o.Kind == obs.SockSendmsg {
			// Its first packet's destination once more (the first
			// datagram its sendmsg4 observer saw go there again left for
			// it): the socket's tuple is known, nothing to count.
			return true, false
		}
		if f == nil && !e.isService(o.Proto, o.Dst) {
			// The same socket asked for a VIP and now sends to dst: its
			// backend. A datagram its sendmsg4 observer saw go where it
			// had gone before (ReqDst, unless the kernel forgot it),
			// which left for dst, was rewritten after the observer: a
			// socket LB after it chose another backend of that flow.
			if f = soleWithoutBackend(s.flows); o.Kind == obs.SockSendmsg {
				if g := s.flowTo(o.ReqDst); g != nil {
					f = g
				} else if f == nil && len(s.flows) == 1 {
					f = s.flows[0]
				}
				if f != nil && len(f.backends) > 0 {
					f.sentElsewhere = true
				}
			}
			if f != nil {
				e.learnBackend(f, o.Dst, o.Time)
			}
		}
		if f == nil && o.Point == obs.PointSockEgress && o.Proto == obs.UDP && len(s.flows) == 1 &&
			s.flows[0].cps[cpSockEgress].vip && !e.isService(o.Proto, o.Dst) {
			// The socket's egress saw its datagrams to the VIP go
			// unrewritten, so one to another peer is the client's
			// own (sendsDirect), sent before its queries to the VIP
			// too: the cookie tells whose, where a guess by time
			// would not take it.
			f = s.flows[0]
		}
	}
	reply := false
	if f == nil {
		var r linkResult
		if f, reply, r = e.link(o.Proto, o.Src, o.Dst, o.Cookie, momentOf(&o, false), true, last); r != linked {
			return r == refused || r == replyOnlyLinked, r == deferredLink
		}
	}
	if !reply {
		e.ownSocket(f, s, o)
	}
	if o.Point == obs.PointSockState && o.Kind != obs.SockClosed && o.Proto == obs.TCP && !reply &&
		f.tcp.note(moment{at: o.Time.UnixNano(), flags: tcpSYN}) {
		// A TCP socket's tuple is reported as it enters SYN_SENT: as
		// it sends its SYN (the connection begins then; reuse.go). Its
		// close (SockClosed) only names the port.
		f.evidenceChanged()
	}
	e.applyPacket(f, o, reply)
	return true, false
}

// ownSocket makes the socket of o, a request's observation, f's socket: its
// process and netns are f's client's. Never for a reply's: that socket is the
// server's (a node-local cache answering every client from one socket), and
// taking it would make its answers to other clients look like f's backends.
func (e *Engine) ownSocket(f *flowState, s *sockState, o obs.Observation) {
	if s != nil {
		s.add(f)
	}
	f.claim(o.Cookie)
	f.noteProc(o.PID, o.Comm, o.Cgroup, o.Time)
	e.noteNodeSocket(f, o)
}

// socketPort learns a socket's port from a netfilter observation at OUTPUT
// that names its cookie, when no socket observer did: a rule at OUTPUT that
// dropped the socket's SYN kept it from the egress hook, and its flow would
// stay apart from the one netfilter saw.
func (e *Engine) socketPort(o obs.Observation) {
	if o.Cookie == 0 || o.Src.Port() == 0 || (o.Point != obs.PointNFBefore && o.Point != obs.PointNFAfter) {
		return
	}
	if s := e.socks.get(o.Cookie); s != nil && s.src.Port() == 0 {
		s.src, s.proto, s.srcAt = o.Src, o.Proto, o.Time
		e.rekey(s, o.Cookie)
	}
}

// noteNodeSocket marks f as a node process's when the socket observation o
// comes from the node's netns, and as unfollowed when o came before its
// Pod was found.
func (e *Engine) noteNodeSocket(f *flowState, o obs.Observation) {
	if !f.fromNode && e.cfg.HostNetNS != 0 && o.NetNS == e.cfg.HostNetNS {
		f.fromNode = true
		f.evidenceChanged()
	}
	if !f.unfollowed && o.Unfollowed {
		f.unfollowed = true
		f.evidenceChanged()
	}
}

// rekey moves the socket's flows that were recorded before the client port was
// known to their full client endpoint, merging each into a flow the packet
// observers may have started meanwhile. cookie is the socket's; a flow of
// another socket is not this one's (joinOrSupersede).
func (e *Engine) rekey(s *sockState, cookie uint64) {
	for i, f := range s.flows {
		if f.client.Port() != 0 {
			continue
		}
		e.unindex(f)
		f.client, f.cookie = s.src, 0
		f.evidenceChanged()
		if f.proto == 0 {
			f.proto = s.proto
		}
		// The socket's connect opens its connection: a flow of a reused
		// port whose connection is over is not this one.
		m := moment{at: f.began(moment{}), flags: tcpSYN}
		if f.proto != obs.TCP {
			m.flags = 0
		}
		g := withService(e.clients[f.key()], f.service, cookie, m)
		if g != nil && g.tcp.over(m) {
			g = nil
		}
		if g == nil {
			g, _ = e.joinOrSupersede(f.key(), f.service, cookie, m)
		}
		if g != nil {
			e.merge(g, f)
			s.flows[i] = g
			continue
		}
		// Made before its port was known, it may continue a retired flow
		// of its endpoint (a new socket on the port rides its conntrack
		// entry), as one its packets made would.
		e.continued(f, m)
		e.index(f)
		// Replies of its endpoint that came before its port was known
		// were taken for a connection seen by its replies alone: it has
		// a flow now, and its client's packets to a backend's address are
		// no longer that connection's (lookup).
		e.replyOnly.requested(f.key(), f.service, m.at)
	}
	s.flows = dedupe(s.flows)
}

// merge moves what is known of f into g, the same flow seen under another
// client endpoint (before its port was known, or beyond the node's SNAT).
// f must be unindexed already.
func (e *Engine) merge(g, f *flowState) {
	e.dropSNAT(f)
	if !g.snat.IsValid() && f.snat.IsValid() {
		e.setSNAT(g, f.snat, f.snatDst)
	}
	g.absorb(f)
	if l := e.lateCounts[f]; l != nil {
		e.lateOf(g).add(*l)
		delete(e.lateCounts, f)
	}
	if ups, ok := e.retiredUpstreams[f]; ok {
		for i := range ups {
			ups[i].after += f.first.Sub(g.first) // from g's first sighting, as proxyUpstreams counts
		}
		e.retiredUpstreams[g] = append(e.retiredUpstreams[g], ups...)
		delete(e.retiredUpstreams, f)
	}
	e.nflows--
	e.replays = append(e.replays, g.key()) // g may know new backends
}

func dedupe(flows []*flowState) []*flowState {
	out := make([]*flowState, 0, len(flows))
	for _, f := range flows {
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// Conntrack status bits (obs.Observation.CTStatus): the entry saw a reply,
// and it is confirmed (every event's is; 0 where the status is not known).
const (
	ipsSeenReply = 0x2
	ipsConfirmed = 0x8
)

// conntrack handles a conntrack event: Dst is the original destination, NATDst
// the reply source when NAT changed it. Conntrack sits just before the NAT hook
// on the way in (original tuple) and confirms after every hook (reply tuple),
// so it brackets netfilter NAT and IPVS by itself.
func (e *Engine) conntrack(o obs.Observation, last bool) (done, deferred bool) {
	if !o.Src.IsValid() || !o.Dst.IsValid() {
		e.unmatched++
		return true, false
	}
	if !hasPorts(o) {
		e.withoutPorts++ // an ICMP conntrack entry
		return true, false
	}
	if !last && !o.NATDst.IsValid() && !o.NATSrc.IsValid() && e.ownEntries(clientKey{o.Proto, o.Src}, o.Dst) {
		// Another flow's entry, no NAT at all: it waits for that flow.
		return false, true
	}
	m := momentOf(&o, false)
	m.entry = o.Proto == obs.TCP
	m.fresh = m.entry && o.CTStatus&ipsConfirmed != 0 && o.CTStatus&ipsSeenReply == 0
	m.cp, m.atCP = cpNFBefore, true // its original tuple
	f, _, r := e.link(o.Proto, o.Src, o.Dst, 0, m, false, last)
	if r != linked {
		return r == refused, r == deferredLink
	}
	final := o.Dst
	if o.NATDst.IsValid() {
		final = o.NATDst
	}
	switch {
	case o.Proto != obs.TCP || !o.NATDst.IsValid() || o.Dst != f.service || ctAgrees(f, final):
	case f.renatable(m):
		// Its SYN NATed to another backend was dropped before conntrack
		// confirmed it: this is its retransmission, NATed anew.
		f.renat = true
		f.evidenceChanged()
	default:
		// A TCP connection keeps the backend its DNAT chose for its
		// life: conntrack naming another one for this flow reports
		// another connection of its reused client port, whose packets
		// may not be seen yet (conntrack delivers ahead of the taps'
		// blocks).
		if f, r = e.ctFlow(f, final, last); r != linked {
			return r == refused, r == deferredLink
		}
	}
	if !f.ctFinal.IsValid() {
		f.ctFinal = final
		if !f.renat && e.udpRenatted(f) {
			// Its datagrams NATed to other backends before were
			// dropped before conntrack confirmed an entry.
			f.renat = true
			f.evidenceChanged()
		}
	}
	if at := o.Time.UnixNano(); at > f.ctLast {
		f.ctLast = at
		for _, g := range e.clients[f.key()] {
			if g != f && g.service == f.service {
				g.evidenceChanged() // ctMayBeOthers
			}
		}
	}
	e.touch(f, o.Time)
	if !f.ctSeen {
		f.ctSeen = true
		f.evidenceChanged()
	}
	f.count(pointKey{point: o.Point}, endpointOf(o.Src), endpointOf(o.Dst), endpointOf(o.NATDst), 1, 0)
	e.sight(f, cpNFBefore, o.Dst, o.Point, o.Time)
	if o.NATDst.IsValid() {
		if !f.ctNAT && o.Dst == f.service {
			f.ctNAT = true
			f.evidenceChanged()
		}
	}
	e.sight(f, cpConfirm, final, o.Point, o.Time)
	if o.NATSrc.IsValid() && o.NATSrc != f.client && (o.NATSrc != f.snat || final != f.snatDst) {
		// Masqueraded on its way out: the uplink sees it from this source
		// to final (conntrack's reply tuple, reversed).
		e.setSNAT(f, o.NATSrc, final)
		e.mergeBeyondSNAT(f)
	}
	return true, false
}

// ownEntries tells whether every flow of client endpoint k has its own
// conntrack entry, a DNAT of its VIP, and none sent to dst itself before
// any rewrite (sendsDirect: a client's own datagrams to a server get an
// entry without NAT): an entry of k to dst without any NAT (to a backend
// a tc program chose) is then another flow's, which may not be seen yet.
// (One with a SNAT may be a flow's own: a client's datagrams to the
// backend itself clash with its DNAT's entry and get a new source port.)
func (e *Engine) ownEntries(k clientKey, dst netip.AddrPort) bool {
	flows := e.clients[k]
	for _, f := range flows {
		if !f.ctNAT || f.sentItself(dst) {
			return false
		}
	}
	return len(flows) > 0
}

// sentItself tells whether a point before any rewrite of the node (the
// socket's egress, the Pod's eth0, its host veth) saw f's client send a
// request to dst.
func (f *flowState) sentItself(dst netip.AddrPort) bool {
	for _, p := range f.points {
		if !p.reply && (p.point == obs.PointSockEgress || p.point == obs.PointPod || p.point == obs.PointHost) && f.end(p.dst).addrPort() == dst {
			return true
		}
	}
	return false
}

// ctAgrees tells whether a TCP flow can be the connection conntrack reports
// DNATed to backend: conntrack reported no other backend for it, nor did
// its packets show another.
func ctAgrees(f *flowState, backend netip.AddrPort) bool {
	if f.ctFinal.IsValid() {
		return f.ctFinal == backend
	}
	return len(f.backends) == 0 || f.hasBackend(backend)
}

// ctFlow is the flow of a conntrack event DNATed to backend that f, the
// flow of its client endpoint and VIP it was linked to, cannot be: the
// latest other flow of theirs reported or seen with backend. Failing
// that the event waits for its connection's packets to make its flow
// (deferredLink); with none in the reordering window, it makes it itself
// (last: lastChance).
func (e *Engine) ctFlow(f *flowState, backend netip.AddrPort, last bool) (*flowState, linkResult) {
	var found *flowState
	for _, g := range e.clients[f.key()] {
		if g != f && g.service == f.service && (g.ctFinal == backend || !g.ctFinal.IsValid() && g.hasBackend(backend)) &&
			(found == nil || g.began(moment{}) > found.began(moment{})) {
			found = g
		}
	}
	switch {
	case found != nil:
		return found, linked
	case last:
		return e.newFlow(f.proto, f.client, f.service, 0, moment{})
	}
	return nil, deferredLink
}

// mergeBeyondSNAT merges into f the flows its packets beyond the node's SNAT
// made before conntrack named the SNAT: a flow that left the node
// unrewritten but masqueraded goes from f.snat to its VIP, which named a
// flow of its own. Only a flow seen nowhere but the uplink is merged: a
// client of its own (a node socket) is seen before the SNAT too.
func (e *Engine) mergeBeyondSNAT(f *flowState) {
	k := clientKey{f.proto, f.snat}
	var found []*flowState
	for _, g := range e.clients[k] {
		if g != f && g.service == f.snatDst && g.onlyBeyondSNAT() {
			found = append(found, g)
		}
	}
	for _, g := range found {
		e.unindex(g)
		e.merge(f, g)
	}
}
