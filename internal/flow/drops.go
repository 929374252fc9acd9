package flow

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// KernelDrop counts a flow's packets the kernel dropped (the drop
// observer, skb:kfree_skb) in one direction, for one reason, in one
// function, netns and device. Count is what the observer reported: the
// first drops of each flow direction, then one every 10 ms (the rest is
// counted in observer_events_summarized): a flood's is a lower bound.
type KernelDrop struct {
	Direction string `json:"direction"` // "request" or "reply"
	Count     uint64 `json:"count"`
	// Reason is the kernel's enum skb_drop_reason without its
	// SKB_DROP_REASON_ prefix (NETFILTER_DROP), or its number when the
	// kernel's BTF did not name it.
	Reason string `json:"reason"`
	// Function is the kernel function that dropped it ("nft_do_chain
	// [nf_tables]": a module's is named), "" when the kernel did not
	// tell.
	Function string `json:"function,omitempty"`
	// Location is the kernel address that dropped it: the events of one
	// place are counted together, whether or not the function was named
	// yet (a probe that reads kallsyms names a new address aside: its
	// first events come without).
	Location uint64 `json:"-"`
	NetNS    uint64 `json:"netns"`
	// Ifindex is the device the packet was at (or came in by), 0 when none.
	Ifindex int `json:"ifindex"`
	// Where names that place, as the session found it: the capture point
	// there ("uplink:bond0"), else the netns and the interface ("the
	// node's netns, cni0 (ifindex 4)"; "netns /run/netns/gw, ifindex 2"
	// when the interface's name was not found); "" when it found none.
	Where string    `json:"where,omitempty"`
	First time.Time `json:"first"`
	// vip: a request packet dropped with the flow's VIP still its
	// destination (droppedUnrewritten).
	vip bool
	// at: when each reply drop counted here was (unix ns), the first
	// maxDropTimes (allReplyDropsReported).
	at []int64
}

// reasonNotSpecified is the reason of a plain kfree_skb(): a drop in most
// paths, but also how some drivers free a packet they sent, so it alone
// never makes a flow's replies lost.
const reasonNotSpecified = "NOT_SPECIFIED"

// reasonOtherHost is the drop of a frame addressed to another host's MAC
// (ip_rcv_core): a copy a bridge flooded to a Pod, not the packet's way.
const reasonOtherHost = "OTHERHOST"

// maxKernelDrops bounds the entries of one flow (each a direction, reason,
// function and place); further ones are added to the last.
const maxKernelDrops = 8

// noteDrop records a drop observation on its flow; false when no flow
// claims the packet yet (it waits as other observations do; deferred: its
// flow's guess was put off, as link's). A drop of a
// flow refused beyond MaxFlows, or of a connection seen by its replies
// alone, is taken with them: no flow will claim it.
func (e *Engine) noteDrop(o obs.Observation, last bool) (done, deferred bool) {
	if !hasPorts(o) {
		e.withoutPorts++
		return true, false
	}
	f, reply := e.find(o)
	if f == nil {
		if f, deferred = e.droppedAfterRewrite(o, last); deferred {
			return false, true
		}
		if f != nil {
			// Where the rewrite sent it: the backend, which no point
			// saw (droppedRewritten places the rewrite by the drop).
			e.learnBackend(f, o.Dst, o.Time)
		}
	}
	if f == nil && (o.NetNS == 0 || e.cfg.HostNetNS == 0 || o.NetNS == e.cfg.HostNetNS) {
		// A datagram NATed to a backend and dropped before conntrack
		// confirmed an entry, delivered after the backend a later
		// one reached: on the node, whose NAT rules picked it (one
		// dropped in the client's Pod was its own, to that address).
		if g, r := e.renatSYN(o.Proto, o.Src, o.Dst, momentOf(&o, false), last); r == linked {
			f = g
			e.learnBackend(f, o.Dst, o.Time)
		}
	}
	if f == nil {
		return e.refusedClients.has(clientKey{o.Proto, o.Src}) || e.refusedClients.has(clientKey{o.Proto, o.Dst}) || e.ReplyWithoutRequest(o), false
	}
	d := KernelDrop{Direction: "request", Count: 1, NetNS: o.NetNS, Ifindex: o.Ifindex, First: o.Time}
	if reply {
		d.Direction = "reply"
		d.at = []int64{o.Time.UnixNano()}
	} else {
		d.vip = o.Dst == f.service
	}
	if o.Drop != nil {
		d.Reason, d.Function, d.Location = o.Drop.Reason, o.Drop.Func, o.Drop.Location
		if d.Reason == "" {
			d.Reason = fmt.Sprint(o.Drop.Code)
		}
	}
	f.addDrop(d)
	f.evidenceChanged()
	return true, false
}

