package flow

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// checkpoint is a place on a request's path where its destination is observed,
// in path order. Between two consecutive checkpoints lies at most one place
// that can rewrite a destination (gapBefore).
type checkpoint uint8

const (
	cpApp        checkpoint = iota // sockaddr ReqDst: what the application asked for
	cpSockAddr                     // sockaddr Dst: after the sock_addr programs before the observer
	cpSockState                    // sockstate: the socket's own destination
	cpSockEgress                   // sockegress: its first packet, after its netns' OUTPUT NAT
	cpPod                          // pod eth0 TX tap
	cpHost                         // host veth RX tap (before tc ingress)
	cpTCHead                       // tcx head observer, ingress
	cpTCTail                       // tcx tail observer, ingress
	cpNFBefore                     // netfilter just below NAT; conntrack original tuple
	cpNFAfter                      // netfilter just above NAT
	cpConfirm                      // conntrack reply tuple (after every hook, IPVS included)
	cpNodeEgress                   // sockegress of a node-netns socket: after OUTPUT and POSTROUTING
	cpLocal                        // host veth TX tap towards a Pod of the node, its eth0 RX: delivered there
	cpUplink                       // uplink TX tap (after tc egress)
	numCheckpoints
)

// floodedCopy tells whether a request seen going into a Pod (its host
// veth's TX, its eth0's RX) is addressed to another than that Pod: a copy
// a bridge flooded to every port, not knowing where the destination MAC is
// (the port it learned it on went down, which forgets it), which the Pod
// drops (OTHERHOST). It was not delivered there: the request may never
// have left the node. False where the node's Pods are not known.
func (e *Engine) floodedCopy(o *obs.Observation) bool {
	a := &e.cfg.Attribution
	if len(a.PodHostSides) == 0 {
		return false
	}
	dst := o.Dst.Addr()
	side, veth := a.PodHostSides[dst]
	if o.Point == obs.PointHost {
		return o.Ifindex > 0 && (!veth || side != o.Ifindex)
	}
	_, stacked := a.StackedPods[dst]
	_, other := a.PodOtherIfaces[dst]
	return !veth && !stacked && !other
}

// requestCheckpoint maps a request-direction packet observation to its checkpoint.
func (e *Engine) requestCheckpoint(o *obs.Observation) (checkpoint, bool) {
	switch o.Point {
	case obs.PointSockEgress:
		if e.cfg.HostNetNS != 0 && o.NetNS == e.cfg.HostNetNS {
			return cpNodeEgress, true
		}
		return cpSockEgress, true
	case obs.PointSockState:
		return cpSockState, true
	case obs.PointPod:
		if o.Dir == obs.DirIn {
			// A request entering a Pod: the backend's, on this node.
			return cpLocal, !e.floodedCopy(o)
		}
		return cpPod, true
	case obs.PointHost:
		if o.Dir == obs.DirOut {
			// A request leaving the node towards a Pod: a backend of
			// this node (hairpin), after its veth's tc egress, as the
			// uplink TX is for a remote one.
			return cpLocal, !e.floodedCopy(o)
		}
		return cpHost, true
	case obs.PointTCHead:
		return cpTCHead, o.Dir != obs.DirOut
	case obs.PointTCTail:
		return cpTCTail, o.Dir != obs.DirOut
	case obs.PointNFBefore:
		return cpNFBefore, natHook(o.Hook)
	case obs.PointNFAfter:
		return cpNFAfter, natHook(o.Hook)
	case obs.PointUplink:
		return cpUplink, o.Dir != obs.DirIn
	}
	return 0, false
}

// natHook: destination NAT happens at PREROUTING (forwarded, bridged with
// bridge-nf-call-iptables) and OUTPUT (host-originated).
func natHook(h obs.Hook) bool { return h == obs.HookPrerouting || h == obs.HookLocalOut }

// ByClientNetfilter is the "by" of a rewrite by netfilter in the client's
// own netns (a sidecar proxy's redirect, between the socket and its first
// packet), whose rules pathtrace does not read.
const ByClientNetfilter = "netfilter OUTPUT in the client's netns (its rules are not read)"

// gap is what can rewrite a destination between two consecutive checkpoints.
type gap uint8

const (
	gapNothing    gap = iota // a veth, or two views of the same step
	gapSocket                // cgroup sock_addr programs
	gapPodNAT                // netfilter OUTPUT in the client's (Pod's) netns
	gapPodNetns              // tc egress on the Pod's eth0
	gapTC                    // tc ingress of the host veth: tcx, then cls_bpf
	gapNetfilter             // DNAT at PREROUTING / OUTPUT
	gapIPVS                  // IPVS at LOCAL_IN (only when an IPVS service matches)
	gapUplinkTC              // tc egress of the uplink, before its TX tap (see bracket)
	gapUplinkInTC            // tc ingress of the uplink, after its RX tap (see fromWire)
	gapNetkit                // the programs of the Pod's netkit pair, inside it (see gapAt)
)

func gapBefore(cp checkpoint) gap {
	switch cp {
	case cpSockAddr, cpSockState:
		return gapSocket
	case cpSockEgress:
		// The cgroup egress hook runs after the socket netns' OUTPUT and
		// POSTROUTING hooks: a sidecar proxy's REDIRECT happens here.
		return gapPodNAT
	case cpPod:
		return gapPodNetns
	case cpTCHead, cpTCTail, cpNFBefore:
		// tcx programs attached ahead of the head observer, the chain itself,
		// then legacy cls_bpf which runs after the whole tcx chain.
		return gapTC
	case cpNFAfter:
		return gapNetfilter
	case cpConfirm:
		return gapIPVS
	}
	return gapNothing // cpApp, cpHost (veth), cpNodeEgress, cpLocal, cpUplink (no DNAT after conntrack confirms)
}

// gapAt is gapBefore for f: the host side of a Pod's netkit pair receives
// what the Pod sends after the programs of the pair's peer ran, inside the
// pair, between the Pod's eth0 TX tap and the host side's RX tap (a veth
// has nothing there).
//
// A Pod without a host side (see Attribution.StackedPods) meets no host
// veth's tc: what runs at tc on its way is the uplink's egress.
func (e *Engine) gapAt(f *flowState, cp checkpoint) gap {
	if cp == cpHost && len(e.netkitCands(f)) > 0 {
		return gapNetkit
	}
	g := gapBefore(cp)
	if f.fromNode && (g == gapPodNAT || g == gapPodNetns || g == gapTC) {
		// A node socket's request meets no Pod netns and no host veth:
		// from its socket to its egress hook only the node's OUTPUT
		// (netfilter, IPVS) and POSTROUTING run.
		return gapNothing
	}
	if _, ok := e.cfg.Attribution.StackedPods[f.client.Addr()]; ok && g == gapTC {
		return gapUplinkTC
	}
	return g
}

func (g gap) String() string {
	return [...]string{"nothing", "socket", "netfilter in the Pod's netns", "tc egress in the Pod's netns", "tc", "netfilter", "ipvs", "tc egress of the uplink", "tc ingress of the uplink", "a program of the Pod's netkit pair"}[g]
}

func (g gap) place() Place {
	switch g {
	case gapSocket:
		return PlaceSocket
	case gapTC, gapUplinkTC, gapUplinkInTC, gapNetkit:
		return PlaceTC
	case gapNetfilter, gapPodNAT:
		return PlaceNetfilter
	case gapIPVS:
		return PlaceIPVS
	}
	return PlaceUnknown
}

// describe names a checkpoint for a reason, by the point that saw it.
func (c checkpoint) describe(from obs.Point) string {
	switch c {
	case cpApp:
		return "the app's request (sockaddr)"
	case cpSockAddr:
		return "the socket (sockaddr)"
	case cpSockState:
		return "the socket tuple (" + from.String() + ")"
	case cpSockEgress:
		return "the socket's first packet (" + from.String() + ")"
	case cpPod:
		return "pod eth0 TX"
	case cpHost:
		return "host veth RX"
	case cpTCHead:
		return "tc head ingress"
	case cpTCTail:
		return "tc tail ingress"
	case cpNFBefore:
		if from == obs.PointConntrack {
			return "conntrack (original dst)"
		}
		return "netfilter before NAT"
	case cpNFAfter:
		return "netfilter after NAT"
	case cpConfirm:
		if from == obs.PointNFBefore || from == obs.PointNFAfter {
			return "netfilter OUTPUT after IPVS (its rewritten packet sent again)"
		}
		return "conntrack (reply src)"
	case cpNodeEgress:
		return "the node socket's egress (" + from.String() + ")"
	case cpLocal:
		if from == obs.PointPod {
			return "the backend Pod's eth0 RX"
		}
		return "host veth TX to the backend Pod"
	case cpUplink:
		return "uplink TX"
	}
	return "?"
}

// checkpointPoints are the observation points that feed a checkpoint.
func checkpointPoints(c checkpoint) []obs.Point {
	switch c {
	case cpApp, cpSockAddr:
		return []obs.Point{obs.PointSockAddr}
	case cpSockState:
		return []obs.Point{obs.PointSockState}
	case cpSockEgress:
		return []obs.Point{obs.PointSockEgress}
	case cpPod:
		return []obs.Point{obs.PointPod}
	case cpHost:
		return []obs.Point{obs.PointHost}
	case cpTCHead:
		return []obs.Point{obs.PointTCHead}
	case cpTCTail:
		return []obs.Point{obs.PointTCTail}
	case cpNFBefore:
		return []obs.Point{obs.PointNFBefore, obs.PointConntrack}
	case cpNFAfter:
		return []obs.Point{obs.PointNFAfter}
	case cpConfirm:
		return []obs.Point{obs.PointConntrack}
	case cpNodeEgress:
		return []obs.Point{obs.PointSockEgress}
	case cpLocal:
		return []obs.Point{obs.PointHost, obs.PointPod}
	case cpUplink:
		return []obs.Point{obs.PointUplink}
	}
	return nil
}

type verdict struct {
	place  Place
	by     string
	reason string
	// answer: the reject rule whose ICMP error a node process got through
	// loopback, which no capture point sees (rejected).
	answer *NATRule
}

func unknown(format string, a ...any) verdict {
	return verdict{place: PlaceUnknown, reason: fmt.Sprintf(format, a...)}
}

