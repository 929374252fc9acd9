package flow

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// DefaultMaxFlows bounds the flow table when Config.MaxFlows is 0.
const DefaultMaxFlows = 16384

// Service is a Service VIP to follow. Port 0 matches any port, Proto 0 any protocol.
type Service struct {
	Addr  netip.Addr
	Port  uint16
	Proto obs.Proto
}

// matches tells whether ap is this Service. A zero proto (not known yet, e.g. a
// sock_addr observation without it) matches any protocol.
func (s Service) matches(proto obs.Proto, ap netip.AddrPort) bool {
	return ap.Addr() == s.Addr &&
		(s.Port == 0 || s.Port == ap.Port()) &&
		(s.Proto == 0 || proto == 0 || s.Proto == proto)
}

// Config is what the engine needs besides the observations.
type Config struct {
	Services []Service
	// Points lists the observation points that were actually active (attached or
	// capturing). Absence of an observation at an inactive point proves nothing; a
	// point that produced an observation counts as active anyway.
	Points      map[obs.Point]bool
	Attribution Attribution
	// MaxFlows bounds the flow table (DefaultMaxFlows when 0). Observations of
	// flows beyond it are counted in the "flows_over_max" drop counter.
	MaxFlows int
	// FlowTimeout is how long a flow may be idle before Retire retires it
	// (DefaultFlowTimeout when 0).
	FlowTimeout time.Duration
	// HostNetNS is the node's netns inode (0: unknown). A client there (a
	// node process, a hostNetwork Pod) sends through the node's netfilter
	// OUTPUT and POSTROUTING hooks before its cgroup egress hook, so its
	// egress tuple is seen after the node's NAT, where a Pod's is seen
	// before it.
	HostNetNS uint64
	// Ready is when every observer and capture point was in place (zero:
	// unknown). A flow that began before it may have met some points before
	// they were there.
	Ready time.Time
	// UDPTimeout and UDPStreamTimeout are how long the node's conntrack
	// keeps a UDP entry after its last packet (nf_conntrack_udp_timeout,
	// nf_conntrack_udp_timeout_stream; the kernel's defaults when 0): a
	// datagram after that makes a new entry, and NAT picks a backend again.
	UDPTimeout, UDPStreamTimeout time.Duration
}