// droppedAfterRewrite is the flow of a request the kernel dropped after its
// rewrite to a peer no point saw it go to (a tc program that redirected it
// past the tc tail and netfilter, then dropped it itself or at the uplink's
// tc egress, before its TX tap): the flow of its client endpoint without a
// backend yet, as link guesses for a packet (deferred: put off, as link's
// guess). The peer is the backend the rewrite chose, though the request
// never reached it.
func (e *Engine) droppedAfterRewrite(o obs.Observation, last bool) (f *flowState, deferred bool) {
	m := momentOf(&o, false)
	f, guessed := toPeer(e.clients[clientKey{o.Proto, o.Src}], o.Dst, m, true)
	if !guessed || f.cps[cpUplink].vip {
		return nil, false
	}
	if !e.plausibleGuess(f, m, last) {
		return nil, true
	}
	return f, false
}

// addDrop counts d among f's drops.
func (f *flowState) addDrop(d KernelDrop) {
	if f.drops == nil {
		f.drops = new([]KernelDrop)
	}
	drops := *f.drops
	for i := range drops {
		k := &drops[i]
		samePlace := k.Function == d.Function
		if k.Location != 0 || d.Location != 0 {
			samePlace = k.Location == d.Location
		}
		if k.Direction == d.Direction && k.Reason == d.Reason && samePlace && k.NetNS == d.NetNS && k.Ifindex == d.Ifindex && k.vip == d.vip ||
			i == maxKernelDrops-1 {
			k.Count += d.Count
			k.at = append(k.at, d.at[:min(len(d.at), maxDropTimes-len(k.at))]...)
			k.Function = cmp.Or(k.Function, d.Function)
			if d.First.Before(k.First) {
				k.First = d.First
			}
			return
		}
	}
	*f.drops = append(drops, d)
}

// kernelDrops are f's drops, nil when none.
func (f *flowState) kernelDrops() []KernelDrop {
	if f.drops == nil {
		return nil
	}
	return *f.drops
}

// refusedInPod is the drop of f's request that its Pod's own redirect sent
// to a loopback address (a sidecar proxy's port), or a socket LB to the
// Pod itself (toOwnPod), where no socket took it: the Pod's kernel then
// refuses it (a TCP reset, for UDP an ICMP port unreachable), so no proxy
// or server ever saw the connection. nil otherwise.
func (f *flowState) refusedInPod() *KernelDrop {
	if !f.toOwnPod() {
		return nil
	}
	for i, d := range f.kernelDrops() {
		if d.Direction == "request" && d.Reason == "NO_SOCKET" {
			return &(*f.drops)[i]
		}
	}
	return nil
}

// requestDropped tells whether the kernel dropped requests of f for a
// reason it named (named).
func (f *flowState) requestDropped() bool {
	for _, d := range f.kernelDrops() {
		if d.Direction == "request" && d.named() && d.Reason != reasonOtherHost {
			return true
		}
	}
	return false
}

// named tells whether the kernel said why it dropped d: a reason other
// than a plain kfree_skb()'s, or the route lookup's (routeError).
func (d KernelDrop) named() bool {
	return d.Reason != reasonNotSpecified || d.routeError()
}