// decide brackets the rewrite: the last checkpoint that saw the VIP and the
// first that saw a backend enclose the place where the destination changed.
// Without why, the verdict has no reason: packet comments and counts read
// place and by only, and writing the reason was most of what deciding cost.
func (e *Engine) decide(f *flowState, why bool) verdict {
	if f.socketLBChanged() {
		// The socket's own hook saw the rewrite: what the later points
		// saw of the datagrams it left alone is not where it happened.
		return e.bracket(f, cpApp, cpSockAddr, why)
	}
	iV, iB := -1, -1
	for i, s := range f.cps {
		if s.vip && (checkpoint(i) != cpNFBefore || !e.natBeforeNF(f)) {
			iV = i
		}
		if iB < 0 && f.sawBackend(checkpoint(i)) {
			iB = i
		}
	}
	if iV >= 0 && iB < 0 {
		return e.unrewritten(f, checkpoint(iV), why)
	}
	if iV >= 0 && iV == iB {
		if v, ok := e.cameBack(f, checkpoint(iV), why); ok {
			return v
		}
	}
	if iV < 0 && iB >= 0 && f.wireVIP {
		if v, ok := e.fromWire(f, checkpoint(iB), why); ok {
			return v
		}
	}
	if iV < 0 && iB < 0 && f.wireVIP {
		if v, ok := e.takenAtUplinkIn(f, why); ok {
			return v
		}
		if rules := e.rejectsOnWire(f); len(rules) > 0 {
			if !why {
				return verdict{place: PlaceNowhere}
			}
			return e.rejected(f, rules)
		}
	}
	if iV < 0 || iV >= iB {
		if !why {
			return verdict{place: PlaceUnknown}
		}
		switch {
		case iB < 0 && f.wireVIP:
			return unknown("the request came in on the uplink with VIP %s (uplink RX) and no point saw it after", f.service)
		case iB < 0:
			return unknown("only replies were seen, no request")
		case iV < 0 && f.wireVIP:
			// The uplink's RX tap saw the VIP, before any checkpoint:
			// fromWire found no one place read between it and iB.
			return unknown("VIP %s on the uplink's wire (uplink RX, before its tc ingress), backend %s at %s, and nothing read at the uplink's ingress (a tc program, an nftables chain) or after it is the one place that can have rewritten it",
				f.service, f.cps[iB].backendAddr.addrPort(), checkpoint(iB).describe(f.cps[iB].backendFrom))
		case iV < 0:
			return unknown("backend %s seen at %s, but no active observation point saw the VIP before it%s",
				f.cps[iB].backendAddr.addrPort(), checkpoint(iB).describe(f.cps[iB].backendFrom), e.uplinkXDPNote(f))
		}
		return unknown("inconsistent: the VIP was seen at %s after backend %s at %s",
			checkpoint(iV).describe(f.cps[iV].vipFrom), f.cps[iB].backendAddr.addrPort(),
			checkpoint(iB).describe(f.cps[iB].backendFrom))
	}
	return e.bracket(f, checkpoint(iV), checkpoint(iB), why)
}

// uplinkXDPNote says, of a flow no point saw with its VIP, that an XDP
// program of the uplink can have rewritten it: XDP runs before the uplink's
// RX tap, so what it rewrote came in with the backend already, and what it
// redirected (into a Pod's veth) the uplink's taps never saw. Only for an
// outside client's request ("" otherwise): the uplink saw it come in, or no
// point of a client on the node (its socket, Pod, host veth) saw it, nor
// did the uplink's TX tap see it leave (XDP takes only what comes in).
func (e *Engine) uplinkXDPNote(f *flowState) string {
	cands := e.uplinkXDPCands(f.first)
	if len(cands) == 0 || f.fromNode {
		return ""
	}
	if f.uplinkIn.seen {
		return fmt.Sprintf(": it came in on the uplink already to the backend (its RX tap runs after XDP): rewritten by %s or before the node", oneOf(cands))
	}
	if f.cps[cpUplink].any() {
		return ""
	}
	for cp := cpApp; cp <= cpTCTail; cp++ {
		if f.cps[cp].any() {
			return ""
		}
	}
	return fmt.Sprintf(", nor did the uplink's RX tap see it come in: %s can have rewritten it and redirected it past the uplink's taps (XDP_REDIRECT), or it came in elsewhere", oneOf(cands))
}

// cameBack decides a flow whose last checkpoint that saw the VIP saw the
// backend too, later, and a later checkpoint the backend: the packets came
// back to it after the rewrite between them, through the uplink (the
// backend's route leads out and a router sends it back: a deleted backend
// Pod that the NAT rules still name, looping until its TTL runs out; a
// router that returns a local Pod's traffic). The retransmissions of the
// client came with the VIP meanwhile, so the VIP was also seen there after
// the backend: not a contradiction.
func (e *Engine) cameBack(f *flowState, at checkpoint, why bool) (verdict, bool) {
	s := f.cps[at]
	if !s.vip || !s.backend || s.backendAt <= s.vipAt {
		return verdict{}, false
	}
	for next := at + 1; int(next) < len(f.cps); next++ {
		if f.cps[next].backend {
			v := e.bracket(f, at, next, why)
			switch be := s.backendAddr.addrPort(); {
			case !why:
			case f.fromNode && e.nodeAddr(be.Addr()):
				// A node process's request that OUTPUT's DNAT sent to an
				// address of the node itself (a hostNetwork endpoint: the
				// kubernetes Service's API server) goes through loopback
				// and comes in again at prerouting, after NAT: no loop.
				v.reason += fmt.Sprintf("; backend %s is an address of the node: the request went on through loopback, in again at prerouting (where %s saw it)",
					be, at.describe(s.backendFrom))
			default:
				v.reason += fmt.Sprintf("; %s saw backend %s too, after the VIP: the packets came back to it after NAT (their route to the backend leads out of the node and back: a routing loop?)",
					at.describe(s.backendFrom), be)
			}
			return v, true
		}
	}
	return verdict{}, false
}

// nodeAddr tells whether a is an address of the node netns (loopback
// included), as far as the node's addresses were read.
func (e *Engine) nodeAddr(a netip.Addr) bool {
	a = a.Unmap()
	return a.IsLoopback() || slices.Contains(e.cfg.Attribution.NodeAddrs, a)
}

// unrewritten decides a flow no checkpoint saw with a backend.
func (e *Engine) unrewritten(f *flowState, last checkpoint, why bool) verdict {
	if v, ok := e.redirectedAtTC(f, last, why); ok {
		return v
	}
	if v, ok := e.droppedRewritten(f, last, why); ok {
		return v
	}
	local, dev := e.deliveredLocally(f)
	rejects := e.rejectsFor(f, last)
	var dropped *KernelDrop
	if !local {
		dropped = e.droppedUnrewritten(f, last)
	}
	if dropped != nil && len(rejects) > 0 {
		if (routeLookupReasons[dropped.Reason] || dropped.routeError()) && e.filterHookOf(f) != "output" {
			// The route lookup, after PREROUTING and before the forward
			// or input filter, dropped it: the rule never saw it.
			rejects = nil
		} else {
			dropped = nil
		}
	}
	switch {
	case !why && (f.cps[cpUplink].vip || local || len(rejects) > 0 || dropped != nil):
		return verdict{place: PlaceNowhere}
	case !why:
		return verdict{place: PlaceUnknown}
	}
	where := last.describe(f.cps[last].vipFrom)
	switch {
	case f.cps[cpUplink].vip:
		v := verdict{place: PlaceNowhere, reason: "the uplink TX showed the VIP as destination: it left the node unrewritten"}
		if notes := e.nowhereNotes(f); notes != "" {
			v.reason += "; " + notes
		}
		if note := e.lostOnTheWayNote(f); note != "" {
			v.reason += "; " + note
		}
		return v
	case len(rejects) > 0:
		// Before local delivery too: a NodePort or a local VIP whose
		// Service has no endpoints is rejected at input (kube-proxy's
		// KUBE-EXTERNAL-SERVICES, nodeport-endpoints-check), never reaching
		// a listener.
		return e.rejected(f, rejects)
	case local:
		on := ""
		if dev != "" {
			on = " (on " + dev + ")"
		}
		v := verdict{place: PlaceNowhere, reason: fmt.Sprintf("not rewritten: %s is an address of the node itself%s, still the destination after netfilter's NAT, so the node delivered the flow to ", f.service.Addr(), on)}
		// A listener of the node's own (NodeLocal DNSCache's on kube-dns's
		// ClusterIP) only when one answered: a NodePort no rule rewrote
		// meets the node's own stack, where nothing listens on its port.
		switch {
		case f.reply && f.tcp.refused():
			v.reason += "itself; the node's TCP reset refused it: nothing listens on that port, and no NAT rule rewrote it to a backend"
		case f.reply:
			v.reason += "its own listener (as NodeLocal DNSCache listens on kube-dns's ClusterIP), which answered"
		case f.icmp != nil:
			v.reason += fmt.Sprintf("itself; the %s from %s is its only answer", f.icmp.Message, f.icmp.From)
		default:
			v.reason += "itself; no answer came back (nothing listening there?)"
		}
		return v
	case dropped != nil:
		// The request went no further than the node's route lookup (or
		// its output path), still to the VIP: nothing on the node
		// rewrote it, whether or not an uplink is captured.
		v := verdict{place: PlaceNowhere, reason: fmt.Sprintf("not rewritten: %s was still the destination after netfilter's NAT (no DNAT applied), and the node dropped the request with it as destination after that NAT: %s", f.service, dropped.String())}
		if last != cpNFAfter {
			// No netfilter observer: the drop's place alone tells.
			v.reason = fmt.Sprintf("not rewritten: the node dropped the request with %s still its destination past netfilter's NAT (no DNAT applied; no netfilter observer attached, the drop's place tells): %s", f.service, dropped.String())
		}
		if notes := e.nowhereNotes(f); notes != "" {
			v.reason += "; " + notes
		}
		if f.icmp != nil {
			v.reason += fmt.Sprintf("; the %s from %s is its answer", f.icmp.Message, f.icmp.From)
		}
		return v
	case !e.active(obs.PointUplink):
		return unknown("the VIP was last seen at %s; no rewrite observed and the uplink capture was inactive", where)
	}
	if g := e.sharesBackends(f); g != nil {
		// An unconnected socket to two VIPs of one backend: what it sends
		// to that backend is either flow's.
		return unknown("the VIP was last seen at %s; no rewrite observed: its client endpoint also sends to %s, whose backend %s gets packets of the same tuple (they cannot be told apart after the rewrite)",
			where, g.service, g.sortedBackends()[0])
	}
	if f.reply || len(f.backends) > 0 {
		// Something answered: the request was not dropped, its rewrite
		// happened where no active point saw the request after it.
		from := ""
		if bs := f.sortedBackends(); len(bs) > 0 {
			from = " from backend " + bs[0].String()
		}
		return unknown("the VIP was last seen at %s and no point saw the request rewritten, yet an answer came back%s: it was rewritten where no active point saw it afterwards (the uplink never saw this flow)", where, from)
	}
	if e.keptInPod(f, last) {
		if dev, ok := e.cfg.Attribution.PodOtherIfaces[f.client.Addr()]; ok {
			return unknown("the VIP was last seen at %s, from %s, the address of the Pod's %s: it left the Pod through %s, where pathtrace does not capture, and no point on the node saw it afterwards: its way crosses neither the node's netfilter nor its uplink (a network of its own, as Multus gives), or it was dropped on that way", where, f.client.Addr(), dev, dev)
		}
		return unknown("the VIP was last seen at %s, and the Pod's eth0 (captured) never saw the request: it did not leave the Pod's netns that way, so nothing on the node saw it; the Pod kept it (a sidecar proxy's TPROXY capture, which delivers it to the proxy with the VIP unchanged: the proxy's own upstream connection is another flow, listed when it goes to a watched VIP (one to the Service's endpoints directly, as Envoy's, is not followed)), dropped it, or routed it out another of its interfaces", where)
	}
	if why := e.neverSent(f, last); why != "" {
		return unknown("the VIP was last seen at %s; %s", where, why)
	}
	v := unknown("the VIP was last seen at %s; no rewrite observed and the uplink never saw this flow (dropped on the node, or routed out another interface)", where)
	if note := e.netfilterProgramsNote(f); note != "" {
		v.reason += "; " + note
	}
	return v
}

