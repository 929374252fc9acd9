package session

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// attachObservers puts the kernel observers in place: socket observers on the
// cgroup, tcx observers on every host veth that has a tc program, netfilter
// and conntrack in the node netns, and the host-wide drop observer. A failed
// attachment is reported, never fatal on its own: the verdict engine treats
// its point as inactive.
func attachObservers(pr *probe.Probe, node *discover.NodeInfo, cgroup string, svcs []flow.Service) []probe.Attachment {
	var atts []probe.Attachment
	atts = append(atts, pr.AttachSocketSkip(cgroup, socketSkip(svcs))...)
	atts = append(atts, attachTCObservers(pr, node)...)
	atts = append(atts, pr.AttachNetfilter(node.HostNetNS.Path)...)
	atts = append(atts, pr.AttachConntrack(node.HostNetNS.Path)...)
	atts = append(atts, pr.AttachDrops()...)
	return atts
}

// socketSkip leaves out the socket observers only one protocol's flows
// need when no traced Service can have that protocol: a node's other
// traffic pays nothing for them.
func socketSkip(svcs []flow.Service) probe.SocketSkip {
	var tcp, udp bool
	for _, s := range svcs {
		tcp = tcp || s.Proto != obs.UDP
		udp = udp || s.Proto != obs.TCP
	}
	var skip probe.SocketSkip
	if !tcp {
		skip.TCP = errNoTCPService
	}
	if !udp {
		skip.UDP = errNoUDPService
	}
	return skip
}

var (
	errNoTCPService = errors.New("no traced Service is TCP (every --svc is /udp): no TCP flow to follow")
	errNoUDPService = errors.New("no traced Service is UDP (every --svc is /tcp): no UDP flow to follow, and the node's unconnected UDP sends pay nothing")
)

// attachTCObservers puts tcx observers on the host veths, in each direction
// where discovery found a tc program (both where it could not read them):
// elsewhere nothing rewrites at tc, and the veth's tap brackets the place.
func attachTCObservers(pr *probe.Probe, node *discover.NodeInfo) []probe.Attachment {
	var atts []probe.Attachment
	tails := needTails(node)
	for _, cp := range node.CapturePoints {
		if cp.Role != discover.RoleHost {
			continue
		}
		dirs := tcDirsOf(node, cp)
		if dirs == 0 {
			atts = append(atts, probe.SkippedTC(cp.NetNS, cp.Ifindex, cp.Ifname, errNoTCProgram)...)
			continue
		}
		skip := dirs.skip()
		if !tails {
			skip.Tails = errNoOtherTCX
		}
		atts = append(atts, pr.AttachTCSkip(cp.NetNS, cp.Ifindex, cp.Ifname, skip)...)
	}
	return atts
}

// preloadObservers loads the observer programs attachObservers will attach,
// so that attaching them all takes milliseconds, not the verifier's time.
// The tcx heads are loaded in any case: a host veth may get a tc program
// while the session runs (a Pod that starts, a CNI agent that starts), and
// the observers for it are attached then (observeTC), when the probe no
// longer loads programs.
func preloadObservers(pr *probe.Probe, node *discover.NodeInfo) {
	pr.Preload(true, needTails(node))
}

// tcObserved are the host veths (by ifindex) attachObservers gave tcx
// observers, with the directions it gave them.
func tcObserved(node *discover.NodeInfo) map[int]tcDirs {
	out := map[int]tcDirs{}
	for _, cp := range node.CapturePoints {
		if cp.Role != discover.RoleHost {
			continue
		}
		if dirs := tcDirsOf(node, cp); dirs != 0 {
			out[cp.Ifindex] = dirs
		}
	}
	return out
}

// tcDirs is a set of directions of a host veth's tc chain.
type tcDirs uint8

const (
	tcIngress tcDirs = 1 << iota // from the Pod
	tcEgress                     // towards the Pod
	tcBoth    = tcIngress | tcEgress
)

// tcDir is the direction a discovered program's Dir names.
func tcDir(dir string) tcDirs {
	if dir == "egress" {
		return tcEgress
	}
	return tcIngress
}

