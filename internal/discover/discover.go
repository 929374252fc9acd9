// Package discover reads a node read-only, without the Kubernetes API: which
// Pods it has (network namespaces with a veth into the node's netns), where to
// capture (the Pod's eth0, the host-side veth, the uplink), and which Service
// translation mechanisms are present (cgroup sock_addr programs, tcx and cls_bpf
// programs, nftables and iptables-legacy NAT rules, IPVS, bridge netfilter).
// Nothing here attaches, creates or changes anything.
package discover

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// DefaultMaxPods bounds pod enumeration when Options.MaxPods is 0.
const DefaultMaxPods = 4096

// Options select what to discover. The zero value covers every Pod of the node
// in pathtrace's own netns.
type Options struct {
	HostNetNS string // node netns path; "" = /proc/self/ns/net
	// Pod selectors, at most one of them.
	PodIP    netip.Addr
	PodNetNS string
	PodPID   int
	HostVeth string // override: host-side veth name (in HostNetNS)
	Uplink   string // override: uplink name (in HostNetNS)
	Cgroup   string // cgroup v2 dir for socket observers; "" = the cgroup2 root
	// Services are the VIPs: NAT rules and IPVS services matching them are reported.
	Services []netip.Addr
	// ServicePorts are VIPs (Services or not) with the port and protocol
	// they were given with: a VIP listed here has only the NAT rules and
	// IPVS services of those ports and protocols reported (and their
	// backends drive the uplink), a rule that requires no port applying
	// to every port; an entry without port and protocol keeps all.
	ServicePorts []ServicePort
	// MaxPods bounds enumeration; netns beyond it are counted in PodsSkipped.
	MaxPods int
	// IsObserver tells the programs to leave out of attribution: pathtrace's
	// observers, its own and those of another pathtrace on the node.
	IsObserver func(ebpf.ProgramID) bool
}

// UsageError is an error caused by the user's input (exit code 2). Msg is one
// line saying what is wrong and how to fix it.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

func usagef(format string, args ...any) *UsageError {
	return &UsageError{Msg: fmt.Sprintf(format, args...)}
}

// Node discovers the node described by opt. User mistakes come back as
// *UsageError; mechanisms that cannot be read are reported in NodeInfo.Notes,
// never hidden and never fatal.
func Node(ctx context.Context, opt Options) (*NodeInfo, error) {
	if opt.HostNetNS == "" {
		opt.HostNetNS = nsutil.Self
	}
	if opt.MaxPods <= 0 {
		opt.MaxPods = DefaultMaxPods
	}
	defaultCgroup := opt.Cgroup == ""
	if err := checkOptions(&opt); err != nil {
		return nil, err
	}
	host, err := openHost(opt.HostNetNS)
	if err != nil {
		return nil, err
	}
	defer host.close()

	info := &NodeInfo{
		Kernel:    kernelRelease(),
		HostNetNS: NetNS{Path: host.path, Inode: host.inode},
		Services:  traced(opt.Services, opt.ServicePorts),
	}
	svcs := newServiceSet(opt.Services, opt.ServicePorts)
	opt.Services = svcs.vips
	info.LocalVIPs = host.localVIPs(svcs.vips)
	for _, lv := range info.LocalVIPs {
		if svcs.anyPort(lv.Addr) && host.routesFrom(lv.Addr) {
			on := ""
			if lv.Device != "" {
				on = " (on " + lv.Device + ")"
			}
			return nil, usagef("--svc %s: an address of the node%s that its own connections leave from, given without a port: every packet to it would be the Service's, the replies to the node's own and masqueraded connections included; give the NodePort: --svc %s:PORT", lv.Addr, on, lv.Addr)
		}
	}
	info.hostAddrs, info.hostAddrsComplete = host.addrs()
	svcs.local = map[netip.Addr]bool{}
	for _, lv := range info.LocalVIPs {
		svcs.local[lv.Addr] = true
	}
	info.hostLinks = linkNames(maps.Values(host.links))
	info.veths = map[int]vethID{}
	for idx, l := range host.links {
		if isVeth(l) {
			info.veths[idx] = vethIDOf(l)
		}
	}
	if err := discoverPods(ctx, host, opt, info); err != nil {
		return nil, err
	}
	for _, p := range info.Pods {
		if p.vipsElsewhere != "" && p.HostPeer != nil {
			info.notef("pod netns %s routes %s, not through %s, its interface captured (host side %s): its flows to them are not captured at the Pod's points; the node's netfilter observers, conntrack and uplink still follow them where they cross the node", p.NetNS.Path, p.vipsElsewhere, p.Eth0.Name, p.HostPeer.Name)
		}
	}
	// The NAT rules and IPVS services name the backends, whose routes tell
	// a routed node's uplink.
	info.svcs = svcs
	info.Netfilter = readNetfilter(ctx, host.path, svcs, info)
	if note := bridgeNFAbsentNote(info); note != "" {
		info.notef("%s", note)
	}
	info.IPVS = readIPVS(host.path, svcs)
	info.ServicesWithoutNAT = untranslated(opt.Services, opt.ServicePorts, info.Netfilter, info.IPVS)
	if note := podLikeNodeNote(host, info); note != "" {
		info.notef("%s", note)
	}
	uplinks, err := discoverUplinks(ctx, host, opt, info)
	if err != nil {
		return nil, err
	}
	info.CapturePoints = capturePoints(host, info, uplinks)
	if info.UplinkNeighbors, err = readUplinkNeighbors(host.nl, info.CapturePoints); err != nil {
		info.notef("uplink neighbour table not fully read: %v", err)
	}

	own := observerFilter(opt.IsObserver)
	nfProgs, err := netfilterPrograms(own)
	if err != nil {
		info.notef("netfilter BPF programs not fully read: %v", err)
	}
	if err := placeNetfilterPrograms(host.path, nfProgs); err != nil {
		info.notef("netfilter BPF programs: not told whether in the node netns: %v", err)
	}
	info.Netfilter.BPFPrograms = nfProgs
	info.SockPrograms, info.SockCgroup = sockPrograms(opt.Cgroup, own, info), opt.Cgroup
	if defaultCgroup && opt.Cgroup != "" {
		if note := cgroupNSNote(opt.Cgroup, cgroup2.IsHierarchyRoot); note != "" {
			info.notef("%s", note)
		}
	}
	cache := newProgCache(own)
	info.TCPrograms = tcPrograms(host, info.CapturePoints, cache, info)
	info.TCPrograms = append(info.TCPrograms, podTCPrograms(info.Pods, cache, info)...)
	info.XDPPrograms = xdpPrograms(host, info.CapturePoints, cache)
	info.emptyNotNull()
	return info, ctx.Err()
}