// neverSent says why f, seen at its connect() or sendmsg() alone, has no
// packet anywhere, "" when another point may have missed one: the socket
// observers report a TCP socket's SYN_SENT and every watched socket's first
// packet, so with them watching and silent no packet left the socket. A
// node has no route to a VIP when nothing (kube-proxy's rules, a socket LB)
// handles it and no default route covers it: connect() and sendmsg() fail
// at once with "network unreachable", before any packet.
func (e *Engine) neverSent(f *flowState, last checkpoint) string {
	if last != cpSockAddr || f.reply || len(f.backends) > 0 || !e.active(obs.PointSockEgress) {
		return ""
	}
	for cp := cpSockAddr + 1; cp < numCheckpoints; cp++ {
		if f.cps[cp].any() {
			return ""
		}
	}
	if e.watchesLost {
		return "no packet was tied to the socket: pathtrace's kernel observers lost some of what they learn during the run (kernel_learn_errors: a socket's watch taken by others before its first packet, when more sockets wait to send at once than they keep), so it may have sent, its packets then listed as another flow of the same client; or its connect() or send failed in the kernel before any packet"
	}
	switch {
	case f.proto == obs.TCP && e.active(obs.PointSockState):
		return "the socket never entered SYN_SENT nor sent a packet: connect() failed in the kernel before its SYN (no route to the VIP, network unreachable, is the usual cause)"
	case f.proto == obs.UDP && f.kind == obs.SockSendmsg:
		return "no packet left the socket: the send failed in the kernel before any packet (no route to the VIP, network unreachable, is the usual cause)"
	case f.proto == obs.UDP:
		return "no packet left the socket: its connect() failed in the kernel (no route to the VIP, network unreachable, is the usual cause), or the socket connected to the VIP sent nothing (as one connected only to learn its source address)"
	}
	return ""
}

// keptInPod tells whether a Pod's flow, last seen with the VIP at its
// socket's first packet (after the Pod's own OUTPUT hooks and routing), was
// never seen by the Pod's eth0 tap, which captured: the request stayed in
// the Pod's netns (policy routing to lo and a TPROXY rule deliver it to a
// local proxy unrewritten) or went nowhere, and "dropped on the node" would
// send the reader to the wrong netns.
func (e *Engine) keptInPod(f *flowState, last checkpoint) bool {
	if last != cpSockEgress || f.fromNode || !e.active(obs.PointPod) {
		return false
	}
	for cp := cpPod; cp < numCheckpoints; cp++ {
		if f.cps[cp].any() {
			return false
		}
	}
	return true
}

// rejectsFor are the node's rules that reject or drop the packets of f, a
// flow that went no further than the VIP and got no answer but a refusal
// (an ICMP error, a TCP reset: what a reject rule answers with), no DNAT
// having applied: last seen after netfilter's NAT, where a filter chain
// after NAT (at forward or input for a Pod's flow, output for the node's,
// prerouting above NAT's priority) met a rule for the VIP; or last seen
// before the netfilter observers, which watched and never saw it, where a
// filter chain before NAT met one (kube-proxy nftables' filter-prerouting
// and filter-output, priority -110, run before them). kube-proxy writes such
// rules for a Service without endpoints, the ports a ClusterIP does not
// serve and loadBalancerSourceRanges, so that those connections fail at once.
func (e *Engine) rejectsFor(f *flowState, last checkpoint) []NATRule {
	beforeNAT := e.beforeNetfilter(f, last)
	// A node process's request to an address of the node (its own
	// NodePort) goes on from output through loopback to input, whose filter
	// (kube-proxy's KUBE-EXTERNAL-SERVICES, nodeport-endpoints-check) runs
	// before any listener, after the socket's egress observer saw it leave.
	_, localVIP := e.cfg.Attribution.LocalVIPs[f.service.Addr()]
	viaInput := f.fromNode && localVIP && !beforeNAT
	if last != cpNFAfter && !(viaInput && last == cpNodeEgress) && !beforeNAT || f.reply && !f.tcp.refused() || len(f.backends) > 0 || f.cps[cpUplink].any() || e.sharesBackends(f) != nil {
		return nil
	}
	// The hooks the request met, in the order it met them.
	var hooks []string
	switch {
	case viaInput && last == cpNodeEgress:
		hooks = []string{"input"} // past output's filter
	case viaInput:
		hooks = []string{"output", "input"}
	case f.fromNode:
		hooks = []string{"output"}
	case beforeNAT:
		hooks = []string{"prerouting"}
	default:
		hooks = []string{"prerouting", e.filterHookOf(f)}
	}
	return e.rejectsAt(f, hooks, beforeNAT)
}

// rejectsOnWire are the node's rules that reject or drop f, an outside
// client's request that the uplink's RX tap saw come in with the VIP and no
// point after it, and that got no answer but a refusal: the netfilter
// observers watched and never saw it, so a filter chain before them at
// prerouting ended it (kube-proxy's firewall-check of
// loadBalancerSourceRanges, priority -110), as rejectsFor finds for a Pod's
// request. None when the uplink's tc ingress has a program: it may have
// taken the request.
func (e *Engine) rejectsOnWire(f *flowState) []NATRule {
	if !e.active(obs.PointNFBefore) || f.cps[cpNFBefore].any() || f.reply && !f.tcp.refused() || len(f.backends) > 0 ||
		f.cps[cpUplink].any() || e.byUplinkInTC(f) != "" {
		return nil
	}
	return e.rejectsAt(f, []string{"prerouting"}, true)
}

// rejectsAt are the rules at hooks (in the order the packets meet them),
// before NAT or after it, that reject or drop f's packets.
func (e *Engine) rejectsAt(f *flowState, hooks []string, beforeNAT bool) []NATRule {
	var out []NATRule
	for _, hook := range hooks {
		for _, r := range e.cfg.Attribution.Rejects {
			if r.Hook == hook && vipMatches(r.VIP, r.Proto, f) && within(r.Since, r.Until, f.first) && r.BeforeNAT == beforeNAT &&
				e.clientMayMeet(r.Sources, f.client.Addr()) {
				out = append(out, r)
				if len(r.Sources) == 0 {
					// Rejects come in the order the hook runs them: the
					// first that every packet of the flow meets ends it,
					// the later ones (kube-proxy's reject of a ClusterIP's
					// other ports, after its no-endpoints reject; iptables'
					// KUBE-PROXY-FIREWALL at input after output's) never
					// see it.
					return out
				}
			}
		}
	}
	return out
}

// beforeNetfilter tells whether f was last seen before the netfilter
// observers, which watched and never saw it: at its socket for a node
// process's flow, at the Pod's veth or tc for a Pod's (not when its frames
// are bridged past netfilter: then netfilter never sees them at all).
func (e *Engine) beforeNetfilter(f *flowState, last checkpoint) bool {
	if !e.active(obs.PointNFBefore) || f.cps[cpNFBefore].any() {
		return false
	}
	if f.fromNode {
		return last == cpSockAddr || last == cpSockState
	}
	if e.bridgedPastNetfilter(f) {
		return false
	}
	return last == cpPod || last == cpHost || last == cpTCHead || last == cpTCTail
}

// bridgedPastNetfilter tells whether f's requests are bridged frames that
// netfilter's IPv4 hooks never see: a Pod's, on a node whose bridge hands
// them there no more (bridge-nf-call-iptables=0), unless its host veth is
// on no bridge: the node routes that Pod's packets into those hooks,
// whatever the sysctl says.
func (e *Engine) bridgedPastNetfilter(f *flowState) bool {
	b := e.cfg.Attribution.BridgeNFCallIPTables
	return !f.fromNode && b != nil && !*b && !e.cfg.Attribution.RoutedHostVeths[f.hostIfindex]
}

// filterHookOf is the filter hook after NAT where f's request went: output
// for the node's own, input for a Pod's to an address of the node (a
// NodePort), forward for a Pod's to any other.
func (e *Engine) filterHookOf(f *flowState) string {
	if natHookOf(f) == "output" {
		return "output"
	}
	if _, local := e.cfg.Attribution.LocalVIPs[f.service.Addr()]; local {
		return "input"
	}
	return "forward"
}

// rejected is the verdict of a flow the node's filter rejected (rejectsFor).
func (e *Engine) rejected(f *flowState, rules []NATRule) verdict {
	cands := make([]string, len(rules))
	for i, r := range rules {
		cands[i] = r.String()
	}
	reason := fmt.Sprintf("not rewritten: %s was still the destination after netfilter's NAT (no DNAT applied), and the node's filter ends it: %s", f.service, oneOf(cands))
	if r := rules[0]; r.BeforeNAT {
		reason = fmt.Sprintf("not rewritten: the node's filter ends the connection to %s at %s before netfilter's NAT (and before pathtrace's netfilter observers, which never saw it): %s", f.service, r.Hook, oneOf(cands))
	}
	v := verdict{place: PlaceNowhere}
	switch {
	case f.icmp != nil && sameICMPAnswer(rules) && f.icmp.Message != rules[0].ICMPAnswer:
		// The rule answers otherwise: something before it refused the
		// request (a route lookup whose drop the kernel drop observer,
		// not attached, did not report).
		reason += fmt.Sprintf("; yet the %s from %s that came back is not the rule's answer (%s): something before the rule refused the request, such as the node's route lookup",
			f.icmp.Message, f.icmp.From, rules[0].ICMPAnswer)
	case f.icmp != nil:
		reason += fmt.Sprintf("; the %s from %s is its answer", f.icmp.Message, f.icmp.From)
	case f.reply:
		reason += "; the TCP reset that answered it is the rule's"
	case f.fromNode && f.client.Addr().IsValid() && sameICMPAnswer(rules):
		// A node process's refusal comes back through loopback, which
		// no tap captures, nor do the netfilter observers report ICMP.
		v.answer = &rules[0]
		reason += fmt.Sprintf("; the rule answers the node process with an %s from its own address %s, through loopback (not captured: known from the rule)", rules[0].ICMPAnswer, f.client.Addr())
	}
	v.reason = reason
	return v
}

// sameICMPAnswer tells whether every candidate rule answers with one ICMP
// error, known.
func sameICMPAnswer(rules []NATRule) bool {
	for _, r := range rules {
		if r.ICMPAnswer == "" || r.ICMPAnswer != rules[0].ICMPAnswer {
			return false
		}
	}
	return len(rules) > 0
}

