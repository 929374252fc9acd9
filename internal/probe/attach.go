package probe

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// AttachSocket attaches the socket bracket: the host-wide TCP state observer
// (once per Probe) and the cgroup observers on cgroupPath (a
// cgroup v2 directory; "" = the cgroup2 root). Programs on descendant cgroups
// and programs attached earlier to the same cgroup run before these, so on
// the root an observer sees the address a socket-LB program chose.
func (p *Probe) AttachSocket(cgroupPath string) []Attachment {
	return p.AttachSocketSkip(cgroupPath, SocketSkip{})
}

// SocketSkip says which of AttachSocket's observers to leave out, and why
// (nil: attach them): those only one protocol's flows need, when no traced
// Service has that protocol. Each runs for the whole node once attached:
// the unconnected-send observer on every datagram an unconnected UDP
// socket sends (the kernel takes the socket's lock for it), the TCP state
// observer on every TCP state change.
type SocketSkip struct {
	TCP, UDP error
}

// AttachSocketSkip is AttachSocket leaving out what skip says, each listed
// with its reason (and without the note of an attached one).
func (p *Probe) AttachSocketSkip(cgroupPath string, skip SocketSkip) []Attachment {
	if cgroupPath == "" {
		root, err := CgroupRoot()
		if err != nil {
			return []Attachment{{Observer: "cgroup sock_addr", Point: obs.PointSockAddr, Err: err}}
		}
		cgroupPath = root
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Attachment
	if !p.globals["inet_sock_set_state"] {
		a := Attachment{Observer: "tp_btf/inet_sock_set_state", Where: "host-wide (TCP_SYN_SENT, and its close before a first packet)",
			Point: obs.PointSockState}
		if a.Err = skip.TCP; a.Err == nil {
			a.Note = "source port is 0 unless the socket was bound"
			a.Err = p.attachGlobal("inet_sock_set_state", sockStateProgram, func(prog *ebpf.Program) (link.Link, error) {
				return link.AttachTracing(link.TracingOptions{Program: prog})
			})
		}
		out = append(out, a)
	}
	for _, c := range cgroupObservers {
		a := Attachment{Observer: c.observer, Where: cgroupPath, Point: c.point}
		if a.Err = c.skip(skip); a.Err == nil {
			a.Note = c.note
			a.Err = p.attachCgroup(cgroupPath, c.prog, c.attach)
		}
		out = append(out, a)
	}
	return out
}

// requested is the note of the observers that read the requested destination.
const requested = "requested destination: the syscall's arguments (saved registers) while another sock_addr program is loaded, else the destination itself"

// cgroupObservers are the observers AttachSocket attaches to a cgroup.
var cgroupObservers = []struct {
	observer, prog, note string
	attach               ebpf.AttachType
	point                obs.Point
	skip                 func(SocketSkip) error
}{
	{"cgroup/connect4", "pt_connect4", requested, ebpf.AttachCGroupInet4Connect, obs.PointSockAddr, attachAlways},
	{"cgroup/connect6", "pt_connect6", requested, ebpf.AttachCGroupInet6Connect, obs.PointSockAddr, attachAlways},
	{"cgroup/sendmsg4", "pt_sendmsg4", requested, ebpf.AttachCGroupUDP4Sendmsg, obs.PointSockAddr,
		func(s SocketSkip) error { return s.UDP }},
	{"cgroup_skb/egress", "pt_sock_egress", "", ebpf.AttachCGroupInetEgress, obs.PointSockEgress, attachAlways},
}

// attachAlways is the skip of an observer every traced flow needs.
func attachAlways(SocketSkip) error { return nil }

// sockStateProgram is AttachSocket's host-wide TCP state observer.
const sockStateProgram = "pt_sock_state"

// attachGlobal loads and attaches a host-wide observer. Callers hold p.mu.
func (p *Probe) attachGlobal(key, progName string, attach func(*ebpf.Program) (link.Link, error)) error {
	prog, err := p.program(p.sockSpec, progName)
	if err != nil {
		return err
	}
	l, err := attach(prog)
	if err != nil {
		return fmt.Errorf("attach %s: %w", progName, err)
	}
	p.keep(l)
	p.globals[key] = true
	return nil
}

// attachCgroup attaches a cgroup observer with a bpf_link. A legacy
// (PROG_ATTACH) fallback would outlive a killed process, so it is refused.
// Callers hold p.mu.
func (p *Probe) attachCgroup(path, progName string, attach ebpf.AttachType) error {
	prog, err := p.program(p.sockSpec, progName)
	if err != nil {
		return err
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: path, Attach: attach, Program: prog})
	if err != nil {
		return fmt.Errorf("attach %s to %s: %w", progName, path, err)
	}
	if _, err := l.Info(); err != nil {
		l.Close()
		return fmt.Errorf("attach %s to %s: kernel lacks cgroup bpf_link, refusing a legacy attachment that would outlive pathtrace", progName, path)
	}
	p.keep(l)
	return nil
}

