package flow

import (
	"net/netip"
	"time"
)

// Place is where a flow's destination was rewritten from the VIP to a backend.
type Place string

const (
	PlaceSocket    Place = "socket"
	PlaceTC        Place = "tc"
	PlaceNetfilter Place = "netfilter"
	PlaceIPVS      Place = "ipvs"
	PlaceNowhere   Place = "nowhere"
	PlaceUnknown   Place = "unknown"
)

// Places lists every verdict in path order, unknown last.
func Places() []Place {
	return []Place{PlaceSocket, PlaceTC, PlaceNetfilter, PlaceIPVS, PlaceNowhere, PlaceUnknown}
}

// Flow is one client IP:port <-> Service VIP:port flow and its verdict.
type Flow struct {
	ID int `json:"id"`
	// Continues is the id of the flow this one continues: the same client
	// endpoint and Service, reported when it had been idle for the flow
	// timeout (a run until stopped reports flows as they end), whose
	// connection spoke again. Its beginning was seen with that flow.
	Continues int            `json:"continues,omitempty"`
	Proto     string         `json:"proto"`
	Client    netip.AddrPort `json:"client"`  // port 0 when only the socket layer saw it
	Service   netip.AddrPort `json:"service"` // the VIP:port the client asked for
	Backend   netip.AddrPort `json:"backend"` // "" when none was seen
	// Backends lists every backend seen when there was more than one.
	Backends    []netip.AddrPort `json:"backends,omitempty"`
	RewrittenAt Place            `json:"rewritten_at"`
	By          string           `json:"by"`
	// Reason explains the verdict from the observations; always set for unknown.
	Reason string  `json:"reason"`
	VLAN   *uint16 `json:"vlan"` // uplink VLAN ID, 0 untagged, null when never at the uplink
	// VLANProto is "802.1ad" when that tag is a QinQ service tag (TPID
	// 0x88a8: VLAN is the outer S-VID); left out for 802.1Q.
	VLANProto          string `json:"vlan_proto,omitempty"`
	UplinkDstMAC       string `json:"uplink_dst_mac"`
	UplinkDstIsGateway bool   `json:"uplink_dst_is_gateway"`
	// UplinkDstNeighbor is what the node's neighbour table maps
	// UplinkDstMAC to on the uplink the frame left by, when it is not
	// the Pod's gateway: "172.30.0.1" (a routed node's next hop), "10.88.2.0,
	// VTEP 192.168.90.2" (a vxlan uplink's remote VTEP, with its fdb's
	// underlay address); "" when unknown.
	UplinkDstNeighbor string `json:"uplink_dst_neighbor,omitempty"`
	// UplinkIfindex is the device (in the node's netns) the uplink frame
	// was seen on, 0 when unknown; not in the JSON: the session names a
	// neighbour learnt after the flow was made with it
	// (Engine.NameUplinkNeighbors).
	UplinkIfindex int  `json:"-"`
	Reply         bool `json:"reply"`
	// Refused: the reply was a TCP RST instead of a SYN-ACK (nothing
	// listened on the backend's port, or a firewall rejected it).
	Refused bool `json:"refused,omitempty"`
	// ICMPError is the first ICMP error message about the flow's packets
	// (a router's net unreachable, a backend's port unreachable), if any.
	ICMPError *ICMPError `json:"icmp_error,omitempty"`
	// StrayReplies: packets to the client from the Service's or a
	// backend's address but another port than the flow's, which no flow
	// took (a UDP server answering from another socket): the client's
	// socket does not take them either.
	StrayReplies *StrayReplies `json:"stray_replies,omitempty"`
	// UntranslatedReplies: replies that entered the client's Pod from a
	// backend's address although its requests left the Pod to the VIP:
	// nothing translated them back (they never met the node's conntrack
	// entry), so the client refuses them. Reply is then false unless a
	// reply from the Service entered the Pod too.
	UntranslatedReplies *StrayReplies `json:"untranslated_replies,omitempty"`
	// LostOnNode: request packets its host veth's tap received that the
	// uplink's TX tap (after the qdisc) never saw, when some did leave: the
	// node dropped them on the way out (a TBF, a full queue, a filter rule)
	// or the capture lost them (kernel_drops), less those that never
	// headed for it (Engine.wentElsewhere); and those the uplink's TX
	// tap saw that the kernel then dropped at the uplink device, after the
	// tap (Engine.dropsAfterUplinkTap): they never left either.
	LostOnNode uint64 `json:"lost_on_node,omitempty"`
	// NotSent: none of its requests left the node: the uplink's TX tap saw
	// them after their rewrite, and the kernel dropped every one of those
	// at the uplink device, after the tap (its xmit: an overlay device
	// without an fdb entry for the remote VTEP, NO_TX_TARGET in
	// vxlan_xmit). They count in LostOnNode. Also true when the kernel
	// dropped every request on the node after its rewrite, before the
	// uplink's TX tap saw one (Engine.droppedOnNode). No request reached
	// the backend, so its silence is not its own.
	NotSent bool `json:"not_sent,omitempty"`
	// RepliesLostOnNode: reply packets the uplink's RX tap received of
	// which none reached the client's Pod, whose eth0 tap saw its
	// requests: the node dropped or altered them on the way in (a tc
	// program or a filter rule at the uplink's ingress, rp_filter, a
	// conntrack INVALID drop). Reply is then false: the backend
	// answered, the client got nothing. Never counted once a Pod's tap
	// lost frames (Engine.CaptureLost): its ring may have dropped them.
	// A node process's flow has no tap past the uplink: counted when its
	// socket never answered the backend's SYN-ACK the uplink received
	// (nodeSynAckLost).
	RepliesLostOnNode uint64 `json:"replies_lost_on_node,omitempty"`
	// KernelDrops are its packets the kernel dropped, by direction,
	// reason, function and place (the drop observer). Replies dropped
	// (for a reason other than NOT_SPECIFIED, which some drivers also
	// free sent packets with) of which none reached the client make
	// Reply false.
	KernelDrops []KernelDrop `json:"kernel_drops,omitempty"`
	// ProxyUpstreams: of a connection its Pod's own NAT redirected to a
	// local proxy (a sidecar's), the flows that can be the proxy's upstream
	// connection (its reason says which and why only "can").
	ProxyUpstreams []int `json:"proxy_upstreams,omitempty"`
	// NodeClient: a socket of the node's own network namespace made the
	// flow (a hostNetwork Pod, the kubelet, a node process), not a Pod's:
	// such clients are traced also when a Pod is selected (--pod-ip).
	NodeClient bool `json:"node_client,omitempty"`
	// BeganBeforeRun: a TCP connection whose first packets seen were not
	// its handshake (no SYN, no SYN-ACK, no connect()): it began before
	// the run. Its verdict rests on the packets seen only; its reason
	// says so first (beganBeforeRun).
	BeganBeforeRun bool        `json:"began_before_run,omitempty"`
	PID            uint32      `json:"pid,omitempty"`
	Comm           string      `json:"comm,omitempty"`
	Cgroup         uint64      `json:"cgroup,omitempty"`
	First          time.Time   `json:"first"`
	Last           time.Time   `json:"last"`
	Points         []PointSeen `json:"points"`
}