// skip says which observers of AttachTCSkip to leave out: those of a
// direction without a tc program.
func (d tcDirs) skip() probe.TCSkip {
	var s probe.TCSkip
	if d&tcIngress == 0 {
		s.Ingress = errNoTCProgramDir
	}
	if d&tcEgress == 0 {
		s.Egress = errNoTCProgramDir
	}
	return s
}

// tcDirsOf are the directions of the host veth cp in which discovery found
// a tc program, both when it could not tell.
func tcDirsOf(node *discover.NodeInfo, cp discover.CapturePoint) tcDirs {
	if cp.TCUnread {
		return tcBoth
	}
	var d tcDirs
	for _, p := range node.TCPrograms {
		if p.Role == discover.RoleHost && p.Ifindex == cp.Ifindex && bracketedByTCX(p) {
			d |= tcDir(p.Dir)
		}
	}
	return d
}

// bracketedByTCX tells whether the tcx observers of a host veth bracket
// the program p: not a netkit program, which runs inside the Pod's netkit
// pair, before the host side's RX tap and its tcx chain (the Pod's eth0 tap
// and the host side's bracket it).
func bracketedByTCX(p discover.TCProgram) bool { return p.Via != "netkit" }

// errNoTCProgram is why a host veth gets no tcx observers. With no tc
// program there, nothing at tc can rewrite its Pod's packets, and the host
// veth's tap (before tc) brackets the same place; a tcx attachment costs an
// RCU grace period (about 10 ms) under the global RTNL lock at start and at
// stop, which a node of 110 kube-proxy Pods would pay 880 times.
var errNoTCProgram = errors.New("no tc program (tcx or cls_bpf) on this veth to bracket; its tap covers the place (a netkit pair's own programs run before it: its tap and the Pod's eth0 bracket them)")

// errNoTCProgramDir is why a host veth with a tc program in one direction
// gets no tcx observers in the other (Cilium's veths, whose programs are on
// ingress only): nothing there to bracket, and the observers of that
// direction would cost two more grace periods at the start and at the stop.
var errNoTCProgramDir = errors.New("no tc program (tcx or cls_bpf) in this direction of the veth to bracket; its tap covers the place")

// errNoOtherTCX is why the tail observers are left out on a node whose host
// veths carry only legacy cls_bpf filters (older Cilium and Calico): the
// tcx chain holds nothing but pathtrace's head, so the head sees what the
// tail would. Decided for the whole node, so that "the tail never saw it"
// keeps its meaning wherever tails are attached.
var errNoOtherTCX = errors.New("no tcx program on any host veth besides pathtrace's: the head observer sees what the tail would (cls_bpf runs after the whole tcx chain)")

// needTails tells whether some host veth has a tcx program (or could not be
// read): only then can a tail observer see something its head does not.
func needTails(node *discover.NodeInfo) bool {
	for _, cp := range node.CapturePoints {
		if cp.Role == discover.RoleHost && cp.TCUnread {
			return true
		}
	}
	for _, p := range node.TCPrograms {
		if p.Role == discover.RoleHost && p.Via == "tcx" {
			return true
		}
	}
	return false
}

var rolePoint = map[string]obs.Point{
	discover.RolePod:    obs.PointPod,
	discover.RoleHost:   obs.PointHost,
	discover.RoleUplink: obs.PointUplink,
}

// Notes telling which in-kernel filter a tap uses.
const (
	noteEBPFFilter    = "eBPF filter following learned flows"
	noteClassicFilter = "classic BPF filter (VIPs and known backends)"
)

