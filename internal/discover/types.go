package discover

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
)

// NodeInfo is what Node found. It is printed as the first JSON object of a run
// ({"type":"node",...}) and as the first block of the table.
type NodeInfo struct {
	Kernel    string `json:"kernel"`
	HostNetNS NetNS  `json:"host_netns"`
	// Services are the traced Services as --svc gave them (VIP[:PORT][/PROTO]),
	// each once: a report read later says what it traced.
	Services []string `json:"services"`
	// ServicesWithoutNAT are those of Services that no NAT rule, nftables
	// device rewrite nor IPVS virtual service translated at discovery
	// (kube-proxy never programmed them): their packets leave unrewritten.
	ServicesWithoutNAT []string `json:"services_without_nat,omitempty"`
	Pods               []Pod    `json:"pods"`
	// PodsSkipped counts netns with a veth into the node left unexamined
	// because of Options.MaxPods.
	PodsSkipped int `json:"pods_skipped"`
	// PodsSkippedVeths names the node's veths into those netns (at most
	// MaxSkippedNamed): which Pods the bound left out.
	PodsSkippedVeths []string       `json:"pods_skipped_veths,omitempty"`
	CapturePoints    []CapturePoint `json:"capture_points"`

	// Service mechanisms present. SockPrograms are those effective on
	// SockCgroup (--cgroup, by default the cgroup2 root); a client's own
	// cgroup may add more, named with its flows.
	SockPrograms []SockProgram `json:"sock_programs"`
	SockCgroup   string        `json:"sock_cgroup"`
	TCPrograms   []TCProgram   `json:"tc_programs"`
	// TCRedirects: the tc filters of the host veths and uplinks whose mirred
	// action sends packets to another interface (no BPF).
	TCRedirects []TCRedirect `json:"tc_redirects,omitempty"`
	// XDPPrograms: the XDP programs of the host veths and uplinks.
	XDPPrograms []XDPProgram `json:"xdp_programs,omitempty"`
	Netfilter   Netfilter    `json:"netfilter"`
	IPVS        IPVS         `json:"ipvs"`

	// LocalVIPs are the traced VIPs that are addresses of the node itself.
	LocalVIPs []LocalVIP `json:"local_vips,omitempty"`

	// Notes say what could not be read or was decided by a fallback.
	Notes []string `json:"notes,omitempty"`

	// UplinkNeighbors are what the uplinks' neighbour tables (and a vxlan
	// uplink's fdb) map MACs to, at most MaxUplinkNeighbors: the flows
	// name their uplink frame's destination with it. Not printed: the
	// session reads it again as the run goes (RefreshUplinkNeighbors).
	UplinkNeighbors []UplinkNeighbor `json:"-"`

	// svcs are the traced VIPs and ports, for NATWatch; veths the node's
	// veths at discovery, and behind the netns found behind them, for
	// PodWatch; hostAddrs the node netns's addresses, all of them when
	// hostAddrsComplete.
	svcs              serviceSet
	veths             map[int]vethID
	behind            []netnsBehind
	hostAddrs         []netip.Addr
	hostAddrsComplete bool
	// hostLinks names the node netns's links at discovery, by ifindex
	// (LinkName).
	hostLinks map[int]string
}

// NodeAddrs are the node netns's own addresses, nil when they could not
// all be read: a NAT rule limited to local sources (kube-proxy's for the
// node's own traffic to a NodePort) is about them.
func (n *NodeInfo) NodeAddrs() []netip.Addr {
	if !n.hostAddrsComplete {
		return nil
	}
	return n.hostAddrs
}

// ClientAddrs are the addresses a traced flow's client may have: the Pods'
// (their eth0's IPv4 addresses) and the node's own (its processes and
// hostNetwork Pods are traced too), but not a traced VIP that is an address
// of the node (a NodePort traced as NODE-IP:PORT, NodeLocal DNSCache's
// ClusterIP, IPVS's ClusterIPs on kube-ipvs0): every client sends to that.
func (n *NodeInfo) ClientAddrs() map[netip.Addr]bool {
	addrs := map[netip.Addr]bool{}
	for _, a := range n.hostAddrs {
		if !slices.Contains(n.svcs.vips, a) {
			addrs[a] = true
		}
	}
	for _, p := range n.Pods {
		for _, pfx := range p.Eth0.Addrs {
			addrs[pfx.Addr()] = true
		}
		for _, ifc := range p.OtherIfaces {
			for _, pfx := range ifc.Addrs {
				addrs[pfx.Addr()] = true
			}
		}
	}
	return addrs
}