// redirectedAtTC decides a flow last seen with the VIP at the tc head of
// its host veth whose backend answered, where the tc tail and netfilter,
// both watching, never saw the request: a program of the tcx chain took it
// out of the chain (a redirect, Cilium's fast path), past every later
// point; what else rewrote it is a tc program too, on the uplink's egress
// (with the SNAT that hides its uplink frame: a BPF SNAT leaves no conntrack
// entry to link that frame by). On a node without tails (only legacy
// cls_bpf filters, which run after the whole tcx chain), the head sees what
// a tail would: a filter after it took the request out.
func (e *Engine) redirectedAtTC(f *flowState, last checkpoint, why bool) (verdict, bool) {
	if last != cpTCHead || !f.reply || len(f.backends) == 0 || f.cps[cpTCTail].any() ||
		!e.active(obs.PointNFBefore) || f.cps[cpNFBefore].any() {
		return verdict{}, false
	}
	v := verdict{place: PlaceTC, by: oneOf(append(e.tcCands(f), e.uplinkTCCands(f, "egress")...))}
	if why {
		// Without tails (a node of legacy cls_bpf filters only, which run
		// after the whole tcx chain), the head sees what a tail would: a
		// filter after it took the request out of the stack.
		seen, out := "neither the tc tail nor netfilter (both watching) saw the request", "took it out of the tcx chain (a redirect)"
		if !e.active(obs.PointTCTail) {
			seen, out = "netfilter (watching) never saw the request (no tc tail watched: the head sees what it would)", "took it out of the stack (a redirect)"
		}
		// Begun while the taps were still opening, the uplink's silence
		// is theirs: the reason says so.
		v.reason = e.outsideWindow(f) + fmt.Sprintf("VIP %s at tc head ingress, then %s, yet backend %s answered: a tc program rewrote it and %s; the uplink frame, if any, was not recognized (a BPF SNAT leaves no conntrack entry to link it)",
			f.service, seen, f.sortedBackends()[0], out)
	}
	return v, true
}

// droppedRewritten decides a flow no checkpoint saw with a backend whose
// request the kernel dropped in the node's netns with a backend as
// destination (rewrittenDrop), before the uplink's TX tap or a Pod of the
// node saw it: a tc program that redirected it past the later points (or
// whose chain no tail watched) and dropped it itself, or had it dropped at
// the uplink's egress. That drop is the one sighting of the backend: the
// rewrite happened between the last point that saw the VIP and it, at the
// host veth's tc ingress when the drop was there (TC_INGRESS), else before
// the uplink's TX tap. Conntrack's silence excludes netfilter only for a
// drop after conntrack confirmed the connection (afterConfirm): it never
// reports one whose first packet was dropped before.
func (e *Engine) droppedRewritten(f *flowState, last checkpoint, why bool) (verdict, bool) {
	d := e.rewrittenDrop(f)
	if d == nil || len(f.backends) == 0 || f.cps[cpUplink].any() || f.cps[cpLocal].any() {
		return verdict{}, false
	}
	upto, atVeth := cpUplink, d.Reason == "TC_INGRESS" && f.hostIfindex != 0 && d.Ifindex == int(f.hostIfindex)
	if atVeth {
		upto = cpNFBefore // past the host veth's tc ingress only
	}
	cands := e.gapsBetween(f, last, upto)
	var notes []string
	if atVeth {
		notes = append(notes, "dropped at its host veth's tc ingress: the rewrite was there or before")
	}
	if slices.Contains(cands, gapNetfilter) && (e.nfNeverSaw(f) || afterConfirm(d.Reason)) {
		if excluded, _ := e.netfilterExcluded(f, why); excluded != "" {
			cands = removeGap(cands, gapNetfilter)
			notes = append(notes, "netfilter excluded: "+excluded)
			if e.nfNeverSaw(f) {
				cands = removeGap(cands, gapIPVS)
			}
		}
	}
	if !atVeth && len(e.uplinkEgressCands(f)) > 0 && (len(cands) == 0 || slices.Equal(cands, []gap{gapTC}) && len(e.hostIngressCands(f)) == 0) {
		// As bracket's: past every other place, the uplink's egress.
		cands = []gap{gapUplinkTC}
	}
	base := ""
	if why {
		base = fmt.Sprintf("VIP %s at %s, backend %s only as the destination of the requests the kernel dropped on the node (the drops follow): no point saw them after the rewrite",
			f.service, last.describe(f.cps[last].vipFrom), f.sortedBackends()[0])
	}
	if len(cands) != 1 || cands[0] == gapPodNetns && len(e.podTCCands(f)) == 0 {
		if !why {
			return verdict{place: PlaceUnknown}, true
		}
		if len(cands) == 0 {
			return unknown("%s: nothing read between them rewrites destinations (a tc action pathtrace does not read, such as act_bpf or a bare ct nat, a rule pathtrace does not decode)", base), true
		}
		names := make([]string, len(cands))
		for i, g := range cands {
			names[i] = g.String()
		}
		v := unknown("%s: could be %s", base, strings.Join(names, " or "))
		if slices.Contains(cands, gapNetfilter) && !e.nfNeverSaw(f) && !afterConfirm(d.Reason) && e.active(obs.PointConntrack) {
			v.reason += "; conntrack's silence does not exclude netfilter: it never reports a connection whose first packet was dropped before it confirmed it"
		}
		return v, true
	}
	g := cands[0]
	v := e.byGap(f, g)
	if g == gapPodNetns {
		v = verdict{place: PlaceTC, by: oneOf(e.podTCCands(f))}
	}
	if !why {
		return v, true
	}
	if v.place == PlaceUnknown {
		return unknown("%s: %s", base, bothOnDevice(g, v.by)), true
	}
	notes = append(notes, e.notLeftNote(f, g))
	v.reason = base
	for _, n := range notes {
		if n != "" {
			v.reason += "; " + n
		}
	}
	return v, true
}

// deliveredLocally tells whether an unrewritten flow went to a VIP that is
// an address of the node (and the device holding it): its request still
// had the VIP after netfilter's NAT, and no IPVS service (which rewrites at
// local delivery, on the node addresses kube-ipvs0 holds) has the VIP.
func (e *Engine) deliveredLocally(f *flowState) (bool, string) {
	dev, ok := e.cfg.Attribution.LocalVIPs[f.service.Addr()]
	if !ok || !f.cps[cpNFAfter].vip || len(e.ipvsFor(f)) > 0 {
		return false, ""
	}
	return true, dev
}

// sharesBackends is another flow of f's client endpoint, to another VIP,
// with a backend, active while f was: the packets of f after its rewrite,
// if it went to that backend, were taken for that flow's.
func (e *Engine) sharesBackends(f *flowState) *flowState {
	for _, g := range e.clients[f.key()] {
		if g != f && g.service != f.service && len(g.backends) > 0 && !g.last.Before(f.first) && !f.last.Before(g.first) {
			return g
		}
	}
	return nil
}

// nowhereNotes explains an unrewritten flow from what the node has.
func (e *Engine) nowhereNotes(f *flowState) string {
	var notes []string
	// A routed Pod's packets pass no bridge.
	routed := e.cfg.Attribution.RoutedHostVeths[f.hostIfindex]
	rules := e.natRulesFor(f, netip.AddrPort{})
	if len(rules) > 0 {
		note := fmt.Sprintf("%d NAT rule(s) for the VIP exist but did not apply", len(rules))
		// That sysctl is why only for a bridged request netfilter missed.
		if e.bridgedPastNetfilter(f) && !f.cps[cpNFBefore].any() {
			note += " (bridge-nf-call-iptables=0: bridged frames bypass netfilter)"
		}
		notes = append(notes, note)
	}
	if e.active(obs.PointNFBefore) && !f.cps[cpNFBefore].any() {
		note := "netfilter never saw it"
		var redirs []string
		for _, r := range e.cfg.Attribution.HostRedirects {
			if (r.Ifindex == 0 || f.hostIfindex == 0 || r.Ifindex == f.hostIfindex) && (r.Until.IsZero() || f.first.Before(r.Until)) &&
				(r.Since.IsZero() || !f.first.Before(r.Since.Add(-tcTimeSlack))) {
				redirs = append(redirs, r.Text)
			}
		}
		if len(redirs) > 0 {
			past := "the bridge and netfilter"
			if routed {
				past = "netfilter"
			}
			note += " (a tc filter at its host veth's ingress sends packets to another interface, past " + past + ": " + strings.Join(redirs, "; ") + ")"
		}
		note += e.vlanTaggedBypass(f)
		notes = append(notes, note)
	}
	return strings.Join(notes, "; ")
}

// vlanTaggedBypass says, for a Pod's request that netfilter never saw and
// that left the uplink tagged, that bridge-nf-filter-vlan-tagged 0 keeps
// netfilter from the frames a bridge carries tagged (a tag pushed on the
// Pod's host veth, as OVS ports and Contiv do); "" otherwise, and for a
// Pod whose host veth has no master (routed: no bridge carried it).
// Whether the bridge carried this one tagged or the uplink tagged it, no
// point tells.
func (e *Engine) vlanTaggedBypass(f *flowState) string {
	a := e.cfg.Attribution
	call, vlanTagged := a.BridgeNFCallIPTables, a.BridgeNFFilterVLANTagged
	if f.fromNode || a.RoutedHostVeths[f.hostIfindex] || call == nil || !*call || vlanTagged == nil || *vlanTagged || !f.uplink.seen || (f.uplink.vlan == 0 && f.uplink.tpid == 0) {
		return ""
	}
	on := fmt.Sprintf("on VLAN %d", f.uplink.vlan)
	if f.uplink.vlan == 0 { // br_netfilter passes by a tag whatever its VLAN ID
		on = "with a priority tag, VLAN ID 0"
	}
	return " (bridge-nf-filter-vlan-tagged=0: netfilter does not see the frames a bridge carries VLAN-tagged, and it left the uplink " + on + ")"
}

// fromWire decides a request that came in on the uplink with the VIP (an
// outside client's) and that no later checkpoint saw with it, the first
// to see it having the backend (iB): between the uplink's RX tap and the
// node's checkpoints from PREROUTING on, only the uplink's tc ingress and
// its nftables ingress chains (netdev, inet), and the places after
// PREROUTING up to iB, can have rewritten it. False when that is not one
// place.
func (e *Engine) fromWire(f *flowState, iB checkpoint, why bool) (verdict, bool) {
	tc, nft := e.uplinkTCCands(f, "ingress"), e.deviceCands(f, true, "ingress")
	if iB < cpNFBefore || len(tc)+len(nft) == 0 {
		return verdict{}, false
	}
	cands := []gap{gapUplinkInTC}
	for cp := cpNFAfter; cp <= iB; cp++ {
		g := gapBefore(cp)
		if g == gapNothing || (g == gapIPVS && len(e.ipvsFor(f)) == 0) || slices.Contains(cands, g) {
			continue
		}
		cands = append(cands, g)
	}
	excluded := ""
	if slices.Contains(cands, gapNetfilter) {
		if excluded, _ = e.netfilterExcluded(f, why); excluded != "" {
			cands = removeGap(cands, gapNetfilter)
			if e.nfNeverSaw(f) {
				cands = removeGap(cands, gapIPVS) // it runs in netfilter's hooks, after the observer
			}
		}
	}
	if len(cands) != 1 {
		return verdict{}, false
	}
	v := verdict{}
	v.place, v.by = onDevice(tc, nft)
	if why {
		v.reason = fmt.Sprintf("VIP %s on the uplink's wire (uplink RX, before its tc ingress), backend %s at %s",
			f.service, f.cps[iB].backendAddr.addrPort(), iB.describe(f.cps[iB].backendFrom))
		if excluded != "" {
			v.reason += "; netfilter excluded: " + excluded
		}
		switch v.place {
		case PlaceNetfilter:
			v.reason += "; set by a rule of an nftables chain on the uplink's ingress hook, which runs after its tc ingress and before PREROUTING: a stateless rewrite, no NAT"
		case PlaceUnknown:
			v.reason += "; a tc program and an nftables chain at the uplink's ingress can both have done it, and no point watches between them: " + v.by
		}
	}
	if v.place == PlaceUnknown {
		v.by = ""
	}
	return v, true
}