// openTaps opens one AF_PACKET ring per capture point, filtered in the
// kernel: by prog (the probe's eBPF filter, which follows the flows the
// observers learn in the kernel) when it loaded, else by a classic filter of
// the watched addresses, which only widen() updates. Several Pods on one
// bridge share the uplink: it is captured once. The rings are opened
// concurrently: setting up a ring waits for an RCU grace period, about
// 10 ms, which a node of many Pods would otherwise pay once per point.
// behind (nil: none) is every tap's capture.Config.Behind.
func openTaps(node *discover.NodeInfo, podPointsOpen int, watch []obs.Watch, snaplen, ringBytes int, behind func(), prog *ebpf.Program, progErr error) ([]tap, []probe.Attachment) {
	filter, ferr := capture.FilterFor(watch, snaplen)
	points := tapPoints(node)
	rings, shared := ringSizes(points, podPointsOpen, ringBytes, snaplen)
	opened := make([]tap, len(points))
	atts := make([]probe.Attachment, len(points))
	concurrently(len(points), func(i int) {
		cp := points[i]
		att := probe.Attachment{Observer: "af_packet " + cp.Role, Where: fmt.Sprintf("%s (ifindex %d, netns %s)", cp.Ifname, cp.Ifindex, cp.NetNS), Point: rolePoint[cp.Role]}
		defer func() { atts[i] = att }()
		cfg := capture.Config{NetNS: cp.NetNS, Ifname: cp.Ifname, Role: cp.Role, Snaplen: snaplen, RingBytes: rings[i], Behind: behind}
		var t *capture.Tap
		var err error
		whyClassic := progErr
		if prog != nil {
			cfg.Program = prog
			if t, err = capture.Open(cfg); err == nil {
				att.Note = noteEBPFFilter
			} else {
				whyClassic, cfg.Program = err, nil
			}
		}
		if t == nil {
			if ferr != nil {
				att.Err = ferr
				return
			}
			cfg.Filter = filter
			if t, err = capture.Open(cfg); err == nil {
				att.Note = fmt.Sprintf("%s; eBPF filter unavailable: %v", noteClassicFilter, whyClassic)
			}
		}
		if err != nil {
			att.Err = err
			return
		}
		if cp.Role != discover.RoleUplink && shared != "" {
			att.Note += fmt.Sprintf("; ring %s, %s", sizeString(rings[i]), shared)
		}
		inode, _ := nsutil.Inode(cp.NetNS) // 0: never taken for gone (releaseGone)
		opened[i] = tap{role: cp.Role, ifname: cp.Ifname, ifindex: cp.Ifindex, netns: cp.NetNS, point: rolePoint[cp.Role], t: t, classic: cfg.Program == nil,
			ended: new(string), released: new(string), inode: inode}
	})
	var taps []tap
	for _, tp := range opened {
		if tp.t != nil {
			taps = append(taps, tp)
		}
	}
	labels := pointLabels(taps, node.Pods)
	for i := range taps {
		taps[i].label = labels[i]
	}
	return taps, atts
}

// tapPoints are the capture points of node that get a tap each: one per
// interface, whatever roles it has.
func tapPoints(node *discover.NodeInfo) []discover.CapturePoint {
	var points []discover.CapturePoint
	seen := map[string]bool{}
	for _, cp := range node.CapturePoints {
		key := cp.NetNS + "|" + cp.Ifname
		if !seen[key] {
			seen[key] = true
			points = append(points, cp)
		}
	}
	return points
}

// closeTaps closes every tap at once: closing a ring waits for RCU grace
// periods too.
func closeTaps(taps []tap) {
	concurrently(len(taps), func(i int) {
		if taps[i].t != nil { // nil: a slot a run until stopped forgot
			taps[i].t.Close()
		}
	})
}

// maxConcurrent bounds the goroutines (each on a thread of its own while it
// is in another netns or in the kernel) that open or close taps at once.
const maxConcurrent = 16

// concurrently runs fn(0) ... fn(n-1), at most maxConcurrent at a time, and
// returns when all have.
func concurrently(n int, fn func(i int)) {
	var wg sync.WaitGroup
	slots := make(chan struct{}, maxConcurrent)
	for i := range n {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			fn(i)
		})
	}
	wg.Wait()
}

// podRingShare is how many rings of --buffer-size the Pods' capture points
// (each Pod's eth0 and host veth) share at most. With one or two Pods every
// point has a whole ring; with many, each has a slice, for the kernel holds
// a ring's memory whether its Pod sends or not: a node of 110 Pods would
// otherwise pin 220 rings. The uplinks keep whole rings: they carry every
// Pod's traffic.
const podRingShare = 4