// StrayReplies counts the packets to a flow's client from the first
// unexpected source, at one capture point (the first to report one): each
// packet crosses every point.
type StrayReplies struct {
	From    netip.AddrPort `json:"from"`
	Packets uint64         `json:"packets"`
	Point   string         `json:"point"`
	At      time.Time      `json:"at"`
}

// ICMPError is an ICMP error message about a flow's packet: what it says,
// who sent it, and the capture point that saw it first.
type ICMPError struct {
	Message string     `json:"message"` // e.g. "ICMP destination unreachable (code 0: net unreachable)"
	From    netip.Addr `json:"from"`
	Point   string     `json:"point,omitempty"`
	At      time.Time  `json:"at"`
	// FromRule: no capture point saw the message; it is the one the node's
	// filter rule (as the flow's reason names it) answers a node process
	// with, through loopback, which pathtrace does not capture. Point is
	// empty then, At the request's last sighting.
	FromRule bool `json:"from_rule,omitempty"`
	// QuotedDst: the destination of the request the message quotes where
	// it reached the client (its Pod's eth0, or the host veth towards
	// it), when that is not the VIP the client sent to (a backend):
	// nothing reversed the NAT of the quoted header, and a connected
	// socket (TCP, connected UDP), looked up by the quoted addresses,
	// does not get the error.
	QuotedDst netip.AddrPort `json:"quoted_dst,omitzero"`
}

