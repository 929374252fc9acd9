package flow

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// Ref tells which flow a packet belongs to and the flow's verdict at the time
// it was asked: what a capture file annotates each packet with.
type Ref struct {
	ID    int
	Reply bool // the packet travels backend/VIP -> client
	// Translated: the packet's service side is a backend, not the VIP: a
	// request after the rewrite, a reply before it is translated back.
	Translated bool
	// Untranslated: a reply that entered the client's Pod from a backend's
	// address while the client addressed the VIP, or the client's packet
	// to that backend there (its kernel's reset of such a reply): nothing
	// translated them (untranslatedReplies).
	Untranslated bool
	// Direct: the client's own datagram to a backend there, or the
	// backend's answer to it, where the client also sends to the VIP
	// from its port (flowState.sendsDirect): not an untranslated packet.
	Direct  bool
	Verdict Place // PlaceUnknown while the observations do not tell yet
	By      string
}

// Classify finds the flow of a packet observation (Proto, Src, Dst) and its
// current verdict without changing what the engine knows: it creates no flow
// and learns no backend, so a packet is found once Add has seen it or a packet
// like it. The verdict is cached per flow until its evidence changes, which
// makes Classify a map lookup in the steady state.
func (e *Engine) Classify(o obs.Observation) (Ref, bool) {
	f, reply := e.find(o)
	if f == nil {
		return Ref{}, false
	}
	r := e.ref(f, reply, translated(f, o, reply))
	r.Untranslated = untranslatedAt(f, o, reply)
	r.Untranslated, r.Direct = r.Untranslated && !f.sendsDirect(), r.Untranslated && f.sendsDirect()
	return r, true
}

// NoteICMPError records an ICMP error message about a packet of a flow: o
// is the packet the message quotes (protocol, addresses, ports; Time and
// Point those of the message), message names it, from is its sender. A
// request refused on its way (a router's net unreachable, a backend's port
// unreachable) got an answer, if not a reply: the earliest such message is
// reported with the flow (Flow.ICMPError). It is not a packet of the flow
// and is not counted in it. False when no flow claims the quoted packet
// yet: the message waits for its flow as observations do (a tap's block
// with the error can come before the packets that make the flow).
func (e *Engine) NoteICMPError(o obs.Observation, message string, from netip.Addr) bool {
	note := &icmpNote{message: message, from: from}
	if e.noteICMP(o, note) {
		return true
	}
	if o.Src.IsValid() && o.Dst.IsValid() {
		// Refused, it is not counted: an ICMP error is not an
		// observation of the flow (nor is one evicted, waiting.expire).
		e.waiting.addICMP(o, note, e.related(o))
		e.expire()
	}
	return false
}

// noteICMP records an ICMP error on the flow of the packet it quotes, if
// any claims it.
//
// A message quoting a reply is not an answer to the request: it refused the
// reply on its way back (the client's kernel answers a reply that came back
// untranslated, from a backend's address no socket is connected to, with a
// port unreachable); it is kept apart (replyICMP), said with the
// untranslated replies.
func (e *Engine) noteICMP(o obs.Observation, note *icmpNote) bool {
	f, reply := e.find(o)
	if f == nil {
		return false
	}
	at := &f.icmp
	if reply {
		at = &f.replyICMP
	}
	if *at == nil || o.Time.Before((*at).At) {
		var quote netip.AddrPort
		if *at != nil {
			quote = (*at).QuotedDst
		}
		*at = &ICMPError{Message: note.message, From: note.from, Point: o.Point.String(), At: o.Time, QuotedDst: quote}
		if reply {
			f.evidenceChanged()
		}
	}
	if !reply && quotesBackendAtClient(f, o) {
		f.icmp = f.icmp.withQuote(o.Dst)
	}
	return true
}

// withQuote is e with QuotedDst q unless it has one or q is none: a copy,
// since the flows reported before share e.
func (e *ICMPError) withQuote(q netip.AddrPort) *ICMPError {
	if e.QuotedDst.IsValid() || !q.IsValid() {
		return e
	}
	c := *e
	c.QuotedDst = q
	return &c
}

// quotesBackendAtClient tells whether o, the request an ICMP error quotes
// (Point and Dir those of the message), is quoted with another destination
// than the VIP where the message reached the client, which addressed the
// VIP there: its Pod's eth0 coming in, or its host veth going out (the TX
// tap runs after tc egress, where a tc program reverses the NAT).
func quotesBackendAtClient(f *flowState, o obs.Observation) bool {
	switch {
	case o.Point == obs.PointPod && o.Dir == obs.DirIn && f.cps[cpPod].vip:
	case o.Point == obs.PointHost && o.Dir == obs.DirOut && f.cps[cpHost].vip:
	default:
		return false
	}
	return o.Dst != f.service
}

// find is the flow o belongs to, as its packet would be linked (lookup),
// without learning anything; reply says o travels in the reply direction.
func (e *Engine) find(o obs.Observation) (f *flowState, reply bool) {
	if !o.Src.IsValid() || !o.Dst.IsValid() {
		return nil, false
	}
	f, reply, _ = e.lookup(o.Proto, o.Src, o.Dst, 0, e.momentAt(&o), true, false, nil)
	return f, reply
}

// translated tells whether a packet's service side is a backend, not the VIP.
func translated(f *flowState, o obs.Observation, reply bool) bool {
	if reply {
		return o.Src != f.service
	}
	return o.Dst != f.service
}

