package discover

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
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
		// One program can be attached at several levels (a policy
		// program on every Pod's cgroup and on their parent): the
		// effective list has it once per level, the cgroup's own
		// first, so each occurrence takes the next directory.
		attachedAt := map[ebpf.ProgramID][]string{}
		for _, dir := range chain {
			ids, err := queryCgroup(dir, at.Type, 0)
			if err != nil {
				continue
			}
			for _, id := range ids {
				attachedAt[id] = append(attachedAt[id], dir)
			}
		}
		for _, id := range effective {
			var dir string
			if dirs := attachedAt[id]; len(dirs) > 0 {
				dir, attachedAt[id] = dirs[0], dirs[1:]
			}
			if own(id) {
				continue
			}
			out = append(out, SockProgram{Attach: at.Name, Name: programName(id), ID: id, Cgroup: dir})
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
// capture point, in both directions, leaving out pathtrace's own, and the
// filters whose actions rewrite (act_nat, pedit, ct nat).
// A point whose programs could not be read is marked TCUnread; a point whose
// interface is gone (its Pod deleted since discovery) is left out.
func tcPrograms(host *hostNS, cps []CapturePoint, progs *progCache, info *NodeInfo) []TCProgram {
	out, _ := tcProgramsOf(host, cps, progs, info)
	return out
}

// tcProgramsOf is tcPrograms that also tells which of cps are gone (their
// link deleted meanwhile: a Pod's veth).
func tcProgramsOf(host *hostNS, cps []CapturePoint, progs *progCache, info *NodeInfo) (out []TCProgram, gone []bool) {
	gone = make([]bool, len(cps))
	tcx := tcxPrograms(host.path, cps)
	cls, qdiscErr := clsBPFPrograms(host, cps)
	for i, cp := range cps {
		if errors.Is(tcx[i].err, unix.ENODEV) {
			gone[i] = true
			continue
		}
		if cp.Role == RolePod {
			continue
		}
		if err := tcx[i].err; err != nil {
			info.notef("tcx programs on %s not checked: %v", cp.Ifname, err)
			cps[i].TCUnread = true
		}
		if err := cmp.Or(qdiscErr, cls[i].err); err != nil {
			info.notef("cls_bpf filters on %s not checked: %v", cp.Ifname, err)
			cps[i].TCUnread = true
		}
		for _, r := range cls[i].redirects {
			r.Ifname, r.Ifindex, r.Role = cp.Ifname, cp.Ifindex, cp.Role
			info.TCRedirects = append(info.TCRedirects, r)
		}
		for _, p := range append(tcx[i].progs, cls[i].progs...) {
			if p.Action == "" { // a filter's action has no program
				facts := progs.facts(p.ID)
				if facts.own {
					continue
				}
				if facts.name != "" || p.Name == "" {
					p.Name = facts.name // a cls_bpf filter without one keeps the loader's
				}
			}
			p.Ifname, p.Ifindex, p.Role = cp.Ifname, cp.Ifindex, cp.Role
			out = append(out, p)
		}
	}
	return out, gone
}

// podTCPrograms lists the tcx and cls_bpf programs on the Pods' eth0, read
// in each Pod's netns: one on its egress rewrites the Pod's requests after
// the socket's egress hook and before the host veth (a CNI or a mesh that
// does its load balancing inside the Pod), which no observer brackets but
// the Pod's eth0 tap. Each names its Pod's host veth (HostIfindex), which
// ties it to that Pod's flows.
func podTCPrograms(pods []Pod, progs *progCache, info *NodeInfo) []TCProgram {
	var out []TCProgram
	for _, p := range pods {
		if p.NetNS.Path == "" || p.HostPeer == nil || p.Eth0.Ifindex == 0 {
			continue
		}
		found, err := ifacePrograms(p.NetNS.Path, p.Eth0.Ifindex)
		if err != nil {
			info.notef("tc programs on %s in %s not checked: %v", p.Eth0.Name, p.NetNS.Path, err)
		}
		for _, tp := range found {
			if tp.Action == "" {
				facts := progs.facts(tp.ID)
				if facts.own {
					continue
				}
				if facts.name != "" || tp.Name == "" {
					tp.Name = facts.name
				}
			}
			tp.Ifname, tp.Ifindex, tp.HostIfindex, tp.Role = p.Eth0.Name, p.Eth0.Ifindex, p.HostPeer.Ifindex, RolePod
			out = append(out, tp)
		}
	}
	return out
}

// ifacePrograms lists the tcx programs and the clsact (or ingress) qdisc's
// bpf filters of the interface ifindex of the netns at path, unnamed, and
// the rewriting actions of its other filters (filterRewrites).
func ifacePrograms(path string, ifindex int) ([]TCProgram, error) {
	var out []TCProgram
	err := nsutil.Do(path, func() error {
		for _, d := range []struct {
			dir string
			typ ebpf.AttachType
		}{{"ingress", ebpf.AttachTCXIngress}, {"egress", ebpf.AttachTCXEgress}} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: d.typ})
			if err != nil {
				return fmt.Errorf("query tcx %s: %w", d.dir, err)
			}
			for _, p := range res.Programs {
				out = append(out, TCProgram{Dir: d.dir, Via: "tcx", ID: p.ID})
			}
		}
		return nil
	})
	if err != nil {
		return out, err
	}
	err = nsutil.Netlink(path, func(nl *netlink.Handle) error {
		l := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: ifindex}}
		qdiscs, err := nl.QdiscList(l)
		if err != nil {
			return fmt.Errorf("list qdiscs: %w", err)
		}
		for _, q := range qdiscs {
			if q.Attrs().LinkIndex != ifindex {
				continue
			}
			for _, p := range TCParents(q) {
				filters, err := nl.FilterList(l, p.Handle)
				if err != nil {
					return fmt.Errorf("list %s filters: %w", p.Dir, err)
				}
				others := false
				for _, f := range filters {
					if bf, ok := f.(*netlink.BpfFilter); ok {
						out = append(out, TCProgram{Dir: p.Dir, Via: "cls_bpf", Name: bf.Name,
							ID: ebpf.ProgramID(bf.Id), DirectAction: bf.DirectAction})
					} else {
						others = true
					}
				}
				if others {
					rw, err := FilterRewrites(path, ifindex, p)
					out = append(out, rw...)
					if err != nil {
						return err
					}
				}
			}
		}
		return nil
	})
	return out, err
}

