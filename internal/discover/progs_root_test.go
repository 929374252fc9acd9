package discover

import (
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

func loadReturn(t *testing.T, name string, typ ebpf.ProgramType, attach ebpf.AttachType, ret int32) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: typ, AttachType: attach, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()}})
	if err != nil {
		t.Fatalf("load %s: %v", name, err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return id
}

// TestNodeFindsPrograms attaches a cgroup connect4 program on a test cgroup,
// a tcx program on the host veth and a cls_bpf filter on the uplink, and
// expects discovery to attribute each, and to leave out OwnPrograms.
func TestNodeFindsPrograms(t *testing.T) {
	tb := newTestbed(t)
	root, err := cgroup2.Root()
	if err != nil {
		t.Skipf("no cgroup2: %v", err)
	}
	cg := filepath.Join(root, filepath.Base(tb.node)+"-cg")
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(cg) })

	sock := loadReturn(t, "pttest_connect4", ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect, 1)
	cl, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: ebpf.AttachCGroupInet4Connect, Program: sock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })

	const tcxNext, tcActUnspec = -1, -1
	tcx := loadReturn(t, "pttest_tcx", ebpf.SchedCLS, ebpf.AttachTCXIngress, tcxNext)
	cls := loadReturn(t, "pttest_cls", ebpf.SchedCLS, ebpf.AttachNone, tcActUnspec)
	var hv0, up0 int
	err = nsutil.Do(tb.node, func() error {
		for name, idx := range map[string]*int{"hv0": &hv0, "up0": &up0} {
			ifc, err := net.InterfaceByName(name)
			if err != nil {
				return err
			}
			*idx = ifc.Index
		}
		tl, err := link.AttachTCX(link.TCXOptions{Interface: hv0, Program: tcx, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		t.Cleanup(func() { tl.Close() })
		return nil
	})
	if err != nil {
		t.Fatalf("attach tcx in the node netns: %v", err)
	}
	addClsBPF(t, tb.node, up0, cls)

	opt := Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP), Cgroup: cg}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	wantSock := SockProgram{Attach: "connect4", Name: "pttest_connect4", ID: progID(t, sock), Cgroup: cg}
	if !slices.Contains(info.SockPrograms, wantSock) {
		t.Errorf("sock programs: got %+v, want %+v among them", info.SockPrograms, wantSock)
	}
	wantTC := []TCProgram{
		{Ifname: "hv0", Ifindex: hv0, Role: RoleHost, Dir: "ingress", Via: "tcx", Name: "pttest_tcx", ID: progID(t, tcx)},
		{Ifname: "up0", Ifindex: up0, Role: RoleUplink, Dir: "egress", Via: "cls_bpf", Name: "pttest_cls", ID: progID(t, cls), DirectAction: true},
	}
	if !slices.Equal(info.TCPrograms, wantTC) {
		t.Errorf("tc programs:\n got %+v\nwant %+v", info.TCPrograms, wantTC)
	}

	opt.IsObserver = func(id ebpf.ProgramID) bool {
		return slices.Contains([]ebpf.ProgramID{progID(t, sock), progID(t, tcx), progID(t, cls)}, id)
	}
	info, err = Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range info.SockPrograms {
		if s.ID == wantSock.ID {
			t.Errorf("own program reported: %+v", s)
		}
	}
	if len(info.TCPrograms) != 0 {
		t.Errorf("own tc programs reported: %+v", info.TCPrograms)
	}
}

// addClsBPF puts prog as a direct-action cls_bpf filter on the egress of a
// clsact qdisc of the interface (in the netns at nsPath; the netns's removal
// takes both away).
func addClsBPF(t *testing.T, nsPath string, ifindex int, prog *ebpf.Program) {
	t.Helper()
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	qdisc := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
	if err := h.QdiscAdd(qdisc); err != nil {
		t.Fatalf("add clsact: %v", err)
	}
	filter := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: netlink.HANDLE_MIN_EGRESS,
		Handle: 1, Protocol: unix.ETH_P_ALL, Priority: 1}, Fd: prog.FD(), Name: "pttest_cls.o", DirectAction: true}
	if err := h.FilterAdd(filter); err != nil {
		t.Fatalf("add cls_bpf: %v", err)
	}
}