// untranslatedAt tells whether o is a packet of f at the client's Pod's
// eth0 or host veth that nothing translated although the client addressed the VIP
// there: a reply from a backend's address coming in, or the client's
// packet to it going out (Ref.Untranslated).
func untranslatedAt(f *flowState, o obs.Observation, reply bool) bool {
	towards, ok := f.clientSide(o.Point)
	if !ok {
		return false
	}
	if reply {
		return o.Dir == towards && o.Src != f.service
	}
	return o.Dir != towards && o.Dir != obs.DirUnknown && o.Dst != f.service
}

// untranslatedSlot is untranslatedAt for the packets counted at slot (a
// Handle's).
func (f *flowState) untranslatedSlot(slot int) bool {
	if slot < 0 || slot >= len(f.points) {
		return false
	}
	k := f.points[slot].pointKey
	towards, ok := f.clientSide(k.point)
	if !ok {
		return false
	}
	if k.reply {
		return k.dir == towards && f.end(k.src).addrPort() != f.service
	}
	return k.dir != towards && k.dir != obs.DirUnknown && f.end(k.dst).addrPort() != f.service
}

// clientSide is the direction towards the client at point p, if p is the
// client's Pod's eth0 or host veth and the client addressed the VIP there;
// its host veth tells the same as its eth0 (a reply leaving the node
// towards the client, the client's packet coming in: its TX tap runs after
// tc egress, its RX tap before tc ingress).
func (f *flowState) clientSide(p obs.Point) (towards obs.Dir, ok bool) {
	switch {
	case p == obs.PointPod && f.cps[cpPod].vip:
		return obs.DirIn, true
	case p == obs.PointHost && f.cps[cpHost].vip:
		return obs.DirOut, true
	}
	return obs.DirUnknown, false
}

func (e *Engine) ref(f *flowState, reply, translated bool) Ref {
	v := e.cachedVerdict(f)
	return Ref{ID: e.idOf(f), Reply: reply, Translated: translated, Verdict: v.place, By: v.by}
}

// placeBy is what packet comments read of a verdict: its place and by
// (flowState.cached; by as CommentBy shortens it).
type placeBy struct {
	place Place
	by    string
}

// cachedVerdict is decide without its reason, recomputed only when the flow's evidence or the
// engine's generation changed since the last call.
func (e *Engine) cachedVerdict(f *flowState) placeBy {
	if f.retired {
		return f.cached // final
	}
	if !f.cachedOK || f.cachedGen != e.gen {
		// Packet comments read place and by only; the report makes the
		// reason afresh: thousands of flows need not keep it.
		v := e.decide(f, false)
		f.cached, f.cachedOK, f.cachedGen = placeBy{place: v.place, by: e.byName(v.by)}, true, e.gen
	}
	return f.cached
}

// maxByNames bounds the distinct "by" strings byName shares; beyond, it
// starts over (the strings made since are shared again).
const maxByNames = 1024

// byName is by as packet comments carry it (CommentBy), the one copy of it
// the engine keeps: the flows of one rule or program name it with the same
// words, made afresh for each (2 MiB for 4096 flows of one kube-proxy
// rule).
func (e *Engine) byName(by string) string {
	if s, ok := e.byNames[by]; ok {
		return s
	}
	if e.byNames == nil || len(e.byNames) >= maxByNames {
		e.byNames = make(map[string]string)
	}
	s := CommentBy(by)
	e.byNames[by] = s
	return s
}

// commentLen is room for a comment's fixed words (the longest, the
// untranslated reply's, and the verdict's labels) and a flow id.
const commentLen = 128

// Comment renders the reference as a packet comment, e.g.
// "flow 3 request to backend (after translation); rewritten_at=socket by=...".
// The verdict is left out while it is unknown. The capture point is not in
// it: each packet block names its interface, and a comment is written for
// every packet.
func (r Ref) Comment() string {
	// Sized once, the id formatted in place: every new flow makes a few
	// comments, and a builder grown step by step took 8 of the 16
	// allocations of a short connection (BenchmarkNewFlow).
	var b strings.Builder
	b.Grow(commentLen + len(r.Verdict) + len(r.By))
	var id [20]byte
	b.WriteString("flow ")
	b.Write(strconv.AppendInt(id[:0], int64(r.ID), 10))
	switch {
	case r.Direct && r.Reply:
		b.WriteString(" reply from backend to the client's own request to it, not to the VIP")
	case r.Direct:
		b.WriteString(" request to backend from the client itself, not to the VIP")
	case r.Untranslated && r.Reply:
		b.WriteString(" reply from backend, not translated back to the VIP (the client does not take it)")
	case r.Untranslated:
		b.WriteString(" to backend from the client, answering a reply that came untranslated")
	case !r.Translated && r.Verdict == PlaceNowhere:
		// No one rewrote the flow: there is no translation to be before.
		if r.Reply {
			b.WriteString(" reply from VIP (not translated)")
		} else {
			b.WriteString(" request to VIP (not translated)")
		}
	case !r.Reply && !r.Translated:
		b.WriteString(" request to VIP (before translation)")
	case !r.Reply:
		b.WriteString(" request to backend (after translation)")
	case r.Translated:
		b.WriteString(" reply from backend (before reverse translation)")
	default:
		b.WriteString(" reply from VIP (after reverse translation)")
	}
	if r.Verdict != "" && r.Verdict != PlaceUnknown {
		b.WriteString("; rewritten_at=")
		b.WriteString(string(r.Verdict))
		if r.By != "" {
			b.WriteString(" by=")
			b.WriteString(r.By)
		}
	}
	return b.String()
}