// pointProgs are the programs found on one capture point, still unnamed,
// and its filters' mirred redirects.
type pointProgs struct {
	progs     []TCProgram
	redirects []TCRedirect
	err       error
}

// mirredWords says what a mirred action does, as tc(8) writes it.
func mirredWords(a netlink.MirredAct) string {
	switch a {
	case netlink.TCA_EGRESS_REDIR:
		return "egress redirect"
	case netlink.TCA_EGRESS_MIRROR:
		return "egress mirror"
	case netlink.TCA_INGRESS_REDIR:
		return "ingress redirect"
	case netlink.TCA_INGRESS_MIRROR:
		return "ingress mirror"
	}
	return fmt.Sprintf("action %d", a)
}

// tcxPrograms queries the tcx chains of every host and uplink point, from
// one thread inside the node netns (an ifindex means something only there):
// a switch per point cost more than the queries. A point whose interface is
// gone gets ENODEV.
func tcxPrograms(hostPath string, cps []CapturePoint) []pointProgs {
	out := make([]pointProgs, len(cps))
	err := nsutil.Do(hostPath, func() error {
		for i, cp := range cps {
			if cp.Role == RolePod {
				continue
			}
			for _, d := range []struct {
				dir string
				typ ebpf.AttachType
			}{{"ingress", ebpf.AttachTCXIngress}, {"egress", ebpf.AttachTCXEgress}} {
				res, err := link.QueryPrograms(link.QueryOptions{Target: cp.Ifindex, Attach: d.typ})
				if err != nil {
					out[i].err = fmt.Errorf("query tcx %s: %w", d.dir, err)
					break
				}
				for _, p := range res.Programs {
					out[i].progs = append(out[i].progs, TCProgram{Dir: d.dir, Via: "tcx", ID: p.ID})
				}
			}
			if cp.Kind == "netkit" && out[i].err == nil {
				progs, err := netkitPrograms(cp.Ifindex)
				out[i].progs, out[i].err = append(out[i].progs, progs...), err
			}
		}
		return nil
	})
	if err != nil {
		for i := range out {
			out[i].err = err
		}
	}
	return out
}

// NetkitChain is one of a netkit pair's program lists, queried on its
// primary: the peer's run on what the Pod sends (Cilium's
// cil_from_container), the primary's on what the node sends to the Pod.
// Both run inside the pair, before the receiving end's tap: the node side's
// RX tap already sees what a peer program made of the Pod's packet. Dir
// names the direction of the node side they act on, as a veth's tc
// programs' does.
type NetkitChain struct {
	Dir, End string // "ingress", "peer"; "egress", "primary"
	Attach   ebpf.AttachType
}

// NetkitChains are both lists of a netkit pair.
var NetkitChains = []NetkitChain{{"ingress", "peer", ebpf.AttachNetkitPeer}, {"egress", "primary", ebpf.AttachNetkitPrimary}}