// takenAtUplinkIn decides a request that came in on the uplink with the VIP
// (an outside client's, to a NodePort) that no point saw after the uplink's
// RX tap, with netfilter watching and never seeing it, and that was answered
// from the VIP out of the uplink: only the uplink's tc ingress runs between
// that tap and PREROUTING, and its program took the request out of the stack
// and had it answered (Cilium's bpf_host in SNAT mode redirects a NodePort's
// request to a backend on another node straight back out of the uplink; its
// frames to the backend carry the node's address, which no point links to
// the flow). The backend stays unseen. False when that does not hold.
func (e *Engine) takenAtUplinkIn(f *flowState, why bool) (verdict, bool) {
	by := e.byUplinkInTC(f)
	if by == "" {
		return verdict{}, false
	}
	if !f.wireAnswered {
		return verdict{}, false
	}
	excluded, _ := e.netfilterExcluded(f, why)
	if excluded == "" {
		return verdict{}, false
	}
	v := verdict{place: PlaceTC, by: by}
	if why {
		v.reason = fmt.Sprintf("VIP %s on the uplink's wire (uplink RX, before its tc ingress), and replies from it left the uplink, but no point after saw the request: the uplink's tc ingress program took it out of the stack (a redirect, as to a backend on another node with BPF SNAT, whose frames carry the node's address, which no point links to this flow); netfilter excluded: %s; backend unseen",
			f.service, excluded)
	}
	return v, true
}

// gapsBetween are the places that can rewrite f's destination after
// checkpoint from up to checkpoint to, each once, in path order (IPVS only
// for a Service it holds).
func (e *Engine) gapsBetween(f *flowState, from, to checkpoint) []gap {
	var cands []gap
	for cp := from + 1; cp <= to; cp++ {
		g := e.gapAt(f, cp)
		if g == gapNothing || (g == gapIPVS && len(e.ipvsFor(f)) == 0) || slices.Contains(cands, g) {
			continue
		}
		cands = append(cands, g)
	}
	return cands
}

// bracket decides between the last VIP checkpoint iV and the first backend
// checkpoint iB (iV < iB).
func (e *Engine) bracket(f *flowState, iV, iB checkpoint, why bool) verdict {
	cands := e.gapsBetween(f, iV, iB)
	if len(cands) == 0 && iB == cpUplink && len(e.uplinkEgressCands(f)) > 0 {
		// Past every other place that rewrites, the VIP; on the uplink's
		// wire, the backend: only the uplink's egress (its nftables egress
		// chains, then its tc) was in between.
		// (Not a candidate otherwise: it cannot be told from the others
		// without an observer of its own, and mostly pushes VLAN tags.)
		cands = []gap{gapUplinkTC}
	}
	var notes []string
	if len(cands) > 1 && slices.Contains(cands, gapSocket) && e.noSockPrograms(f) {
		// A UDP socket redirected by its Pod's own OUTPUT NAT (a sidecar's
		// DNS capture): no socket tuple between the socket observer and
		// the first packet, but nothing at the socket layer to rewrite.
		cands = removeGap(cands, gapSocket)
		notes = append(notes, "socket excluded: no sock_addr program is effective on the client's cgroup")
	}
	if len(cands) > 1 && slices.Contains(cands, gapPodNAT) && slices.Contains(cands, gapSocket) && f.sentElsewhere {
		// A NAT keeps one destination per connection (conntrack's
		// entry): what sends one socket port's datagrams to one
		// destination to several backends runs at the socket, after
		// its observer.
		cands = removeGap(cands, gapPodNAT)
		notes = append(notes, "netfilter in the Pod's netns excluded: the datagrams its socket's observer saw go to one destination left one port for several backends, where a NAT keeps one per connection")
	}
	doubt := ""
	if len(cands) > 1 && slices.Contains(cands, gapNetfilter) {
		var excluded string
		if excluded, doubt = e.netfilterExcluded(f, why); excluded != "" {
			cands = removeGap(cands, gapNetfilter)
			notes = append(notes, "netfilter excluded: "+excluded)
			if e.nfNeverSaw(f) && slices.Contains(cands, gapIPVS) {
				cands = removeGap(cands, gapIPVS)
				notes = append(notes, "ipvs excluded: it runs in netfilter's hooks, after the netfilter observer that never saw this flow")
			}
		}
	}
	if len(cands) > 1 && slices.Contains(cands, gapPodNetns) && slices.Contains(cands, gapTC) && e.hostSide(f) != 0 &&
		len(e.podTCCands(f)) == 0 && len(e.hostIngressCands(f)) > 0 {
		// No point between its socket and the node saw the request (a Pod
		// found after its first packets): of the places in between, its
		// host veth's ingress has a program, its eth0 had none when read.
		cands = removeGap(cands, gapPodNetns)
		notes = append(notes, "tc egress in the Pod's netns excluded: its eth0 had no tc program when the Pod was read, its host veth's ingress has one")
	}
	if len(cands) > 1 && slices.Contains(cands, gapNetkit) && e.bypassedHostSide(f) {
		// Every place after the netkit pair is on the node side, whose
		// points (watching) never saw the request: a program of the pair
		// sent it elsewhere.
		cands = slices.DeleteFunc(cands, func(g gap) bool { return g == gapTC || g == gapNetfilter || g == gapIPVS })
		notes = append(notes, "the host side of its netkit pair and every later point of the node (watching) never saw it: the pair's program redirected it past the node's stack (bpf_redirect_neigh or bpf_redirect to the uplink)")
	}
	if stacked, ok := e.cfg.Attribution.StackedPods[f.client.Addr()]; ok && slices.Equal(cands, []gap{gapUplinkTC}) && len(e.uplinkEgressCands(f)) == 0 {
		if !why {
			return verdict{place: PlaceUnknown}
		}
		v := unknown("%s: the Pod's eth0 has no host side (%s): only the uplink's egress runs in between, where no tc program and no nftables egress chain's rule for the VIP was found (a tc action pathtrace does not read, such as act_bpf or a bare ct nat, or a rule whose conditions or rewrite pathtrace does not decode)", bracketBase(f, iV, iB), stacked)
		for _, n := range notes {
			v.reason += "; " + n
		}
		return v
	}
	if len(cands) == 1 && cands[0] == gapTC && iB == cpUplink && len(e.hostIngressCands(f)) == 0 && len(e.uplinkEgressCands(f)) > 0 {
		// The tc left between the two points is the host veth's ingress,
		// which had no program or nftables ingress chain that can have
		// rewritten (none at all on a bridged node's veth, or only tcx
		// programs the tail saw pass the VIP), and the uplink's egress,
		// before its TX tap, which has.
		cands = []gap{gapUplinkTC}
		notes = append(notes, "the host veth's ingress has no tc program or nftables chain that can have rewritten it; the uplink's tc egress or an nftables egress chain of it, just before its TX tap, has")
	}
	if len(cands) == 1 && cands[0] == gapPodNetns {
		// Between the socket's egress hook and the Pod's eth0 tap only its
		// eth0's tc egress runs: its programs, when it has some, did it.
		if by := oneOf(e.podTCCands(f)); by != "" {
			v := verdict{place: PlaceTC, by: by}
			if why {
				v.reason = bracketBase(f, iV, iB) + "; rewritten inside the Pod's netns, by a tc program on its eth0's egress, before the packet reached the node"
			}
			return v
		}
	}
	if len(cands) != 1 || cands[0] == gapPodNetns {
		if !why {
			return verdict{place: PlaceUnknown}
		}
		base := bracketBase(f, iV, iB)
		switch {
		case len(cands) == 0 && iB == cpHost && len(e.hostXDPCands(f)) > 0:
			// XDP runs before the veth's RX tap: pathtrace has no place
			// for it, nor an observer to tell what it did.
			return unknown("%s: only the host veth's XDP program runs in between, before its RX tap: %s", base, oneOf(e.hostXDPCands(f)))
		case len(cands) == 0:
			return unknown("%s: nothing between these points rewrites destinations (inconsistent observations)", base)
		case len(cands) > 1:
			names := make([]string, len(cands))
			for i, g := range cands {
				names[i] = g.String()
			}
			v := unknown("%s: could be %s; %s", base, strings.Join(names, " or "), e.blindSpots(iV, iB))
			if doubt != "" {
				v.reason += "; conntrack reported no connection for this flow, which does not exclude netfilter: " + doubt
			}
			return v
		}
		return unknown("%s: rewritten inside the Pod's netns, at its eth0's egress, where no tc program was found when the Pod was read (one attached since, a tc action pathtrace does not read, such as act_bpf or a bare ct nat, or an nftables netdev egress rule)", base)
	}
	g := cands[0]
	v := e.byGap(f, g)
	if v.place == PlaceUnknown {
		if !why {
			return verdict{place: PlaceUnknown}
		}
		return unknown("%s: %s", bracketBase(f, iV, iB), bothOnDevice(g, v.by))
	}
	if !why {
		return v
	}
	switch g {
	case gapNetkit:
		notes = append(notes, "rewritten inside the Pod's netkit pair, by a program its host side (the primary) holds for what the Pod sends, which runs after the Pod's eth0 TX tap and before the host side's RX tap")
	case gapTC:
		switch {
		case v.place == PlaceNetfilter:
			next := "the bridge and netfilter's IP hooks"
			if e.cfg.Attribution.RoutedHostVeths[f.hostIfindex] {
				next = "netfilter's IP hooks" // no bridge: the node routes the Pod
			}
			notes = append(notes, "set by a rule of an nftables chain on the host veth's ingress hook, which runs after its tc ingress and before "+next+": a stateless rewrite, no NAT (conntrack's original destination is the backend)")
		case iB > cpTCTail && e.tcxChainEnded(f):
			notes = append(notes, "tc tail ingress never saw it: the rewriting program ended the tcx chain (so no cls_bpf filter ran)")
		}
		if e.natBeforeNF(f) {
			notes = append(notes, "conntrack's entry has the VIP as its original destination, made before netfilter's NAT hook: a NAT through conntrack at tc (act_ct)")
		}
	case gapUplinkTC:
		if v.place == PlaceNetfilter {
			notes = append(notes, "set by a rule of an nftables chain on the uplink's egress hook, which runs before its tc egress and TX tap: a stateless rewrite, no NAT")
		}
	case gapNetfilter:
		notes = append(notes, e.conntrackNote(f, iV, iB))
	case gapPodNAT:
		b := f.cps[iB].backendAddr.addrPort()
		switch d := f.refusedInPod(); {
		case d != nil:
			answer := "a TCP reset"
			if f.proto == obs.UDP {
				answer = "an ICMP port unreachable"
			}
			notes = append(notes, fmt.Sprintf("redirected to the Pod itself (%s), as a sidecar proxy's capture does, but nothing listened there: the Pod's kernel dropped the request (%s in %s) and refused it with %s (not captured: known from the drop), so no proxy took it: the proxy was not running or not ready (an app that starts before its sidecar)", b, d.Reason, d.Function, answer))
		case b.Addr().IsLoopback():
			notes = append(notes, fmt.Sprintf("redirected to the Pod itself (%s), as a sidecar proxy's capture does: the proxy's own upstream connection is another flow, listed when it goes to a watched VIP (one to the Service's endpoints directly, as Envoy's, is not followed)", b)+e.proxyUpstreamNote(f))
		}
		if !f.reply && !f.cps[cpPod].any() {
			notes = append(notes, "it never left the Pod: no capture point could see it or its reply")
		}
	case gapSocket:
		notes = append(notes, f.ownPodNote())
	}
	if v.by == "" {
		notes = append(notes, "no "+g.String()+" rewriter for the VIP was found on the node")
	}
	notes = append(notes, e.notLeftNote(f, g), e.netfilterProgramsNote(f), e.lostOnTheWayNote(f))
	if bs := f.sortedBackends(); len(bs) > 1 {
		notes = append(notes, fmt.Sprintf("%d backends seen", len(bs)))
	}
	notes = append(notes, snatNote(f))
	v.reason = bracketBase(f, iV, iB)
	for _, n := range notes {
		if n != "" {
			v.reason += "; " + n
		}
	}
	return v
}