// NodeVIPPorts are the traced VIPs that are addresses of the node and
// were given with ports only (a NodePort traced as NODE-IP:PORT), with those
// ports: only they are the Service's, the node's other ports are its own
// processes' client ports (ClientAddrs leaves such an address out). A VIP
// given without a port is not here: every port of it is the Service's.
func (n *NodeInfo) NodeVIPPorts() map[netip.Addr][]uint16 {
	var out map[netip.Addr][]uint16
	for _, a := range n.hostAddrs {
		specs := n.svcs.ports[a]
		if !slices.Contains(n.svcs.vips, a) || len(specs) == 0 || n.svcs.any[a] ||
			slices.ContainsFunc(specs, func(sp ServicePort) bool { return sp.Port == 0 }) {
			continue
		}
		if out == nil {
			out = map[netip.Addr][]uint16{}
		}
		for _, sp := range specs {
			if !slices.Contains(out[a], sp.Port) {
				out[a] = append(out[a], sp.Port)
			}
		}
	}
	return out
}

func (n *NodeInfo) notef(format string, args ...any) {
	n.Notes = append(n.Notes, fmt.Sprintf(format, args...))
}

// LocalVIP is a traced VIP the node routes as its own address (route type
// local): a NodePort traced as NODE-IP:PORT, or a Service address a
// node-local cache listens on (NodeLocal DNSCache).
type LocalVIP struct {
	Addr   netip.Addr `json:"addr"`
	Device string     `json:"device,omitempty"` // the device holding the address; "" when none does (a local route alone)
}

// NetNS identifies a network namespace: a path that opens it, and its inode.
type NetNS struct {
	Path  string `json:"path"`
	Inode uint64 `json:"inode"`
}

// Iface is a network interface inside some netns.
type Iface struct {
	Name    string         `json:"name"`
	Ifindex int            `json:"ifindex"`
	MAC     string         `json:"mac"`
	Kind    string         `json:"kind"`            // link type: veth, macvlan, ...
	Addrs   []netip.Prefix `json:"addrs,omitempty"` // IPv4
}

// Pod is a network namespace with a veth whose peer is in the node's netns.
type Pod struct {
	NetNS NetNS `json:"netns"`
	// Who holds the netns: a process (PID, Comm) and/or a /run/netns name
	// (or the path of a netns mount elsewhere).
	PID    int    `json:"pid,omitempty"`
	Comm   string `json:"comm,omitempty"`
	NSName string `json:"netns_name,omitempty"`

	Eth0       Iface      `json:"eth0"`
	Gateway    netip.Addr `json:"gateway"`     // gateway of the route through Eth0 (see viaEth0), zero when none or on-link
	GatewayMAC string     `json:"gateway_mac"` // from the pod's neighbour table, "" until resolved
	HostPeer   *HostPeer  `json:"host_peer"`   // nil when eth0's peer is not in the node netns

	Uplinks   []string `json:"uplinks"`
	UplinkHow string   `json:"uplink_how"` // which rule chose Uplinks

	// OtherIfaces are the Pod's other interfaces with an IPv4 address
	// (Multus's net1, a macvlan), loopback left out: a flow it routes out
	// one of them has that source, and is the Pod's all the same.
	OtherIfaces []Iface `json:"other_ifaces,omitempty"`
	// vipsElsewhere says which traced VIPs the Pod routes through another
	// interface than Eth0 ("10.120.0.10 through net1"), "" when none.
	vipsElsewhere string

	// viaEth0: the pod's default route leaves through Eth0, or, when it
	// leaves elsewhere (Multus's net1), its route to one of the VIPs does.
	viaEth0 bool
	// vipRouteOnly: viaEth0 holds by a VIP's route alone, not the default
	// route.
	vipRouteOnly bool
	// defaultDev names the pod's interface of its default route when that
	// is not Eth0 ("" otherwise, or without one).
	defaultDev string
	// peerNSID is, when peerElsewhere, the id (from the pod's view) of the
	// netns holding Eth0's veth peer: a netns that is not the node netns.
	peerElsewhere bool
	peerNSID      int
	// lower is the ifindex in the node netns of the device below Eth0 when
	// Eth0 is a macvlan or ipvlan on a node device (0 otherwise), lowerName
	// its name.
	lower     int
	lowerName string
	// links names the Pod netns's links when it was inspected, by
	// ifindex (NodeInfo.LinkName).
	links map[int]string
}

