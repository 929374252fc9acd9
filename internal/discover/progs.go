package discover

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// SockHook is a cgroup sock_addr hook a socket load balancer uses.
type SockHook struct {
	Name string // connect4, sendmsg4, ...
	Type ebpf.AttachType
}

// SockHooks are the hooks of Cilium's socket LB and its kind, v4 then v6.
var SockHooks = [...]SockHook{
	{"connect4", ebpf.AttachCGroupInet4Connect},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg},
	{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg},
	{"getpeername4", ebpf.AttachCgroupInet4GetPeername},
	{"connect6", ebpf.AttachCGroupInet6Connect},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg},
	{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg},
	{"getpeername6", ebpf.AttachCgroupInet6GetPeername},
}

// sockPrograms lists the sock_addr programs effective for cgroup (the
// client's), each with the cgroup it is attached to: the effective list of the
// cgroup itself, attributed by querying it and each ancestor up to the root.
func sockPrograms(cgroup string, own func(ebpf.ProgramID) bool, info *NodeInfo) []SockProgram {
	if cgroup == "" {
		info.notef("socket programs not checked: no cgroup2 mount found (pass --cgroup)")
		return nil
	}
	chain := cgroupChain(cgroup, cgroup2.IsCgroup2)
	var out []SockProgram
	for _, at := range SockHooks {
		effective, err := queryCgroup(cgroup, at.Type, unix.BPF_F_QUERY_EFFECTIVE)
		if err != nil {
			info.notef("socket programs (%s) not checked on %s: %v", at.Name, cgroup, err)
			continue
		}
		attachedAt := map[ebpf.ProgramID]string{}
		for _, dir := range chain {
			ids, err := queryCgroup(dir, at.Type, 0)
			if err != nil {
				continue
			}
			for _, id := range ids {
				if _, ok := attachedAt[id]; !ok {
					attachedAt[id] = dir
				}
			}
		}
		for _, id := range effective {
			if own(id) {
				continue
			}
			out = append(out, SockProgram{Attach: at.Name, Name: programName(id), ID: id, Cgroup: attachedAt[id]})
		}
	}
	return out
}

// cgroupChain lists dir (made absolute), its parent, ... up to the root of
// the cgroup2 mount (the last directory isCgroup2 holds for). It ends at the
// top of the path too: filepath.Dir of "/" (or of "." when the working
// directory is gone and dir stays relative) is itself.
func cgroupChain(dir string, isCgroup2 func(string) bool) []string {
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	var chain []string
	for dir := filepath.Clean(dir); isCgroup2(dir); {
		chain = append(chain, dir)
		parent := filepath.Dir(dir)
		if parent == dir {
			break
		}
		dir = parent
	}
	return chain
}

func queryCgroup(dir string, typ ebpf.AttachType, flags uint32) ([]ebpf.ProgramID, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: typ, QueryFlags: flags})
	if err != nil {
		return nil, err
	}
	ids := make([]ebpf.ProgramID, len(res.Programs))
	for i, p := range res.Programs {
		ids[i] = p.ID
	}
	return ids, nil
}

// programName is the program's full name: cilium/ebpf takes it from the BTF
// func info when the kernel's copy is cut to 15 characters.
func programName(id ebpf.ProgramID) string {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return ""
	}
	defer p.Close()
	pi, err := p.Info()
	if err != nil {
		return ""
	}
	return pi.Name
}

// tcPrograms lists the tcx and cls_bpf programs on every host and uplink
// capture point, in both directions.
// A point whose programs could not be read is marked TCUnread.
func tcPrograms(host *hostNS, cps []CapturePoint, own func(ebpf.ProgramID) bool, info *NodeInfo) []TCProgram {
	var out []TCProgram
	for i, cp := range cps {
		if cp.Role == RolePod {
			continue
		}
		tcx, err := tcxPrograms(host.path, cp)
		if err != nil {
			info.notef("tcx programs on %s not checked: %v", cp.Ifname, err)
			cps[i].TCUnread = true
		}
		cls, err := clsBPFPrograms(host, cp)
		if err != nil {
			info.notef("cls_bpf filters on %s not checked: %v", cp.Ifname, err)
			cps[i].TCUnread = true
		}
		for _, p := range append(tcx, cls...) {
			if !own(p.ID) {
				out = append(out, p)
			}
		}
	}
	return out
}

// tcxPrograms queries the tcx chains of an interface from a thread inside the
// node netns (the ifindex means something only there).
func tcxPrograms(hostPath string, cp CapturePoint) ([]TCProgram, error) {
	var out []TCProgram
	err := nsutil.Do(hostPath, func() error {
		for _, d := range []struct {
			dir string
			typ ebpf.AttachType
		}{{"ingress", ebpf.AttachTCXIngress}, {"egress", ebpf.AttachTCXEgress}} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: cp.Ifindex, Attach: d.typ})
			if err != nil {
				return fmt.Errorf("query tcx %s: %w", d.dir, err)
			}
			for _, p := range res.Programs {
				out = append(out, TCProgram{Ifname: cp.Ifname, Ifindex: cp.Ifindex, Role: cp.Role,
					Dir: d.dir, Via: "tcx", Name: programName(p.ID), ID: p.ID})
			}
		}
		return nil
	})
	return out, err
}