// proxyWindow bounds how long after a redirected connection the
// connections its Pod then opens to the same VIP are named as its proxy's.
const proxyWindow = time.Second

// proxyUpstream is a flow that can be a redirected connection's proxy
// upstream, as its reason names it.
type proxyUpstream struct {
	id    int
	after time.Duration // its first sighting after the redirected one's
	pid   uint32
	comm  string
	place Place
}

// proxyUpstreams are the flows that can be the upstream connection of f,
// an app's connection its Pod redirected to a local proxy: those to the
// same VIP from the same Pod by another process (the proxy, which the
// redirect skips), begun after f, within proxyWindow and before the Pod's
// next redirected connection to it, by first sighting: the retired ones
// (a closed upstream retires before the app's connection, whose close no
// point sees: noteProxyUpstreams), then the open ones. Nothing links one
// to the other in the kernel: connections redirected at once share their
// candidates, and an HTTP proxy may reuse one it opened before.
func (e *Engine) proxyUpstreams(f *flowState) []proxyUpstream {
	ups := slices.Clone(e.retiredUpstreams[f])
	list := e.podFlowsOf(f)
	i, _ := slices.BinarySearchFunc(list, f.first, func(g *flowState, t time.Time) int { return g.first.Compare(t) })
	end := f.first.Add(proxyWindow)
	for _, g := range list[i:] {
		if !g.first.Before(end) {
			break
		}
		if g == f {
			continue
		}
		if redirectedInPod(g) {
			if g.first.After(f.first) {
				break // the Pod's next redirected connection: its proxy's follow it
			}
			continue
		}
		if g.pid != f.pid {
			ups = append(ups, proxyUpstream{e.idOf(g), g.first.Sub(f.first), g.pid, g.comm, e.cachedVerdict(g).place})
		}
	}
	return ups
}

// toOwnPod tells whether f's backend is an address of its client's own
// Pod: a loopback address, or the client's own (a socket LB that picked
// the client's Pod, as Cilium's does when the Service's endpoint is that
// Pod). A packet the socket sent there goes through the Pod's loopback,
// never to its eth0: no capture point is on its way, nor on its reply's.
func (f *flowState) toOwnPod() bool {
	bs := f.sortedBackends()
	return !f.fromNode && len(bs) > 0 && (bs[0].Addr().IsLoopback() || bs[0].Addr() == f.client.Addr())
}

// ownPodNote says, of a flow the socket layer sent to its client's own
// Pod (toOwnPod), that it never left the Pod, or that nothing listened
// there (refusedInPod); rather than let the row read as a request the
// node lost. "" for any other flow, or one that got a reply all the same.
func (f *flowState) ownPodNote() string {
	if !f.toOwnPod() {
		return ""
	}
	b := f.sortedBackends()[0]
	if d := f.refusedInPod(); d != nil {
		answer := "a TCP reset"
		if f.proto == obs.UDP {
			answer = "an ICMP port unreachable"
		}
		return fmt.Sprintf("the socket layer sent it to the client's own Pod (%s), but nothing listened there: the Pod's kernel dropped the request (%s in %s) and refused it with %s (not captured: known from the drop)", b, d.Reason, d.Function, answer)
	}
	if f.reply {
		return ""
	}
	return fmt.Sprintf("the socket layer sent it to the client's own Pod (%s): it went through the Pod's loopback and never left the Pod, so no capture point could see it or its reply", b)
}

// redirectedInPod tells whether f's backend is a loopback address: its
// Pod's own NAT redirected it to a local proxy.
func redirectedInPod(f *flowState) bool {
	bs := f.sortedBackends()
	return len(bs) > 0 && bs[0].Addr().IsLoopback()
}

// noteProxyUpstreams keeps, of g, a flow about to be retired, what the
// reason of the redirected connection it can be the proxy upstream of
// names, while that one is open: the Pod's last redirected connection to
// the same VIP begun before it (proxyUpstreams).
func (e *Engine) noteProxyUpstreams(g *flowState) {
	if redirectedInPod(g) {
		return
	}
	list := e.podFlowsOf(g)
	i, _ := slices.BinarySearchFunc(list, g.first, func(f *flowState, t time.Time) int { return f.first.Compare(t) })
	for _, f := range slices.Backward(list[:i]) {
		if !redirectedInPod(f) || f.retired {
			continue
		}
		if f.pid != g.pid && g.first.Sub(f.first) < proxyWindow {
			if e.retiredUpstreams == nil {
				e.retiredUpstreams = make(map[*flowState][]proxyUpstream)
			}
			e.retiredUpstreams[f] = append(e.retiredUpstreams[f], proxyUpstream{e.idOf(g), g.first.Sub(f.first), g.pid, g.comm, g.cached.place})
		}
		return
	}
}

// podFlowKey groups the flows of one client address to one Service.
type podFlowKey struct {
	proto   obs.Proto
	client  netip.Addr
	service netip.AddrPort
}

// podFlowsOf are the flows of f's client address to f's Service, by first
// sighting. The index is made at the first call of a round of snapshots
// (proxyUpstreams scans every flow otherwise, for each redirected one) and
// dropped after it (Flows, retire).
func (e *Engine) podFlowsOf(f *flowState) []*flowState {
	if e.podFlows == nil {
		e.podFlows = make(map[podFlowKey][]*flowState)
		for _, list := range e.clients {
			for _, g := range list {
				k := podFlowKey{g.proto, g.client.Addr(), g.service}
				e.podFlows[k] = append(e.podFlows[k], g)
			}
		}
		for _, list := range e.podFlows {
			slices.SortFunc(list, byFirstSeen)
		}
	}
	return e.podFlows[podFlowKey{f.proto, f.client.Addr(), f.service}]
}

// proxyUpstreamNote names f's proxyUpstreams, "" when there is none.
func (e *Engine) proxyUpstreamNote(f *flowState) string {
	ups := e.proxyUpstreams(f)
	if len(ups) == 0 {
		return ""
	}
	parts := make([]string, len(ups))
	for i, u := range ups {
		who := ""
		if u.pid != 0 {
			who = fmt.Sprintf("%s pid %d, ", u.comm, u.pid)
		}
		parts[i] = fmt.Sprintf("flow %d (%s%s after: %s)", u.id, who, u.after.Round(10*time.Microsecond), u.place)
	}
	return fmt.Sprintf("; its Pod's connections to %s by another process begun after it (within %s, before its next one redirected), the proxy's upstream when it opens one per connection: %s", f.service, proxyWindow, strings.Join(parts, ", "))
}

// byGap places a rewrite at g, the one place that can have done it, and
// names what there can have: unknown when a tc program and an nftables
// chain on one device both can (bothOnDevice).
func (e *Engine) byGap(f *flowState, g gap) verdict {
	v := verdict{place: g.place()}
	switch g {
	case gapSocket:
		v.by = e.bySocket(f)
	case gapTC:
		v.place, v.by = onDevice(e.tcCands(f), e.hostDeviceCands(f))
	case gapNetkit:
		v.by = oneOf(e.netkitCands(f))
	case gapUplinkTC:
		v.place, v.by = onDevice(e.uplinkTCCands(f, "egress"), e.uplinkDeviceCands(f))
	case gapNetfilter:
		v.by = e.byNAT(f)
	case gapIPVS:
		v.by = e.byIPVS(f)
	case gapPodNAT:
		v.by = ByClientNetfilter
	}
	return v
}

// bothOnDevice says why a rewrite at g is unknown: a tc program and an
// nftables chain on the same device (by names them), between which no
// point watches.
func bothOnDevice(g gap, by string) string {
	at := "the host veth's ingress"
	if g == gapUplinkTC {
		at = "the uplink's egress"
	}
	return fmt.Sprintf("a tc program and an nftables chain at %s can both have done it, and no point watches between them: %s", at, by)
}

// snatNote names the source conntrack says the node's SNAT gave f. It
// says the flow left with it only when the uplink's TX tap saw the flow
// leave: a flow to a Pod of the node (a hairpin, a local backend), whose
// source conntrack remapped too, never left the node. "" without SNAT.
func snatNote(f *flowState) string {
	switch {
	case !f.snat.IsValid():
		return ""
	case f.cps[cpUplink].any():
		return "SNAT on the node: it left with source " + f.snat.String() + " (conntrack)"
	case f.cps[cpLocal].any():
		return "SNAT on the node: conntrack gave it source " + f.snat.String() + " on its way to a Pod of the node (it did not leave the node)"
	}
	return "SNAT on the node: conntrack gave it source " + f.snat.String()
}

// noSockPrograms tells whether the sock_addr programs effective on f's
// client cgroup were read (the session resolves a client's cgroup when it
// first sees it) and none of them, pathtrace's own left out, runs at f's
// hook: the socket layer then cannot have rewritten its destination.
func (e *Engine) noSockPrograms(f *flowState) bool {
	if _, ok := e.cfg.Attribution.SockProgramsByCgroup[f.cgroup]; !ok || f.cgroup == 0 {
		return false
	}
	return e.bySocket(f) == ""
}