// StackedOn says, for a Pod whose eth0 is a macvlan or ipvlan of a node
// device, what it is ("ipvlan on eno1"): such a Pod has no host side, and
// no host veth's tc runs on its way out. "" for another Pod.
func (p Pod) StackedOn() string {
	if p.lower == 0 {
		return ""
	}
	return p.Eth0.Kind + " on " + p.lowerName
}

// HostPeer is the node-side end of a pod's veth.
type HostPeer struct {
	Iface
	Master     string `json:"master,omitempty"`
	MasterKind string `json:"master_kind"` // bridge, openvswitch, none, or the master's link kind
}

// Capture point roles.
const (
	RolePod    = "pod"
	RoleHost   = "host"
	RoleUplink = "uplink"
)

// CapturePoint is an interface pathtrace captures on.
type CapturePoint struct {
	Role        string   `json:"role"`
	NetNS       string   `json:"netns"` // path that opens the netns holding Ifname
	Ifname      string   `json:"ifname"`
	Ifindex     int      `json:"ifindex"`
	MAC         string   `json:"mac"`
	Kind        string   `json:"kind"` // link type: veth, bond, vlan, device, ...
	Master      string   `json:"master,omitempty"`
	MasterKind  string   `json:"master_kind,omitempty"`
	BondMembers []string `json:"bond_members,omitempty"`
	VLANParent  string   `json:"vlan_parent,omitempty"`
	VLANID      int      `json:"vlan_id,omitempty"`
	// Tunnel describes an overlay device (VXLAN, Geneve: flannel.1,
	// vxlan.calico, cilium_vxlan): its frames are the inner ones, so the
	// VLAN and MAC its flows show are not those of the wire below
	// ("vxlan id 1 over eth0, local 192.168.50.1, udp 8472").
	Tunnel string `json:"tunnel,omitempty"`
	// TCUnread: its tc programs could not be listed (see the notes).
	TCUnread bool `json:"tc_unread,omitempty"`
	// Hairpin is an uplink's hairpin mode as a port of a Linux bridge
	// (nil for another uplink, or when unread): off, the bridge never
	// sends a frame back out it, as a request that came in on it and was
	// rewritten to a backend behind it.
	Hairpin *bool `json:"hairpin,omitempty"`
}

// SockProgram is a cgroup sock_addr program effective for the client's cgroup.
type SockProgram struct {
	Attach string         `json:"attach"` // connect4, sendmsg4, recvmsg4, getpeername4
	Name   string         `json:"name"`   // full name from BTF when available
	ID     ebpf.ProgramID `json:"id"`
	Cgroup string         `json:"cgroup"` // the cgroup directory it is attached to
}

// TCProgram is a tcx or cls_bpf program on a host veth or uplink, or on a
// Pod's eth0 (in the Pod's netns: Ifindex is there, HostIfindex names the
// Pod's host veth in the node netns), or a netkit program of a Pod's netkit
// pair, on its host side (see NetkitChain).
type TCProgram struct {
	Ifname       string         `json:"ifname"`
	Ifindex      int            `json:"ifindex"`
	HostIfindex  int            `json:"host_ifindex,omitempty"` // pod only
	Role         string         `json:"role"`                   // host, uplink or pod
	Dir          string         `json:"dir"`                    // ingress or egress
	Via          string         `json:"via"`                    // tcx, cls_bpf or netkit
	Name         string         `json:"name"`
	ID           ebpf.ProgramID `json:"id"`
	DirectAction bool           `json:"direct_action,omitempty"` // cls_bpf only
	// Action: a tc filter that is not BPF (Via its kind, "u32"; Name its
	// preference, "pref 10"; ID 0), by its rewriting action, as tc(8)
	// says it briefly ("nat ingress 10.120.0.80/32 -> 10.244.20.31").
	Action       string       `json:"action,omitempty"`
	Rewrites     netip.Prefix `json:"rewrites,omitzero"`       // the destinations Action rewrites
	RewritesPort uint16       `json:"rewrites_port,omitempty"` // and their port, its filter's match; 0: any
}

// FilterText names a filter's action (Action) with the filter, as a flow's
// "by" says it: "u32 pref 10 on hv0 ingress: nat ingress 10.120.0.80/32 ->
// 10.244.20.31".
func (p TCProgram) FilterText() string {
	return fmt.Sprintf("%s %s on %s %s: %s", p.Via, p.Name, p.Ifname, p.Dir, p.Action)
}

// Conntrack tells whether Action is act_ct's NAT (ctAction's), which makes
// the connection's conntrack entry at tc.
func (p TCProgram) Conntrack() bool { return strings.HasPrefix(p.Action, "ct ") }