// Attribution is what the node has that can rewrite a VIP, read from the node by
// discovery. It names the rewriter ("by") once the observations have located the
// rewrite; it never decides the place itself (except IPVS, which has no observer
// of its own). pathtrace's own observer programs must not be listed.
type Attribution struct {
	// SockPrograms: cgroup sock_addr programs effective for the client's cgroup.
	SockPrograms []SockProgram
	// SockProgramsByCgroup: the programs effective for a client's own cgroup
	// (by cgroup id), when known; they take precedence over SockPrograms for
	// flows whose socket was seen in that cgroup.
	SockProgramsByCgroup map[uint64][]SockProgram
	// TCPrograms: tcx and cls_bpf programs on the host-side veth, and the
	// programs of a netkit pair, on its host side (its primary).
	TCPrograms []TCProgram
	// UplinkTCPrograms: those on the uplinks. An egress one runs before the
	// uplink's TX tap, after every other place that rewrites: a DNAT there
	// (Cilium's bpf_host) is where nothing else can have rewritten.
	UplinkTCPrograms []TCProgram
	// UplinkXDPPrograms: the uplinks' XDP programs (Kind their mode, as
	// ip-link(8)'s keyword: xdpdrv, xdpgeneric, ...; no Direction). They run
	// before the uplink's RX tap: an outside client's request one rewrote
	// (Cilium's bpf_xdp, a Katran-like LB) every point sees to its backend
	// already, and one it redirected no point of the uplink sees at all.
	UplinkXDPPrograms []TCProgram
	// HostXDPPrograms: the host veths' XDP programs (Ifindex the veth),
	// which run on what the Pod sends before the veth's RX tap.
	HostXDPPrograms []TCProgram
	// PodTCPrograms: those on the Pods' eth0, in the Pods' netns, each with
	// Ifindex its Pod's host veth (in the node netns, as a flow's). An
	// egress one runs after the socket's egress hook and before the Pod's
	// eth0 tap.
	PodTCPrograms []TCProgram
	// HostRedirects: the tc filters (not BPF) at the host veths' ingress
	// whose mirred action sends a Pod's packets to another interface, past
	// the bridge and netfilter, each with its host veth's Ifindex (0: any).
	HostRedirects []TCRedirect
	// NATRules: DNAT rules whose match includes a watched VIP.
	NATRules []NATRule
	// Rejects: rules that reject or drop a watched VIP's packets (no
	// Backends; Rule says "reject" or "drop" and the rule's comment):
	// kube-proxy's for a Service without endpoints. Hook is the filter
	// hook: forward, input or output.
	Rejects []NATRule
	// BackendDrops: rules of filter chains after NAT that reject or drop
	// packets to a backend's address (VIP holds the backend, port 0 any;
	// Rule the verdict): a NetworkPolicy's, which a request the node lost
	// after its rewrite may have met.
	BackendDrops []NATRule
	// DeviceRules: the rules of nftables chains on device hooks (netdev
	// ingress and egress, inet ingress) of the host veths and uplinks that
	// set a watched VIP's destination. An ingress chain of a host veth runs
	// after the veth's tc ingress and before the bridge and PREROUTING, an
	// egress chain of an uplink before the uplink's tc egress: each at a
	// tc place, where no point watches between the two.
	DeviceRules []DeviceRule
	// NetfilterPrograms: BPF programs on netfilter hooks (another tool's,
	// not pathtrace's observers), which may drop what they see.
	NetfilterPrograms []NetfilterProgram
	IPVS              []IPVSService
	// BridgeNFCallIPTables is the node's net.bridge.bridge-nf-call-iptables (nil
	// when unknown); it explains why NAT rules never saw a bridged flow.
	BridgeNFCallIPTables *bool
	// BridgeNFFilterVLANTagged is net.bridge.bridge-nf-filter-vlan-tagged
	// (nil when unknown): with 0, netfilter never sees the frames a bridge
	// carries VLAN-tagged (a tag pushed on a Pod's host veth).
	BridgeNFFilterVLANTagged *bool
	// PodOtherIfaces names, by address, the Pods' interfaces other than
	// the one captured (Multus's net1, a macvlan): a flow with one of
	// those addresses as source left its Pod through it, uncaptured.
	PodOtherIfaces map[netip.Addr]string
	// PodHostSides are the host sides (ifindex in the node netns) of the
	// traced Pods, by their eth0's addresses: a request a program of a
	// netkit pair redirected past the host side is tied to its own pair's
	// programs by its client.
	PodHostSides map[netip.Addr]int
	// StackedPods are the addresses of the traced Pods whose eth0 is a
	// macvlan or ipvlan of a node device, with what it is ("macvlan on
	// eno1"): they have no host side, so no host veth's tc runs between
	// their eth0 and the uplink, only the uplink's egress (and the node's
	// netfilter, for ipvlan's L3 modes, which its observers watch).
	StackedPods map[netip.Addr]string
	// RoutedHostVeths are the Pods' host veths (ifindex in the node netns)
	// that have no master: the node routes their Pods' packets (Calico,
	// Cilium), and a hairpin to the client's own Pod goes back out its
	// veth by routing, where no bridge's hairpin mode can stop it.
	RoutedHostVeths map[int]bool
	// HairpinOffUplinks are the uplinks (ifindex in the node netns) that
	// are ports of a Linux bridge with hairpin mode off: the bridge never
	// sends a frame back out the port it came in on, so it drops an
	// outside client's request rewritten to a backend behind that port.
	HairpinOffUplinks map[int]BridgePort
	// GatewayMACs are the Pods' default-gateway MAC addresses.
	GatewayMACs []net.HardwareAddr
	// UplinkNeighbors are what the node's neighbour tables (and a vxlan
	// uplink's fdb) map MACs to on the uplinks, by device and MAC:
	// discovery reads them, the session again as the run goes. A flow
	// whose uplink frame went to another MAC than its Pod's gateway names
	// it (Flow.UplinkDstNeighbor).
	UplinkNeighbors map[UplinkNeighborKey]UplinkNeighbor
	// NodeAddrs are the node netns's own addresses (nil: unknown), which
	// a NAT rule's source condition "local" is about.
	NodeAddrs []netip.Addr
	// LocalVIPs are the VIPs that are addresses of the node itself, with the
	// device holding each ("" when none does): the node delivers what is
	// sent to them to its own processes, unrewritten (NodeLocal DNSCache
	// listens on kube-dns's ClusterIP so).
	LocalVIPs map[netip.Addr]string
}

