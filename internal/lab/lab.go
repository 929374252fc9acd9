// Package lab reproduces, in network namespaces on one machine, the cluster
// datapath of pathtrace's seed case: a Pod behind a Linux bridge (playing OVS),
// an uplink that carries VLAN 200, a gateway that knows nothing of Services, and
// a backend. A Service VIP is translated to the backend in one of four places
// (Mode): by a socket LB, by a tc LB, by kube-proxy-shaped netfilter rules, or
// nowhere at all.
//
// Every object the lab makes is named from its instance name, so several labs
// (e.g. parallel test binaries) never collide. The lab outlives the process that
// built it: BPF programs are attached without links or pins, so they live as
// long as their device or cgroup, and the servers are detached worker processes
// (this same binary re-executed, see RunWorkerIfRequested).
package lab

import (
	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/nsutil"

	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"regexp"

	"github.com/vishvananda/netlink"
)

// Mode is where the Service VIP is translated to the backend.
type Mode string

const (
	ModeSocket    Mode = "socket"    // cgroup connect4/sendmsg4/recvmsg4/getpeername4 on the client cgroup
	ModeTC        Mode = "tc"        // tcx DNAT on the host veth, reverse NAT on its egress
	ModeTCLegacy  Mode = "tc-legacy" // the same LB as cls_bpf filters under clsact (runs after tcx)
	ModeNetfilter Mode = "netfilter" // kube-proxy nftables DNAT, bridge-nf-call-iptables=1
	ModeNowhere   Mode = "nowhere"   // the same rules, bridge-nf-call-iptables=0: nobody translates
)

// Modes lists every mode in the order of the datapath.
func Modes() []Mode { return []Mode{ModeSocket, ModeTC, ModeTCLegacy, ModeNetfilter, ModeNowhere} }

// ParseMode checks that s names a mode.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes() {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("unknown lab mode %q (want socket, tc, tc-legacy, netfilter or nowhere)", s)
}

// Topology. The addresses are the seed article's anonymised ones; they never
// leave the lab's namespaces. Treat these values as constants.
var (
	PodIP            = netip.MustParseAddr("10.244.8.23")
	GatewayIP        = netip.MustParseAddr("10.244.8.1") // the Pod's gateway, VLAN side
	GatewayBackendIP = netip.MustParseAddr("10.244.20.1")
	BackendIP        = netip.MustParseAddr("10.244.20.31")

	TCPVIP     = netip.MustParseAddrPort("10.120.0.80:80")
	UDPVIP     = netip.MustParseAddrPort("10.120.0.10:53")
	TCPBackend = netip.AddrPortFrom(BackendIP, 3000)
	UDPBackend = netip.AddrPortFrom(BackendIP, 5353)
)

const (
	subnetBits = 22 // both lab subnets are /22

	PodIface        = "eth0"       // in the pod netns
	HostVeth        = "veth-a"     // the Pod's host-side veth, in the node netns
	Bridge          = "br-pod"     // node netns, no IP
	Uplink          = "bond0"      // node netns: a veth to the gateway carrying VLAN 200
	GatewayPort     = "gw-node"    // gw netns: the uplink's peer, GatewayIP
	GatewayBackPort = "gw-backend" // gw netns: towards the backend, GatewayBackendIP
	BackendIface    = "eth0"       // in the backend netns
	VLAN            = 200          // the uplink's 802.1Q VLAN ID

	// DefaultName is the instance name of `pathtrace lab`.
	DefaultName = "ptlab"

	netnsDir     = "/run/netns"
	stateBaseDir = "/run/pathtrace-lab"
)

// Lab is one instance of the lab, identified by its name. A Lab holds no
// kernel resources: every method finds the instance's objects by name, so a
// Lab made in another process (or after a crash) manages the same instance.
type Lab struct {
	name string
}

var validName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// New returns the lab instance called name (DefaultName when empty). The name
// prefixes every namespace, cgroup and state directory of the instance.
func New(name string) *Lab {
	if name == "" {
		name = DefaultName
	}
	return &Lab{name: name}
}

// Name is the instance name.
func (l *Lab) Name() string { return l.name }

// Command is the pathtrace command line of the lab subcommand sub for this
// lab, with --name unless it is the default one: what a message tells the
// user to run.
func (l *Lab) Command(sub string) string {
	if l.name == DefaultName {
		return "pathtrace lab " + sub
	}
	return "pathtrace lab " + sub + " --name " + l.name
}

// CheckName tells whether name can name a lab instance.
func CheckName(name string) error {
	if !validName.MatchString(name) {
		return fmt.Errorf("lab name %q: want 1-32 characters of a-z, 0-9 and '-', starting with a letter or digit", name)
	}
	return nil
}

func (l *Lab) checkName() error { return CheckName(l.name) }

// Namespace roles.
const (
	rolePod     = "pod"
	roleNode    = "node"
	roleGateway = "gw"
	roleBackend = "backend"
)

func roles() []string { return []string{rolePod, roleNode, roleGateway, roleBackend} }

func (l *Lab) netnsName(role string) string { return l.name + "-" + role }

func (l *Lab) netnsPath(role string) string { return filepath.Join(netnsDir, l.netnsName(role)) }

// NodeNetNS is the path of the node's network namespace (bridge, host veth, uplink).
func (l *Lab) NodeNetNS() string { return l.netnsPath(roleNode) }

// PodNetNS is the path of the Pod's network namespace.
func (l *Lab) PodNetNS() string { return l.netnsPath(rolePod) }

// GatewayNetNS is the path of the gateway's network namespace.
func (l *Lab) GatewayNetNS() string { return l.netnsPath(roleGateway) }

// BackendNetNS is the path of the backend's network namespace.
func (l *Lab) BackendNetNS() string { return l.netnsPath(roleBackend) }

// ClientCgroup is the path of the cgroup v2 directory the lab's client runs in
// (the socket LB is attached there), or "" when cgroup2 is not mounted.
func (l *Lab) ClientCgroup() string {
	root, err := cgroup2.Root()
	if err != nil {
		return ""
	}
	return filepath.Join(root, l.name+"-client")
}

func (l *Lab) stateDir() string { return filepath.Join(stateBaseDir, l.name) }

// GatewayMAC is the MAC address of the gateway's VLAN-side port: the
// destination MAC of the Pod's frames on the uplink.
func (l *Lab) GatewayMAC() (net.HardwareAddr, error) {
	var mac net.HardwareAddr
	err := nsutil.Netlink(l.GatewayNetNS(), func(h *netlink.Handle) error {
		link, err := h.LinkByName(GatewayPort)
		if err != nil {
			return fmt.Errorf("gateway port %s: %w", GatewayPort, err)
		}
		mac = link.Attrs().HardwareAddr
		return nil
	})
	return mac, err
}