// netkitPrograms lists the programs of the netkit pair whose primary is the
// interface ifindex of the calling thread's netns, unnamed.
func netkitPrograms(ifindex int) ([]TCProgram, error) {
	var out []TCProgram
	for _, c := range NetkitChains {
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: c.Attach})
		if errors.Is(err, unix.EACCES) {
			return out, errors.New("query netkit programs: this end of the pair is not its primary, which holds them (the primary is in the Pod's netns)")
		}
		if err != nil {
			return out, fmt.Errorf("query netkit %s programs: %w", c.End, err)
		}
		for _, p := range res.Programs {
			out = append(out, TCProgram{Dir: c.Dir, Via: "netkit", ID: p.ID})
		}
	}
	return out, nil
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

// clsBPFPrograms lists the bpf filters on the clsact (or ingress) qdiscs of
// the host and uplink points, and the rewriting actions and redirects of
// their other filters (parentFilters); a point without such a qdisc has
// none. One dump of the node's qdiscs finds them (its error is returned on
// its own), and filters are listed only where one is.
func clsBPFPrograms(host *hostNS, cps []CapturePoint) ([]pointProgs, error) {
	out := make([]pointProgs, len(cps))
	qdiscs, err := host.nl.QdiscList(nil)
	if err != nil {
		return out, fmt.Errorf("list qdiscs: %w", err)
	}
	byLink := map[int][]netlink.Qdisc{}
	for _, q := range qdiscs {
		byLink[q.Attrs().LinkIndex] = append(byLink[q.Attrs().LinkIndex], q)
	}
	var conn *nl.SocketHandle // opened once needed
	for i, cp := range cps {
		if cp.Role == RolePod || len(byLink[cp.Ifindex]) == 0 {
			continue
		}
		if conn == nil {
			if conn, err = dialRoute(host.ns); err != nil {
				out[i].err = err
				continue
			}
			defer conn.Close()
		}
		for _, q := range byLink[cp.Ifindex] {
			for _, p := range TCParents(q) {
				if err := parentFilters(host, conn, cp.Ifindex, p, &out[i]); err != nil {
					out[i].err = err
					break
				}
			}
		}
	}
	return out, nil
}

// parentFilters adds the filters on parent p of the interface ifindex to
// its programs: its bpf filters, and the rewriting actions of the others
// (act_nat, pedit, ct nat), with their mirred redirects. One dump reads
// both, as the tc watch does every 2 s: netlink's would hide the actions it
// does not decode.
func parentFilters(host *hostNS, c *nl.SocketHandle, ifindex int, p TCParent, out *pointProgs) error {
	msgs, err := dumpFilters(c, ifindex, p)
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if bp, ok := bpfFilter(m); ok {
			bp.Dir = p.Dir
			out.progs = append(out.progs, bp)
			continue
		}
		actions, err := filterActions(m)
		if err != nil {
			return fmt.Errorf("decode %s filters: %w", p.Dir, err)
		}
		for _, a := range actions {
			if a.rewrite != "" {
				out.progs = append(out.progs, a.program(p))
			}
			if a.mirredTo != 0 {
				out.redirects = append(out.redirects, TCRedirect{Dir: p.Dir, Filter: a.kind + " " + a.pref,
					Action: mirredWords(netlink.MirredAct(a.mirredAct)), To: host.name(a.mirredTo)})
			}
		}
	}
	return nil
}

// progCache tells, by program ID, a program's name and whether it is
// pathtrace's own, asking the kernel once per ID (opening a program and
// reading its info is most of what a look at 50 veths costs): neither ever
// changes, and the kernel hands an ID out again only after 2^31 others.
type progCache struct {
	own  func(ebpf.ProgramID) bool
	seen map[ebpf.ProgramID]progFacts
	used map[ebpf.ProgramID]progFacts // asked since the last forget
}

type progFacts struct {
	name string
	own  bool
}

func newProgCache(own func(ebpf.ProgramID) bool) *progCache {
	return &progCache{own: observerFilter(own), seen: map[ebpf.ProgramID]progFacts{}, used: map[ebpf.ProgramID]progFacts{}}
}

func (c *progCache) facts(id ebpf.ProgramID) progFacts {
	f, ok := c.seen[id]
	if !ok {
		f = progFacts{own: c.own(id)}
		if !f.own {
			f.name = programName(id)
		}
		c.seen[id] = f
	}
	c.used[id] = f
	return f
}