// routeError tells whether d is ip_error's: the route lookup of a
// forwarded packet found no route, or a blackhole, unreachable or prohibit
// one. With forwarding on, ip_error names only the first (IP_INNOROUTES)
// and drops the others as NOT_SPECIFIED, as a plain kfree_skb() would.
func (d KernelDrop) routeError() bool {
	return d.Function == "ip_error"
}

// afterNATReasons are the drop reasons the kernel gives only past the NAT
// hooks (PREROUTING, OUTPUT) of the netns it drops in: the route lookup of
// a forwarded or delivered packet (no route, an unreachable or invalid
// destination, rp_filter), which runs after PREROUTING, and the output
// path's (no route out, no neighbour), after OUTPUT and POSTROUTING. A
// request dropped so with the VIP as destination met every place of that
// netns that can rewrite it before routing, and none did. A reason given
// at several places (NETFILTER_DROP: a filter chain before NAT or after
// it; TC_INGRESS, at the host veth before netfilter) is not among them.
var afterNATReasons = map[string]bool{
	"IP_INNOROUTES":     true, // ip_error: network unreachable
	"IP_INADDRERRORS":   true, // ip_error: host unreachable
	"IP_INVALID_SOURCE": true,
	"IP_LOCALNET":       true,
	"IP_INVALID_DEST":   true,
	"IP_RPFILTER":       true,
	"IP_OUTNOROUTES":    true,
	"NEIGH_FAILED":      true,
	"NEIGH_CREATEFAIL":  true,
	"NEIGH_DEAD":        true,
	"NEIGH_QUEUEFULL":   true,
}

// routeLookupReasons are those of afterNATReasons that the route lookup of
// a forwarded or delivered packet gives, before the forward and input
// filter hooks: a filter rule there never saw a packet so dropped.
var routeLookupReasons = map[string]bool{
	"IP_INNOROUTES":     true,
	"IP_INADDRERRORS":   true,
	"IP_INVALID_SOURCE": true,
	"IP_LOCALNET":       true,
	"IP_INVALID_DEST":   true,
	"IP_RPFILTER":       true,
}

// droppedUnrewritten is the earliest drop that shows f's request was
// dropped by the node, in its own netns, with the VIP still its
// destination after netfilter's NAT (afterNATReasons, routeError), nil
// when none: f was last seen with the VIP by the netfilter observer after
// NAT, or anywhere before it when those observers were not attached
// (conntrack alone watches netfilter, and reports no connection dropped
// before its confirmation), and no point saw it afterwards, nor any answer
// but a refusal. Nothing on the node rewrote it: every place of the node
// that rewrites a Pod's request before its route lookup had run (a rewrite
// at the uplink's egress comes after it, and the request never got there).
func (e *Engine) droppedUnrewritten(f *flowState, last checkpoint) *KernelDrop {
	if last != cpNFAfter && (last > cpNFAfter || e.active(obs.PointNFAfter)) || e.cfg.HostNetNS == 0 || f.reply || len(f.backends) > 0 ||
		f.cps[cpUplink].any() || f.cps[cpLocal].any() || f.cps[cpNodeEgress].any() || e.sharesBackends(f) != nil {
		return nil
	}
	var first *KernelDrop
	drops := f.kernelDrops()
	for i := range drops {
		d := &drops[i]
		if d.Direction == "request" && d.vip && d.NetNS == e.cfg.HostNetNS && (afterNATReasons[d.Reason] || d.routeError()) &&
			(first == nil || d.First.Before(first.First)) {
			first = d
		}
	}
	return first
}

// rewrittenDrop is the earliest of f's requests the kernel dropped in the
// node's netns with a backend as destination, for a reason it named, nil
// when none: the request was rewritten before that drop.
func (e *Engine) rewrittenDrop(f *flowState) *KernelDrop {
	if e.cfg.HostNetNS == 0 {
		return nil
	}
	var first *KernelDrop
	drops := f.kernelDrops()
	for i := range drops {
		d := &drops[i]
		if d.Direction == "request" && !d.vip && d.NetNS == e.cfg.HostNetNS && d.named() &&
			(first == nil || d.First.Before(first.First)) {
			first = d
		}
	}
	return first
}

