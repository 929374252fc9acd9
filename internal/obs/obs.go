// Package obs is the observation model shared by the producers (probe, capture)
// and the consumer (flow) of pathtrace's data: one Observation is one thing seen
// at one point of the datapath. Nothing here talks to the kernel.
package obs

import (
	"net"
	"net/netip"
	"time"
)

// Point is where along the path from the Pod's socket to the uplink something was
// seen. The constants are declared in path order for a request leaving a Pod.
type Point uint8

const (
	PointNone Point = iota
	// PointSockAddr: cgroup connect4/sendmsg4 observer on the client's cgroup
	// hierarchy. ReqDst is what the application passed to the syscall (syscall
	// tracepoint), Dst what the socket uses after every sock_addr program that ran
	// before the observer.
	PointSockAddr
	// PointSockState: tp_btf/inet_sock_set_state at TCP_SYN_SENT: the socket's
	// actual 4-tuple; and at its close from SYN_SENT when no packet of it
	// reached the egress observer (Kind SockClosed).
	PointSockState
	// PointSockEgress: cgroup_skb/egress observer: the first packet a watched socket
	// sent (its 4-tuple and cookie); Kind SockSendmsg: an unconnected UDP
	// socket's datagram that left for a destination new for the socket while
	// its sendmsg4 observer saw one it had reported (a socket LB after the
	// observer chose another backend).
	PointSockEgress
	// PointPod: AF_PACKET tap on the Pod's eth0 (inside the Pod netns).
	PointPod
	// PointHost: AF_PACKET tap on the host-side veth (RX runs before tc ingress).
	PointHost
	// PointTCHead / PointTCTail: tcx observers at the head / tail of the host veth
	// chain (Dir tells ingress = from the Pod, egress = towards the Pod).
	PointTCHead
	PointTCTail
	// PointNFBefore / PointNFAfter: BPF netfilter observers just below / just above
	// the NAT priority of a hook (Hook tells which).
	PointNFBefore
	PointNFAfter
	// PointConntrack: a conntrack NEW/UPDATE event; Dst is the original
	// destination, NATDst the reply source (the backend) when it differs,
	// NATSrc the reply destination when it differs from Src (SNAT).
	PointConntrack
	// PointUplink: AF_PACKET tap on the uplink (TX runs after tc egress).
	PointUplink
	// PointDrop: the kernel dropped the packet (skb:kfree_skb), anywhere on
	// the node: Drop says why and where. Not a place on the path: it
	// brackets nothing.
	PointDrop
)

var pointNames = [...]string{"none", "sockaddr", "sockstate", "sockegress", "pod", "host",
	"tc_head", "tc_tail", "nf_before", "nf_after", "conntrack", "uplink", "drop"}

func (p Point) String() string {
	if int(p) < len(pointNames) {
		return pointNames[p]
	}
	return "point?"
}

// Dir is the direction of a packet relative to the interface it was seen on.
type Dir uint8

const (
	DirUnknown Dir = iota
	DirIn          // received by the interface (RX; tc ingress)
	DirOut         // sent by the interface (TX; tc egress)
)

func (d Dir) String() string {
	switch d {
	case DirIn:
		return "in"
	case DirOut:
		return "out"
	}
	return "?"
}

// Hook is a netfilter hook (values of the kernel's enum nf_inet_hooks).
type Hook uint8

const (
	HookPrerouting  Hook = 0
	HookLocalIn     Hook = 1
	HookForward     Hook = 2
	HookLocalOut    Hook = 3
	HookPostrouting Hook = 4
)

func (h Hook) String() string {
	return [...]string{"prerouting", "input", "forward", "output", "postrouting"}[h%5]
}

// Proto is an IP protocol number (6 TCP, 17 UDP).
type Proto uint8

const (
	TCP Proto = 6
	UDP Proto = 17
)

func (p Proto) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return "proto?"
}

