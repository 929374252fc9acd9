package flow

import (
	"net/netip"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// DropRepliesForgotten counts the connections seen by their replies alone
// that the bounded table of them forgot (replyOnly): still counted in
// Summary.RepliesWithoutRequest, but a later reply of one counts it again.
const DropRepliesForgotten = "replies_without_request_forgotten"

// CommentReplyWithoutRequest is the pcapng comment of a reply no flow took
// because none of its connection's requests was seen (replyOnly).
const CommentReplyWithoutRequest = "reply of a connection none of whose requests was seen so far (began before the run?)"

// replyConn is a connection (a client endpoint and a Service) of which
// replies were seen and none of its requests.
type replyConn struct {
	service netip.AddrPort
	first   int64 // its first reply seen (unix ns)
	// opened: that first reply opens the connection (a SYN-ACK): it
	// began in the run, its SYN just before.
	opened bool
	// atPod: a reply of it from the Service was seen at the client's Pod
	// (its eth0, its host veth): the node translated its replies back, so
	// its requests left the Pod to the Service (ownRequest).
	atPod bool
	// own: the latest address its client endpoint's requests were seen
	// going to where nothing on the node rewrote them yet (ownRequest).
	own netip.AddrPort
	// waited counts its replies kept waiting for its request within the
	// reordering window, at most replyWaitCap.
	waited int
}

// replyWaitCap is how many replies of a connection none of whose requests
// was seen wait for one within the reordering window; the next ones are
// counted with it at once. A SYN-ACK delivered before its SYN has a few
// replies at most behind it; a stream of replies alone (a server pushing
// datagrams to a client of before the run) must not fill the waiting room,
// whose overflow would count as a loss and evict the traced flows'
// observations.
const replyWaitCap = 64

// replyOnly remembers, in bounded memory, the connections of which only
// replies were seen: a reply from a Service to a client endpoint that has
// no flow to it is no flow of its own (it would have no request to decide
// on). It waits, as any observation, for the reordering window (a SYN-ACK
// whose SYN is in another ring's later block), then its connection counts
// as seen by its replies alone (began before the run, or its requests went
// where no point captures), and its later replies, and those of the same
// client endpoint from a backend's address, are counted with it, no
// longer kept waiting. A request of it that comes later makes its flow as
// usual (requestedLater counts those that had been counted so). Two
// generations of at most limit connections each, as recentSet; a
// connection forgotten while still reply-only stays counted (forgotten).
type replyOnly struct {
	cur, old map[clientKey]*replyConn
	limit    int
	// forgotten counts the connections dropped while reply-only (the
	// table full), replaced those whose client endpoint's replies came
	// from another Service since; requestedLater those whose request came
	// once they counted.
	forgotten, replaced, requestedLater uint64
	// gen counts the connections whose request came: a handle of a reply
	// counted with its connection (Handle.ro) made before is stale, its
	// connection may have a flow now (Repeat). A handle holds no pointer
	// to its connection: a frame, which holds its handle, fits two cache
	// lines.
	gen int
}

func newReplyOnly(limit int) replyOnly {
	return replyOnly{cur: map[clientKey]*replyConn{}, old: map[clientKey]*replyConn{}, limit: limit}
}

func (r *replyOnly) get(k clientKey) *replyConn {
	if c := r.cur[k]; c != nil {
		return c
	}
	return r.old[k]
}

// counts tells whether c counts as seen by its replies alone at now: its
// first reply is older than the reordering window (its request, had it
// been seen, would have come by then), or the run is over (stopped).
func (c *replyConn) counts(now int64, stopped bool) bool {
	return stopped || now-c.first > int64(reorderWindow)
}

// reply notes a reply of client k from service at m, whose connection
// has no flow; it tells whether the reply waits for its request (the
// connection does not count yet, and it is among its first replyWaitCap);
// else it is counted with the connection at once; and whether the
// connection is new.
func (r *replyOnly) reply(k clientKey, service netip.AddrPort, m moment) (wait, isNew bool) {
	at := m.at
	c := r.get(k)
	if c == nil || c.service != service {
		if c != nil && c.counts(at, false) {
			r.replaced++ // another Service's reply on its endpoint: it was one
		}
		c, isNew = &replyConn{service: service, first: at, opened: m.opens()}, true
	}
	if at < c.first {
		c.first, c.opened = at, m.opens()
	}
	c.atPod = c.atPod || m.point == obs.PointPod || m.point == obs.PointHost
	r.put(k, c)
	if c.counts(at, false) || c.waited >= replyWaitCap {
		return false, isNew
	}
	c.waited++
	return true, isNew
}

// put remembers c as the latest connection of k; when the newer generation
// is full, the older one is dropped and its connections counted as
// forgotten.
func (r *replyOnly) put(k clientKey, c *replyConn) {
	if r.cur[k] == c {
		return
	}
	delete(r.old, k)
	if len(r.cur) >= r.limit {
		r.forgotten += uint64(len(r.old))
		r.old, r.cur = r.cur, make(map[clientKey]*replyConn, r.limit)
	}
	r.cur[k] = c
}

// requested notes a request of client k to service at at: its connection,
// if only its replies had been seen, is a flow from now on.
func (r *replyOnly) requested(k clientKey, service netip.AddrPort, at int64) {
	c := r.get(k)
	if c == nil || c.service != service {
		return
	}
	r.gen++
	delete(r.cur, k)
	delete(r.old, k)
	if c.counts(at, false) {
		r.requestedLater++
	}
}

// open counts the connections remembered that count at now (counts).
func (r *replyOnly) open(now int64, stopped bool) int {
	n := 0
	for _, m := range [...]map[clientKey]*replyConn{r.cur, r.old} {
		for _, c := range m {
			if c.counts(now, stopped) {
				n++
			}
		}
	}
	return n
}

// replyWithoutRequest takes a reply from service to client at m whose
// connection has no flow (flowFor): no flow is made of it. Within the
// reordering window it waits for its request (unlinked), as the first
// replyWaitCap do; later, or beyond them, it is counted with its
// connection (replyOnlyLinked), waiting no longer.
func (e *Engine) replyWithoutRequest(proto obs.Proto, client, service netip.AddrPort, m moment) linkResult {
	k := clientKey{proto, client}
	wait, isNew := e.replyOnly.reply(k, service, m)
	if isNew {
		// Its requests to a backend that came first wait: they are its
		// flow's now (lookup).
		e.replays = append(e.replays, k)
	}
	if wait {
		return unlinked
	}
	return replyOnlyLinked
}

// replyToReplyOnly tells whether a packet from src to a client endpoint
// dst at at is a reply of a connection that counts as seen by its replies
// alone, or whose replies waiting for a request are replyWaitCap already:
// src is a watched address (the Service's replies come from a backend's
// before the node translates them back).
func (e *Engine) replyToReplyOnly(proto obs.Proto, src, dst netip.AddrPort, at int64) bool {
	c := e.replyOnly.get(clientKey{proto, dst})
	return c != nil && (c.counts(at, false) || c.waited >= replyWaitCap) && e.watchedAddr(src.Addr())
}

// ownRequest tells whether a request at m of c's client endpoint to dst,
// another address than c's Service, can be c's. Not when c's replies came
// from the Service at the client's Pod (atPod): c's requests left the Pod
// to the Service, so one seen going to dst where nothing on the node
// rewrote it yet (its Pod's eth0, its host veth, tc head) is another
// connection of the port, the client's own to dst (the kernel picks a
// client's port per destination); so are its requests to dst seen past
// the Pod (own), which would else make c's flow of that connection.
func (c *replyConn) ownRequest(dst netip.AddrPort, m moment) bool {
	direct := m.atCP && (m.cp == cpPod || m.cp == cpHost || m.cp == cpTCHead)
	if direct {
		c.own = dst
	}
	return !c.atPod || !direct && dst != c.own
}

// openedBeforeXDP tells whether a request at m of c's client endpoint to
// an address not watched can be c's own, rewritten by an uplink's XDP
// program (Attribution.UplinkXDPPrograms): it opens a connection (a TCP
// SYN; any UDP datagram) within the reordering window before c's first
// reply, and an uplink had an XDP program then. Of TCP, only where that
// first reply is the SYN-ACK: a connection of before the run (its first
// reply seen mid-stream) had its SYN then, and a SYN of its client port
// now is another connection's.
func (e *Engine) openedBeforeXDP(proto obs.Proto, c *replyConn, m moment) bool {
	if proto == obs.TCP && (!m.opens() || !c.opened) || m.at > c.first || c.first-m.at > int64(reorderWindow) {
		return false
	}
	return len(e.uplinkXDPCands(time.Unix(0, m.at))) > 0
}

// ReplyWithoutRequest tells whether o, a packet no flow claims (Classify
// found none), is a reply of a connection of which only replies were seen
// so far (counted or still within the reordering window): from the
// Service, or from a watched address to its client endpoint. Its comment
// is CommentReplyWithoutRequest.
func (e *Engine) ReplyWithoutRequest(o obs.Observation) bool {
	if !o.Src.IsValid() || !o.Dst.IsValid() {
		return false
	}
	c := e.replyOnly.get(clientKey{o.Proto, o.Dst})
	return c != nil && (o.Src == c.service || e.watchedAddr(o.Src.Addr()))
}

// repliesWithoutRequest is Summary's count of the connections seen by
// their replies alone: those remembered that count, and those no longer
// remembered.
func (e *Engine) repliesWithoutRequest() int {
	r := &e.replyOnly
	return r.open(e.newest.UnixNano(), !e.stopped.IsZero()) + int(r.forgotten+r.replaced)
}

// ReplyOnly tells whether h is a reply counted with a connection of which
// only replies were seen so far (its comment is CommentReplyWithoutRequest).
func (h Handle) ReplyOnly() bool { return h.ro }