// emptyNotNull makes empty lists print as [] in JSON, so consumers can tell
// "looked, found none" from a missing field.
func (n *NodeInfo) emptyNotNull() {
	if n.Pods == nil {
		n.Pods = []Pod{}
	}
	if n.CapturePoints == nil {
		n.CapturePoints = []CapturePoint{}
	}
	if n.SockPrograms == nil {
		n.SockPrograms = []SockProgram{}
	}
	if n.TCPrograms == nil {
		n.TCPrograms = []TCProgram{}
	}
	if n.Netfilter.Rules == nil {
		n.Netfilter.Rules = []NATRule{}
	}
	for i := range n.Pods {
		if n.Pods[i].Uplinks == nil {
			n.Pods[i].Uplinks = []string{}
		}
	}
}

// checkOptions turns every user mistake that can be seen up front into a
// UsageError, and fills in the cgroup default.
func checkOptions(opt *Options) error {
	selectors := 0
	for _, set := range []bool{opt.PodIP.IsValid(), opt.PodNetNS != "", opt.PodPID != 0} {
		if set {
			selectors++
		}
	}
	if selectors > 1 {
		return usagef("--pod-ip, --pod-netns and --pod-pid select the same thing: give at most one")
	}
	if opt.PodIP.IsValid() && !opt.PodIP.Is4() {
		return usagef("--pod-ip %s: only IPv4 pod addresses are supported", opt.PodIP)
	}
	if err := checkNetNSPath("--host-netns", opt.HostNetNS); err != nil {
		return err
	}
	if opt.PodPID < 0 {
		return usagef("--pod-pid %d: a PID is a positive number", opt.PodPID)
	}
	if opt.PodPID > 0 {
		path := fmt.Sprintf("/proc/%d/ns/net", opt.PodPID)
		if _, err := os.Stat(path); err != nil {
			return PodPIDMissing(opt.PodPID)
		}
		opt.PodNetNS = path
	}
	if opt.PodNetNS != "" {
		if err := checkNetNSPath("--pod-netns", opt.PodNetNS); err != nil {
			return err
		}
	}
	if opt.Cgroup == "" {
		// A missing cgroup2 mount only loses the socket attribution: noted later.
		opt.Cgroup, _ = cgroup2.Root()
		return nil
	}
	given := opt.Cgroup
	// Absolute, so that walking up its parents ends at "/" and reports
	// name real directories (--cgroup . is the working directory).
	if abs, err := filepath.Abs(opt.Cgroup); err == nil {
		opt.Cgroup = abs
	}
	if st, err := os.Stat(opt.Cgroup); err != nil || !st.IsDir() {
		return usagef("--cgroup %s: no such directory; give a cgroup v2 directory (default: the cgroup2 root from /proc/self/mountinfo)", given)
	} else if !cgroup2.IsCgroup2(opt.Cgroup) {
		return usagef("--cgroup %s: not on a cgroup2 filesystem; give a cgroup v2 directory", given)
	}
	return nil
}