// TestSockProgramsSameProgramTwoLevels attaches one connect4 program on a
// Pod's cgroup and on its parent, the LB between them on the Pod's: each
// effective occurrence is named with the cgroup it is attached to.
func TestSockProgramsSameProgramTwoLevels(t *testing.T) {
	needRoot(t)
	root, err := cgroup2.Root()
	if err != nil {
		t.Skipf("no cgroup2: %v", err)
	}
	parent, err := os.MkdirTemp(root, "pttest-cg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(parent) })
	pod := filepath.Join(parent, "pod")
	if err := os.Mkdir(pod, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(pod) })

	other := loadReturn(t, "pttest_other4", ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect, 1)
	lb := loadReturn(t, "pttest_lb4", ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect, 1)
	for _, a := range []struct {
		dir  string
		prog *ebpf.Program
	}{{pod, other}, {pod, lb}, {parent, other}} {
		l, err := link.AttachCgroup(link.CgroupOptions{Path: a.dir, Attach: ebpf.AttachCGroupInet4Connect, Program: a.prog})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
	}

	var info NodeInfo
	var got []string
	for _, p := range sockPrograms(pod, func(id ebpf.ProgramID) bool { return id != progID(t, other) && id != progID(t, lb) }, &info) {
		got = append(got, p.Name+" "+p.Cgroup)
	}
	want := []string{"pttest_other4 " + pod, "pttest_lb4 " + pod, "pttest_other4 " + parent}
	if !slices.Equal(got, want) {
		t.Errorf("got %q, want %q (notes %q)", got, want, info.Notes)
	}
}

// TestNewSockAddrProgram: a cgroup sock_addr program loaded after the last
// look is found, unless it is pathtrace's own; other program types are not;
// a look from the returned ID on sees only what loaded since. (Other tests
// may load programs meanwhile: each look counts all but the one under test
// as pathtrace's own.)
func TestNewSockAddrProgram(t *testing.T) {
	needRoot(t)
	allBut := func(id ebpf.ProgramID) func(ebpf.ProgramID) bool {
		return func(p ebpf.ProgramID) bool { return p != id }
	}
	_, last, err := NewSockAddrProgram(0, allBut(0))
	if err != nil {
		t.Fatal(err)
	}
	filter := progID(t, loadReturn(t, "pttest_filter", ebpf.SocketFilter, ebpf.AttachNone, 0))
	if found, _, err := NewSockAddrProgram(last, allBut(filter)); err != nil || found {
		t.Errorf("socket filter %d: found %v, err %v; want neither", filter, found, err)
	}
	sock := progID(t, loadReturn(t, "pttest_sendmsg4", ebpf.CGroupSockAddr, ebpf.AttachCGroupUDP4Sendmsg, 1))
	found, l, err := NewSockAddrProgram(last, allBut(sock))
	if err != nil || !found || l < sock {
		t.Fatalf("foreign sock_addr program %d: found %v, last %d, err %v", sock, found, l, err)
	}
	if found, _, err := NewSockAddrProgram(last, func(ebpf.ProgramID) bool { return true }); err != nil || found {
		t.Errorf("every program pathtrace's own: found %v, err %v; want neither", found, err)
	}
	if found, _, err := NewSockAddrProgram(l, allBut(sock)); err != nil || found {
		t.Errorf("looking after %d, program %d: found %v, err %v; want neither", l, sock, found, err)
	}
}