// afterConfirm tells whether the kernel drops a packet the node forwards
// or sends for reason only once conntrack confirmed its connection (at
// the end of POSTROUTING), which conntrack then reports: at the device's
// tc egress or qdisc, or for want of a neighbour. A filter rule
// (NETFILTER_DROP), the route lookup and tc ingress drop it before: a
// connection whose first packet they drop is never reported.
func afterConfirm(reason string) bool {
	return reason == "TC_EGRESS" || strings.HasPrefix(reason, "QDISC_") || strings.HasPrefix(reason, "NEIGH_")
}

// droppedOnNode tells whether every request of f, rewritten (it has a
// backend) and unanswered, was dropped by the kernel in the node's netns
// after its rewrite, before the uplink's TX tap or the backend's Pod saw
// one: as many dropped as the point that saw most of them saw (mostSeen).
// None left the node, so none reached the backend. A drop the kernel gave
// no reason counts when it is a bridge's refusal of a hairpin
// (hairpinDrop).
func (e *Engine) droppedOnNode(f *flowState) bool {
	if f.reply || len(f.backends) == 0 || e.cfg.HostNetNS == 0 || f.cps[cpUplink].any() || f.cps[cpLocal].any() {
		return false
	}
	var dropped uint64
	for _, d := range f.kernelDrops() {
		if d.Direction == "request" && !d.vip && d.NetNS == e.cfg.HostNetNS && (d.named() || e.hairpinDrop(f, &d)) {
			dropped += d.Count
		}
	}
	return dropped > 0 && dropped >= f.mostSeen(false)
}

// hairpinDrop tells whether d is the bridge of an uplink without hairpin
// mode refusing f's request there: an outside client's, which came in on
// that port (the bridge's input path drops with the port it came in on as
// the device), rewritten to a backend the bridge would send back out the
// same port. The bridge frees it with a plain kfree_skb() (NOT_SPECIFIED)
// in br_forward, or br_handle_frame_finish where that is inlined: only
// there, at such a port, does that reason tell this drop (the bridge's
// output path, br_dev_queue_push_xmit, drops too big a frame so, at the
// port it was to leave by). A backend that is a Pod of the node is behind
// its host veth, not that port: the bridge refused it there for another
// reason (the two ports isolated, a VLAN the Pod's port does not carry),
// with the same kfree_skb() at the port it came in on.
func (e *Engine) hairpinDrop(f *flowState, d *KernelDrop) bool {
	fn, _, _ := strings.Cut(d.Function, " ")
	_, off := e.cfg.Attribution.HairpinOffUplinks[d.Ifindex]
	return off && f.uplinkIn.seen && d.Direction == "request" && !d.vip && d.NetNS == e.cfg.HostNetNS &&
		d.Reason == reasonNotSpecified && (fn == "br_forward" || fn == "br_handle_frame_finish") &&
		slices.ContainsFunc(f.backends, func(b backendSeen) bool {
			_, pod := e.cfg.Attribution.PodHostSides[b.addr.Addr()]
			return !pod
		})
}

// hairpinRefused is the earliest of f's requests a bridge refused to send
// back out the uplink port it came in on (hairpinDrop), nil when none.
func (e *Engine) hairpinRefused(f *flowState) *KernelDrop {
	var first *KernelDrop
	drops := f.kernelDrops()
	for i := range drops {
		if d := &drops[i]; e.hairpinDrop(f, d) && (first == nil || d.First.Before(first.First)) {
			first = d
		}
	}
	return first
}

// mostSeen is the most of f's requests (or replies) one place saw, in the
// drop observer's measure. It reports a flow direction's first drops, then
// one per 10 ms, as the tc and netfilter observers report its packets: of
// a burst, fewer than the taps count. So the observers' count where one
// saw them, the taps' otherwise.
func (f *flowState) mostSeen(reply bool) uint64 {
	type place struct {
		point obs.Point
		dir   obs.Dir
	}
	at := map[place]uint64{}
	var observed, tapped uint64
	for _, p := range f.points {
		if p.reply != reply {
			continue
		}
		k := place{p.point, p.dir}
		at[k] += p.packets
		switch p.point {
		case obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter:
			observed = max(observed, at[k])
		default:
			tapped = max(tapped, at[k])
		}
	}
	return cmp.Or(observed, tapped)
}