// XDPProgram is an XDP program on a host veth or an uplink. It runs before
// the device's RX tap and tc ingress: what it rewrites every point sees
// rewritten already, and what it redirects no point of the device sees.
type XDPProgram struct {
	Ifname  string         `json:"ifname"`
	Ifindex int            `json:"ifindex"`
	Role    string         `json:"role"` // host or uplink
	Mode    string         `json:"mode"` // ip-link(8)'s keyword: xdpdrv, xdpgeneric, xdpoffload; xdpmulti for several
	Name    string         `json:"name"`
	ID      ebpf.ProgramID `json:"id"` // 0 for xdpmulti: netlink names none
}

// TCRedirect is a tc filter whose mirred action redirects (or mirrors)
// packets to another interface: at a host veth's ingress it takes a Pod's
// packets past the bridge and netfilter, whose NAT then never applies.
type TCRedirect struct {
	Ifname  string `json:"ifname"`
	Ifindex int    `json:"ifindex"`
	Role    string `json:"role"` // host or uplink
	Dir     string `json:"dir"`  // ingress or egress
	Filter  string `json:"filter"`
	Action  string `json:"action"` // "egress redirect", "egress mirror", "ingress redirect", ...
	To      string `json:"to"`     // the target interface
}

// String names it for a reason or the report.
func (r TCRedirect) String() string {
	return fmt.Sprintf("%s %s %s: mirred %s to %s", r.Ifname, r.Dir, r.Filter, r.Action, r.To)
}

// Netfilter is what the node's netfilter does to the Service VIPs.
type Netfilter struct {
	NFTables       string `json:"nftables"`        // what was read, or why not
	IPTablesLegacy string `json:"iptables_legacy"` // what was read, or why not
	// Per-netns sysctls of the node netns; nil when absent.
	BridgeNFCallIPTables *bool `json:"bridge_nf_call_iptables"`
	// BridgeNFFilterVLANTagged: whether the frames a bridge carries
	// VLAN-tagged meet netfilter too.
	BridgeNFFilterVLANTagged *bool     `json:"bridge_nf_filter_vlan_tagged"`
	IPForward                *bool     `json:"ip_forward"`
	Rules                    []NATRule `json:"rules"`
	// Rejects are the rules that reject or drop packets to a VIP (in a
	// filter chain, a NAT one's for a DROP): kube-proxy's for a Service
	// without endpoints, or to a port a ClusterIP does not serve.
	Rejects []NATRule `json:"rejects,omitempty"`
	// BackendDrops are the rules of filter chains after NAT that reject or
	// drop packets to the address of a backend the NAT rules name (a
	// NetworkPolicy's, written on the Pod's address), Service holding the
	// backend: a request the node drops after its rewrite may meet them.
	// Read at discovery.
	BackendDrops []NATRule `json:"backend_drops,omitempty"`
	// DeviceChains are the nftables base chains on device hooks (netdev
	// ingress and egress, inet ingress), every one, with the rules that
	// set a traced VIP's destination.
	DeviceChains []DeviceChain `json:"device_chains,omitempty"`
	// BPFPrograms are the BPF programs attached to netfilter hooks (not
	// pathtrace's observers), the machine's: the kernel does not say in
	// which netns a netfilter link is. Read once, at discovery.
	BPFPrograms []NetfilterProgram `json:"bpf_programs,omitempty"`
	// UDPTimeout, UDPStreamTimeout: how long conntrack keeps a UDP entry
	// after its last packet, before and once it is a stream (seconds;
	// nf_conntrack_udp_timeout, _stream); 0 when absent (no conntrack).
	UDPTimeout       int `json:"udp_timeout,omitempty"`
	UDPStreamTimeout int `json:"udp_timeout_stream,omitempty"`
}