// podLikeNodeNote says when the netns taken for the node looks like a Pod's:
// it forwards nothing (ip_forward 0, which no node of a cluster has) and its
// default route leaves through its only veth into another netns. pathtrace then
// runs in a Pod without hostNetwork, or --host-netns names a Pod's netns:
// what it traces is that Pod's own view, none of the node's datapath.
func podLikeNodeNote(host *hostNS, info *NodeInfo) string {
	if fwd := info.Netfilter.IPForward; fwd == nil || *fwd {
		return ""
	}
	var out []netlink.Link // veths into other netns
	for _, l := range host.links {
		if isVeth(l) && l.Attrs().NetNsID >= 0 {
			out = append(out, l)
		}
	}
	// A Pod has one, its eth0; a node with Pods has one per Pod.
	if len(out) != 1 || !host.carriesDefault(out[0].Attrs().Index) {
		return ""
	}
	return fmt.Sprintf("the node netns %s looks like a Pod's, not a node's: ip_forward is 0 and its default route leaves through %s, a veth into another netns; "+
		"run pathtrace with hostNetwork (a DaemonSet's hostNetwork: true), or give --host-netns with the node's netns (the host's /proc/1/ns/net, mounted in)", host.path, out[0].Attrs().Name)
}

// cgroupNSNote says what the socket observers miss when the only cgroup2
// mount pathtrace sees is not the hierarchy's root but that of its cgroup
// namespace (a container's, a DaemonSet Pod's): attached there, they see the
// processes below it only, pathtrace's own, and none of the node's Pods.
func cgroupNSNote(dir string, isRoot func(string) bool) string {
	if isRoot(dir) {
		return ""
	}
	return fmt.Sprintf("the cgroup2 mount %s is not the root of the node's cgroup hierarchy (pathtrace runs in a cgroup namespace of its own, as a container does): "+
		"the socket observers attached there see only the processes below it, not the node's Pods, so socket-level rewrites (a socket LB) go unseen; "+
		"mount the host's /sys/fs/cgroup into the container (a hostPath volume, at /host/sys/fs/cgroup say: pathtrace takes it by itself) or give --cgroup with it", dir)
}

// nsGetNSType is the NS_GET_NSTYPE ioctl (_IO(0xb7, 0x3)), absent from x/sys.
const nsGetNSType = 0xb703

func checkNetNSPath(flag, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return usagef("%s %s: cannot open (%v); give a netns file such as /run/netns/NAME or /proc/PID/ns/net", flag, path, unwrapPathError(err))
	}
	defer f.Close()
	typ, err := unix.IoctlRetInt(int(f.Fd()), nsGetNSType)
	if st, serr := f.Stat(); err != nil && serr == nil && st.Mode().IsRegular() && st.Size() == 0 {
		// What a named netns's file is without the mount on it: the
		// directory was bind-mounted without its submounts.
		return usagef("%s %s: an empty file, not a network namespace: the netns mounted on it is not visible here (its directory was mounted without its submounts: mount it recursively, rbind, or in Kubernetes with mountPropagation: HostToContainer); or give /proc/PID/ns/net of a process in it", flag, path)
	}
	if err != nil || typ != unix.CLONE_NEWNET {
		return usagef("%s %s: not a network namespace; give a netns file such as /run/netns/NAME or /proc/PID/ns/net", flag, path)
	}
	return nil
}

func unwrapPathError(err error) error {
	if pe, ok := err.(*os.PathError); ok {
		return pe.Err
	}
	return err
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

// observerFilter is isObserver, or a filter that keeps every program.
func observerFilter(isObserver func(ebpf.ProgramID) bool) func(ebpf.ProgramID) bool {
	if isObserver == nil {
		return func(ebpf.ProgramID) bool { return false }
	}
	return isObserver
}