// dropsAfterUplinkTap counts f's request packets the kernel dropped at the
// uplink device after its TX tap saw them: in the node's netns, on the
// device whose tap saw the request leave (f.uplink), for a reason other
// than those given before the tap (a tc egress program, an nftables egress
// chain, the qdisc; the route, neighbour and fragmentation steps before
// the device: beforeUplinkTap). An overlay device's xmit drops a frame the
// tap saw (vxlan_xmit without an fdb entry for the remote VTEP:
// NO_TX_TARGET); so does a driver. Such a frame never left the node.
func (e *Engine) dropsAfterUplinkTap(f *flowState) uint64 {
	if !f.uplink.seen || f.uplink.ifindex == 0 || e.cfg.HostNetNS == 0 {
		return 0
	}
	var n uint64
	for _, d := range f.kernelDrops() {
		if d.Direction == "request" && d.NetNS == e.cfg.HostNetNS && d.Ifindex == int(f.uplink.ifindex) && !beforeUplinkTap(d.Reason) {
			n += d.Count
		}
	}
	return n
}

// beforeUplinkTap tells whether the kernel drops a packet for reason
// before a device's TX taps (dev_queue_xmit_nit) see it: from the route
// and neighbour steps of the output path through the device's tc egress,
// nftables egress chains and qdisc. NOT_SPECIFIED, a plain kfree_skb()
// anywhere, proves nothing either.
func beforeUplinkTap(reason string) bool {
	switch reason {
	case reasonNotSpecified, "NETFILTER_DROP", "TC_EGRESS", "TC_INGRESS", "TC_COOKIE_ERROR", "TC_CHAIN_NOTFOUND", "TC_RECLASSIFY_LOOP",
		"IP_OUTNOROUTES", "PKT_TOO_BIG", "DEV_READY", "RECURSION_LIMIT", "CAKE_FLOOD", "XFRM_POLICY", "IPV6DISABLED":
		return true
	}
	for _, p := range []string{"QDISC_", "NEIGH_", "FRAG_", "FQ_", "IP_"} {
		if strings.HasPrefix(reason, p) {
			return true
		}
	}
	return false
}

// replyDrops counts f's reply packets the kernel dropped, other than those
// of reason NOT_SPECIFIED (reasonNotSpecified).
func (f *flowState) replyDrops() uint64 {
	var n uint64
	for _, d := range f.kernelDrops() {
		if d.Direction == "reply" && d.Reason != reasonNotSpecified {
			n += d.Count
		}
	}
	return n
}

// String says why and where a drop was: "NETFILTER_DROP in nft_do_chain
// [nf_tables] (at uplink:bond0)", or with the netns inode and ifindex when
// the place has no name (Where).
func (d KernelDrop) String() string {
	var b strings.Builder
	b.WriteString(d.Reason)
	if d.Function != "" {
		b.WriteString(" in " + d.Function)
	}
	if d.Where != "" {
		fmt.Fprintf(&b, " (at %s)", d.Where)
	} else {
		fmt.Fprintf(&b, " (netns %d, ifindex %d)", d.NetNS, d.Ifindex)
	}
	return b.String()
}

