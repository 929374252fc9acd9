package incident

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// Bounds of the program listings.
const (
	maxCgroups  = 10000
	maxBPFLinks = 4096
)

// progDesc describes a loaded program: id, full name (cilium/ebpf takes it
// from BTF when the kernel's copy is cut to 15 characters), type and tag.
func (s *snapshot) progDesc(id ebpf.ProgramID) string {
	d := fmt.Sprintf("prog id %d", id)
	if s.own[id] {
		d += " (pathtrace's own observer)"
	}
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return fmt.Sprintf("%s (not opened: %v)", d, err)
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return fmt.Sprintf("%s (no info: %v)", d, err)
	}
	return fmt.Sprintf("%s name %s type %s tag %s", d, orDash(info.Name), info.Type, info.Tag)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// tcIface is an interface whose tc/tcx/XDP programs are listed.
type tcIface struct {
	role, name string
	// ifindex is its capture point's (0: whatever has the name now); gone:
	// its Pod went during the incident, with its netns.
	ifindex int
	gone    bool
}

// tcPrograms lists, for every capture interface (and the members of a bond
// uplink and the parent of a VLAN uplink), the tcx chains in run order, the
// qdiscs and the filters of a clsact/ingress qdisc (cls_bpf runs after the
// whole tcx chain), and an XDP program. A Pod's eth0 is taken from its Pod,
// whose netns path may open another Pod's now.
func (s *snapshot) tcPrograms(_ context.Context, w *topicWriter) error {
	byNS := map[string][]tcIface{}
	var order []string
	add := func(path string, ifc tcIface) {
		if _, ok := byNS[path]; !ok {
			order = append(order, path)
		}
		byNS[path] = append(byNS[path], ifc)
	}
	for _, p := range s.node.Pods {
		if p.NetNS.Path != "" {
			add(p.NetNS.Path, tcIface{role: discover.RolePod, name: p.Eth0.Name, gone: podGone(p)})
		}
	}
	for _, cp := range s.node.CapturePoints {
		if cp.Role == discover.RolePod {
			continue // its Pod's, above
		}
		path := cp.NetNS
		if path == "" {
			path = s.hostPath
		}
		add(path, tcIface{role: cp.Role, name: cp.Ifname, ifindex: cp.Ifindex})
		for _, m := range cp.BondMembers {
			add(path, tcIface{role: cp.Role + " bond member", name: m})
		}
		if cp.VLANParent != "" {
			add(path, tcIface{role: cp.Role + " vlan parent", name: cp.VLANParent})
		}
	}
	if len(order) == 0 {
		fmt.Fprintln(w, "no capture points were discovered: no interface to list")
		return nil
	}
	for _, path := range order {
		ifcs := byNS[path]
		if !slices.ContainsFunc(ifcs, func(ifc tcIface) bool { return !ifc.gone }) {
			for _, ifc := range ifcs {
				podWent(w, path, ifc)
			}
			continue
		}
		err := nsutil.Netlink(path, func(h *netlink.Handle) error {
			for _, ifc := range ifcs {
				if ifc.gone {
					podWent(w, path, ifc)
				} else {
					s.tcIface(w, h, path, ifc)
				}
			}
			return nil
		})
		if err != nil {
			fmt.Fprintf(w, "# netns %s not read: %v\n", path, err)
			w.notef("netns %s not read: %v", path, err)
		}
	}
	return nil
}

// podWent says that ifc's Pod went: the net-pod file's note says so.
func podWent(w *topicWriter, nsPath string, ifc tcIface) {
	fmt.Fprintf(w, "## %s %s (netns %s): gone, the Pod went during the incident (the report's capture_ended says when)\n\n", ifc.role, ifc.name, nsPath)
}