// forget drops the programs not asked about since the last forget (gone
// from the veths), which bounds the cache.
func (c *progCache) forget() {
	c.seen, c.used = c.used, map[ebpf.ProgramID]progFacts{}
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

// TCWatch reads again and again the tcx and cls_bpf programs on the host-side
// veths and the uplinks among the capture points, leaving out pathtrace's
// own (isObserver): a session looks every few seconds, since a CNI agent
// that restarts or upgrades replaces them (Cilium's bpf_host on the uplink
// too, which translates NodePorts). It remembers each program's name and whether it is
// an observer, so a look that finds the programs of the last one costs a few
// queries per veth (one netns switch, one qdisc dump) and nothing per program.
type TCWatch struct {
	hostNetNS string
	cps       []CapturePoint // the host veths and uplinks
	progs     *progCache
}

func NewTCWatch(hostNetNS string, cps []CapturePoint, isObserver func(ebpf.ProgramID) bool) *TCWatch {
	w := &TCWatch{hostNetNS: hostNetNS, progs: newProgCache(isObserver)}
	w.Add(cps)
	return w
}

// HostNetNS is the node netns the watched veths are in.
func (w *TCWatch) HostNetNS() string { return w.hostNetNS }

// Add watches the host veths and uplinks among cps too (a Pod that
// started). One that got the ifindex of a veth watched (a Pod deleted and
// made again, see PodWatch) takes its place: both would read the new
// veth's programs.
func (w *TCWatch) Add(cps []CapturePoint) {
	for _, cp := range cps {
		if cp.Role == RoleHost || cp.Role == RoleUplink {
			w.cps = slices.DeleteFunc(w.cps, func(c CapturePoint) bool { return c.Ifindex == cp.Ifindex })
			w.cps = append(w.cps, cp)
		}
	}
}

// Watches tells whether the interface ifindex is watched: a deleted Pod's
// veth is not, once a look found it gone.
func (w *TCWatch) Watches(ifindex int) bool {
	return slices.ContainsFunc(w.cps, func(cp CapturePoint) bool { return cp.Ifindex == ifindex })
}

// Look reads the programs. An error says a veth's programs could not be
// read (a deleted Pod's veth is skipped).
func (w *TCWatch) Look() ([]TCProgram, error) {
	ns, err := netns.GetFromPath(w.hostNetNS)
	if err != nil {
		return nil, fmt.Errorf("open node netns %s: %w", w.hostNetNS, err)
	}
	defer ns.Close()
	nl, err := nsutil.HandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in node netns %s: %w", w.hostNetNS, err)
	}
	defer nl.Close()
	host := &hostNS{path: w.hostNetNS, ns: ns, nl: nl, links: map[int]netlink.Link{}}
	var scratch NodeInfo
	cps := slices.Clone(w.cps) // tcPrograms marks them
	progs, gone := tcProgramsOf(host, cps, w.progs, &scratch)
	w.progs.forget()
	// A deleted Pod's veth is not looked at again: with Pods that come and
	// go, each would cost a query at every look.
	kept := w.cps[:0]
	for i, cp := range w.cps {
		if !gone[i] {
			kept = append(kept, cp)
		}
	}
	w.cps = kept
	if len(scratch.Notes) > 0 {
		return progs, errors.New(scratch.Notes[0])
	}
	return progs, nil
}

// xdpPrograms lists the XDP programs of the host and uplink capture points
// (their links as discovery read them), leaving out pathtrace's own.
func xdpPrograms(host *hostNS, cps []CapturePoint, progs *progCache) []XDPProgram {
	var out []XDPProgram
	for _, cp := range cps {
		if cp.Role == RolePod {
			continue
		}
		l, err := host.link(cp.Ifindex)
		if err != nil {
			continue // gone: its Pod deleted since
		}
		x := l.Attrs().Xdp
		if x == nil || !x.Attached {
			continue
		}
		p := XDPProgram{Ifname: cp.Ifname, Ifindex: cp.Ifindex, Role: cp.Role, Mode: XDPMode(x.AttachMode), ID: ebpf.ProgramID(x.ProgId)}
		if p.ID != 0 {
			facts := progs.facts(p.ID)
			if facts.own {
				continue
			}
			p.Name = facts.name
		}
		out = append(out, p)
	}
	return out
}

// XDPMode names an XDP attach mode (IFLA_XDP_ATTACHED) by ip-link(8)'s keyword.
func XDPMode(m uint32) string {
	switch m {
	case nl.XDP_ATTACHED_DRV:
		return "xdpdrv"
	case nl.XDP_ATTACHED_SKB:
		return "xdpgeneric"
	case nl.XDP_ATTACHED_HW:
		return "xdpoffload"
	case nl.XDP_ATTACHED_HW + 1: // XDP_ATTACHED_MULTI, which nl lacks
		return "xdpmulti"
	}
	return fmt.Sprintf("xdp mode %d", m)
}