// BridgePort is a port of a Linux bridge, by name.
type BridgePort struct {
	Port, Bridge string
}

// UplinkNeighborKey is a MAC on an uplink device (its ifindex in the node's
// netns).
type UplinkNeighborKey struct {
	Ifindex int
	MAC     obs.MAC
}

// UplinkNeighbor is what the node's tables map a MAC to on an uplink: the
// IPv4 addresses of its neighbour entries there, and on a vxlan uplink the
// remote underlay address (VTEP) the device's fdb sends it to.
type UplinkNeighbor struct {
	Addrs []netip.Addr
	VTEP  netip.Addr // invalid when none
}

// maxNeighborAddrs bounds the addresses a flow names for one MAC.
const maxNeighborAddrs = 2

// String names n as Flow.UplinkDstNeighbor does: "172.30.0.1",
// "10.88.2.0, VTEP 192.168.90.2", at most maxNeighborAddrs addresses and
// how many more; "" when n names nothing.
func (n UplinkNeighbor) String() string {
	var parts []string
	for i, a := range n.Addrs {
		if i == maxNeighborAddrs {
			parts = append(parts, fmt.Sprintf("+%d more", len(n.Addrs)-i))
			break
		}
		parts = append(parts, a.String())
	}
	if n.VTEP.IsValid() {
		parts = append(parts, "VTEP "+n.VTEP.String())
	}
	return strings.Join(parts, ", ")
}

// SockProgram is a cgroup sock_addr program.
type SockProgram struct {
	// AttachType is "connect4", "sendmsg4", "recvmsg4" or "getpeername4" (the
	// cilium/ebpf names such as "CGroupInet4Connect" are understood too).
	AttachType string
	Name       string
	ID         uint32
	Cgroup     string // the cgroup directory it is attached to
	// Since: when it was loaded after, as far as the session saw (zero:
	// before the start); a socket rewritten before is not its.
	Since time.Time
}

// NetfilterProgram is a BPF program on a netfilter hook (a
// BPF_LINK_TYPE_NETFILTER link).
type NetfilterProgram struct {
	Family   string // "ipv4", "ipv6"
	Hook     string // "prerouting", "input", "forward", "output", "postrouting"
	Priority int32
	Name     string
	ID       uint32
}

// TCProgram is a tc program on the host-side veth, or a tc filter that is
// not BPF whose action rewrites addresses (act_nat, pedit, ct nat): it
// runs where a cls_bpf filter would.
type TCProgram struct {
	Direction string // "ingress" (from the Pod) or "egress" (towards the Pod)
	Kind      string // "tcx", "cls_bpf" or "netkit" (a Pod's netkit pair's: see gapAt); a filter's ("u32")
	Name      string
	ID        uint32
	// Action names a filter's rewriting action, the filter with it
	// ("u32 pref 10 on hv0 ingress: nat ingress 10.120.0.80/32 ->
	// 10.244.20.31"); "" for a program.
	Action string
	// Dst are the destinations Action rewrites (invalid: none, as an
	// act_nat that rewrites sources): a candidate only for their flows.
	Dst netip.Prefix
	// DstPort is their port, when its filter matches one (0: any).
	DstPort uint16
	// Conntrack: Action is act_ct's NAT, which makes the connection's
	// conntrack entry at tc (a stateless act_nat or pedit makes none).
	Conntrack bool
	// Ifindex is the host veth it is attached to (in the node netns): a
	// flow's tc rewrite is attributed to its own veth's programs. 0 =
	// unknown, a candidate for every flow.
	Ifindex int
	// Since and Until bound when it was there, as far as the session saw
	// (zero: from before the start, to the end): a CNI agent that restarts
	// replaces its programs, and a flow is attributed to those of its time.
	Since, Until time.Time
	// NotBefore: a look at its interface at this time did not find it
	// (zero: none did): it came after, however early Since's slack reaches.
	NotBefore time.Time
}

