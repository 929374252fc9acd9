package flow

import (
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// Per-flow bounds: a flow has one client endpoint, so these are only reached by
// pathological traffic (e.g. unconnected UDP spraying backends).
const (
	maxBackendsPerFlow = 8
	maxPointsPerFlow   = 48
	// initialPoints is room for a flow seen at every point both ways:
	// a TCP flow in kube-proxy's netfilter mode has 14 entries (socket
	// layer 3, Pod and host taps 2 each, netfilter observers 4, conntrack,
	// uplink 2), a UDP one 13; 16 entries fill a size class of the Go
	// allocator (384 bytes) exactly.
	initialPoints = 16
	// initialEnds is room for a flow's usual endpoints (its client with
	// and without its port, the VIP, a backend, an SNAT address and the
	// destination beyond it): 6 fill a size class (128 bytes).
	initialEnds = 6
)

// sighting is what one checkpoint saw of a flow's request destination: the VIP,
// a backend, or both, with the earliest observation of each.
type sighting struct {
	vipAt, backendAt     int64 // unix nanoseconds
	backendAddr          endpoint
	vip, backend         bool
	vipFrom, backendFrom obs.Point
}

// see records a sighting and reports whether it changed anything.
func (s *sighting) see(isVIP bool, dst endpoint, from obs.Point, at int64) bool {
	if isVIP {
		if s.vip && at >= s.vipAt {
			return false
		}
		s.vip, s.vipFrom, s.vipAt = true, from, at
		return true
	}
	if s.backend && at >= s.backendAt {
		return false
	}
	s.backend, s.backendFrom, s.backendAt, s.backendAddr = true, from, at, dst
	return true
}

func (s *sighting) merge(o sighting) {
	if o.vip {
		s.see(true, endpoint{}, o.vipFrom, o.vipAt)
	}
	if o.backend {
		s.see(false, o.backendAddr, o.backendFrom, o.backendAt)
	}
}

func (s sighting) any() bool { return s.vip || s.backend }

// pointKey identifies one aggregated PointSeen entry. It holds no pointer
// (nor do pointStats): the per-point counters of thousands of flows are
// never scanned by the garbage collector. Its addresses are the flow's
// endpoints by number (flowState.ends): a flow has few distinct ones (its
// client, the VIP, a backend, an SNAT address), so an entry takes 24
// bytes, not the 88 of three endpoints inline. A new flow's memory is most
// of its cost: the page faults of a growing heap, the collector's work.
type pointKey struct {
	point obs.Point
	dir   obs.Dir
	reply bool
	src   endRef
	dst   endRef
	// far is what the point saw beyond the packet's addresses: the socket
	// layer's requested destination (PointSockAddr: ReqDst), conntrack's
	// reply source (PointConntrack: NATDst).
	far endRef
	// iface is the capture point's label (obs.Observation.Ifname; a
	// node's Pods each have a "pod" and a "host" point), as its index in
	// the engine's labels.
	iface uint16
}

// endRef is one of a flow's endpoints: 1 + its index in flowState.ends, 0
// for none (the invalid endpoint). A flow holds at most maxPointsPerFlow
// entries of three endpoints each, and only endpoints of its entries, so
// a byte is enough.
type endRef uint8

type pointStats struct {
	pointKey
	packets, bytes uint64
}

type backendSeen struct {
	addr netip.AddrPort
	at   time.Time
}

// uplinkFrame is the earliest frame of the flow seen on the uplink.
type uplinkFrame struct {
	seen   bool
	at     time.Time
	vlan   uint16
	tpid   uint16 // the tag's TPID, 0 untagged
	dstMAC obs.MAC
	// ifindex is the device the tap saw it on (in the node's netns, where
	// the uplinks are), 0 when unknown: a drop there came after the tap
	// (dropsAfterUplinkTap). It fits the struct's padding.
	ifindex int32
}

func (u *uplinkFrame) note(o obs.Observation) {
	if u.seen && !o.Time.Before(u.at) {
		if u.ifindex == 0 {
			u.ifindex = int32(o.Ifindex)
		}
		return
	}
	u.seen, u.at, u.vlan, u.tpid = true, o.Time, o.VLAN, o.TPID
	u.dstMAC = o.DstMAC
	if o.Ifindex != 0 {
		u.ifindex = int32(o.Ifindex)
	}
}

// uplinkTag is the tag of a direction's frames on the uplink, without the
// rest of an uplinkFrame: a flow's memory is bounded, and it fits the
// padding after flowState.proto. The first frame noted gives it (a flow's
// frames in one direction of the uplink carry one tag).
type uplinkTag struct {
	vlan, tpid uint16
	seen       bool
}

func (u *uplinkTag) note(o obs.Observation) {
	if !u.seen {
		u.vlan, u.tpid, u.seen = o.VLAN, o.TPID, true
	}
}

// flowState is the engine's record of one flow.
type flowState struct {
	// id is the number the user sees, given when it is first shown (a
	// packet's comment, the report; Engine.idOf): a flow absorbed before
	// that, such as a socket's event that came before its first packet, then
	// leaves no gap in the numbers. seq is the order in which flows were made.
	id  int
	seq int
	// fromNode: a socket of the node's own netns made it (Config.HostNetNS).
	fromNode bool
	proto    obs.Proto
	// uplinkIn: an outside client's request coming in on the uplink (a
	// NodePort's, an external IP's): the VLAN it came on, the last fallback,
	// for a flow whose request never left again and got no reply there (the
	// node rejected it, or it is still unanswered).
	uplinkIn uplinkTag
	client   netip.AddrPort
	service  netip.AddrPort
	// cookie tells apart flows of different sockets while their client port is
	// not known yet (TCP connect before bind); 0 once the port is known.
	cookie uint64
	// sock is the cookie of the socket whose flow it is, 0 while no socket
	// observer named one: a later socket on the same client port (a
	// resolver's socket per query) makes a flow of its own.
	sock uint64

	backends []backendSeen
	cps      [numCheckpoints]sighting
	ctSeen   bool // conntrack reported this flow
	ctNAT    bool // ... with the VIP as original destination and a backend replying
	// renat: a SYN of the connection (a UDP socket's datagram) was NATed
	// to a backend and dropped on the node before conntrack confirmed its
	// entry (no entry binds that backend), and a retransmitted SYN (a
	// later datagram) was NATed anew, to ctFinal: the backend it reached
	// (renatSYN, Engine.conntrack, udpRenatted).
	renat       bool
	ctFinal     netip.AddrPort // the destination conntrack first reported for it after NAT (its reply source)
	ctLast      int64          // its latest conntrack event (unix ns)
	snat        netip.AddrPort // the source conntrack says the node's SNAT gave it
	snatDst     netip.AddrPort // ... and the destination it has beyond the SNAT (conntrack's reply source)
	tcp         tcpLife        // what its packets' TCP flags told of its connection
	points      []pointStats
	ends        []endpoint // the endpoints its points name (endRef)
	first, last time.Time
	icmp        *ICMPError // the first ICMP error about its requests (and its QuotedDst: noteICMP)
	// replyICMP is the first ICMP error about one of its replies (noteICMP).
	replyICMP *ICMPError
	stray     *StrayReplies
	// drops are its packets the kernel dropped (noteDrop): a pointer,
	// as most flows have none (a flow's bytes count: maxFlowBytes).
	drops *[]KernelDrop
	// untranslated is the earliest reply that entered the client's Pod
	// from another source than the Service (untranslatedReplies).
	untranslated *StrayReplies
	// resetOnly has the bit 1<<cp set when checkpoint cp saw a backend
	// only in the client's bare TCP resets (clientReset), which answer a
	// reply that reached the client untranslated, not a request the
	// client addressed so (sawBackend).
	resetOnly uint16
	kind      obs.SockKind
	// sentElsewhere: its socket's datagrams to a destination its sendmsg4
	// observer had seen left for another backend than the first (a
	// PointSockEgress observation of kind SockSendmsg).
	sentElsewhere bool

	pid    uint32
	comm   string
	cgroup uint64
	procAt time.Time

	// hostIfindex is the node-side interface (the Pod's host veth) the
	// request entered by, 0 while unknown: the tc programs that can have
	// rewritten it are that interface's.
	hostIfindex int
	// natHook is the NAT hook the netfilter observers saw its request at
	// ("prerouting", "output"), "" while they did not.
	natHook string

	uplink      uplinkFrame // request direction
	uplinkReply uplinkFrame // reply direction: VLAN fallback when no request was seen there
	// wireVIP: the uplink's RX tap saw a request to the VIP come in (an
	// outside client's, a NodePort's), before the uplink's tc ingress.
	wireVIP bool
	// wireAnswered: the uplink's TX tap saw a reply leave from the VIP.
	wireAnswered bool
	// reply: some point saw a reply of it. (Among the other flags: the
	// flow fills a size class of the allocator, 1408 bytes, exactly.)
	reply bool
	// unfollowed: its socket's events came before its Pod was found
	// (obs.Observation.Unfollowed): no later point followed it until then.
	unfollowed bool

	// cached is the verdict as of engine generation cachedGen, valid while
	// cachedOK: every change to the evidence decide reads clears cachedOK.
	cached    placeBy
	cachedOK  bool
	cachedGen uint64
	// evidence counts evidenceChanged calls: a packet comment made for this
	// flow stays valid while it and the engine's gen are unchanged.
	evidence uint64
	// comments are the pcapng comments of its packets by kind (CommentOf),
	// valid while evidence and the engine's gen are as recorded; commented:
	// it is among the flows that keep them (keepComments).
	comments                      [6]string
	commentsEvidence, commentsGen uint64
	commented                     bool
	// merged: absorbed into another flow; handles to it are stale. (The
	// flags sit together: the flow fills its size class.)
	merged bool
	// deferred: a backend guess for it waits for its next activity
	// (plausibleGuess).
	deferred bool
	// retired: reported as over and forgotten by the engine (Retire);
	// cached holds its final verdict. Nothing changes it any more.
	retired bool
	// continues is the id of the retired flow of its client endpoint and
	// Service it continues (a connection idle for the flow timeout that
	// spoke again), 0 for none; continuesLast, that flow's last sighting.
	continues     int
	continuesLast int64
	// connBegan is when the connection of the retired flow it continues
	// began (unix ns; 0: it continues none).
	connBegan int64
}

// evidenceChanged drops the cached verdict.
func (f *flowState) evidenceChanged() { f.cachedOK = false; f.evidence++ }

func (f *flowState) key() clientKey { return clientKey{f.proto, f.client} }

// claim makes f the flow of socket cookie (0: none) if no socket claimed it.
func (f *flowState) claim(cookie uint64) {
	if f.sock == 0 {
		f.sock = cookie
	}
}

func (f *flowState) touch(t time.Time) {
	if f.first.IsZero() || t.Before(f.first) {
		f.first = t
		f.cachedOK = false // whether it began before Ready (conntrackBlind)
	}
	if t.After(f.last) {
		f.last = t
	}
}

// isRemote tells whether ap is this flow's VIP or one of its backends.
func (f *flowState) isRemote(ap netip.AddrPort) bool {
	return ap == f.service || f.hasBackend(ap)
}

func (f *flowState) hasBackend(ap netip.AddrPort) bool {
	for _, b := range f.backends {
		if b.addr == ap {
			return true
		}
	}
	return false
}

// addBackend records a backend and reports whether it was new.
func (f *flowState) addBackend(ap netip.AddrPort, at time.Time) bool {
	for i, b := range f.backends {
		if b.addr == ap {
			if at.Before(b.at) {
				f.backends[i].at = at
				f.evidenceChanged() // the earliest backend may be another one now
			}
			return false
		}
	}
	if len(f.backends) >= maxBackendsPerFlow {
		return false
	}
	f.backends = append(f.backends, backendSeen{ap, at})
	f.evidenceChanged()
	return true
}

// sortedBackends returns the backends, earliest seen first.
func (f *flowState) sortedBackends() []netip.AddrPort {
	bs := append([]backendSeen(nil), f.backends...)
	sort.SliceStable(bs, func(i, j int) bool { return bs[i].at.Before(bs[j].at) })
	out := make([]netip.AddrPort, len(bs))
	for i, b := range bs {
		out[i] = b.addr
	}
	if f.renatted() && len(out) > 1 {
		// The backend its connection reached comes first: the ones
		// before were its dropped SYNs' (renat): conntrack's, else the
		// latest seen.
		reached := out[len(out)-1]
		if f.ctFinal.IsValid() && slices.Contains(out, f.ctFinal) {
			reached = f.ctFinal
		}
		out = append([]netip.AddrPort{reached}, slices.DeleteFunc(out, func(b netip.AddrPort) bool { return b == reached })...)
	}
	// A backend the client sent to itself alone is not where the VIP
	// went; beside another, it comes last, though seen first (a resolver
	// that asks a server itself before the VIP): the verdict's backend,
	// its rule and its reason name the VIP's.
	if d := f.directBackend(); len(out) > 1 && f.sendsDirect() && slices.Contains(out, d) {
		out = append(slices.DeleteFunc(out, func(b netip.AddrPort) bool { return b == d }), d)
	}
	return out
}

// renatted is renat, unless f is a UDP flow whose client also sent to
// another backend than conntrack's itself (sendsDirect), or one of whose
// datagrams to another backend left the node (leftFor), which evidence
// delivered after renat was set can show: the datagrams the node dropped
// may be those, not the VIP's; and an entry that bound another backend
// (made before the run, or whose event was lost) then expired or was
// deleted lets a flow change backend for real.
func (f *flowState) renatted() bool {
	if !f.renat || f.proto != obs.UDP {
		return f.renat
	}
	if f.sendsDirect() && f.directBackend() != f.ctFinal {
		return false
	}
	for _, b := range f.backends {
		if b.addr != f.ctFinal && f.leftFor(b.addr) {
			return false
		}
	}
	return true
}

// leftFor tells whether a request of f to b left the node: its uplink's
// TX tap or a host veth's TX (towards a Pod of the node) saw it, and both
// run after conntrack confirmed its entry, which bound b.
func (f *flowState) leftFor(b netip.AddrPort) bool {
	ep := endpointOf(b)
	for _, p := range f.points {
		if !p.reply && p.dir == obs.DirOut && (p.point == obs.PointUplink || p.point == obs.PointHost) && f.end(p.dst) == ep {
			return true
		}
	}
	return false
}

// renatable tells whether a conntrack entry at m that DNATs f's VIP to
// another backend than f's packets were seen going to can be f's own: a
// SYN whose entry conntrack never confirmed (it reports entries as they are
// confirmed; a SYN the node dropped before, as a bridge refusing a hairpin,
// a filter rule or a masquerade with no address to give do, leaves none)
// binds no backend, and the client's retransmission, within its SYN retry
// window, is NATed anew. So when no entry was reported for f and none of
// the backends it was seen going to answered it.
func (f *flowState) renatable(m moment) bool {
	l := &f.tcp
	if f.proto != obs.TCP || f.ctFinal.IsValid() || l.syn == 0 || l.superseded(m) || m.at-l.syn > int64(synRetryWindow) {
		return false
	}
	for _, b := range f.backends {
		if f.repliedFrom(b.addr) {
			return false
		}
	}
	return true
}

// repliedFrom tells whether a point saw a reply of f come from b.
func (f *flowState) repliedFrom(b netip.AddrPort) bool {
	ep := endpointOf(b)
	for _, p := range f.points {
		if p.reply && f.end(p.src) == ep {
			return true
		}
	}
	return false
}

// count adds packets and bytes to the entry of point k (its endpoints
// left out: src, dst and far) and returns its index in f.points, -1 when
// the flow has no room for another entry.
func (f *flowState) count(k pointKey, src, dst, far endpoint, packets, bytes uint64) int {
	var known [3]bool
	k.src, known[0] = f.endRefOf(src)
	k.dst, known[1] = f.endRefOf(dst)
	k.far, known[2] = f.endRefOf(far)
	if known == [3]bool{true, true, true} { // else no entry names them yet
		for i := range f.points {
			if f.points[i].pointKey == k {
				f.points[i].packets += packets
				f.points[i].bytes += bytes
				return i
			}
		}
	}
	if len(f.points) >= maxPointsPerFlow {
		return -1
	}
	if f.points == nil {
		f.points = make([]pointStats, 0, initialPoints)
	}
	k.src, k.dst, k.far = f.addEnd(src), f.addEnd(dst), f.addEnd(far)
	f.points = append(f.points, pointStats{k, packets, bytes})
	return len(f.points) - 1
}

// endRefOf is ep's number among f's endpoints, and whether it has one.
func (f *flowState) endRefOf(ep endpoint) (endRef, bool) {
	if ep.bits == 0 {
		return 0, true
	}
	for i := range f.ends {
		if f.ends[i] == ep {
			return endRef(i + 1), true
		}
	}
	return 0, false
}

// addEnd numbers ep among f's endpoints.
func (f *flowState) addEnd(ep endpoint) endRef {
	if r, ok := f.endRefOf(ep); ok {
		return r
	}
	if f.ends == nil {
		f.ends = make([]endpoint, 0, initialEnds)
	}
	f.ends = append(f.ends, ep)
	return endRef(len(f.ends))
}

// end is the endpoint r names.
func (f *flowState) end(r endRef) endpoint {
	if r == 0 {
		return endpoint{}
	}
	return f.ends[r-1]
}

func (f *flowState) noteProc(pid uint32, comm string, cgroup uint64, at time.Time) {
	if pid == 0 && comm == "" && cgroup == 0 {
		return
	}
	if f.procAt.IsZero() || at.Before(f.procAt) {
		f.pid, f.comm, f.cgroup, f.procAt = pid, comm, cgroup, at
		f.evidenceChanged() // the cgroup selects the sock_addr programs
	}
}

// onlyBeyondSNAT tells whether nothing but the uplink saw f's requests and
// no socket-layer point saw it at all: what a flow's packets beyond the
// node's SNAT look like.
func (f *flowState) onlyBeyondSNAT() bool {
	if f.cookie != 0 || f.kind != 0 || !f.procAt.IsZero() || f.ctSeen {
		return false
	}
	for cp := range f.cps {
		if checkpoint(cp) != cpUplink && f.cps[cp].any() {
			return false
		}
	}
	return true
}

// absorb merges o (the same flow, seen before its client port was known) into f.
func (f *flowState) absorb(o *flowState) {
	o.merged = true
	f.evidenceChanged()
	f.claim(o.sock)
	if o.id != 0 && (f.id == 0 || o.id < f.id) {
		f.id = o.id
	}
	for _, b := range o.backends {
		f.addBackend(b.addr, b.at)
	}
	f.fromNode = f.fromNode || o.fromNode
	f.unfollowed = f.unfollowed || o.unfollowed
	for i := range f.cps {
		// A checkpoint's backend stays seen only by resets when each
		// flow that saw one there saw it so (sawBackend).
		// fReset, oReset: the flow saw no request to a backend there.
		bit := uint16(1) << i
		fReset, oReset := f.resetOnly&bit != 0 || !f.cps[i].backend, o.resetOnly&bit != 0 || !o.cps[i].backend
		if !fReset && o.cps[i].backend && oReset {
			// f's request sighting stands against o's resets: merge the VIP only.
			f.cps[i].merge(sighting{vip: o.cps[i].vip, vipFrom: o.cps[i].vipFrom, vipAt: o.cps[i].vipAt})
			continue
		}
		if o.cps[i].backend && !oReset && f.cps[i].backend && fReset {
			f.cps[i].backend = false // o's request sighting replaces f's resets'
		}
		f.cps[i].merge(o.cps[i])
		if f.cps[i].backend && fReset && oReset {
			f.resetOnly |= bit
		} else {
			f.resetOnly &^= bit
		}
	}
	if f.hostIfindex == 0 {
		f.hostIfindex = o.hostIfindex
	}
	if f.natHook == "" {
		f.natHook = o.natHook
	}
	f.tcp.merge(o.tcp)
	f.ctSeen = f.ctSeen || o.ctSeen
	f.ctNAT = f.ctNAT || o.ctNAT
	if !f.ctFinal.IsValid() {
		f.ctFinal = o.ctFinal
	}
	f.ctLast = max(f.ctLast, o.ctLast)
	f.renat = f.renat || o.renat
	if !f.snat.IsValid() {
		f.snat, f.snatDst = o.snat, o.snatDst
	}
	for _, p := range o.points {
		f.count(p.pointKey, o.end(p.src), o.end(p.dst), o.end(p.far), p.packets, p.bytes)
	}
	f.touch(o.first)
	f.touch(o.last)
	f.reply = f.reply || o.reply
	f.wireVIP = f.wireVIP || o.wireVIP
	f.wireAnswered = f.wireAnswered || o.wireAnswered
	if f.stray == nil {
		f.stray = o.stray
	}
	if o.drops != nil {
		for _, d := range *o.drops {
			f.addDrop(d)
		}
	}
	if o.untranslated != nil && (f.untranslated == nil || o.untranslated.At.Before(f.untranslated.At)) {
		f.untranslated = o.untranslated
	}
	if o.replyICMP != nil && (f.replyICMP == nil || o.replyICMP.At.Before(f.replyICMP.At)) {
		f.replyICMP = o.replyICMP
	}
	if later := o.icmp; later != nil {
		if f.icmp == nil || later.At.Before(f.icmp.At) {
			later, f.icmp = f.icmp, later
		}
		if later != nil {
			f.icmp = f.icmp.withQuote(later.QuotedDst)
		}
	}
	if f.kind == 0 {
		f.kind = o.kind
	}
	if !o.procAt.IsZero() {
		f.noteProc(o.pid, o.comm, o.cgroup, o.procAt)
	}
	if o.uplink.seen {
		f.uplink.note(obs.Observation{Time: o.uplink.at, VLAN: o.uplink.vlan, TPID: o.uplink.tpid, DstMAC: o.uplink.dstMAC, Ifindex: int(o.uplink.ifindex)})
	}
	if o.uplinkReply.seen {
		f.uplinkReply.note(obs.Observation{Time: o.uplinkReply.at, VLAN: o.uplinkReply.vlan, TPID: o.uplinkReply.tpid})
	}
	if o.uplinkIn.seen {
		f.uplinkIn.note(obs.Observation{VLAN: o.uplinkIn.vlan, TPID: o.uplinkIn.tpid})
	}
}

// labels numbers the labels of the observation points (capture points and
// the interfaces of tc observers, obs.Observation.Ifname), so that a
// per-point entry holds an index, not a string: few (two per Pod, at most
// a few thousand Pods, and the uplink). Index 0 is the empty label. A run
// until stopped sees Pods come and go for days, each with labels of its
// own: the labels no open flow counts in are forgotten (sweep), and their
// indexes given to the next. Beyond maxLabels at once, a point is counted
// unnamed (index 0) and unnamed says how often: never silently another's.
type labels struct {
	names []string
	index map[string]uint16
	free  []uint16 // indexes of labels forgotten, for the next
	// sweepAt is how many labels make Retire look for those no open flow
	// counts in (twice what the last sweep kept, and at least
	// minLabelSweep): a sweep costs a look at every open flow's points.
	sweepAt  int
	unnamed  uint64
	maxNames int // maxLabels; smaller in tests
}

// maxLabels is how many labels the engine holds at once: the 16 bits of
// pointKey.iface.
const maxLabels = 1 << 16

// minLabelSweep is the fewest labels held that make Retire sweep them.
const minLabelSweep = 1024

func newLabels() labels {
	return labels{names: []string{""}, index: map[string]uint16{"": 0}, sweepAt: minLabelSweep, maxNames: maxLabels}
}

func (l *labels) indexOf(name string) uint16 {
	if i, ok := l.index[name]; ok {
		return i
	}
	var i uint16
	switch {
	case len(l.free) > 0:
		i = l.free[len(l.free)-1]
		l.free = l.free[:len(l.free)-1]
		l.names[i] = name
	case len(l.names) < l.maxNames:
		i = uint16(len(l.names))
		l.names = append(l.names, name)
	default:
		l.unnamed++
		return 0
	}
	l.index[name] = i
	return i
}

// held counts the labels held now.
func (l *labels) held() int { return len(l.index) - 1 }

// sweep forgets the labels whose index used does not report, and returns
// how many it kept. A label forgotten that comes again gets an index anew.
func (l *labels) sweep(used func(uint16) bool) int {
	for name, i := range l.index {
		if i != 0 && !used(i) {
			delete(l.index, name)
			l.names[i] = ""
			l.free = append(l.free, i)
		}
	}
	kept := l.held()
	l.sweepAt = max(2*kept, minLabelSweep)
	return kept
}

// sweepLabels forgets the labels no open flow counts in, when there are
// many (labels.sweepAt): a retired flow's snapshot is made, a merged one's
// points went to the flow it merged into.
func (e *Engine) sweepLabels() {
	if e.labels.held() < e.labels.sweepAt {
		return
	}
	used := make([]bool, len(e.labels.names))
	for _, list := range e.clients {
		for _, f := range list {
			for i := range f.points {
				used[f.points[i].iface] = true
			}
		}
	}
	e.labels.sweep(func(i uint16) bool { return used[i] })
}

// CountsAt tells whether an open flow counts at the point labelled name.
func (e *Engine) CountsAt(name string) bool {
	i, ok := e.labels.index[name]
	if !ok || i == 0 {
		return false
	}
	for _, list := range e.clients {
		for _, f := range list {
			for _, p := range f.points {
				if p.iface == i {
					return true
				}
			}
		}
	}
	return false
}

// UnnamedPoints counts the observations counted at a point without its
// label: more labels than the engine holds at once (maxLabels).
func (e *Engine) UnnamedPoints() uint64 { return e.labels.unnamed }

func (l *labels) name(i uint16) string { return l.names[i] }

// sawBackend tells whether checkpoint cp saw the request go to a backend:
// a reset the client sent to a backend where its requests went to the VIP
// is its kernel refusing a reply that came back untranslated (a SYN-ACK
// from the backend's address, to which no socket of the client is
// connected), not a request it addressed to the backend. Nor is, where the
// VIP's requests are seen too, a datagram the client sent to the backend
// itself (sendsDirect).
func (f *flowState) sawBackend(cp checkpoint) bool {
	s := f.cps[cp]
	return s.backend && !(s.vip && (f.resetOnly&(1<<cp) != 0 || f.sendsDirect()))
}

// natBeforeNF tells whether f's connection was NATed through conntrack
// before netfilter's NAT hook: conntrack's original destination is its
// only sighting of the VIP at netfilter, whose observer before NAT (after
// conntrack's hook, which makes the entry) already saw the backend. An
// act_ct's NAT at tc (OVS's TC offload), or a tc program's through
// conntrack's kfuncs, made the entry there: its VIP is no sighting at
// netfilter. Without such a filter or program on f's veth, a rule between
// conntrack's hook and that observer rewrote it (a stateless `ip daddr set`
// at mangle priority), which the flow's inconsistency then says: a
// stateless filter there (act_nat, pedit) would have rewritten before
// conntrack's hook, which would then hold the backend.
func (e *Engine) natBeforeNF(f *flowState) bool {
	s := f.cps[cpNFBefore]
	return s.vip && s.vipFrom == obs.PointConntrack && s.backend && s.backendFrom == obs.PointNFBefore &&
		slices.ContainsFunc(e.tcCandPrograms(f), func(p TCProgram) bool { return p.Action == "" || p.Conntrack })
}

// sendsDirect tells whether the client sent UDP datagrams from its port to
// a backend itself besides those to the VIP: a resolver's unconnected
// socket that asks the Service and then a server behind it. A point on the
// client's side of every rewrite of the node (its socket's packets, its
// Pod's eth0, its host veth's tap) saw both. Every later point that sees
// the VIP's requests sees those datagrams too, with the backend: they tell
// nothing of where the VIP was rewritten (sawBackend), and the backend's
// answers to them, which the socket takes, are neither untranslated
// replies nor the Service's (answered).
func (f *flowState) sendsDirect() bool {
	if f.proto != obs.UDP {
		return false
	}
	if f.socketLBChanged() {
		return false // its datagrams to a backend are the socket LB's rewrites
	}
	for _, cp := range [...]checkpoint{cpSockEgress, cpPod, cpHost} {
		if s := f.cps[cp]; s.vip && s.backend {
			return true
		}
	}
	return false
}

// socketLBChanged tells whether a socket LB came or went during the flow of
// an unconnected UDP socket: the app asked the VIP for every datagram, and
// the socket's hook saw some go to the VIP unrewritten and some to a
// backend. The later points saw both too, each datagram with the
// destination its socket gave it.
func (f *flowState) socketLBChanged() bool {
	app, sock := f.cps[cpApp], f.cps[cpSockAddr]
	return f.proto == obs.UDP && app.vip && !app.backend && sock.vip && sock.backend
}

// directBackend is the backend a client that sendsDirect sent to itself.
func (f *flowState) directBackend() netip.AddrPort {
	for _, cp := range [...]checkpoint{cpSockEgress, cpPod, cpHost} {
		if s := f.cps[cp]; s.vip && s.backend {
			return s.backendAddr.addrPort()
		}
	}
	return netip.AddrPort{}
}

// answered tells whether a reply to the client's requests to the VIP came
// back (f.reply): of a client that sendsDirect, only one from the VIP at
// its Pod counts, as the backend's to its own datagrams come from the
// backend there (a socket LB's or a tc program's reverse NAT, which gives
// those the VIP too, cannot be told apart: counted).
func (f *flowState) answered() bool {
	if !f.reply || !f.sendsDirect() {
		return f.reply
	}
	for _, p := range f.points {
		if p.reply && f.end(p.src).addrPort() == f.service &&
			(p.point == obs.PointPod && p.dir == obs.DirIn || p.point == obs.PointHost && p.dir == obs.DirOut) {
			return true
		}
	}
	return false
}

// guessable tells whether a packet of f's client endpoint at m to a peer
// f does not know can be f's, that peer its backend (toPeer): f knows
// none yet, or only the one its client sends to itself (sendsDirect),
// which is no rewrite's, or (UDP) none it had seen by m (noBackendBy); or
// it is a UDP datagram seen where nothing on the node rewrote it yet
// (moment.direct), where f's requests went to the VIP: the client sent it
// to that peer itself, beside its queries to the VIP.
func (f *flowState) guessable(m moment) bool {
	if len(f.backends) == 0 {
		return true
	}
	if f.proto != obs.UDP {
		return false
	}
	if f.noBackendBy(m.at) {
		return true
	}
	if m.direct && !m.reply && (f.cps[cpPod].vip || f.cps[cpHost].vip || f.cps[cpTCHead].vip) {
		return true
	}
	return f.sendsDirect() && len(f.backends) == 1 && f.backends[0].addr == f.directBackend()
}

// noBackendBy tells whether every backend f knows was first seen after
// at: at that time f knew none, as when its datagrams come in order (a
// UDP flow that changed backend, its first backend's datagrams delivered
// after the second's).
func (f *flowState) noBackendBy(at int64) bool {
	for _, b := range f.backends {
		if b.at.UnixNano() <= at {
			return false
		}
	}
	return true
}

// rewriteSeen tells whether a checkpoint saw a request of f go to a
// backend (sawBackend).
func (f *flowState) rewriteSeen() bool {
	for cp := range f.cps {
		if f.sawBackend(checkpoint(cp)) {
			return true
		}
	}
	return false
}

// untranslatedReplies reports the replies that entered the client's Pod from
// a backend's address while its requests left the Pod to the VIP: nothing
// translated them back (the node's conntrack entry never saw them: a bridge
// that switched them from the backend Pod straight to the client with
// bridge-nf-call-iptables 0, or a return path around the node that
// rewrote the request). Packets counts them at the Pod's eth0; translated
// says whether a reply from the Service entered it too. Nil when there were
// none, or when the Pod's eth0 did not see the requests go to the VIP (a
// socket LB's client talks to the backend itself), or when the client sent
// to a backend itself (sendsDirect): those are its answers.
func (f *flowState) untranslatedReplies() (u *StrayReplies, translated bool) {
	if f.untranslated == nil || !f.cps[cpPod].vip || f.sendsDirect() || f.socketLBChanged() {
		return nil, false
	}
	out := *f.untranslated
	out.Packets = 0
	for _, p := range f.points {
		if p.point != obs.PointPod || p.dir != obs.DirIn || !p.reply {
			continue
		}
		if f.end(p.src).addrPort() == f.service {
			translated = true
		} else {
			out.Packets += p.packets
		}
	}
	return &out, translated
}