// ringSizes returns each point's ring and, when the Pods' points share
// theirs, a note saying so ("" otherwise). A slice is never smaller than a
// ring that holds a snaplen frame (capture.MinRingFor). podPointsOpen are
// the Pods' points already open (those of the start, when Pods start
// later): the share is that of a node with them all, as the rings open
// cannot shrink.
func ringSizes(points []discover.CapturePoint, podPointsOpen, ringBytes, snaplen int) ([]int, string) {
	if ringBytes <= 0 {
		ringBytes = capture.DefaultRingBytes
	}
	podPoints := podPointsOpen
	for _, cp := range points {
		if cp.Role != discover.RoleUplink {
			podPoints++
		}
	}
	per, note := ringBytes, ""
	if budget := podRingShare * ringBytes; podPoints*ringBytes > budget {
		const step = 16 << 10
		per = min(ringBytes, max(budget/podPoints/step*step, capture.MinRingFor(snaplen)))
	}
	if per < ringBytes {
		note = fmt.Sprintf("the Pods' %d capture points share %d rings of --buffer-size (--pod-ip gives one Pod whole rings)", podPoints, podRingShare)
	}
	rings := make([]int, len(points))
	for i, cp := range points {
		rings[i] = ringBytes
		if cp.Role != discover.RoleUplink {
			rings[i] = per
		}
	}
	return rings, note
}

// sizeString is a byte count in KiB or MiB, as --buffer-size takes them.
func sizeString(n int) string {
	if n%(1<<20) == 0 {
		return fmt.Sprintf("%dM", n>>20)
	}
	return fmt.Sprintf("%dK", n>>10)
}

// pointLabels names each tap's capture point for the report and the pcapng
// interfaces: "role:ifname", made unique where several points share it (every
// Pod's eth0) with the Pod's IPv4 address, else its netns name or path. With
// several Pods every Pod's point says whose it is, also one whose interface
// has a name no other Pod's has (a CNI that names it net0): "pod:net0" beside
// "pod:eth0@10.0.0.5" would leave that one Pod unnamed.
func pointLabels(taps []tap, pods []discover.Pod) []string {
	n := map[string]int{}
	podTaps := 0
	for _, tp := range taps {
		n[tp.role+":"+tp.ifname]++
		if tp.role == discover.RolePod {
			podTaps++
		}
	}
	labels := make([]string, len(taps))
	for i, tp := range taps {
		labels[i] = tp.role + ":" + tp.ifname
		if n[labels[i]] < 2 && (tp.role != discover.RolePod || podTaps < 2) {
			continue
		}
		where := tp.netns
		for _, p := range pods {
			// A Pod made again in a netns of the same name (a named netns
			// reused, a PID reused) is another netns: the inodes tell.
			if p.NetNS.Path != tp.netns || tp.inode != 0 && p.NetNS.Inode != 0 && p.NetNS.Inode != tp.inode {
				continue
			}
			switch {
			case len(p.Eth0.Addrs) > 0:
				where = p.Eth0.Addrs[0].Addr().String()
			case p.NSName != "":
				where = p.NSName
			}
			break
		}
		labels[i] += "@" + where
	}
	return labels
}

// activePoints is the set of observation points that really observe.
func activePoints(atts []probe.Attachment) map[obs.Point]bool {
	pts := map[obs.Point]bool{}
	for _, a := range atts {
		if a.Err == nil && a.Point != obs.PointNone {
			pts[a.Point] = true
		}
	}
	return pts
}

// hostRedirects are the mirred redirects at the host veths' ingress among
// redirs, in the engine's terms. A mirror copies: the packet itself goes on
// through the bridge.
func hostRedirects(redirs []discover.TCRedirect) []flow.TCRedirect {
	var out []flow.TCRedirect
	for _, r := range redirs {
		if r.Role == discover.RoleHost && r.Dir == "ingress" && strings.HasSuffix(r.Action, "redirect") {
			out = append(out, flow.TCRedirect{Ifindex: r.Ifindex, Text: r.String()})
		}
	}
	return out
}

// podHostSides are the host sides of pods by their eth0's addresses.
func podHostSides(pods []discover.Pod) map[netip.Addr]int {
	out := map[netip.Addr]int{}
	for _, p := range pods {
		if p.HostPeer == nil {
			continue
		}
		for _, pfx := range p.Eth0.Addrs {
			out[pfx.Addr()] = p.HostPeer.Ifindex
		}
	}
	return out
}