// TCRedirect is a tc filter's mirred redirect, as text ("veth-a ingress u32
// pref 10: mirred egress redirect to bond0").
type TCRedirect struct {
	Ifindex int
	Text    string
	// Since: when it was first read, for the host veth of a Pod that
	// started during the run (tcTimeSlack before it); zero: from the start.
	Since time.Time
	// Until: when another Pod's host veth was found with its ifindex (the
	// veth it was on went with its Pod); zero while it stands.
	Until time.Time
}

// DeviceRule is a rule of an nftables chain on a device hook that sets a
// VIP's destination (`ip daddr set`): a stateless rewrite, no NAT.
type DeviceRule struct {
	Chain   string // family table/chain, and the chains jumped to: "netdev t/c > rw"
	Hook    string // "ingress" or "egress"
	Device  string
	Ifindex int  // the device's, in the node netns; 0 = unknown, any host veth
	Uplink  bool // the device is an uplink, not a host veth
	VIP     netip.AddrPort
	Proto   obs.Proto
	// Backends: what the rule sets (port 0: kept); none when it is not
	// a constant (a map's value), then Rule says so.
	Backends []netip.AddrPort
	Rule     string // e.g. "daddr set 10.244.20.31:3000"
	// Since, Until: when the rule was there, as NATRule's (zero: from the
	// start, still there): the session reads the chains again while it
	// runs (Engine.SetDeviceRules).
	Since, Until time.Time
}

// NATRule is a DNAT rule for a VIP.
type NATRule struct {
	Source   string         // "nftables" or "iptables-legacy"
	Table    string         // e.g. "ip kube-proxy" or "nat"
	Chain    string         // e.g. "service-AB12CD-default/web/tcp/http" or "KUBE-SVC-..."
	Hook     string         // "prerouting" (traffic from Pods) or "output" (from the node); "" = unknown
	VIP      netip.AddrPort // port 0: any port
	Proto    obs.Proto      // 0: any protocol
	Backends []netip.AddrPort
	// PortRange: the DNAT's target is a range of ports, of which Backends
	// name the first: the backend may serve any of them.
	PortRange bool
	Rule      string // the rule as text, e.g. "endpoint-EF34 dnat to 10.244.20.31:3000"
	// Sources are the conditions on the client's address that the path
	// requires, all of them (none: any client): kube-proxy sends only
	// clients outside the cluster to an externalTrafficPolicy: Local
	// Service's local endpoints.
	Sources []SourceMatch
	// ICMPAnswer: the ICMP error a reject rule (Rejects) answers with, as
	// the capture words one, e.g. "ICMP destination unreachable (code 3:
	// port unreachable)"; "" for a drop, a TCP reset or an answer not
	// known.
	ICMPAnswer string
	// BeforeNAT: a reject or drop rule (Rejects) of a chain at prerouting
	// or output that runs before destination NAT, and so before the
	// netfilter observers (kube-proxy nftables' filter-prerouting and
	// filter-output, priority -110): the packets it ends were never seen
	// by netfilter's observers.
	BeforeNAT bool
	// Since and Until bound when it was there, as far as the session saw
	// (zero: from before the start, to the end): kube-proxy rewrites its
	// rules whenever a Service's endpoints change, and a flow is attributed
	// to the rules of its time.
	Since, Until time.Time
}

// String names the rule as verdicts do: source, table, chain path, then
// what it does ("nftables ip kube-proxy services -> ... -> dnat to B").
func (r NATRule) String() string {
	return fmt.Sprintf("%s %s %s -> %s", r.Source, r.Table, r.Chain, r.Rule)
}

// SourceMatch is a condition on a client's address: in one of Prefixes, or,
// with Local, one of the node's own addresses; Not negates it.
type SourceMatch struct {
	Prefixes []netip.Prefix
	Local    bool
	Not      bool
}

// Equal tells whether s and o are the same condition.
func (s SourceMatch) Equal(o SourceMatch) bool {
	return s.Local == o.Local && s.Not == o.Not && slices.Equal(s.Prefixes, o.Prefixes)
}

// IPVSService is an IPVS virtual service.
type IPVSService struct {
	VIP       netip.AddrPort
	Proto     obs.Proto
	Scheduler string
	Backends  []netip.AddrPort
	// Since and Until: as NATRule's.
	Since, Until time.Time
}