// tcObservers are the tcx observers AttachTC attaches to an interface.
var tcObservers = []struct {
	observer, prog string
	attach         ebpf.AttachType
	anchor         link.Anchor
	point          obs.Point
	dir            obs.Dir
}{
	{"tcx ingress head", "pt_tc_head_in", ebpf.AttachTCXIngress, link.Head(), obs.PointTCHead, obs.DirIn},
	{"tcx ingress tail", "pt_tc_tail_in", ebpf.AttachTCXIngress, link.Tail(), obs.PointTCTail, obs.DirIn},
	{"tcx egress head", "pt_tc_head_out", ebpf.AttachTCXEgress, link.Head(), obs.PointTCHead, obs.DirOut},
	{"tcx egress tail", "pt_tc_tail_out", ebpf.AttachTCXEgress, link.Tail(), obs.PointTCTail, obs.DirOut},
}

// AttachTC attaches tcx observers to the interface ifindex of the netns at
// netnsPath ("" = own): one at the head and one at the tail of its ingress
// and of its egress chain. The tail observer only runs when the programs
// before it return TCX_NEXT; a program that ends the chain hides it.
func (p *Probe) AttachTC(netnsPath string, ifindex int, ifname string) []Attachment {
	return p.AttachTCSkip(netnsPath, ifindex, ifname, TCSkip{})
}

// TCSkip says which of AttachTC's observers to leave out, and why (nil:
// attach them): the tails, or both observers of a direction whose chain
// has no program to bracket. Each attachment and each detachment costs an
// RCU grace period under the RTNL lock (about 12 ms, serialized node-wide:
// attaching from several threads does not shorten it), four per veth: a
// node of 110 Pods with a tc program in each direction pays 5 s at the
// start and as much at the stop.
type TCSkip struct {
	Tails, Ingress, Egress error
}

func (s TCSkip) why(point obs.Point, dir obs.Dir) error {
	if dir == obs.DirIn && s.Ingress != nil {
		return s.Ingress
	}
	if dir == obs.DirOut && s.Egress != nil {
		return s.Egress
	}
	if point == obs.PointTCTail {
		return s.Tails
	}
	return nil
}

// AttachTCSkip is AttachTC without the observers skip names, reported as
// not attached for its reason.
func (p *Probe) AttachTCSkip(netnsPath string, ifindex int, ifname string, skip TCSkip) []Attachment {
	where := tcWhere(netnsPath, ifindex, ifname)
	netns, nsErr := netnsInode(netnsPath)
	p.mu.Lock()
	defer p.mu.Unlock()
	if nsErr == nil {
		p.ifnames[ifaceKey{netns, ifindex}] = ifname
	}
	var out []Attachment
	for _, c := range tcObservers {
		a := Attachment{Observer: c.observer, Where: where, Point: c.point, Dir: c.dir}
		if a.Err = skip.why(c.point, c.dir); a.Err == nil {
			a.Err = nsErr
		}
		if a.Err == nil {
			var l link.Link
			if l, a.Err = p.attachTCX(netnsPath, ifindex, c.prog, c.attach, c.anchor); a.Err == nil {
				k := ifaceKey{netns, ifindex}
				p.tcLinks[k] = append(p.tcLinks[k], l)
			}
		}
		out = append(out, a)
	}
	return out
}

// tcWhere names the interface of a tcx observer.
func tcWhere(netnsPath string, ifindex int, ifname string) string {
	return fmt.Sprintf("%s (ifindex %d) in %s", ifname, ifindex, netnsLabel(netnsPath))
}

// SkippedTC reports the four tcx observers of AttachTC as not attached, for
// why.
func SkippedTC(netnsPath string, ifindex int, ifname string, why error) []Attachment {
	where := tcWhere(netnsPath, ifindex, ifname)
	var out []Attachment
	for _, c := range tcObservers {
		out = append(out, Attachment{Observer: c.observer, Where: where, Point: c.point, Dir: c.dir, Err: why})
	}
	return out
}

// attachTCX creates the tcx link from a thread inside the interface's netns.
// Callers hold p.mu.
func (p *Probe) attachTCX(netnsPath string, ifindex int, progName string, attach ebpf.AttachType, anchor link.Anchor) (link.Link, error) {
	prog, err := p.program(p.tcSpec, progName)
	if err != nil {
		return nil, err
	}
	var l link.Link
	err = nsutil.Do(netnsPath, func() error {
		var err error
		l, err = link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: attach, Anchor: anchor})
		if err != nil {
			return fmt.Errorf("attach %s to ifindex %d: %w", progName, ifindex, err)
		}
		p.keep(l)
		return nil
	})
	return l, err
}