// TestNodeFindsPodEth0Programs attaches a tcx program and a cls_bpf filter
// on the egress of the Pod's own eth0, in the Pod's netns (a DNAT there
// rewrites the Pod's requests before the host veth), and expects discovery
// to report both as the Pod's, tied to its host veth; pathtrace's own are
// left out.
func TestNodeFindsPodEth0Programs(t *testing.T) {
	tb := newTestbed(t)
	const tcxNext, tcActUnspec = -1, -1
	tcx := loadReturn(t, "pttest_podtcx", ebpf.SchedCLS, ebpf.AttachTCXEgress, tcxNext)
	cls := loadReturn(t, "pttest_podcls", ebpf.SchedCLS, ebpf.AttachNone, tcActUnspec)
	var eth0, hv0 int
	err := nsutil.Do(tb.pod, func() error {
		ifc, err := net.InterfaceByName("eth0")
		if err != nil {
			return err
		}
		eth0 = ifc.Index
		tl, err := link.AttachTCX(link.TCXOptions{Interface: eth0, Program: tcx, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			return err
		}
		t.Cleanup(func() { tl.Close() })
		return nil
	})
	if err != nil {
		t.Fatalf("attach tcx in the pod netns: %v", err)
	}
	addClsBPF(t, tb.pod, eth0, cls)
	if err := nsutil.Do(tb.node, func() error {
		ifc, err := net.InterfaceByName("hv0")
		if err == nil {
			hv0 = ifc.Index
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}

	opt := Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	want := []TCProgram{
		{Ifname: "eth0", Ifindex: eth0, HostIfindex: hv0, Role: RolePod, Dir: "egress", Via: "tcx", Name: "pttest_podtcx", ID: progID(t, tcx)},
		{Ifname: "eth0", Ifindex: eth0, HostIfindex: hv0, Role: RolePod, Dir: "egress", Via: "cls_bpf", Name: "pttest_podcls", ID: progID(t, cls), DirectAction: true},
	}
	if !slices.Equal(info.TCPrograms, want) {
		t.Errorf("tc programs:\n got %+v\nwant %+v", info.TCPrograms, want)
	}

	opt.IsObserver = func(id ebpf.ProgramID) bool { return id == progID(t, tcx) || id == progID(t, cls) }
	if info, err = Node(context.Background(), opt); err != nil {
		t.Fatal(err)
	}
	if len(info.TCPrograms) != 0 {
		t.Errorf("own tc programs reported: %+v", info.TCPrograms)
	}
}

// TestNodeFindsMirredRedirect: a u32 filter (no BPF) at the host veth's
// ingress whose mirred action redirects the Pod's packets to the uplink
// takes them past the bridge and netfilter; discovery lists it with where
// it sends them.
func TestNodeFindsMirredRedirect(t *testing.T) {
	tb := newTestbed(t)
	ns, err := netns.GetFromPath(tb.node)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	hv0, err := h.LinkByName("hv0")
	if err != nil {
		t.Fatal(err)
	}
	up0, err := h.LinkByName("up0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.QdiscAdd(&netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: hv0.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}); err != nil {
		t.Fatal(err)
	}
	redir := netlink.NewMirredAction(up0.Attrs().Index)
	mirror := netlink.NewMirredAction(up0.Attrs().Index)
	mirror.MirredAction = netlink.TCA_EGRESS_MIRROR
	for i, a := range []*netlink.MirredAction{redir, mirror} {
		if err := h.FilterAdd(&netlink.U32{FilterAttrs: netlink.FilterAttrs{LinkIndex: hv0.Attrs().Index,
			Parent: netlink.HANDLE_MIN_INGRESS, Priority: uint16(10 + i), Protocol: unix.ETH_P_IP},
			Actions: []netlink.Action{a}}); err != nil {
			t.Fatalf("add u32 mirred filter: %v", err)
		}
	}
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)})
	if err != nil {
		t.Fatal(err)
	}
	want := []TCRedirect{
		{Ifname: "hv0", Ifindex: hv0.Attrs().Index, Role: RoleHost, Dir: "ingress", Filter: "u32 pref 10", Action: "egress redirect", To: "up0"},
		{Ifname: "hv0", Ifindex: hv0.Attrs().Index, Role: RoleHost, Dir: "ingress", Filter: "u32 pref 11", Action: "egress mirror", To: "up0"},
	}
	if !slices.Equal(info.TCRedirects, want) {
		t.Errorf("tc redirects:\n got %+v\nwant %+v", info.TCRedirects, want)
	}
	if len(info.TCPrograms) != 0 {
		t.Errorf("a u32 filter taken for a tc program: %+v", info.TCPrograms)
	}
}