// attribution turns what discovery read from the node into the engine's terms.
func attribution(node *discover.NodeInfo) flow.Attribution {
	var a flow.Attribution
	for _, p := range node.SockPrograms {
		a.SockPrograms = append(a.SockPrograms, flow.SockProgram{AttachType: p.Attach, Name: p.Name, ID: uint32(p.ID), Cgroup: p.Cgroup})
	}
	a.TCPrograms = hostTCPrograms(node.TCPrograms)
	a.UplinkTCPrograms = uplinkTCPrograms(node.TCPrograms)
	a.PodTCPrograms = podTCPrograms(node.TCPrograms)
	for _, x := range node.XDPPrograms {
		p := flow.TCProgram{Kind: x.Mode, Name: x.Name, ID: uint32(x.ID), Ifindex: x.Ifindex}
		switch x.Role {
		case discover.RoleUplink:
			a.UplinkXDPPrograms = append(a.UplinkXDPPrograms, p)
		case discover.RoleHost:
			a.HostXDPPrograms = append(a.HostXDPPrograms, p)
		}
	}
	a.HostRedirects = hostRedirects(node.TCRedirects)
	a.NATRules = natRulesOf(node.Netfilter.Rules)
	a.Rejects = natRulesOf(node.Netfilter.Rejects)
	a.BackendDrops = natRulesOf(node.Netfilter.BackendDrops)
	a.DeviceRules = deviceRulesOf(node.Netfilter.DeviceChains, node.CapturePoints)
	for _, p := range node.Netfilter.BPFPrograms {
		if p.Elsewhere {
			continue // in another netns: none of the node's packets meets it
		}
		a.NetfilterPrograms = append(a.NetfilterPrograms, flow.NetfilterProgram{Family: p.Family, Hook: p.Hook, Priority: p.Priority, Name: p.Name, ID: uint32(p.ID)})
	}
	a.IPVS = ipvsOf(node.IPVS.Services)
	a.BridgeNFCallIPTables = node.Netfilter.BridgeNFCallIPTables
	a.BridgeNFFilterVLANTagged = node.Netfilter.BridgeNFFilterVLANTagged
	a.PodHostSides = podHostSides(node.Pods)
	for _, p := range node.Pods {
		if on := p.StackedOn(); on != "" {
			if a.StackedPods == nil {
				a.StackedPods = map[netip.Addr]string{}
			}
			for _, pfx := range p.Eth0.Addrs {
				a.StackedPods[pfx.Addr()] = on
			}
		}
		if p.HostPeer != nil && p.HostPeer.MasterKind == "none" {
			if a.RoutedHostVeths == nil {
				a.RoutedHostVeths = map[int]bool{}
			}
			a.RoutedHostVeths[p.HostPeer.Ifindex] = true
		}
		for _, ifc := range p.OtherIfaces {
			for _, pfx := range ifc.Addrs {
				if a.PodOtherIfaces == nil {
					a.PodOtherIfaces = map[netip.Addr]string{}
				}
				a.PodOtherIfaces[pfx.Addr()] = ifc.Name
			}
		}
	}
	for _, cp := range node.CapturePoints {
		if cp.Role == discover.RoleUplink && cp.Hairpin != nil && !*cp.Hairpin {
			if a.HairpinOffUplinks == nil {
				a.HairpinOffUplinks = map[int]flow.BridgePort{}
			}
			a.HairpinOffUplinks[cp.Ifindex] = flow.BridgePort{Port: cp.Ifname, Bridge: cp.Master}
		}
	}
	a.GatewayMACs = gatewayMACs(node)
	a.UplinkNeighbors = uplinkNeighbors(node)
	a.NodeAddrs = node.NodeAddrs()
	for _, lv := range node.LocalVIPs {
		if a.LocalVIPs == nil {
			a.LocalVIPs = map[netip.Addr]string{}
		}
		a.LocalVIPs[lv.Addr] = lv.Device
	}
	return a
}

// natRulesOf are discovery's NAT rules in the engine's terms, one for one.
func natRulesOf(rules []discover.NATRule) []flow.NATRule {
	out := make([]flow.NATRule, 0, len(rules))
	for _, r := range rules {
		rule := flow.NATRule{
			Source: r.Source,
			Table:  r.Table,
			Hook:   r.Hook,
			VIP:    netip.AddrPortFrom(r.Service, r.Port),
			Proto:  protoOf(r.Proto),
			Chain:  strings.Join(r.Chains, " -> "),
		}
		for _, m := range r.Sources {
			rule.Sources = append(rule.Sources, flow.SourceMatch(m))
		}
		switch {
		case r.Verdict != "":
			rule.Rule = r.Verdict
			rule.BeforeNAT = !r.AfterNAT
			if code, ok := r.RejectICMPCode(); ok {
				rule.ICMPAnswer = capture.ICMPError{Type: capture.ICMPDestUnreachable, Code: code}.Kind()
			}
			if r.Comment != "" {
				rule.Rule += fmt.Sprintf(" (%q)", r.Comment)
			}
		case r.Backend.IsValid():
			rule.Backends = []netip.AddrPort{r.Backend}
			rule.PortRange = r.PortRange
			rule.Rule = "dnat to " + r.Backend.String()
		default:
			rule.Rule = r.Note
		}
		out = append(out, rule)
	}
	return out
}