// ForgetTC closes the links of the tcx observers on the interface
// ifindex of the netns at netnsPath, one that went (a Pod's host veth: the
// kernel took them out of its path with it, but each link held a
// descriptor and its kernel object until the run's end), and forgets the
// interface's name. A run until stopped calls it for the Pods that went.
func (p *Probe) ForgetTC(netnsPath string, ifindex int) {
	netns, err := netnsInode(netnsPath)
	if err != nil {
		return
	}
	k := ifaceKey{netns, ifindex}
	p.mu.Lock()
	ls := p.tcLinks[k]
	delete(p.tcLinks, k)
	delete(p.ifnames, k)
	if len(ls) > 0 {
		p.links = slices.DeleteFunc(p.links, func(l link.Link) bool { return slices.Contains(ls, l) })
	}
	p.mu.Unlock()
	for _, l := range ls {
		l.Close()
	}
}

// NAT runs at priority -100 (NF_IP_PRI_NAT_DST) at PREROUTING and OUTPUT; the
// observers take the closest free priorities on each side of it.
const (
	natPriority    = -100
	nfPrioAttempts = 32
)

// AttachNetfilter attaches BPF netfilter observers (IPv4) at PREROUTING and
// OUTPUT of the netns at netnsPath ("" = own), just below the NAT priority
// (-101, or the next free one downwards) and just above it (-99, or the next
// free one upwards). Only one link may hold a given priority of a hook.
func (p *Probe) AttachNetfilter(netnsPath string) []Attachment {
	netns, nsErr := netnsInode(netnsPath)
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Attachment
	for _, hook := range []obs.Hook{obs.HookPrerouting, obs.HookLocalOut} {
		for _, side := range nfObservers {
			a := Attachment{Observer: "netfilter " + side.point.String(), Where: hook.String() + " in " + netnsLabel(netnsPath),
				Point: side.point, Hook: hook}
			a.Err = nsErr
			if a.Err == nil {
				a.Prio, a.Err = p.attachNetfilter(netnsPath, side.prog, hook, side.step)
			}
			if a.Err == nil {
				p.nfPrios[nfKey{netns, hook, side.point}] = a.Prio
				if a.Prio != natPriority+side.step {
					a.Note = fmt.Sprintf("priority %d was taken", natPriority+side.step)
				}
			}
			out = append(out, a)
		}
	}
	return out
}

// nfObservers are the observers AttachNetfilter attaches to each hook, on
// either side of the NAT priority.
var nfObservers = []struct {
	prog  string
	point obs.Point
	step  int32
}{
	{"pt_nf_before", obs.PointNFBefore, -1},
	{"pt_nf_after", obs.PointNFAfter, +1},
}

// attachNetfilter tries priorities from next to NAT outwards by step until a
// free one is found. Callers hold p.mu.
func (p *Probe) attachNetfilter(netnsPath, progName string, hook obs.Hook, step int32) (int32, error) {
	prog, err := p.program(p.nfSpec, progName)
	if err != nil {
		return 0, err
	}
	var prio int32
	err = nsutil.Do(netnsPath, func() error {
		for i := range int32(nfPrioAttempts) {
			prio = natPriority + step*(i+1)
			l, err := link.AttachNetfilter(link.NetfilterOptions{
				Program:        prog,
				ProtocolFamily: link.NetfilterProtoIPv4,
				Hook:           link.NetfilterInetHook(hook),
				Priority:       prio,
			})
			if errors.Is(err, unix.EBUSY) {
				continue
			}
			if err != nil {
				return fmt.Errorf("attach %s at %s priority %d: %w", progName, hook, prio, err)
			}
			p.keep(l)
			return nil
		}
		return fmt.Errorf("attach %s at %s: priorities %d..%d all taken", progName, hook,
			natPriority+step, natPriority+step*nfPrioAttempts)
	})
	return prio, err
}

func netnsLabel(path string) string {
	if path == "" {
		return "own netns"
	}
	return "netns " + path
}

func netnsInode(path string) (uint64, error) {
	if path == "" {
		path = nsutil.Self
	}
	return nsutil.Inode(path)
}

// Preload loads, without attaching them, the programs the Attach calls of
// a session will need: the socket bracket, netfilter and drop observers always,
// the tcx heads when tcHeads, their tails too when tcTails. Loading (the
// verifier) takes most of the start-up; done first, the observers are then
// attached within tens of milliseconds of each other, not hundreds, so few
// flows that begin during start-up meet some observers and not the others. A program that
// fails to load is left for its Attach call to report.
func (p *Probe) Preload(tcHeads, tcTails bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	load := func(spec *ebpf.CollectionSpec, name string) {
		_, _ = p.program(spec, name) // an error comes back from the Attach call
	}
	load(p.sockSpec, sockStateProgram)
	for _, o := range cgroupObservers {
		load(p.sockSpec, o.prog)
	}
	for _, o := range nfObservers {
		load(p.nfSpec, o.prog)
	}
	load(p.pktSpec, ctFilterProgram)
	load(p.dropSpec, dropProgram)
	load(p.dropSpec, ksymProgram)
	for _, o := range tcObservers {
		if tail := o.point == obs.PointTCTail; tcHeads && !tail || tcTails && tail {
			load(p.tcSpec, o.prog)
		}
	}
}