// TestNodeFindsFilterRewrites: tc filters (no BPF) whose actions rewrite
// the destination of the Pod's packets at its host veth's ingress (act_nat,
// a pedit of ip dst, a ct commit with a NAT of its own), and an act_nat
// that rewrites their source back at its egress (tc-nat(8)), are listed as
// tc programs of a filter, with what they rewrite (netlink decodes none of
// these actions; discover does). Each case is skipped on a kernel without
// its classifier or action.
func TestNodeFindsFilterRewrites(t *testing.T) {
	vip := netip.MustParsePrefix("10.120.0.80/32")
	for _, tc := range []struct {
		name    string
		filters [][]string // tc filter add dev hv0 ...
		want    []TCProgram
	}{
		{"act_nat", [][]string{
			{"ingress", "pref", "10", "protocol", "ip", "u32", "match", "ip", "dst", "10.120.0.80/32", "action", "nat", "ingress", "10.120.0.80/32", "10.244.20.31"},
			{"egress", "pref", "10", "protocol", "ip", "u32", "match", "ip", "src", "10.244.20.31/32", "action", "nat", "egress", "10.244.20.31/32", "10.120.0.80"},
		}, []TCProgram{
			{Dir: "ingress", Via: "u32", Name: "pref 10", Action: "nat ingress 10.120.0.80/32 -> 10.244.20.31", Rewrites: vip},
			{Dir: "egress", Via: "u32", Name: "pref 10", Action: "nat egress 10.244.20.31/32 -> 10.120.0.80"},
		}},
		{"pedit", [][]string{
			{"ingress", "pref", "11", "protocol", "ip", "u32", "match", "ip", "dst", "10.120.0.80/32", "action", "pedit", "ex", "munge", "ip", "dst", "set", "10.244.20.31", "pipe", "csum", "ip", "and", "tcp"},
		}, []TCProgram{
			{Dir: "ingress", Via: "u32", Name: "pref 11", Action: "pedit munge ip dst set 10.244.20.31", Rewrites: vip},
		}},
		{"ct_nat", [][]string{
			{"ingress", "pref", "12", "protocol", "ip", "flower", "dst_ip", "10.120.0.80", "action", "ct", "commit", "nat", "dst", "addr", "10.244.20.31", "port", "3000"},
		}, []TCProgram{
			{Dir: "ingress", Via: "flower", Name: "pref 12", Action: "ct commit nat dst addr 10.244.20.31 port 3000", Rewrites: vip},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := newTestbed(t)
			node := filepath.Base(tb.node)
			tcCmd := func(args ...string) {
				t.Helper()
				out, err := exec.Command("tc", append([]string{"-n", node}, args...)...).CombinedOutput()
				if err != nil && (strings.Contains(string(out), "Failed to load TC action module") || strings.Contains(string(out), "TC classifier not found")) {
					t.Skipf("this kernel lacks the classifier or action: tc %s: %s", strings.Join(args, " "), out)
				}
				if err != nil {
					t.Fatalf("tc %s: %v: %s", strings.Join(args, " "), err, out)
				}
			}
			tcCmd("qdisc", "add", "dev", "hv0", "clsact")
			for _, f := range tc.filters {
				tcCmd(append([]string{"filter", "add", "dev", "hv0"}, f...)...)
			}
			info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)})
			if err != nil {
				t.Fatal(err)
			}
			hv0 := slices.IndexFunc(info.CapturePoints, func(cp CapturePoint) bool { return cp.Ifname == "hv0" })
			if hv0 < 0 {
				t.Fatalf("hv0 not a capture point: %+v", info.CapturePoints)
			}
			want := slices.Clone(tc.want)
			for i := range want {
				want[i].Ifname, want[i].Ifindex, want[i].Role = "hv0", info.CapturePoints[hv0].Ifindex, RoleHost
			}
			if !slices.Equal(info.TCPrograms, want) {
				t.Errorf("tc programs:\n got %+v\nwant %+v", info.TCPrograms, want)
			}
		})
	}
}