// TCParent is a clsact/ingress qdisc parent that bpf filters hang off.
type TCParent struct {
	Dir    string // ingress or egress
	Handle uint32
}

// TCParents are the filter parents a qdisc offers bpf classifiers: ingress
// and egress of clsact, ingress of the old ingress qdisc, none otherwise.
func TCParents(q netlink.Qdisc) []TCParent {
	switch q.Type() {
	case "clsact":
		return []TCParent{{"ingress", netlink.HANDLE_MIN_INGRESS}, {"egress", netlink.HANDLE_MIN_EGRESS}}
	case "ingress":
		return []TCParent{{"ingress", netlink.HANDLE_MIN_INGRESS}}
	}
	return nil
}

// clsBPFPrograms lists the bpf filters on the clsact (or ingress) qdisc of an
// interface; without such a qdisc there are none.
func clsBPFPrograms(host *hostNS, cp CapturePoint) ([]TCProgram, error) {
	l, err := host.link(cp.Ifindex)
	if err != nil {
		return nil, err
	}
	qdiscs, err := host.nl.QdiscList(l)
	if err != nil {
		return nil, fmt.Errorf("list qdiscs: %w", err)
	}
	var out []TCProgram
	for _, q := range qdiscs {
		for _, p := range TCParents(q) {
			filters, err := host.nl.FilterList(l, p.Handle)
			if err != nil {
				return out, fmt.Errorf("list %s filters: %w", p.Dir, err)
			}
			for _, f := range filters {
				bf, ok := f.(*netlink.BpfFilter)
				if !ok {
					continue
				}
				name := programName(ebpf.ProgramID(bf.Id))
				if name == "" {
					name = bf.Name // the object file and section the loader gave
				}
				out = append(out, TCProgram{Ifname: cp.Ifname, Ifindex: cp.Ifindex, Role: cp.Role, Dir: p.Dir,
					Via: "cls_bpf", Name: name, ID: ebpf.ProgramID(bf.Id), DirectAction: bf.DirectAction})
			}
		}
	}
	return out, nil
}

// NewSockAddrProgram reports whether a cgroup sock_addr program other than
// pathtrace's own (own) is loaded on the node, looking only at programs with
// an ID above after, and returns the highest ID it saw: passed back as
// after, it limits the next look to programs loaded since (the kernel hands
// out IDs in increasing order). A socket LB must be such a program.
func NewSockAddrProgram(after ebpf.ProgramID, own func(ebpf.ProgramID) bool) (found bool, last ebpf.ProgramID, err error) {
	last = after
	for {
		id, err := ebpf.ProgramGetNextID(last)
		if errors.Is(err, os.ErrNotExist) {
			return found, last, nil
		}
		if err != nil {
			return found, last, fmt.Errorf("list BPF programs: %w", err)
		}
		last = id
		if found || own(id) {
			continue
		}
		p, err := ebpf.NewProgramFromID(id)
		if errors.Is(err, os.ErrNotExist) {
			continue // unloaded meanwhile
		}
		if err != nil {
			return found, last, fmt.Errorf("open BPF program %d: %w", id, err)
		}
		info, err := p.Info()
		p.Close()
		if err != nil {
			return found, last, fmt.Errorf("info of BPF program %d: %w", id, err)
		}
		found = info.Type == ebpf.CGroupSockAddr
	}
}

// HostTCPrograms reads again the tcx and cls_bpf programs on the host-side
// veths among cps, leaving out pathtrace's own (isObserver): a session looks
// again while it runs, since a CNI agent that restarts or upgrades replaces
// them. An error says a veth's programs could not be read (a deleted Pod's
// veth is skipped).
func HostTCPrograms(hostNetNS string, cps []CapturePoint, isObserver func(ebpf.ProgramID) bool) ([]TCProgram, error) {
	ns, err := netns.GetFromPath(hostNetNS)
	if err != nil {
		return nil, fmt.Errorf("open node netns %s: %w", hostNetNS, err)
	}
	defer ns.Close()
	nl, err := nsutil.HandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in node netns %s: %w", hostNetNS, err)
	}
	defer nl.Close()
	host := &hostNS{path: hostNetNS, ns: ns, nl: nl, links: map[int]netlink.Link{}}
	var hostCPs []CapturePoint
	for _, cp := range cps {
		if cp.Role != RoleHost {
			continue
		}
		if _, err := host.link(cp.Ifindex); err != nil {
			continue // its Pod was deleted
		}
		hostCPs = append(hostCPs, cp)
	}
	var scratch NodeInfo
	progs := tcPrograms(host, hostCPs, observerFilter(isObserver), &scratch)
	if len(scratch.Notes) > 0 {
		return progs, errors.New(scratch.Notes[0])
	}
	return progs, nil
}