// Watch is what the observers and the taps follow of one address: every
// port of it (Port 0: a VIP, a backend known without its port, e.g. one of a
// DNAT rule to a port range or of IPVS without a port), or only the endpoint
// Port of it (a backend known with the port it serves), of protocol Proto
// (0: TCP and UDP). Traffic to an address's other ports is not followed; a
// packet without ports (a later fragment, ICMP) is matched by its address.
type Watch struct {
	Addr  netip.Addr
	Port  uint16
	Proto Proto
}

// WatchAddr watches every port of a.
func WatchAddr(a netip.Addr) Watch { return Watch{Addr: a} }

func (w Watch) String() string {
	if w.Port == 0 {
		return w.Addr.String()
	}
	s := netip.AddrPortFrom(w.Addr, w.Port).String()
	if w.Proto != 0 {
		s += "/" + w.Proto.String()
	}
	return s
}

// SockKind tells which socket operation a PointSockAddr observation comes
// from, or for a PointSockState one, SockClosed, or for a PointSockEgress
// one, SockSendmsg (see there).
type SockKind uint8

const (
	SockConnect SockKind = 1
	SockSendmsg SockKind = 2
	// SockClosed: a TCP socket closed in SYN_SENT before its first packet
	// passed the egress observer (the node's filter rejected or dropped its
	// SYN at OUTPUT); the observation names its port, known only then.
	SockClosed SockKind = 3
	// SockConnect6: a dual-stack (IPv6) socket's connect to a v4-mapped
	// address, which runs the connect6 hooks only: a socket LB's connect6
	// program is what can have rewritten it.
	SockConnect6 SockKind = 4
)

// MAC is an Ethernet address, kept by value (no allocation per packet); the
// zero MAC means not known.
type MAC [6]byte

// IsZero tells whether m is unknown.
func (m MAC) IsZero() bool { return m == MAC{} }

func (m MAC) String() string { return net.HardwareAddr(m[:]).String() }

// Observation is one thing seen at one point. Zero values mean "not known".
type Observation struct {
	Time  time.Time // wall clock
	Point Point
	Dir   Dir
	Proto Proto
	Src   netip.AddrPort
	Dst   netip.AddrPort

	// Socket layer (PointSockAddr, PointSockState, PointSockEgress).
	Kind   SockKind
	ReqDst netip.AddrPort // what the application asked for (syscall arguments)
	Cookie uint64         // socket cookie, links the socket-layer points together
	PID    uint32
	Comm   string
	Cgroup uint64 // cgroup v2 id
	// Unfollowed: the event of a netns out of the observers' scope when it
	// came, held until its Pod was found: they taught the other points
	// nothing of its socket, which missed its packets until then.
	Unfollowed bool

	// Packet taps and tc/netfilter observers.
	Ifindex  int
	Ifname   string
	NetNS    uint64 // netns inode
	Hook     Hook   // PointNF*
	Prio     int32  // PointNF*: priority the observer is attached at
	Len      int    // bytes on the wire (captured frames: original length)
	VLAN     uint16 // VLAN ID (0 = untagged)
	TPID     uint16 // 0x8100 or 0x88a8 when tagged
	SrcMAC   MAC
	DstMAC   MAC
	TCPFlags uint8

	// PointConntrack.
	NATDst   netip.AddrPort // reply source when it differs from Dst: the backend
	NATSrc   netip.AddrPort // reply destination when it differs from Src: the node's SNAT (masquerade)
	CTMark   uint32
	CTStatus uint32 // conntrack status bits (IPS_*: IPS_DST_NAT 0x20, IPS_CONFIRMED 0x8, ...)

	// PointDrop: why and where the kernel dropped the packet (NetNS and
	// Ifindex: its device's, or the one it came in by).
	Drop *KernelDrop
}

// KernelDrop is what the kernel says of a packet it dropped.
type KernelDrop struct {
	Code     uint32 // enum skb_drop_reason
	Reason   string // its name without SKB_DROP_REASON_ (NETFILTER_DROP), "" when unknown
	Location uint64 // the kernel address that dropped it
	Func     string // the kernel function at Location, "" when unknown
}