// notLeftNote says, of a rewritten flow that got no answer (no reply, no
// ICMP error), that the uplink's TX tap, which captured, never saw its
// request after the rewrite, nor did it reach a Pod of the node: the node
// lost it after the rewrite (a filter rule, the uplink's qdisc: a TBF or
// a full queue drops before the TX tap) or sent it elsewhere. Without it the
// row reads as a backend that does not answer. "" otherwise; a sidecar's
// redirect in the Pod (gapPodNAT) says why it never left the Pod itself.
//
// A flow whose backend is its client's own Pod (a hairpin) has no business
// on the uplink: when it never came back into that Pod (its host veth's TX
// tap, which captured, never saw it after the rewrite), the note says so,
// and what usually stops it there, rather than name the uplink: a bridge
// port without hairpin mode, or on a routed Pod (its host veth has no
// master, Attribution.RoutedHostVeths), which no hairpin mode concerns,
// a filter rule; or, when the kernel named why it dropped the request
// (requestDropped), that drop alone.
func (e *Engine) notLeftNote(f *flowState, g gap) string {
	if f.reply || f.icmp != nil || g == gapPodNAT || g == gapSocket && f.toOwnPod() || f.cps[cpUplink].any() || f.cps[cpLocal].any() || e.window(f) != withinWindow {
		return ""
	}
	if bs := f.sortedBackends(); len(bs) > 0 && bs[0].Addr() == f.client.Addr() && !f.fromNode && e.active(obs.PointHost) {
		if f.requestDropped() {
			// The drop observer saw why (its drops follow): a filter rule,
			// a masquerade with no address to give; a bridge that refuses
			// a hairpin names no reason, so its hairpin mode is not it.
			return "no answer: its backend is the client's own Pod (a hairpin), and the request never came back into it after the rewrite (its host veth's TX tap, which captured, never saw it): the kernel dropped it on the node, for the reason it names"
		}
		if f.hostIfindex != 0 && e.cfg.Attribution.RoutedHostVeths[f.hostIfindex] {
			return "no answer: its backend is the client's own Pod (a hairpin), and the request never came back into it after the rewrite (its host veth's TX tap, which captured, never saw it): the node routes this Pod's packets (its host veth has no bridge, so no hairpin mode applies): the node dropped it between the rewrite and that veth (a filter rule at forward, a NetworkPolicy's) or routed it elsewhere"
		}
		return "no answer: its backend is the client's own Pod (a hairpin), and the request never came back into it after the rewrite (its host veth's TX tap, which captured, never saw it): a bridge sends a packet back out the port it came in on only when that port has hairpin mode on (the CNI's hairpinMode, kubelet's --hairpin-mode), or a filter rule dropped it"
	}
	if !e.active(obs.PointUplink) {
		return ""
	}
	if f.unfollowed {
		return "no answer seen: its Pod was found after it began, and until then no point after its socket followed it (the uplink's capture among them)"
	}
	note := "no answer, and the uplink TX (captured) never saw the request after its rewrite: the node dropped it on its way out (a filter rule, a qdisc on the uplink) or sent it elsewhere (to itself or one of its Pods, out another interface)"
	switch hp := e.hairpinRefused(f); {
	case hp != nil:
		p := e.cfg.Attribution.HairpinOffUplinks[hp.Ifindex]
		note = fmt.Sprintf("no answer, and the uplink TX (captured) never saw the request after its rewrite: it came in on %[1]s, a port of bridge %[2]s, and its backend is back out that port: a bridge sends a frame back out the port it came in on only when that port has hairpin mode on, and %[1]s's is off", p.Port, p.Bridge)
		if e.droppedOnNode(f) {
			note += ", so none reached the backend"
		}
		note += fmt.Sprintf(" (turn it on: bridge link set dev %s hairpin on; or have the node route its uplink's traffic rather than bridge it)", p.Port)
	case e.droppedOnNode(f):
		note = "no answer, and the uplink TX (captured) never saw the request after its rewrite: the kernel dropped every one on the node, so none reached the backend"
	case f.requestDropped():
		// The drop observer saw where: its drops, which follow, say it.
		note = "no answer, and the uplink TX (captured) never saw the request after its rewrite: the kernel dropped it on the node"
	}
	if cands := e.backendDropCands(f); len(cands) > 0 {
		note += fmt.Sprintf("; the node's filter drops or rejects packets to backend %s: %s", f.sortedBackends()[0], oneOf(cands))
	}
	return note
}

// backendDropCands names the filter rules after NAT that drop or reject
// packets to f's backend (Attribution.BackendDrops).
func (e *Engine) backendDropCands(f *flowState) []string {
	bs := f.sortedBackends()
	if len(bs) == 0 {
		return nil
	}
	var out []string
	for _, r := range e.cfg.Attribution.BackendDrops {
		if !listed([]netip.AddrPort{r.VIP}, bs[0]) || (r.Proto != 0 && f.proto != 0 && r.Proto != f.proto) {
			continue
		}
		if c := r.String(); !slices.Contains(out, c) {
			out = append(out, c)
		}
	}
	return out
}

// lostOnTheWayNote says, of a flow some of whose requests left the uplink,
// how many of those its host veth's tap received never did: both taps see
// every frame (the uplink's TX tap after the qdisc, which a TBF or a full
// queue drops in front of; a GSO frame split on its way out only adds to
// the uplink's count), so a shortfall is the node's drop on the way out
// or the capture's own loss. Without it, a connection whose SYN got through
// and whose data a qdisc dropped reads "reply yes" with nothing amiss.
// It says too how many of those the uplink's TX tap saw the kernel dropped
// at the uplink device after the tap (dropsAfterUplinkTap), which never
// left either.
func (e *Engine) lostOnTheWayNote(f *flowState) string {
	w := e.lostOnTheWay(f)
	if w.lost == 0 {
		return ""
	}
	var notes []string
	if before := w.lost - w.afterTap; before > 0 {
		notes = append(notes, fmt.Sprintf("of the %d request packets its host veth received, %d never left the uplink (its TX tap runs after the qdisc): the node dropped them on the way out (a qdisc or a filter rule), or pathtrace's capture lost them (kernel_drops)", w.host, before))
	}
	switch {
	case w.afterTap == 0:
	case w.sent == 0 && !f.reply:
		notes = append(notes, fmt.Sprintf("no answer, and every request the uplink's TX tap saw (%d) was dropped by the kernel at the uplink device, after the tap (in its transmit: an overlay device without a forwarding entry for the remote VTEP, a driver): none left the node, so none reached the backend", w.afterTap))
	case w.sent == 0:
		notes = append(notes, fmt.Sprintf("every request the uplink's TX tap saw (%d) was dropped by the kernel at the uplink device, after the tap (in its transmit): none of those left the node", w.afterTap))
	default:
		notes = append(notes, fmt.Sprintf("of the %d request packets the uplink's TX tap saw, the kernel dropped %d at the uplink device, after the tap (in its transmit): those never left the node", w.sent+w.afterTap, w.afterTap))
	}
	return strings.Join(notes, "; ")
}

// wayOut is what lostOnTheWay counts of a flow's requests on their way out.
type wayOut struct {
	// host: request packets its host veth's tap received; lost: those
	// of them, or of the uplink's, that never left the node; afterTap:
	// those among lost the uplink's TX tap saw and the kernel dropped at
	// the uplink device after it; sent: those the uplink's TX tap saw,
	// less afterTap.
	host, lost, afterTap, sent uint64
}

// lostOnTheWay counts the request packets of f its host veth's tap
// received before the run was stopping and of those, how many the
// uplink's TX tap never saw (0 unless some did leave it: one that left
// none says so otherwise, notLeftNote), and adds those the uplink's TX tap
// saw that the kernel dropped at the uplink device after it
// (dropsAfterUplinkTap, all of them when as many as the point that saw
// most of them saw: mostSeen): they did not leave the node either. A node
// process's flow has no host veth: only the latter count.
func (e *Engine) lostOnTheWay(f *flowState) wayOut {
	if f.cps[cpLocal].any() || e.window(f) != withinWindow {
		return wayOut{}
	}
	var host, up uint64
	for _, p := range f.points {
		switch {
		case p.reply:
		case p.point == obs.PointHost && p.dir == obs.DirIn:
			host += p.packets
		case p.point == obs.PointUplink && p.dir == obs.DirOut:
			up += p.packets
		}
	}
	// The host veth's packets captured once the run was stopping may have
	// left the uplink after its tap stopped (the taps stop one by one): a
	// flow that was busy at the end would count them lost. Those captured
	// before went out while every tap still captured, within stopTransit;
	// the uplink's later ones are of the packets left out.
	if l := e.lateCounts[f]; l != nil {
		host -= min(l.host, host)
		up -= min(l.up, up)
	}
	after := min(e.dropsAfterUplinkTap(f), up)
	if after > 0 && after >= f.mostSeen(false) {
		// As many as the observers sharing the drop observer's budget
		// saw: every one the tap saw, of a burst whose drops it summarized.
		after = up
	}
	w := wayOut{host: host, afterTap: after, sent: up - after, lost: after}
	if f.fromNode {
		w.host = 0
		return w
	}
	if up > 0 && host > up {
		w.lost += host - up - min(host-up, e.wentElsewhere(f))
	}
	return w
}

// wentElsewhere counts f's request packets that did not head for the
// uplink, so that its TX tap's shortfall is no loss on the way out: those
// the kernel dropped on the node elsewhere than at the uplink device (a
// bridge refusing a hairpin to the client's own Pod: the flow's
// kernel_drops tell), and those a node point saw rewritten to another
// backend than the one that left by the uplink (a first pick dropped
// before conntrack confirmed it, a local backend). The two may be the same
// packets: the larger count is taken.
func (e *Engine) wentElsewhere(f *flowState) uint64 {
	var dropped uint64
	for _, d := range f.kernelDrops() {
		if d.Direction == "request" && (e.cfg.HostNetNS == 0 || d.NetNS == e.cfg.HostNetNS) && d.Ifindex != int(f.uplink.ifindex) {
			dropped += d.Count
		}
	}
	var left []netip.AddrPort
	for _, p := range f.points {
		if p.point == obs.PointUplink && p.dir == obs.DirOut && !p.reply {
			left = append(left, f.end(p.dst).addrPort())
		}
	}
	// Each packet crosses each point once: the point that saw most of
	// them go to another backend counts.
	other := map[pointKey]uint64{}
	for _, p := range f.points {
		switch p.point {
		case obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter:
		default:
			continue
		}
		if dst := f.end(p.dst).addrPort(); p.reply || dst == f.service || slices.Contains(left, dst) {
			continue
		}
		other[pointKey{point: p.point, dir: p.dir, iface: p.iface}] += p.packets
	}
	var most uint64
	for _, n := range other {
		most = max(most, n)
	}
	return max(dropped, most)
}

// repliesLostOnNode counts the reply packets of f the uplink's RX tap
// received, and names their sender, when none reached the client's Pod:
// its eth0 tap saw the flow's requests and no reply (translated or not).
// The uplink's replies captured once the run was stopping are left out:
// the Pod's tap may have stopped before they would have reached it. So is
// every flow once a Pod's tap lost frames (CaptureLost): its ring may have
// dropped the replies the client did get.
//
// A node process's flow has no tap past the uplink: its TCP handshake
// tells instead (nodeSynAckLost).
func (e *Engine) repliesLostOnNode(f *flowState) (n uint64, from netip.AddrPort) {
	if !f.uplinkReply.seen || e.window(f) != withinWindow || e.late(f.uplinkReply.at.UnixNano()) ||
		f.fromNode && !e.nodeSynAckLost(f) || !f.fromNode && e.captureLost[obs.PointPod] {
		return 0, netip.AddrPort{}
	}
	var podOut uint64
	for _, p := range f.points {
		switch {
		case p.point == obs.PointPod && p.dir == obs.DirOut && !p.reply:
			podOut += p.packets
		case p.point == obs.PointPod && p.dir == obs.DirIn && p.reply:
			return 0, netip.AddrPort{}
		case p.point == obs.PointUplink && p.dir == obs.DirIn && p.reply:
			n += p.packets
			if !from.IsValid() {
				from = f.end(p.src).addrPort()
			}
		}
	}
	if podOut == 0 && !f.fromNode {
		return 0, netip.AddrPort{}
	}
	return n, from
}