// repliesDroppedInKernel tells whether the kernel dropped replies of f
// (for a reason other than NOT_SPECIFIED) and none reached its client: its
// Pod's eth0 tap, which lost no frames, saw no reply come in; or, without
// that tap (a node process's flow has none past the uplink), the kernel
// dropped at least as many replies as the point that saw most of them saw
// (mostSeen), unless it dropped fewer on the node than the uplink's RX tap
// saw come in (nodeReplyDrops), or, for a node process, when the netfilter
// observers saw none of the replies that tap saw come in. A reply its
// Pod's eth0 tap saw come in reached it, whatever else that tap lost.
func (e *Engine) repliesDroppedInKernel(f *flowState) bool {
	n := f.replyDrops()
	if n == 0 {
		return false
	}
	// The client's Pod's eth0 tap tells only when it saw the flow's
	// requests leave: an outside client's (a NodePort's) has none.
	podTap := !f.fromNode && e.active(obs.PointPod) && !e.captureLost[obs.PointPod]
	podOut, pastNF := false, false
	var in uint64
	for _, p := range f.points {
		if !p.reply {
			podOut = podOut || p.point == obs.PointPod && p.dir == obs.DirOut
			continue
		}
		switch {
		case p.point == obs.PointPod && p.dir == obs.DirIn:
			return false
		case p.point == obs.PointUplink && p.dir == obs.DirIn:
			in += p.packets
		case p.point == obs.PointNFBefore || p.point == obs.PointNFAfter:
			pastNF = true
		}
	}
	if podTap && podOut {
		return true
	}
	// The uplink's RX tap sees every reply that comes in before the node
	// can drop it, the observers only those that got past the drops
	// before them (a tc program or a netdev chain at the uplink's
	// ingress): measured against theirs, such drops read as every reply.
	if dropped, all := e.nodeReplyDrops(f); all && in > dropped {
		return false
	}
	// Past its budget the drop observer reports fewer drops than the tap
	// saw replies, however many got through. Every reply of a node
	// process passes the netfilter observers at prerouting, which report
	// a flow's first ones: when they saw none, none got past the drops.
	if f.fromNode && in > 0 && !pastNF && e.active(obs.PointNFBefore) && !e.watchesLost {
		return true
	}
	return n >= f.mostSeen(true)
}

// dropBudget and dropRefill are the drop observer's budget: it reports a
// flow direction's first 8 drops, then one per 10 units of 2^20 ns
// (PT_EVENTS_PER_FLOW, PT_REFILL_UNITS in bpf/observe.h).
const (
	dropBudget = 8
	dropRefill = 10
)

// maxDropTimes bounds the reply drop times a flow keeps: past them, its
// drops are not replayed (allReplyDropsReported).
const maxDropTimes = 64

// nodeReplyDrops counts f's reply packets the kernel dropped in the
// node's netns, NOT_SPECIFIED aside; all: the drop observer reported
// every reply drop of f (allReplyDropsReported).
func (e *Engine) nodeReplyDrops(f *flowState) (n uint64, all bool) {
	for _, d := range f.kernelDrops() {
		if d.Direction == "reply" && d.NetNS == e.cfg.HostNetNS && d.Reason != reasonNotSpecified {
			n += d.Count
		}
	}
	return n, e.cfg.HostNetNS != 0 && f.allReplyDropsReported()
}

// allReplyDropsReported tells whether the drop observer reported every
// reply drop of f: its budget, replayed over the drops it reported (in
// any netns: they share it), never ran out, so it left none out. The
// replay refills from the drop before, a unit short, where the observer
// refills from an older stamp on a clock of its own: it never has more
// left than the observer had.
func (f *flowState) allReplyDropsReported() bool {
	var at []int64
	for _, d := range f.kernelDrops() {
		if d.Direction != "reply" {
			continue
		}
		if uint64(len(d.at)) != d.Count {
			return false // some not timed
		}
		at = append(at, d.at...)
	}
	slices.Sort(at)
	left := dropBudget
	for i, t := range at {
		if i > 0 {
			left = min(dropBudget, left+max(int((t-at[i-1])>>20)-1, 0)/dropRefill)
		}
		if left--; left == 0 {
			return false
		}
	}
	return true
}

// dropsReason says what the kernel dropped of f, "" when nothing.
func (f *flowState) dropsReason() string {
	var parts []string
	for _, d := range f.kernelDrops() {
		unit := "packets"
		if d.Count == 1 {
			unit = "packet"
		}
		parts = append(parts, fmt.Sprintf("%d %s %s: %s", d.Count, d.Direction, unit, d.String()))
	}
	if len(parts) == 0 {
		return ""
	}
	return "the kernel dropped " + strings.Join(parts, "; ")
}
