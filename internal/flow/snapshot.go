package flow

import (
	"bytes"
	"cmp"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// snapshot renders a flow and its current verdict.
func (e *Engine) snapshot(f *flowState) Flow {
	// Its id first: its reason may name later flows (proxyUpstreamNote),
	// which then get theirs after it.
	id := e.idOf(f)
	v := e.decide(f, true)
	if v.place == PlaceUnknown {
		v.reason = e.outsideWindow(f) + f.continuesNote() + v.reason
	}
	before := e.beganBeforeRun(f)
	if before {
		v.reason = e.beganBeforeRunNote(f) + v.reason
	}
	out := Flow{
		ID:             id,
		Continues:      f.continues,
		Client:         f.client,
		NodeClient:     f.fromNode,
		Service:        f.service,
		RewrittenAt:    v.place,
		By:             v.by,
		Reason:         v.reason,
		Reply:          f.answered(),
		Refused:        f.reply && f.tcp.refused() || f.proto == obs.TCP && (v.by == ByClientNetfilter || v.place == PlaceSocket) && f.refusedInPod() != nil,
		ICMPError:      f.icmp,
		StrayReplies:   f.stray,
		PID:            f.pid,
		Comm:           f.comm,
		Cgroup:         f.cgroup,
		BeganBeforeRun: before,
		First:          f.first,
		Last:           f.last,
	}
	if r := v.answer; r != nil {
		out.ICMPError = &ICMPError{Message: r.ICMPAnswer, From: f.client.Addr(), At: f.last, FromRule: true}
	}
	if e := f.icmp; e != nil && e.QuotedDst.IsValid() {
		out.Reason += fmt.Sprintf("; the %s reached the client quoting its request to %s, not to %s, where the client sent it: nothing reversed the NAT of the quoted header (%s), so a connected socket (TCP, connected UDP) does not get the error (an unconnected UDP socket, found by its port alone, may)",
			e.Message, e.QuotedDst, f.service, whyQuoteUntranslated(v.place))
	}
	if u, translated := f.untranslatedReplies(); u != nil {
		out.UntranslatedReplies = u
		refuses := "a UDP client that asked the VIP takes no answer from another address"
		switch {
		case f.proto == obs.TCP && f.tcp.rstUntranslated && f.tcp.synAck == 0:
			// The server's resets: nothing answers a reset.
			refuses = "the client's kernel drops them: its socket never learns of the refusal and retransmits its SYN"
		case f.proto == obs.TCP && f.tcp.rstUntranslated:
			refuses = "the client's kernel resets them (and drops the resets among them)"
		case f.proto == obs.TCP:
			refuses = "the client's kernel resets them"
		case f.replyICMP != nil:
			refuses = fmt.Sprintf("%s sent %s about them", f.replyICMP.From, f.replyICMP.Message)
		}
		if f.proto == obs.TCP || f.replyICMP != nil {
			// Refused: no reply reached the client's socket unless one
			// from the Service did.
			out.Reply = translated
			out.Refused = translated && f.tcp.refused()
		}
		out.Reason += fmt.Sprintf("; replies entered the client's Pod from %s, not from %s: nothing translated them back (%s), and %s", u.From, f.service, whyUntranslated(v.place, e.cfg.Attribution.RoutedHostVeths[f.hostIfindex]), refuses)
	}
	if f.proto != 0 {
		out.Proto = f.proto.String()
	}
	if f.socketLBChanged() {
		sock := f.cps[cpSockAddr]
		change := "loaded after its first datagrams (first rewrite at %s)"
		if sock.backendAt < sock.vipAt {
			change = "unloaded, or stopped rewriting, before its later ones (first left unrewritten at %s)"
		}
		out.Reason += fmt.Sprintf("; the socket also sent datagrams the app addressed to the VIP with the VIP still their destination: a socket LB was "+change+"; those left the socket unrewritten",
			time.Unix(0, max(sock.vipAt, sock.backendAt)).UTC().Format("15:04:05.000"))
	}
	if f.sendsDirect() {
		out.Reason += fmt.Sprintf("; the client also sent to backend %s itself from this port, not to the VIP: those datagrams, counted with the flow, are not taken for its rewrite, nor the answers they got from the backend's address for its replies", f.directBackend())
	}
	bs := f.sortedBackends()
	if len(bs) > 0 && (!f.sendsDirect() || f.rewriteSeen()) {
		out.Backend = bs[0]
		if len(bs) > 1 {
			out.Backends = bs
		}
	}
	if f.renatted() && len(bs) > 1 {
		dropped := make([]string, len(bs)-1)
		for i, b := range bs[1:] {
			dropped[i] = b.String()
		}
		if f.proto == obs.UDP {
			out.Reason += fmt.Sprintf("; its first datagram was NATed to %s, where the node dropped it before conntrack confirmed an entry (none kept that backend); a later one was NATed anew, to %s",
				strings.Join(dropped, ", then "), bs[0])
		} else {
			out.Reason += fmt.Sprintf("; its SYN was first NATed to %s, where the node dropped it before conntrack confirmed the connection (no entry kept that backend); a retransmission of it was NATed anew, to %s",
				strings.Join(dropped, ", then "), bs[0])
		}
	}
	switch {
	case f.uplink.seen:
		vlan := f.uplink.vlan
		out.VLAN, out.VLANProto = &vlan, tagProto(f.uplink.tpid, vlan)
		if !f.uplink.dstMAC.IsZero() {
			out.UplinkDstMAC = f.uplink.dstMAC.String()
			out.UplinkDstIsGateway = e.isGateway(f.uplink.dstMAC[:])
			out.UplinkIfindex = int(f.uplink.ifindex)
			if !out.UplinkDstIsGateway {
				out.UplinkDstNeighbor = e.uplinkNeighbor(out.UplinkIfindex, f.uplink.dstMAC)
			}
		}
	case f.uplinkReply.seen:
		vlan := f.uplinkReply.vlan
		out.VLAN, out.VLANProto = &vlan, tagProto(f.uplinkReply.tpid, vlan)
	case f.uplinkIn.seen:
		// An outside client's request that came in on the uplink and
		// neither left again nor got a reply out of it (rejected by the
		// node): it did reach the uplink, on this VLAN.
		vlan := f.uplinkIn.vlan
		out.VLAN, out.VLANProto = &vlan, tagProto(f.uplinkIn.tpid, vlan)
	}
	way := e.lostOnTheWay(f)
	out.LostOnNode = way.lost
	out.NotSent = way.afterTap > 0 && way.sent == 0 && !f.answered() || e.droppedOnNode(f)
	if n, from := e.repliesLostOnNode(f); n > 0 {
		out.RepliesLostOnNode = n
		out.Reply, out.Refused = false, false
		packets := "reply packets"
		if n == 1 {
			packets = "reply packet"
		}
		lost := "none reached the Pod's eth0, whose tap saw the requests"
		causes := "a tc program or a filter rule at the uplink's ingress, rp_filter, a conntrack INVALID drop"
		checked := "the Pods' taps lost no frames"
		if f.fromNode {
			lost = "the node process's socket never got the SYN-ACK: neither its ACK nor a reset answered it at any point (the netfilter observer at output, the uplink)"
			causes = "a tc program or a filter rule at the uplink's ingress, a filter rule at input, rp_filter, a conntrack INVALID drop"
			checked = "the uplink's tap lost no frames"
		}
		out.Reason += fmt.Sprintf("; %d %s came in on the uplink from %s and %s: the node dropped or altered them on the way in (%s); %s", n, packets, from, lost, causes, checked)
	}
	if drops := f.kernelDrops(); len(drops) > 0 {
		out.KernelDrops = slices.Clone(drops)
		out.Reason += "; " + f.dropsReason()
		if e.repliesDroppedInKernel(f) {
			out.Reply, out.Refused = false, false
			out.Reason += ": no reply reached the client"
		}
	}
	if v.by == ByClientNetfilter && f.refusedInPod() == nil {
		for _, u := range e.proxyUpstreams(f) {
			out.ProxyUpstreams = append(out.ProxyUpstreams, u.id)
		}
	}
	out.Points = e.pointsSeen(f)
	return out
}

// beganBeforeRunNote begins the reason of a flow that began before the run
// (beganBeforeRun), also an undecided one's, whose first packet seen is then
// placed in the points' window (outsideWindow). Once a capture lost frames,
// its handshake may have been among them.
func (e *Engine) beganBeforeRunNote(f *flowState) string {
	lost := ""
	if len(e.captureLost) > 0 {
		lost = " (or its handshake was among the frames a capture lost: kernel_drops)"
	}
	return fmt.Sprintf("the connection began before the run%s: its first packet seen (at %s) was mid-connection, and neither its SYN, its SYN-ACK nor its connect() was seen, so the socket layer's bracket is not judged and the verdict rests on the packets seen; ",
		lost, time.Unix(0, f.tcp.first).Format("15:04:05.000"))
}

// beganBeforeRun tells whether f is a TCP connection seen from its middle
// on (tcpLife.midConnection) whose socket's connect was not seen either
// (kind): it began before the run (or its handshake was not captured).
// Not one that continues a retired flow: its beginning was seen with that
// flow.
func (e *Engine) beganBeforeRun(f *flowState) bool {
	return f.proto == obs.TCP && f.tcp.midConnection() && f.kind == 0 && f.continues == 0
}

// whyQuoteUntranslated says what can have left the header an ICMP error
// quotes untranslated on its way to the client, by where its request was
// rewritten.
func whyQuoteUntranslated(p Place) string {
	switch p {
	case PlaceTC:
		return "the tc program that rewrote the request does not translate ICMP errors back"
	case PlaceNetfilter, PlaceIPVS:
		return "the message never met the node's conntrack entry, which translates the errors related to it"
	}
	return "nothing on its way back knew the flow's translation"
}

// whyUntranslated says what can have let a flow's replies reach its client
// untranslated, by where its request was rewritten; routed: the client's
// host veth has no master, so no bridge can have switched them.
func whyUntranslated(p Place, routed bool) string {
	switch {
	case p == PlaceTC:
		return "the tc program that rewrote the request did not reverse it for them: no reverse NAT on their way to the Pod, at the host veth's egress"
	case (p == PlaceNetfilter || p == PlaceIPVS) && routed:
		return "they never met the node's conntrack entry, though the node routes the client's Pod (its host veth is on no bridge): they came back by another path, or a rule kept them from conntrack (a raw table's notrack)"
	case p == PlaceNetfilter || p == PlaceIPVS:
		return "they never met the node's conntrack entry: a bridge switched them from the backend Pod straight to the client with bridge-nf-call-iptables 0, or they came back by another path"
	}
	return "nothing on their way back knew the flow's translation"
}

// tagProto names an outer tag other than 802.1Q's (a QinQ S-tag), and an
// 802.1Q priority tag (VLAN ID 0: a tag in the frame all the same, which
// VLAN 0 alone says untagged); "" for other 802.1Q tags and untagged.
func tagProto(tpid, vlan uint16) string {
	switch {
	case tpid == 0x88a8:
		return "802.1ad"
	case tpid != 0 && vlan == 0:
		return "802.1Q"
	}
	return ""
}

func (e *Engine) isGateway(mac []byte) bool {
	for _, gw := range e.cfg.Attribution.GatewayMACs {
		if bytes.Equal(gw, mac) {
			return true
		}
	}
	return false
}

// uplinkNeighbor names what the node's tables map mac to on the uplink
// with that ifindex ("" when they do not); with the ifindex unknown (0), on
// the uplink of the lowest ifindex that has it.
func (e *Engine) uplinkNeighbor(ifindex int, mac obs.MAC) string {
	ns := e.cfg.Attribution.UplinkNeighbors
	if ifindex != 0 {
		return ns[UplinkNeighborKey{ifindex, mac}].String()
	}
	best := 0
	for k := range ns {
		if k.MAC == mac && (best == 0 || k.Ifindex < best) {
			best = k.Ifindex
		}
	}
	if best == 0 {
		return ""
	}
	return ns[UplinkNeighborKey{best, mac}].String()
}

// RequestLeftUplink tells whether f's requests were seen leaving the
// uplink (its TX tap). A VLAN alone does not say so: an outside client's
// request that came in on the uplink, and that the node rejected, answered
// itself or lost after its rewrite, has the VLAN it came in on.
func (f *Flow) RequestLeftUplink() bool {
	if f.NotSent {
		return false // its TX tap saw them, the device dropped them after it
	}
	if f.UplinkDstMAC != "" {
		return true // set from the request's frames leaving the uplink
	}
	for _, p := range f.Points {
		if p.Point == obs.PointUplink.String() && !p.Reply && p.Dir != obs.DirIn.String() {
			return true
		}
	}
	return false
}

// UplinkNeighborMissing tells whether f's uplink frame went to a MAC other
// than its Pod's gateway that the engine's UplinkNeighbors did not name.
func (f *Flow) UplinkNeighborMissing() bool {
	return f.UplinkDstMAC != "" && !f.UplinkDstIsGateway && f.UplinkDstNeighbor == ""
}

// NameUplinkNeighbors names the uplink neighbour of the flows that have
// none (UplinkNeighborMissing) from the current UplinkNeighbors: flows
// made before the session read the neighbour table again.
func (e *Engine) NameUplinkNeighbors(fs []Flow) {
	for i := range fs {
		f := &fs[i]
		if !f.UplinkNeighborMissing() {
			continue
		}
		hw, err := net.ParseMAC(f.UplinkDstMAC)
		if err != nil || len(hw) != len(obs.MAC{}) {
			continue
		}
		f.UplinkDstNeighbor = e.uplinkNeighbor(f.UplinkIfindex, obs.MAC(hw))
	}
}

// pointsSeen lists f's per-point entries in path order, requests first.
func (e *Engine) pointsSeen(f *flowState) []PointSeen {
	sorted := slices.Clone(f.points)
	// Each key is compared only when the ones before tie (cmp.Or would
	// compute them all: the names and endpoints were most of a flow's
	// snapshot, which a run until stopped makes for every flow it logs).
	slices.SortFunc(sorted, func(a, b pointStats) int {
		if c := cmp.Compare(a.point, b.point); c != 0 {
			return c
		}
		if c := compareBool(a.reply, b.reply); c != 0 {
			return c
		}
		if c := cmp.Compare(a.dir, b.dir); c != 0 {
			return c
		}
		if a.iface != b.iface {
			if c := cmp.Compare(e.labels.name(a.iface), e.labels.name(b.iface)); c != 0 {
				return c
			}
		}
		for _, r := range [...][2]endRef{{a.dst, b.dst}, {a.src, b.src}, {a.far, b.far}} {
			if r[0] == r[1] {
				continue
			}
			if c := f.end(r[0]).addrPort().Compare(f.end(r[1]).addrPort()); c != 0 {
				return c
			}
		}
		return 0
	})
	out := make([]PointSeen, len(sorted))
	for i, p := range sorted {
		out[i] = PointSeen{
			Point:   p.point.String(),
			Iface:   e.labels.name(p.iface),
			Reply:   p.reply,
			Src:     f.end(p.src).addrPort(),
			Dst:     f.end(p.dst).addrPort(),
			Packets: p.packets,
			Bytes:   p.bytes,
		}
		switch p.point {
		case obs.PointSockAddr:
			out[i].ReqDst = f.end(p.far).addrPort()
		case obs.PointConntrack:
			out[i].NATDst = f.end(p.far).addrPort()
		}
		if p.dir != obs.DirUnknown {
			out[i].Dir = p.dir.String()
		}
	}
	return out
}

func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// outsideWindow explains, for an undecided flow, that it began while the
// capture was starting or ending, when some points were not (or no longer)
// there to see it: "" for a flow within the window. A connection that began
// before the run did not begin then: its first packet seen came then.
func (e *Engine) outsideWindow(f *flowState) string {
	const stamp = "15:04:05.000"
	it := "it began"
	if e.beganBeforeRun(f) {
		it = "its first packet seen came"
	}
	switch e.window(f) {
	case beforeReady:
		return fmt.Sprintf("%s before pathtrace was in place at every point (at %s): its first packets may have passed points not yet there; ",
			it, e.cfg.Ready.Format(stamp))
	case afterStop:
		return fmt.Sprintf("%s after the capture was asked to stop (at %s): points were closing; ",
			it, e.stopped.Format(stamp))
	}
	return ""
}

// began says when a flow began relative to the capture window: from when
// every point was in place to when the run was asked to stop.
type began int

const (
	withinWindow began = iota
	beforeReady
	afterStop
)

func (e *Engine) window(f *flowState) began {
	switch {
	case !e.cfg.Ready.IsZero() && f.first.Before(e.cfg.Ready):
		return beforeReady
	case !e.stopped.IsZero() && !f.first.Before(e.stopped):
		return afterStop
	}
	return withinWindow
}