func (s *snapshot) tcIface(w *topicWriter, h *netlink.Handle, nsPath string, ifc tcIface) {
	l, err := h.LinkByName(ifc.name)
	var notFound netlink.LinkNotFoundError
	if ifc.ifindex != 0 && (errors.As(err, &notFound) || err == nil && l.Attrs().Index != ifc.ifindex) {
		// A Pod's host veth that went with it; a Pod made again may have
		// given its name to its own.
		fmt.Fprintf(w, "## %s %s (ifindex %d, netns %s): gone during the incident (the report's capture_ended says when)\n\n", ifc.role, ifc.name, ifc.ifindex, nsPath)
		return
	}
	if err != nil {
		fmt.Fprintf(w, "## %s %s (netns %s): not found: %v\n\n", ifc.role, ifc.name, nsPath, err)
		w.notef("%s %s not found in netns %s: %v", ifc.role, ifc.name, nsPath, err)
		return
	}
	idx := l.Attrs().Index
	fmt.Fprintf(w, "## %s %s (ifindex %d, netns %s)\n", ifc.role, ifc.name, idx, nsPath)

	// A tcx query takes an ifindex, which means something only from a thread
	// inside the interface's netns.
	err = nsutil.Do(nsPath, func() error {
		for _, d := range []struct {
			dir string
			typ ebpf.AttachType
		}{{"ingress", ebpf.AttachTCXIngress}, {"egress", ebpf.AttachTCXEgress}} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: idx, Attach: d.typ})
			if err != nil {
				fmt.Fprintf(w, "tcx %s: not read: %v\n", d.dir, err)
				continue
			}
			fmt.Fprintf(w, "tcx %s (run order):", d.dir)
			s.chain(w, res.Programs)
		}
		if nk, ok := l.(*netlink.Netkit); ok {
			s.netkitChains(w, idx, nk)
		}
		return nil
	})
	if err != nil {
		fmt.Fprintf(w, "tcx: not read: %v\n", err)
		w.notef("tcx of %s not read: %v", ifc.name, err)
	}

	qdiscs, err := h.QdiscList(l)
	if err != nil {
		fmt.Fprintf(w, "qdiscs: not read: %v\n\n", err)
		w.notef("qdiscs of %s not read: %v", ifc.name, err)
		return
	}
	fmt.Fprintln(w, "qdiscs:")
	for _, q := range qdiscs {
		a := q.Attrs()
		fmt.Fprintf(w, "  %s handle %s parent %s\n", q.Type(), netlink.HandleStr(a.Handle), netlink.HandleStr(a.Parent))
		for _, p := range discover.TCParents(q) {
			s.tcFilters(w, h, nsPath, l, p)
		}
	}
	if x := l.Attrs().Xdp; x != nil && x.Attached {
		fmt.Fprintf(w, "xdp: %s mode %s\n", s.progDesc(ebpf.ProgramID(x.ProgId)), discover.XDPMode(x.AttachMode))
	} else {
		fmt.Fprintln(w, "xdp: none")
	}
	fmt.Fprintln(w)
}

// netkitChains writes the program lists of the netkit pair whose end nk
// (ifindex idx) is, from a thread in its netns: they run inside the pair,
// before the receiving end's tap and tcx chain. Only the primary holds them.
func (s *snapshot) netkitChains(w *topicWriter, idx int, nk *netlink.Netkit) {
	if !nk.IsPrimary() {
		fmt.Fprintln(w, "netkit: the peer end of its pair; the pair's programs are held by its primary, in the other netns")
		return
	}
	for _, c := range discover.NetkitChains {
		res, err := link.QueryPrograms(link.QueryOptions{Target: idx, Attach: c.Attach})
		if err != nil {
			fmt.Fprintf(w, "netkit %s: not read: %v\n", c.End, err)
			w.notef("netkit %s programs of %s not read: %v", c.End, nk.Name, err)
			continue
		}
		fmt.Fprintf(w, "netkit %s (%s of the node side, run order):", c.End, c.Dir)
		s.chain(w, res.Programs)
	}
}

// chain ends a chain's header line and lists its programs in run order.
func (s *snapshot) chain(w *topicWriter, progs []link.AttachedProgram) {
	if len(progs) == 0 {
		fmt.Fprint(w, " none")
	}
	fmt.Fprintln(w)
	for i, p := range progs {
		linkID, _ := p.LinkID()
		fmt.Fprintf(w, "  %d. %s link %d\n", i+1, s.progDesc(p.ID), linkID)
	}
}