// NATRule is one DNAT reachable for a VIP: the chain path from a NAT base chain
// to the rule that rewrites the destination; or, with Verdict, a rule that
// rejects or drops the VIP's packets, from a base chain (of a filter hook:
// forward, input, output).
type NATRule struct {
	Source  string     `json:"source"` // nftables or iptables-legacy
	Table   string     `json:"table"`  // "ip kube-proxy", "nat", ...
	Hook    string     `json:"hook"`   // prerouting (traffic from pods) or output (from the node)
	Service netip.Addr `json:"service"`
	Port    uint16     `json:"port,omitempty"`  // service port the path requires, 0 = any
	Proto   string     `json:"proto,omitempty"` // tcp, udp, ... "" = any
	Chains  []string   `json:"chains"`
	// Backend is the DNAT target; port 0 keeps the destination port. Invalid
	// when the target could not be decoded (then Note says why).
	Backend netip.AddrPort `json:"backend"`
	// PortRange: the target is a range of ports, of which Backend names
	// the first (the backend may serve any port of it).
	PortRange bool   `json:"port_range,omitempty"`
	Note      string `json:"note,omitempty"`
	// Verdict is "reject" or "drop" for a rule that ends the packets, ""
	// for a DNAT; Comment is its comment (kube-proxy's: "default/web:http
	// has no endpoints"), only kept for those.
	Verdict string `json:"verdict,omitempty"`
	// RejectWith is what a reject rule answers with, in iptables' words:
	// "tcp-reset", "icmp-port-unreachable", "icmp-admin-prohibited", ...
	// (RejectICMPCode); "" for a drop or an answer not decoded.
	RejectWith string `json:"reject_with,omitempty"`
	Comment    string `json:"comment,omitempty"`
	// AfterNAT: the rule sees packets after destination NAT (a filter
	// chain at forward, input, or output after NAT's priority), so it only
	// ends those NAT left addressed to the VIP: the ports no DNAT rule
	// serves (kube-proxy's "Reject traffic to invalid ports of ClusterIPs"
	// never meets a healthy Service's own port).
	AfterNAT bool `json:"after_nat,omitempty"`
	// Sources are the conditions on the packet's source address that the
	// rules of the path require, all of them; none: any source.
	Sources []SourceMatch `json:"sources,omitempty"`
}

// SourceMatch is a rule's condition on the source address of a packet: in
// one of Prefixes (iptables -s, nftables ip saddr), or, with Local, one of
// the node's own addresses (-m addrtype --src-type LOCAL, fib saddr type
// local); Not negates it.
type SourceMatch struct {
	Prefixes []netip.Prefix `json:"prefixes,omitempty"`
	Local    bool           `json:"local,omitempty"`
	Not      bool           `json:"not,omitempty"`
}

// String says the condition as the node block shows it: "10.244.0.0/16",
// "not local".
func (s SourceMatch) String() string {
	what := "local"
	if !s.Local {
		ps := make([]string, len(s.Prefixes))
		for i, p := range s.Prefixes {
			ps[i] = p.String()
		}
		what = "{" + strings.Join(ps, ", ") + "}"
		if len(ps) == 1 {
			what = ps[0]
		}
	}
	if s.Not {
		return "not " + what
	}
	return what
}

// Backends are the backend addresses the node's NAT rules and IPVS services
// give the VIPs, in rule order, each once.
func (n *NodeInfo) Backends() []netip.Addr {
	var out []netip.Addr
	seen := map[netip.Addr]bool{} // a Service may have thousands of endpoints
	add := func(a netip.Addr) {
		if a.IsValid() && !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	for _, r := range n.Netfilter.Rules {
		add(r.Backend.Addr())
	}
	for _, s := range n.IPVS.Services {
		for _, b := range s.Backends {
			add(b.Addr())
		}
	}
	return out
}

// IPVS tells whether IPVS is present in the node netns and which of its
// virtual services are the VIPs.
type IPVS struct {
	Present  bool          `json:"present"`
	Note     string        `json:"note,omitempty"`
	Services []IPVSService `json:"services,omitempty"`
}

// IPVSService is an IPVS virtual service and its real servers.
type IPVSService struct {
	Proto     string           `json:"proto"`
	Service   netip.AddrPort   `json:"service"`
	Scheduler string           `json:"scheduler"`
	Backends  []netip.AddrPort `json:"backends"`
}

// rejectICMPCodes are the ICMP destination unreachable codes of the reject
// answers (RejectWith) that are one.
var rejectICMPCodes = map[string]uint8{
	"icmp-net-unreachable":   0,
	"icmp-host-unreachable":  1,
	"icmp-proto-unreachable": 2,
	"icmp-port-unreachable":  3,
	"icmp-net-prohibited":    9,
	"icmp-host-prohibited":   10,
	"icmp-admin-prohibited":  13,
}

// RejectICMPCode is the code of the ICMP destination unreachable a reject
// rule answers with; false when it answers otherwise (a TCP reset) or not
// known.
func (r NATRule) RejectICMPCode() (uint8, bool) {
	c, ok := rejectICMPCodes[r.RejectWith]
	return c, ok
}

// rejectWithICMPCode is the RejectWith of an ICMP destination unreachable
// of code c, "" for a code no reject sends.
func rejectWithICMPCode(c uint8) string {
	for name, code := range rejectICMPCodes {
		if code == c {
			return name
		}
	}
	return ""
}