// deviceRulesOf are the rewrites of the VIPs by the node's nftables chains
// on device hooks, in the engine's terms: one per device of a chain that is
// a host veth or an uplink of the capture points cps (a chain on another
// device is on no traced Pod's way).
func deviceRulesOf(chains []discover.DeviceChain, cps []discover.CapturePoint) []flow.DeviceRule {
	var out []flow.DeviceRule
	for _, c := range chains {
		for _, dev := range c.Devices {
			// Every capture point of that name: a bounded run lists the
			// host veth of a Pod that went beside that of the Pod made
			// again with its name (and another ifindex).
			var seen []int
			for _, cp := range cps {
				if cp.Ifname != dev || cp.Role != discover.RoleHost && cp.Role != discover.RoleUplink || slices.Contains(seen, cp.Ifindex) {
					continue
				}
				seen = append(seen, cp.Ifindex)
				out = appendDeviceRules(out, c, dev, cp)
			}
		}
	}
	return out
}

// appendDeviceRules appends the rules of chain c's rewrites on device dev,
// the capture point cp.
func appendDeviceRules(out []flow.DeviceRule, c discover.DeviceChain, dev string, cp discover.CapturePoint) []flow.DeviceRule {
	for _, r := range c.Rewrites {
		rule := flow.DeviceRule{Chain: c.String(), Hook: c.Hook, Device: dev, Ifindex: cp.Ifindex, Uplink: cp.Role == discover.RoleUplink,
			VIP: netip.AddrPortFrom(r.Service, r.Port), Proto: protoOf(r.Proto), Rule: "daddr set " + r.Note}
		if len(r.Chains) > 1 {
			rule.Chain += " > " + strings.Join(r.Chains[1:], " > ")
		}
		if r.Backend.IsValid() {
			rule.Backends = []netip.AddrPort{r.Backend}
			rule.Rule = "daddr set " + r.Backend.String()
			if r.Backend.Port() == 0 {
				rule.Rule = "daddr set " + r.Backend.Addr().String() + " (port kept)"
			}
		}
		out = append(out, rule)
	}
	return out
}

// ipvsOf are discovery's IPVS services in the engine's terms.
func ipvsOf(services []discover.IPVSService) []flow.IPVSService {
	out := make([]flow.IPVSService, 0, len(services))
	for _, s := range services {
		out = append(out, flow.IPVSService{VIP: s.Service, Proto: protoOf(s.Proto), Scheduler: s.Scheduler, Backends: s.Backends})
	}
	return out
}

func gatewayMACs(node *discover.NodeInfo) []net.HardwareAddr {
	var macs []net.HardwareAddr
	for _, p := range node.Pods {
		if mac, err := net.ParseMAC(p.GatewayMAC); err == nil {
			macs = append(macs, mac)
		}
	}
	return macs
}

// uplinkNeighbors are discovery's uplink neighbours in the engine's terms
// (nil when none).
func uplinkNeighbors(node *discover.NodeInfo) map[flow.UplinkNeighborKey]flow.UplinkNeighbor {
	var out map[flow.UplinkNeighborKey]flow.UplinkNeighbor
	for _, n := range node.UplinkNeighbors {
		if len(n.MAC) != len(obs.MAC{}) {
			continue
		}
		if out == nil {
			out = make(map[flow.UplinkNeighborKey]flow.UplinkNeighbor, len(node.UplinkNeighbors))
		}
		out[flow.UplinkNeighborKey{Ifindex: n.Ifindex, MAC: obs.MAC(n.MAC)}] = flow.UplinkNeighbor{Addrs: n.Addrs, VTEP: n.VTEP}
	}
	return out
}