// tcFilters writes the filters hanging off one qdisc parent of l, in the
// netns at nsPath, and what the actions of those that are not BPF rewrite.
func (s *snapshot) tcFilters(w *topicWriter, h *netlink.Handle, nsPath string, l netlink.Link, p discover.TCParent) {
	filters, err := h.FilterList(l, p.Handle)
	if err != nil {
		fmt.Fprintf(w, "    %s filters: not read: %v\n", p.Dir, err)
		w.notef("%s filters of %s not read: %v", p.Dir, l.Attrs().Name, err)
		return
	}
	fmt.Fprintf(w, "    %s filters:", p.Dir)
	if len(filters) == 0 {
		fmt.Fprint(w, " none")
	}
	fmt.Fprintln(w)
	others := false
	for _, f := range filters {
		a := f.Attrs()
		fmt.Fprintf(w, "      %s pref %d handle %s protocol %#04x", f.Type(), a.Priority, netlink.HandleStr(a.Handle), a.Protocol)
		if bf, ok := f.(*netlink.BpfFilter); ok {
			fmt.Fprintf(w, " %s section %q", s.progDesc(ebpf.ProgramID(bf.Id)), bf.Name)
			if bf.DirectAction {
				fmt.Fprint(w, " direct-action")
			}
		} else {
			others = true
		}
		fmt.Fprintln(w)
	}
	if !others {
		return
	}
	// netlink decodes no act_nat, pedit key or act_ct: discover does.
	rws, err := discover.FilterRewrites(nsPath, l.Attrs().Index, p)
	if err != nil {
		fmt.Fprintf(w, "    %s filters' actions: not read: %v\n", p.Dir, err)
		w.notef("%s filters' actions of %s not read: %v", p.Dir, l.Attrs().Name, err)
	}
	for _, rw := range rws {
		fmt.Fprintf(w, "      %s %s rewrites: %s\n", rw.Via, rw.Name, rw.Action)
	}
}

var errEnough = errors.New("enough")

// cgroupPrograms lists the sock_addr programs of the cgroup2 tree: the ones
// on the root (every process runs them), then every cgroup with programs of
// its own, with what is effective there (its own, then its ancestors').
func (s *snapshot) cgroupPrograms(ctx context.Context, w *topicWriter) error {
	root, err := cgroup2.Root()
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "cgroup2 mount: %s\n", root)
	if !cgroup2.IsHierarchyRoot(root) {
		// A container's own cgroup namespace: the node's cgroups, and the
		// programs on them, are out of sight.
		fmt.Fprintln(w, "NOT the node's cgroup hierarchy but the root of pathtrace's cgroup namespace (a container's): the node's other cgroups and the programs on them are not seen here; mount the host's /sys/fs/cgroup in (a hostPath)")
	}
	fmt.Fprint(w, "\n## on the root (effective for every process in it)\n")
	if err := s.cgroupQuery(w, root, 0); err != nil {
		return err
	}

	fmt.Fprintln(w, "\n## cgroups below the root with programs attached")
	walked, withProgs := 0, 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() || path == root {
			return nil // a cgroup removed during the walk is not an error
		}
		if walked++; walked > maxCgroups {
			return errEnough
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if !hasSockPrograms(path) {
			return nil
		}
		withProgs++
		fmt.Fprintf(w, "### %s\nattached here:\n", path)
		if err := s.cgroupQuery(w, path, 0); err != nil {
			return err
		}
		fmt.Fprintln(w, "effective (here first, then the ancestors'):")
		return s.cgroupQuery(w, path, unix.BPF_F_QUERY_EFFECTIVE)
	})
	switch {
	case errors.Is(err, errEnough):
		fmt.Fprintf(w, "# walk stopped after %d cgroups\n", maxCgroups)
		w.notef("cgroup walk stopped after %d cgroups", maxCgroups)
	case err != nil:
		return err
	case withProgs == 0:
		fmt.Fprintf(w, "none (%d cgroups walked)\n", walked)
	}
	return nil
}

// hasSockPrograms tells whether sock_addr programs are attached to the cgroup
// at dir itself (a cheap query, made for every cgroup of the walk).
func hasSockPrograms(dir string) bool {
	f, err := os.Open(dir)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, at := range discover.SockHooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at.Type})
		if err == nil && len(res.Programs) > 0 {
			return true
		}
	}
	return false
}