// PointSeen aggregates what one point saw of a flow in one direction.
type PointSeen struct {
	Point   string         `json:"point"`
	Iface   string         `json:"iface,omitempty"` // the capture point, as the pcapng names it
	Dir     string         `json:"dir,omitempty"`
	Reply   bool           `json:"reply,omitempty"`
	Src     netip.AddrPort `json:"src"`
	Dst     netip.AddrPort `json:"dst"`
	ReqDst  netip.AddrPort `json:"req_dst,omitzero"` // sockaddr: what the application asked for
	NATDst  netip.AddrPort `json:"nat_dst,omitzero"` // conntrack: the reply source (backend)
	Packets uint64         `json:"packets"`
	Bytes   uint64         `json:"bytes"`
}

// Summary counts flows per verdict and what the engine could not keep.
type Summary struct {
	Flows int `json:"flows"`
	// Retired counts the flows of Flows reported as they ended (a run
	// until stopped, Engine.Retire), before the summary; ReportedBefore
	// is the same for JSON, present (0 too) once the engine retires flows,
	// absent from a bounded run's summary.
	Retired        int           `json:"-"`
	ReportedBefore *int          `json:"flows_reported_before,omitempty"`
	RewrittenAt    map[Place]int `json:"rewritten_at"`
	// Drops are losses by counter name. The engine reports its own,
	// "flows_over_max" (flows beyond MaxFlows), "flows_joined" (flows of a
	// socket on a reused client port taken into the earlier socket's flow,
	// joinOrSupersede) and "unmatched_overflow" (observations evicted while
	// waiting for their flow because the waiting room was full); WithDrops
	// adds the caller's.
	Drops map[string]uint64 `json:"drops"`
	// Unmatched counts observations that no flow claimed within the reordering
	// window (e.g. traffic to a backend that did not go through a VIP); a
	// packet between two watched addresses on ports that are no Service's
	// nor backend's (a tunnel between nodes that are backends) is left out.
	Unmatched uint64 `json:"unmatched"`
	// WithoutPorts counts packet and conntrack observations without TCP or
	// UDP ports (ICMP and other protocols to a VIP watched on any
	// protocol, IP fragments after the first): a flow is made of ports, so
	// they belong to none and are left out.
	WithoutPorts uint64 `json:"without_ports"`
	// OutOfScope counts the observations left out on purpose: socket-layer
	// ones of clients outside the traced netns (the socket observers are
	// host-wide) and, with a Pod selected, the node-wide points' packets and
	// conntrack entries of other clients. Set by the session.
	OutOfScope uint64 `json:"out_of_scope,omitempty"`
	// RepliesWithoutRequest counts the connections (a client endpoint and
	// a Service) of which replies were seen and none of their requests,
	// for the reordering window at least (until the end of the run for
	// the last ones): they began before the run (or their requests went
	// where no point captures). They are no flows: a reply alone has no
	// request to decide on. RequestedAfterReplies counts those of which
	// a request came after all: they are flows, and not in the count.
	RepliesWithoutRequest int `json:"replies_without_request"`
	RequestedAfterReplies int `json:"requested_after_replies,omitempty"`
	// Observations counts observations per point name.
	Observations map[string]uint64 `json:"observations"`
	// UnknownBeforeReady and UnknownAfterStop count the undecided flows that
	// began while pathtrace was still attaching (before Config.Ready) or
	// after the run was asked to stop: points missed them, not the node.
	UnknownBeforeReady int `json:"unknown_began_before_ready,omitempty"`
	UnknownAfterStop   int `json:"unknown_began_after_stop,omitempty"`
}

// WithDrops returns a copy of s whose Drops also hold extra (the capture and
// probe counters: kernel drops per point, ring buffer losses, ...).
func (s Summary) WithDrops(extra map[string]uint64) Summary {
	drops := make(map[string]uint64, len(s.Drops)+len(extra))
	for k, v := range s.Drops {
		drops[k] = v
	}
	for k, v := range extra {
		drops[k] += v
	}
	s.Drops = drops
	return s
}