func protoOf(s string) obs.Proto {
	switch s {
	case "tcp":
		return obs.TCP
	case "udp":
		return obs.UDP
	}
	return 0
}

// counters gathers packets per capture point and every loss counter outside
// the engine (whose own are in its Summary: reports add both, WithDrops).
func (tr *tracer) counters() (packets, drops map[string]uint64) {
	packets, drops = map[string]uint64{}, map[string]uint64{}
	for _, tp := range tr.taps {
		if tp.t == nil {
			continue // forgotten: counted in goneLabel's
		}
		st := tp.t.Stats()
		packets[tp.label] += st.Packets
		drops[tp.label+" kernel_drops"] += st.KernelDrops
		drops[tp.label+" decode_errors"] += st.DecodeErrors
	}
	if g := tr.gone; g != nil && g.n > 0 {
		packets[goneLabel] += g.packets
		drops[goneLabel+" kernel_drops"] += g.kernelDrops
		drops[goneLabel+" decode_errors"] += g.decodeErrors
	}
	// More capture points at once than the engine numbers: counted
	// without their names (a run until stopped forgets those of Pods that
	// went). Zero too, as every loss counter is.
	drops["points_unnamed"] = tr.eng.UnnamedPoints()
	ps := tr.pr.Stats()
	drops["ringbuf_losses"] = ps.RingbufLosses
	drops["kernel_learn_errors"] = ps.LearnErrors
	drops["filter_update_errors"] = tr.filterErrors
	drops["event_decode_errors"] = ps.DecodeErrors
	drops["conntrack_errors"] = ps.ConntrackErrors
	drops["conntrack_drops"] = ps.ConntrackDrops
	return packets, drops
}

// lbWatch saves the socket observers reading requested destinations from
// the syscalls' arguments while no other sock_addr program is on the node:
// then nothing can have rewritten the destination they see. It looks again
// every second, at programs loaded since, and turns reading back on for good
// once one appears (a socket LB loaded mid-trace goes unseen for at most
// that second) or when it cannot tell. The looks that found one also tell
// when each program was loaded after (since), and that the clients'
// cgroups need reading again.
type lbWatch struct {
	pr      *probe.Probe
	last    ebpf.ProgramID
	lastAt  time.Time
	reading bool
	loads   []sockLoad // bounded by maxSockLoads, the oldest dropped
}

// sockLoad is a look that found sock_addr programs loaded since the one
// before, which was at at and had seen the IDs up to after.
type sockLoad struct {
	at    time.Time
	after ebpf.ProgramID
}

// maxSockLoads bounds lbWatch.loads: a program older than those kept is
// taken to be there from the start, naming more flows, never fewer.
const maxSockLoads = 256

func newLBWatch(pr *probe.Probe) *lbWatch {
	w := &lbWatch{pr: pr, reading: true} // the probe's default
	w.check(time.Now())
	return w
}

// check looks at the programs loaded since the last look and tells whether
// a sock_addr program was among them (never at the first look).
func (w *lbWatch) check(now time.Time) (loaded bool) {
	if w == nil {
		return false
	}
	first := w.lastAt.IsZero()
	found, last, err := discover.NewSockAddrProgram(w.last, w.pr.IsObserver)
	if loaded = found && !first; loaded {
		if len(w.loads) == maxSockLoads {
			w.loads = slices.Delete(w.loads, 0, 1)
		}
		w.loads = append(w.loads, sockLoad{at: w.lastAt, after: w.last})
	}
	w.last, w.lastAt = max(last, 1), now
	// On for good once on after the first look.
	if want := found || err != nil || w.reading && !first; want != w.reading {
		if w.pr.ReadRequested(want) == nil {
			w.reading = want
		}
	}
	return loaded
}

// others tells whether a sock_addr program other than pathtrace's may be on
// the node (the observers read requested destinations).
func (w *lbWatch) others() bool { return w != nil && w.reading }

// since is when the program id was loaded after, as far as the looks tell
// (IDs grow): zero when it was there at the first look.
func (w *lbWatch) since(id ebpf.ProgramID) time.Time {
	var at time.Time
	if w == nil {
		return at
	}
	for _, l := range w.loads {
		if id > l.after {
			at = l.at
		}
	}
	return at
}