// cgroupQuery writes the programs of every sock_addr hook of one cgroup.
func (s *snapshot) cgroupQuery(w *topicWriter, dir string, flags uint32) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("open cgroup: %w", err)
	}
	defer f.Close()
	for _, at := range discover.SockHooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at.Type, QueryFlags: flags})
		if err != nil {
			fmt.Fprintf(w, "  %s: not read: %v\n", at.Name, err)
			continue
		}
		if len(res.Programs) == 0 {
			fmt.Fprintf(w, "  %s: none\n", at.Name)
			continue
		}
		for i, p := range res.Programs {
			fmt.Fprintf(w, "  %s %d. %s\n", at.Name, i+1, s.progDesc(p.ID))
		}
	}
	return nil
}

// bpfLinks lists every BPF link of the machine with what it is attached to.
// tcx and netfilter links are invisible to older bpftool; an ifindex here is
// relative to the link's own netns, which the kernel does not report.
func (s *snapshot) bpfLinks(ctx context.Context, w *topicWriter) error {
	it := new(link.Iterator)
	defer it.Close()
	n := 0
	for it.Next() {
		if n++; n > maxBPFLinks {
			fmt.Fprintf(w, "# listing stopped after %d links\n", maxBPFLinks)
			w.notef("listing stopped after %d links", maxBPFLinks)
			return nil
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		info, err := it.Link.Info()
		if err != nil {
			fmt.Fprintf(w, "link %d: no info: %v\n", it.ID, err)
			continue
		}
		fmt.Fprintf(w, "link %d %s%s: %s\n", info.ID, linkTypeName(info.Type), linkTarget(info), s.progDesc(info.Program))
	}
	if n == 0 {
		fmt.Fprintln(w, "no BPF links")
	}
	return it.Err()
}

func linkTypeName(t link.Type) string {
	switch t {
	case link.RawTracepointType:
		return "raw_tracepoint"
	case link.TracingType:
		return "tracing"
	case link.CgroupType:
		return "cgroup"
	case link.IterType:
		return "iter"
	case link.NetNsType:
		return "netns"
	case link.XDPType:
		return "xdp"
	case link.PerfEventType:
		return "perf_event"
	case link.KprobeMultiType:
		return "kprobe_multi"
	case link.TCXType:
		return "tcx"
	case link.UprobeMultiType:
		return "uprobe_multi"
	case link.NetfilterType:
		return "netfilter"
	case link.NetkitType:
		return "netkit"
	case link.StructOpsType:
		return "struct_ops"
	}
	return fmt.Sprintf("type%d", t)
}

// linkTarget says what a link is attached to, for the types pathtrace's
// verdicts depend on.
func linkTarget(info *link.Info) string {
	switch {
	case info.TCX() != nil:
		return fmt.Sprintf(" ifindex %d %s", info.TCX().Ifindex, strings.TrimPrefix(info.TCX().AttachType.String(), "BPF_"))
	case info.Netfilter() != nil:
		nf := info.Netfilter()
		return fmt.Sprintf(" %s %s priority %d flags %#x", nfFamily(uint32(nf.ProtocolFamily)), nfHook(uint32(nf.Hook)), nf.Priority, nf.Flags)
	case info.Cgroup() != nil:
		return fmt.Sprintf(" cgroup id %d %s", info.Cgroup().CgroupId, strings.TrimPrefix(info.Cgroup().AttachType.String(), "BPF_"))
	case info.Netkit() != nil:
		return fmt.Sprintf(" ifindex %d %s", info.Netkit().Ifindex, strings.TrimPrefix(info.Netkit().AttachType.String(), "BPF_"))
	case info.XDP() != nil:
		return fmt.Sprintf(" ifindex %d", info.XDP().Ifindex)
	case info.NetNs() != nil:
		return fmt.Sprintf(" netns inode %d", info.NetNs().NetnsInode)
	}
	return ""
}

func nfFamily(pf uint32) string {
	switch pf {
	case unix.NFPROTO_IPV4:
		return "ipv4"
	case unix.NFPROTO_IPV6:
		return "ipv6"
	}
	return fmt.Sprintf("pf%d", pf)
}

func nfHook(h uint32) string {
	switch h {
	case unix.NF_INET_PRE_ROUTING:
		return "prerouting"
	case unix.NF_INET_LOCAL_IN:
		return "input"
	case unix.NF_INET_FORWARD:
		return "forward"
	case unix.NF_INET_LOCAL_OUT:
		return "output"
	case unix.NF_INET_POST_ROUTING:
		return "postrouting"
	}
	return fmt.Sprintf("hook%d", h)
}