// nodeSynAckLost tells whether the SYN-ACK of f, a node process's TCP
// flow, came in on the uplink and never reached its socket: the socket
// answers a SYN-ACK at once, with its ACK (in SYN_SENT) or the kernel with a
// RST (the socket gone), and no point saw either, where the netfilter
// observer at output sees every packet the node sends before any filter
// rule can drop it, and the uplink's TX tap, which lost no frames, every
// packet that leaves. A SYN-ACK captured once the run was stopping tells
// nothing: the answer may have come after the points stopped.
func (e *Engine) nodeSynAckLost(f *flowState) bool {
	t := &f.tcp
	return f.proto == obs.TCP && t.synAck != 0 && t.ack == 0 && t.rst == 0 && !e.late(t.synAck) &&
		e.active(obs.PointNFBefore) && e.active(obs.PointUplink) && !e.captureLost[obs.PointUplink]
}

// bracketBase is the start of a bracketed verdict's reason: where the VIP
// was seen last and the backend first.
func bracketBase(f *flowState, iV, iB checkpoint) string {
	b := f.cps[iB].backendAddr.addrPort()
	if f.renatted() || f.sendsDirect() && b == f.directBackend() {
		// The point saw the dropped pick first, or the client's own
		// datagrams to a backend; the flow's backend is the one its
		// VIP's packets reached through the rewrite.
		b = f.sortedBackends()[0]
	}
	return fmt.Sprintf("VIP %s at %s, backend %s at %s", f.service, iV.describe(f.cps[iV].vipFrom),
		b, iB.describe(f.cps[iB].backendFrom))
}

// nfNeverSaw tells whether the netfilter observers, watching, never saw f's
// request: it met none of netfilter's IP hooks, so neither netfilter's NAT
// nor IPVS, which runs at LOCAL_IN and LOCAL_OUT after the observers, can
// have rewritten it.
func (e *Engine) nfNeverSaw(f *flowState) bool {
	return e.active(obs.PointNFBefore) && !f.cps[cpNFBefore].any()
}

// netfilterExcluded tells why netfilter cannot have rewritten a flow that no
// netfilter checkpoint saw, or "" when nothing tells. When conntrack was
// silent about the flow but that proves nothing, doubt says why (with why
// only).
func (e *Engine) netfilterExcluded(f *flowState, why bool) (excluded, doubt string) {
	switch {
	case e.active(obs.PointNFBefore) && !f.cps[cpNFBefore].any():
		return "the netfilter observer never saw this flow", ""
	case e.active(obs.PointConntrack) && !f.ctSeen:
		if blind := e.conntrackBlind(f); blind != "" {
			if why {
				doubt = blind
			}
			return "", doubt
		}
		return "conntrack reported no connection for this flow", ""
	}
	return "", ""
}

// The kernel's defaults of conntrack's UDP entry lives (Config.UDPTimeout,
// UDPStreamTimeout), and how long after its beginning an entry that saw a
// reply must see a packet to live the longer one (nf_conntrack_udp_packet).
const (
	defaultUDPTimeout       = 30 * time.Second
	defaultUDPStreamTimeout = 120 * time.Second
	udpStreamAfter          = 2 * time.Second
)

// udpTimeouts are conntrack's UDP entry lives after the last packet: of
// an entry before it is a stream, and of a stream.
func (e *Engine) udpTimeouts() (plain, stream time.Duration) {
	return cmp.Or(e.cfg.UDPTimeout, defaultUDPTimeout), cmp.Or(e.cfg.UDPStreamTimeout, defaultUDPStreamTimeout)
}

// udpEntryLife bounds how long conntrack keeps a UDP entry after its last
// packet, whether it is a stream or not.
func (e *Engine) udpEntryLife() time.Duration {
	plain, stream := e.udpTimeouts()
	return max(plain, stream)
}

// ctMayBeOthers tells whether conntrack's report of f may have been taken
// for another flow of its client endpoint and VIP, an earlier connection
// of its reused port that conntrack reported after f began: conntrack
// delivers ahead of the taps, and the two connections' events are alike
// when the NAT chose the same backend for both.
func (e *Engine) ctMayBeOthers(f *flowState) bool {
	began := f.first.UnixNano()
	for _, g := range e.clients[f.key()] {
		if g != f && g.service == f.service && g.ctLast >= began-int64(clockSlack) && g.began(moment{}) < began {
			return true
		}
	}
	return false
}

// conntrackBlind says why conntrack's silence about f proves nothing, ""
// when conntrack would have reported f had netfilter tracked it: it is
// subscribed to new connections (and their updates), lost none of its
// events, and f was seen from its start, after the subscription: a TCP flow
// whose client's first packet seen was its SYN, a UDP flow first seen
// udpEntryLife after every point was in place (UDP has no first packet to
// see: a long-lived socket rides an entry made before the run, which
// conntrack never reports; one first seen that late had sent nothing for so
// long that any earlier entry of it had expired).
func (e *Engine) conntrackBlind(f *flowState) string {
	const when = "conntrack reports a connection when it begins"
	switch {
	case e.ctLosses > 0:
		return fmt.Sprintf("conntrack lost %d events during the run", e.ctLosses)
	case e.window(f) == beforeReady:
		return "the flow began before pathtrace was in place, and " + when
	case f.continues != 0:
		return fmt.Sprintf("it continues flow %d, whose connection conntrack reported when it began", f.continues)
	case e.ctMayBeOthers(f):
		return "its client port was reused just after an earlier connection to the VIP, which conntrack's report of it may have been taken for"
	case f.proto == obs.TCP:
		if f.tcp.syn != 0 && f.tcp.syn-f.tcp.first <= int64(sameConnGap) {
			return ""
		}
		return "its first packets seen were not a SYN: the connection began before they were seen, and " + when
	case f.proto == obs.UDP:
		if e.mayContinueForgotten(f) {
			return fmt.Sprintf("it may continue one of the flows reported as ended less than %s before it began, more than pathtrace remembers (a busy node), and ride the conntrack entry made for it, which conntrack does not report again", e.udpEntryLife())
		}
		if !e.cfg.Ready.IsZero() && f.first.Sub(e.cfg.Ready) >= e.udpEntryLife() {
			return ""
		}
		return fmt.Sprintf("a UDP flow first seen less than %s after pathtrace was in place may ride a conntrack entry made before, and %s", e.udpEntryLife(), when)
	}
	return "its protocol is not known"
}

// conntrackNote says how conntrack relates to a netfilter verdict.
func (e *Engine) conntrackNote(f *flowState, iV, iB checkpoint) string {
	switch {
	case f.cps[iV].vipFrom == obs.PointConntrack && f.cps[iB].backendFrom == obs.PointConntrack:
		return "from conntrack NAT alone (the netfilter observers did not see it)"
	case f.ctNAT:
		return "conntrack NAT corroborates"
	}
	return ""
}

// blindSpots lists the inactive points between two checkpoints.
func (e *Engine) blindSpots(iV, iB checkpoint) string {
	var inactive []string
	for cp := iV + 1; cp < iB; cp++ {
		if cp == cpLocal {
			continue // an end of the path, as the uplink is: never between two
		}
		for _, p := range checkpointPoints(cp) {
			if !e.active(p) && !slices.Contains(inactive, p.String()) {
				inactive = append(inactive, p.String())
			}
		}
	}
	if len(inactive) == 0 {
		return "no observation point in between saw it"
	}
	return "inactive points in between: " + strings.Join(inactive, ", ")
}

func removeGap(gs []gap, g gap) []gap {
	out := gs[:0]
	for _, x := range gs {
		if x != g {
			out = append(out, x)
		}
	}
	return out
}

// natPriority is the priority of netfilter's DNAT at prerouting and
// output (NF_IP_PRI_NAT_DST), which pathtrace's netfilter observers
// bracket.
const natPriority = -100

// netfilterProgramsNote names the BPF programs on netfilter hooks
// (another tool's: NetfilterPrograms) that sit where f's request, which
// got no answer and never left the uplink, went after the last point that
// saw it: at its NAT hook before NAT when pathtrace's netfilter observers
// (watching, and seen by a bridged frame) never saw it; after NAT (the
// NAT hook's later priorities, the filter hook, postrouting) when the
// last point to see it was the observer after NAT or conntrack. One that
// returns NF_DROP ends the packet there, which nothing else reports. ""
// when none sits there, or the flow was lost elsewhere.
func (e *Engine) netfilterProgramsNote(f *flowState) string {
	progs := e.cfg.Attribution.NetfilterPrograms
	if len(progs) == 0 || f.reply || f.icmp != nil || f.cps[cpUplink].any() || f.cps[cpLocal].any() || !e.active(obs.PointUplink) {
		return ""
	}
	last := cpApp
	for cp := cpApp; cp <= cpNodeEgress; cp++ {
		if f.cps[cp].any() {
			last = cp
		}
	}
	var before bool
	switch {
	case last == cpNFAfter || last == cpConfirm:
	case last >= cpNFBefore || !e.active(obs.PointNFBefore):
		return ""
	case f.fromNode && last != cpSockState && (f.proto == obs.TCP || last != cpSockAddr):
		// A node's TCP connection sent its SYN (into OUTPUT) only once
		// in SYN_SENT: one last seen at connect() failed before (no
		// route), and sent nothing a program could drop.
		return ""
	case !f.fromNode && last < cpPod:
		return "" // never left the Pod
	default:
		if e.bridgedPastNetfilter(f) {
			return "" // bridged frames meet no IPv4 hook
		}
		before = true
	}
	family := "ipv4"
	if f.service.Addr().Is6() {
		family = "ipv6"
	}
	nat := natHookOf(f)
	var names []string
	for _, p := range progs {
		if p.Family != family {
			continue
		}
		at := p.Hook == nat && p.Priority < natPriority
		if !before {
			at = p.Hook == nat && p.Priority > natPriority || p.Hook == e.filterHookOf(f) || p.Hook == "postrouting"
		}
		if at {
			names = append(names, fmt.Sprintf("%s (id %d) at %s priority %d", p.Name, p.ID, p.Hook, p.Priority))
		}
	}
	if len(names) == 0 {
		return ""
	}
	const drop = "one that returns NF_DROP ends the packet there, and no netfilter rule shows it"
	if before {
		return fmt.Sprintf("it vanished at %s before netfilter's NAT (pathtrace's netfilter observers, watching, never saw it), where netfilter BPF programs run: %s (%s)", nat, strings.Join(names, ", "), drop)
	}
	return fmt.Sprintf("past %s (the last point that saw it), netfilter BPF programs run: %s (%s)", last.describe(f.cps[last].vipFrom), strings.Join(names, ", "), drop)
}
