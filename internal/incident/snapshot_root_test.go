package incident

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

const (
	testPodIP   = "10.244.8.23"
	testGwIP    = "10.244.8.1"
	testVIP     = "10.120.0.80"
	testBackend = "10.244.20.31"
)

// testNode is a node in namespaces: "node" with bridge br0 (no VLAN
// filtering: this kernel lacks it), a "pod" whose eth0 is a veth to hv0 on br0,
// a "gw" behind up0; an nftables DNAT for the VIP, a conntrack entry for it,
// a tcx program on hv0, a cls_bpf filter on up0 and a connect4 program on a
// test cgroup.
type testNode struct {
	node, pod, gw string // /run/netns paths
	cgroup        string
	progs         map[string]ebpf.ProgramID
}

func ipCmd(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func newTestNode(t *testing.T) *testNode {
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces, BPF programs and a cgroup")
	}
	prefix := fmt.Sprintf("pttest-incident-%06x", rand.IntN(1<<24))
	names := map[string]string{}
	for _, role := range []string{"node", "pod", "gw"} {
		name := prefix + "-" + role
		ipCmd(t, "netns", "add", name)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
		names[role] = name
		ipCmd(t, "-n", name, "link", "set", "lo", "up")
	}
	node, pod, gw := names["node"], names["pod"], names["gw"]
	ipCmd(t, "-n", node, "link", "add", "br0", "type", "bridge")
	ipCmd(t, "-n", node, "link", "add", "hv0", "type", "veth", "peer", "name", "eth0", "netns", pod)
	ipCmd(t, "-n", node, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", gw)
	for _, l := range []string{"hv0", "up0"} {
		ipCmd(t, "-n", node, "link", "set", l, "master", "br0", "up")
	}
	ipCmd(t, "-n", node, "link", "set", "br0", "up")
	ipCmd(t, "-n", pod, "addr", "add", testPodIP+"/22", "dev", "eth0")
	ipCmd(t, "-n", pod, "link", "set", "eth0", "up")
	ipCmd(t, "-n", pod, "route", "add", "default", "via", testGwIP)
	ipCmd(t, "-n", gw, "addr", "add", testGwIP+"/22", "dev", "eth0")
	ipCmd(t, "-n", gw, "link", "set", "eth0", "up")

	tn := &testNode{node: "/run/netns/" + node, pod: "/run/netns/" + pod, gw: "/run/netns/" + gw, progs: map[string]ebpf.ProgramID{}}
	tn.talk(t)
	tn.addDNAT(t)
	tn.addConntrack(t)
	tn.addPrograms(t, prefix)
	for _, path := range []string{tn.node, tn.pod, tn.gw} {
		ipv6Settled(t, path)
	}
	return tn
}

// ipv6Settled waits until each interface up with a carrier in the netns at
// path has its IPv6 link-local address, none tentative: the kernel adds
// that address once it sees the carrier and its local route once DAD ends
// (a second or two after the link came up, later on a loaded machine), and
// a route that came in the middle of a test that compares the node before
// and after the snapshot is a change it did not make.
func ipv6Settled(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat("/proc/sys/net/ipv6"); err != nil {
		return // no IPv6 in this kernel
	}
	var pending string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		pending = ""
		err := nsutil.Netlink(path, func(h *vnl.Handle) error {
			links, err := h.LinkList()
			if err != nil {
				return err
			}
			for _, l := range links {
				a := l.Attrs()
				if a.RawFlags&unix.IFF_LOOPBACK != 0 || a.RawFlags&unix.IFF_UP == 0 || a.RawFlags&unix.IFF_LOWER_UP == 0 || ipv6Disabled(t, path, a.Name) {
					continue
				}
				addrs, err := h.AddrList(l, vnl.FAMILY_V6)
				if err != nil {
					return err
				}
				linkLocal := false
				for _, ad := range addrs {
					if ad.Flags&unix.IFA_F_TENTATIVE != 0 {
						pending = fmt.Sprintf("%s: %s tentative", a.Name, ad.IPNet)
						return nil
					}
					linkLocal = linkLocal || ad.Scope == unix.RT_SCOPE_LINK
				}
				if !linkLocal {
					pending = a.Name + ": no IPv6 link-local address yet"
					return nil
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if pending == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: IPv6 addresses not settled within 30 s: %s", path, pending)
		}
	}
}

// ipv6Disabled reports whether IPv6 is off on the interface name of the
// netns at path: it gets no address to wait for.
func ipv6Disabled(t *testing.T, path, name string) bool {
	t.Helper()
	var b []byte
	err := nsutil.Do(path, func() error {
		var err error
		b, err = os.ReadFile("/proc/sys/net/ipv6/conf/" + name + "/disable_ipv6")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b)) == "1"
}

// talk sends a datagram from the pod to its gateway, so neighbour tables and
// the bridge FDB have entries.
func (tn *testNode) talk(t *testing.T) {
	t.Helper()
	err := nsutil.Do(tn.pod, func() error {
		c, err := net.Dial("udp4", testGwIP+":9")
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("hello"))
		return err
	})
	if err != nil {
		t.Fatalf("send from pod: %v", err)
	}
	for range 100 {
		out, _ := exec.Command("ip", "-n", filepath.Base(tn.pod), "neigh", "show", testGwIP).Output()
		if strings.Contains(string(out), "lladdr") {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("the pod never resolved its gateway")
}

// addDNAT adds kube-proxy's shape of rule: ip daddr VIP tcp dport 80 dnat to
// backend:3000 at prerouting, NAT priority.
func (tn *testNode) addDNAT(t *testing.T) {
	t.Helper()
	conn := nftIn(t, tn.node)
	table := conn.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "pttest-incident"})
	chain := conn.AddChain(&nftables.Chain{Name: "prerouting", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	vip, backend := netip.MustParseAddr(testVIP).As4(), netip.MustParseAddr(testBackend).As4()
	conn.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: vip[:]},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0, 80}},
		&expr.Immediate{Register: 1, Data: backend[:]},
		&expr.Immediate{Register: 2, Data: []byte{0x0b, 0xb8}},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2, Specified: true},
	}})
	if err := conn.Flush(); err != nil {
		t.Fatalf("add nftables DNAT: %v", err)
	}
}

// addConntrack creates the entry a DNATed UDP request to the VIP leaves.
func (tn *testNode) addConntrack(t *testing.T) {
	t.Helper()
	ns, err := netns.GetFromPath(tn.node)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	conn, err := conntrack.Dial(&netlink.Config{NetNS: int(ns)})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	f := conntrack.NewFlow(unix.IPPROTO_UDP, 0, netip.MustParseAddr(testPodIP),
		netip.MustParseAddr(testVIP), 40000, 53, 600, 0)
	f.TupleReply.IP.SourceAddress = netip.MustParseAddr(testBackend)
	f.TupleReply.Proto.SourcePort = 5353
	if err := conn.Create(f); err != nil {
		t.Fatalf("create conntrack entry: %v", err)
	}
}

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

func (tn *testNode) addPrograms(t *testing.T, prefix string) {
	t.Helper()
	root, err := cgroup2.Root()
	if err != nil {
		t.Skipf("no cgroup2: %v", err)
	}
	tn.cgroup = filepath.Join(root, prefix)
	if err := os.Mkdir(tn.cgroup, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(tn.cgroup) })
	sock := loadReturn(t, "pttest_conn4", ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect, 1)
	cl, err := link.AttachCgroup(link.CgroupOptions{Path: tn.cgroup, Attach: ebpf.AttachCGroupInet4Connect, Program: sock})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })

	const tcxNext, tcActUnspec = -1, -1
	tcx := loadReturn(t, "pttest_tcx", ebpf.SchedCLS, ebpf.AttachTCXIngress, tcxNext)
	cls := loadReturn(t, "pttest_cls", ebpf.SchedCLS, ebpf.AttachNone, tcActUnspec)
	const xdpPass = 2
	xdp := loadReturn(t, "pttest_xdp", ebpf.XDP, ebpf.AttachXDP, xdpPass)
	err = nsutil.Netlink(tn.node, func(h *vnl.Handle) error {
		hv0, err := h.LinkByName("hv0")
		if err != nil {
			return err
		}
		up0, err := h.LinkByName("up0")
		if err != nil {
			return err
		}
		err = nsutil.Do(tn.node, func() error {
			tl, err := link.AttachTCX(link.TCXOptions{Interface: hv0.Attrs().Index, Program: tcx, Attach: ebpf.AttachTCXIngress})
			if err != nil {
				return err
			}
			t.Cleanup(func() { tl.Close() })
			xl, err := link.AttachXDP(link.XDPOptions{Interface: up0.Attrs().Index, Program: xdp, Flags: link.XDPGenericMode})
			if err != nil {
				return err
			}
			t.Cleanup(func() { xl.Close() })
			return nil
		})
		if err != nil {
			return fmt.Errorf("attach tcx and xdp: %w", err)
		}
		qdisc := &vnl.GenericQdisc{QdiscType: "clsact", QdiscAttrs: vnl.QdiscAttrs{
			LinkIndex: up0.Attrs().Index, Handle: vnl.MakeHandle(0xffff, 0), Parent: vnl.HANDLE_CLSACT}}
		if err := h.QdiscAdd(qdisc); err != nil {
			return fmt.Errorf("add clsact: %w", err)
		}
		return h.FilterAdd(&vnl.BpfFilter{FilterAttrs: vnl.FilterAttrs{LinkIndex: up0.Attrs().Index,
			Parent: vnl.HANDLE_MIN_INGRESS, Handle: 1, Protocol: unix.ETH_P_ALL, Priority: 1},
			Fd: cls.FD(), Name: "pttest_cls.o", DirectAction: true})
	})
	if err != nil {
		t.Fatalf("attach tc programs: %v", err)
	}
	tn.progs["conn4"], tn.progs["tcx"], tn.progs["cls"] = progID(t, sock), progID(t, tcx), progID(t, cls)
}

// nodeInfo is what discovery would report for the test node.
func (tn *testNode) nodeInfo() *discover.NodeInfo {
	return &discover.NodeInfo{
		Kernel:    "test",
		HostNetNS: discover.NetNS{Path: tn.node},
		Pods: []discover.Pod{{
			NetNS: discover.NetNS{Path: tn.pod}, NSName: filepath.Base(tn.pod),
			Eth0:     discover.Iface{Name: "eth0", Kind: "veth", Addrs: []netip.Prefix{netip.MustParsePrefix(testPodIP + "/22")}},
			Gateway:  netip.MustParseAddr(testGwIP),
			HostPeer: &discover.HostPeer{Iface: discover.Iface{Name: "hv0"}, Master: "br0", MasterKind: "bridge"},
			Uplinks:  []string{"up0"},
		}},
		CapturePoints: []discover.CapturePoint{
			{Role: discover.RolePod, NetNS: tn.pod, Ifname: "eth0", Kind: "veth"},
			{Role: discover.RoleHost, NetNS: tn.node, Ifname: "hv0", Kind: "veth", Master: "br0"},
			{Role: discover.RoleUplink, NetNS: tn.node, Ifname: "up0", Kind: "veth", Master: "br0"},
		},
		Notes: []string{"a note from discovery"},
	}
}

// state renders everything a snapshot must leave as it found: the nftables
// ruleset, links, addresses and routes, qdiscs, tc filters and tcx chains
// (with their revision counters) of the node and pod netns, the programs on
// the test cgroup, and the legacy iptables tables. Not the cgroup2 root's
// programs: test packages run in parallel, and the others' pathtrace runs
// attach there (CI once saw a connect4 program appear mid-snapshot); the
// snapshot reads the test cgroup the way it reads any other.
func (tn *testNode) state(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	conn := nftIn(t, tn.node)
	if err := renderRuleset(&b, conn, nil, nil); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{tn.node, tn.pod} {
		err := nsutil.Netlink(path, func(h *vnl.Handle) error {
			links, err := h.LinkList()
			if err != nil {
				return err
			}
			for _, l := range links {
				a := l.Attrs()
				fmt.Fprintf(&b, "link %d %s %s %v mtu %d master %d %s\n", a.Index, a.Name, l.Type(), a.Flags, a.MTU, a.MasterIndex, a.OperState)
				addrs, _ := h.AddrList(l, vnl.FAMILY_ALL)
				for _, ad := range addrs {
					fmt.Fprintf(&b, "  addr %s\n", ad.IPNet)
				}
				qdiscs, _ := h.QdiscList(l)
				for _, q := range qdiscs {
					fmt.Fprintf(&b, "  qdisc %s %x %x\n", q.Type(), q.Attrs().Handle, q.Attrs().Parent)
				}
				for _, parent := range []uint32{vnl.HANDLE_MIN_INGRESS, vnl.HANDLE_MIN_EGRESS} {
					filters, _ := h.FilterList(l, parent)
					for _, f := range filters {
						fmt.Fprintf(&b, "  filter %x %s %+v\n", parent, f.Type(), *f.Attrs())
					}
				}
				nsutil.Do(path, func() error {
					for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
						res, err := link.QueryPrograms(link.QueryOptions{Target: a.Index, Attach: at})
						if err == nil {
							fmt.Fprintf(&b, "  tcx %s rev %d %v\n", at, res.Revision, res.Programs)
						}
					}
					return nil
				})
			}
			routes, err := h.RouteListFiltered(vnl.FAMILY_ALL, &vnl.Route{Table: unix.RT_TABLE_UNSPEC}, vnl.RT_FILTER_TABLE)
			if err != nil {
				return err
			}
			for _, r := range routes {
				fmt.Fprintf(&b, "route %s\n", r)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	f, err := os.Open(tn.cgroup)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, at := range discover.SockHooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at.Type})
		if err == nil {
			fmt.Fprintf(&b, "cgroup %s %s %v\n", tn.cgroup, at.Name, res.Programs)
		}
	}
	for _, fam := range legacyFamilies {
		tables, err := legacyTables(tn.node, fam.namesFile)
		fmt.Fprintf(&b, "%s: %v %v\n", fam.namesFile, tables, err)
	}
	return b.String()
}

// wantParts is what each snapshot file must show of the test node.
func (tn *testNode) wantParts() map[string][]string {
	return map[string][]string{
		"kernel.txt":              {"kernel release:", "tcx", "netfilter links", "a note from discovery"},
		"sysctl.txt":              {"net.bridge.bridge-nf-call-iptables = ", "net.ipv4.ip_forward = 0", "net.ipv4.conf.hv0.rp_filter = ", "net.ipv4.conf.eth0.rp_filter = "},
		"cgroup-sock.txt":         {tn.cgroup, "connect4 1. prog id", "name pttest_conn4 type CGroupSockAddr"},
		"tc.txt":                  {"## host hv0", "tcx ingress (run order):", "name pttest_tcx", "## uplink up0", "clsact", "name pttest_cls", "direct-action", "name pttest_xdp type XDP", "mode xdpgeneric", "## pod eth0"},
		"nftables.txt":            {"table ip pttest-incident", "dnat", testBackend},
		"iptables-nft.txt":        {"no nftables table ip nat or ip filter: no iptables-nft tables"},
		"iptables-legacy-nat.txt": {"no legacy nat table (not read: reading would create it)"},
		"conntrack.txt":           {"dst=" + testVIP, "src=" + testBackend, "sport=5353", "1 of "},
		"bridges.txt":             {"## bridge br0", "vlan_filtering false", "port hv0", "port up0", "vlans: ", "hairpin off", "forwarding database", "dev up0 master br0"},
		"ovs.txt":                 {""},
		"net-node.txt":            {"hv0 kind veth", "br0 kind bridge", "## routes", "## neighbours"},
		"net-pod-1.txt":           {testPodIP + "/22", "default via " + testGwIP + " dev eth0", testGwIP + " dev eth0 lladdr"},
		"bpf-links.txt":           {"tcx ifindex", "name pttest_tcx", "cgroup id", "name pttest_conn4"},
	}
}

func TestSnapshotCollectsEverythingAndChangesNothing(t *testing.T) {
	tn := newTestNode(t)
	before := tn.state(t)
	dir := t.TempDir()
	opt := Options{Features: []string{"tcx", "netfilter links", "kprobes absent"},
		OwnPrograms: func() []ebpf.ProgramID { return []ebpf.ProgramID{tn.progs["tcx"]} }}
	m, err := Snapshot(context.Background(), tn.nodeInfo(), []netip.Addr{netip.MustParseAddr(testVIP)}, dir, opt)
	if err != nil {
		t.Fatal(err)
	}
	if after := tn.state(t); after != before {
		t.Errorf("the snapshot changed the node:\n--- before\n%s\n--- after\n%s", before, after)
	}
	for _, n := range m.Notes {
		t.Logf("note: %s", n)
	}

	want := tn.wantParts()
	listed := map[string]File{}
	for _, f := range m.Files {
		listed[f.Name] = f
	}
	for name, parts := range want {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if f, ok := listed[name]; !ok || f.Bytes != int64(len(b)) || f.Holds == "" || len(b) == 0 {
			t.Errorf("%s: manifest entry %+v, file has %d bytes", name, f, len(b))
		}
		for _, p := range parts {
			if !strings.Contains(string(b), p) {
				t.Errorf("%s lacks %q:\n%s", name, p, b)
			}
		}
	}
	if len(m.Files) != len(want) {
		t.Errorf("manifest lists %d files, want %d: %+v", len(m.Files), len(want), m.Files)
	}
	if tc, _ := os.ReadFile(filepath.Join(dir, "tc.txt")); !strings.Contains(string(tc), fmt.Sprintf("prog id %d (pathtrace's own observer)", tn.progs["tcx"])) {
		t.Errorf("tc.txt does not mark pathtrace's own program:\n%s", tc)
	}
	got, err := ReadManifest(dir)
	if err != nil || !slices.Equal(got.Files, m.Files) {
		t.Errorf("manifest.json: %v %+v", err, got)
	}
	if mt, err := os.ReadFile(filepath.Join(dir, ManifestText)); err != nil || !strings.Contains(string(mt), "nftables.txt") {
		t.Errorf("MANIFEST.txt: %v\n%s", err, mt)
	}
}

// TestSnapshotTCFilterRewrites: tc.txt says what the actions of a tc
// filter that is not BPF rewrite (an act_nat here), which netlink does not
// decode. Skipped on a kernel without act_nat.
func TestSnapshotTCFilterRewrites(t *testing.T) {
	tn := newTestNode(t)
	node := filepath.Base(tn.node)
	for _, args := range [][]string{
		{"qdisc", "add", "dev", "hv0", "clsact"},
		{"filter", "add", "dev", "hv0", "ingress", "pref", "10", "protocol", "ip", "u32", "match", "ip", "dst", testVIP + "/32",
			"action", "nat", "ingress", testVIP + "/32", testBackend},
	} {
		out, err := exec.Command("tc", append([]string{"-n", node}, args...)...).CombinedOutput()
		if err != nil && strings.Contains(string(out), "Failed to load TC action module") {
			t.Skipf("this kernel has no act_nat (CONFIG_NET_ACT_NAT): %s", out)
		}
		if err != nil {
			t.Fatalf("tc %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	dir := t.TempDir()
	if _, err := Snapshot(context.Background(), tn.nodeInfo(), []netip.Addr{netip.MustParseAddr(testVIP)}, dir, Options{}); err != nil {
		t.Fatal(err)
	}
	tc, err := os.ReadFile(filepath.Join(dir, "tc.txt"))
	if want := "u32 pref 10 rewrites: nat ingress " + testVIP + "/32 -> " + testBackend; err != nil || !strings.Contains(string(tc), want) {
		t.Errorf("tc.txt lacks %q (%v):\n%s", want, err, tc)
	}
}

// TestSnapshotReadsExistingLegacyNAT creates the legacy nat and filter
// tables the way a kube-proxy in iptables-legacy mode would, and expects
// their rules, without the snapshot creating any other legacy table.
func TestSnapshotReadsExistingLegacyNAT(t *testing.T) {
	tn := newTestNode(t)
	legacy, err := exec.LookPath("iptables-legacy")
	if err != nil {
		t.Skip("iptables-legacy is not installed")
	}
	if _, err := exec.LookPath("iptables-legacy-save"); err != nil {
		t.Skip("iptables-legacy-save is not installed")
	}
	err = nsutil.Do(tn.node, func() error {
		for _, rule := range [][]string{
			{"-t", "nat", "-A", "PREROUTING", "-d", "10.120.0.81/32", "-p", "tcp", "-j", "DNAT", "--to-destination", "10.244.20.32:3000"},
			{"-t", "filter", "-A", "OUTPUT", "-d", "10.120.0.82/32", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"},
		} {
			if out, err := exec.Command(legacy, rule...).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
		}
		return nil
	})
	if err != nil {
		t.Skipf("cannot create a legacy nat table here: %v", err)
	}
	before := tn.state(t)
	dir := t.TempDir()
	if _, err := Snapshot(context.Background(), tn.nodeInfo(), nil, dir, Options{}); err != nil {
		t.Fatal(err)
	}
	if after := tn.state(t); after != before {
		t.Errorf("the snapshot changed the node:\n--- before\n%s\n--- after\n%s", before, after)
	}
	b, err := os.ReadFile(filepath.Join(dir, "iptables-legacy-nat.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"existing legacy tables: ", "*nat", "--to-destination 10.244.20.32:3000", "*filter", "-d 10.120.0.82/32"} {
		if !strings.Contains(string(b), p) {
			t.Errorf("iptables-legacy-nat.txt lacks %q:\n%s", p, b)
		}
	}
}

// TestSnapshotReadsIPTablesNFT creates the nat and filter tables the way a
// kube-proxy in iptables mode writes them through iptables-nft (xtables
// comments, DNAT and REJECT targets inside nftables), and expects them as
// iptables-nft-save prints them, without the snapshot changing the ruleset.
func TestSnapshotReadsIPTablesNFT(t *testing.T) {
	tn := newTestNode(t)
	ipt, err := exec.LookPath("iptables-nft")
	if err != nil {
		t.Skip("iptables-nft is not installed")
	}
	if _, err := exec.LookPath("iptables-nft-save"); err != nil {
		t.Skip("iptables-nft-save is not installed")
	}
	err = nsutil.Do(tn.node, func() error {
		for _, rule := range [][]string{
			{"-t", "nat", "-N", "KUBE-SEP-WEB"},
			{"-t", "nat", "-A", "PREROUTING", "-d", "10.120.0.81/32", "-p", "tcp", "-m", "comment", "--comment", "default/web:http cluster IP", "-m", "tcp", "--dport", "80", "-j", "KUBE-SEP-WEB"},
			{"-t", "nat", "-A", "KUBE-SEP-WEB", "-p", "tcp", "-m", "comment", "--comment", "default/web:http", "-m", "tcp", "-j", "DNAT", "--to-destination", "10.244.20.32:3000"},
			{"-t", "filter", "-A", "OUTPUT", "-d", "10.120.0.82/32", "-p", "tcp", "-m", "comment", "--comment", "default/empty:http has no endpoints", "-j", "REJECT", "--reject-with", "icmp-port-unreachable"},
		} {
			if out, err := exec.Command(ipt, rule...).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
		}
		return nil
	})
	if err != nil {
		t.Skipf("cannot create iptables-nft tables here: %v", err)
	}
	before := tn.state(t)
	dir := t.TempDir()
	m, err := Snapshot(context.Background(), tn.nodeInfo(), []netip.Addr{netip.MustParseAddr("10.120.0.81")}, dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if after := tn.state(t); after != before {
		t.Errorf("the snapshot changed the node:\n--- before\n%s\n--- after\n%s", before, after)
	}
	b, err := os.ReadFile(filepath.Join(dir, "iptables-nft.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"## iptables-nft-save -t nat, -t filter", "*nat",
		`-A KUBE-SEP-WEB -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.20.32:3000`,
		"*filter", `--comment "default/empty:http has no endpoints" -j REJECT --reject-with icmp-port-unreachable`,
		"no nftables table ip6 nat or ip6 filter"} {
		if !strings.Contains(string(b), p) {
			t.Errorf("iptables-nft.txt lacks %q:\n%s", p, b)
		}
	}
	if !slices.ContainsFunc(m.Files, func(f File) bool { return f.Name == "iptables-nft.txt" && f.Bytes == int64(len(b)) }) {
		t.Errorf("the manifest does not list iptables-nft.txt: %+v", m.Files)
	}
}

// TestSnapshotBounds cuts files at their cap with a marker and stops
// collecting when the snapshot's budget is used up, saying so. The caps are
// taken from what an unbounded snapshot of the test node holds (the node's
// cgroup programs and BPF links vary with what else runs on the machine), so
// that a file is longer than the cap and the files longer than the budget.
func TestSnapshotBounds(t *testing.T) {
	tn := newTestNode(t)
	vips := []netip.Addr{netip.MustParseAddr(testVIP)}
	full, err := Snapshot(context.Background(), tn.nodeInfo(), vips, t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	var largest, sum int64
	for _, f := range full.Files {
		largest = max(largest, f.Bytes)
		sum += f.Bytes
	}
	if largest <= minFileBytes+1 {
		t.Fatalf("no snapshot file is longer than %d bytes to cut: %+v", minFileBytes, full.Files)
	}

	// A cap below the longest file, a budget that holds everything.
	fileCap := max(minFileBytes, largest/2)
	dir := t.TempDir()
	m, err := Snapshot(context.Background(), tn.nodeInfo(), vips, dir, Options{MaxFileBytes: fileCap, MaxBytes: 4 * sum})
	if err != nil {
		t.Fatal(err)
	}
	cut := 0
	for _, f := range m.Files {
		st, err := os.Stat(filepath.Join(dir, f.Name))
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > fileCap {
			t.Errorf("%s: %d bytes, cap %d", f.Name, st.Size(), fileCap)
		}
		if f.Truncated {
			cut++
			b, _ := os.ReadFile(filepath.Join(dir, f.Name))
			if !strings.Contains(string(b), "[pathtrace: truncated here:") {
				t.Errorf("%s is cut without a marker:\n%s", f.Name, b)
			}
		}
	}
	if cut == 0 {
		t.Errorf("no file was cut at %d bytes: %+v", fileCap, m.Files)
	}

	// A budget of half of what the files hold.
	total := max(sum/2, 2*minFileBytes)
	dir = t.TempDir()
	m, err = Snapshot(context.Background(), tn.nodeInfo(), vips, dir, Options{MaxBytes: total})
	if err != nil {
		t.Fatal(err)
	}
	var held int64
	for _, f := range m.Files {
		st, err := os.Stat(filepath.Join(dir, f.Name))
		if err != nil {
			t.Fatal(err)
		}
		held += st.Size()
	}
	if held > total {
		t.Errorf("snapshot files hold %d bytes, budget %d", held, total)
	}
	if !slices.ContainsFunc(m.Notes, func(n string) bool { return strings.Contains(n, "byte budget") }) {
		t.Errorf("no note says the budget of %d bytes (of %d) ran out: %q", total, sum, m.Notes)
	}
}

// An nft that does not finish in its share of the collector's time (as on
// a node with tens of thousands of kube-proxy chains) gives way to the
// rendering from netlink narrowed to the traced Services, within the
// collector's time: the file holds their rules, not "not collected".
func TestNFTablesOverrunNarrowed(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and nftables rules")
	}
	name := fmt.Sprintf("pttest-nftslow-%06x", rand.IntN(1<<24))
	ipCmd(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	tn := &testNode{node: "/run/netns/" + name}
	tn.addDNAT(t)
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "nft"), []byte("#!/bin/sh\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{{Source: discover.SourceNFTables, Table: "ip pttest-incident", Chains: []string{"prerouting"}}}
	s := &snapshot{node: node, hostPath: tn.node, vips: []netip.Addr{netip.MustParseAddr(testVIP)}, opt: Options{CollectorTimeout: 3 * time.Second}}
	body, notes, _ := s.run(context.Background(), topic{"nftables.txt", "", s.nftables}, 1<<20)
	for _, want := range []string{
		"# nft did not finish in its share of the collector's time",
		"written narrowed to the traced Services (" + testVIP + ")",
		"table ip pttest-incident {\n\tchain prerouting { # type nat hook prerouting priority -100",
		"cmp reg 1 == 0x0a780050 (" + testVIP + ")",
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("missing %q in:\n%s", want, body)
		}
	}
	if len(notes) != 1 || !strings.Contains(notes[0], "overran its time") {
		t.Errorf("notes %q, want the overrun", notes)
	}
}

// An iptables-nft-save that does not finish in its share of the
// collector's time (a nat table of thousands of Services) is cut where it
// got to, said so, within the collector's time: not the whole file lost,
// also when a child of it holds its output open after the kill (runCommand
// waits commandWaitDelay for it) on a loaded machine.
func TestIPTablesNFTOverrunCut(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and nftables tables")
	}
	name := fmt.Sprintf("pttest-iptnftslow-%06x", rand.IntN(1<<24))
	ipCmd(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	conn := nftIn(t, "/run/netns/"+name)
	conn.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "nat"})
	if err := conn.Flush(); err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	child := filepath.Join(bin, "child.pid")
	slow := "#!/bin/sh\necho '*nat'\necho '-A KUBE-SERVICES -d 10.120.0.80/32 -j KUBE-SVC-WEB'\nsleep 30 &\necho $! >" + child + "\nexec sleep 30\n"
	if err := os.WriteFile(filepath.Join(bin, "iptables-nft-save"), []byte(slow), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if b, err := os.ReadFile(child); err == nil {
			exec.Command("kill", strings.TrimSpace(string(b))).Run()
		}
	})
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))
	s := &snapshot{node: &discover.NodeInfo{}, hostPath: "/run/netns/" + name, opt: Options{CollectorTimeout: 2 * time.Second}}
	body, notes, _ := s.run(context.Background(), topic{"iptables-nft.txt", "", s.iptablesNFT}, 1<<20)
	for _, want := range []string{"-A KUBE-SERVICES -d 10.120.0.80/32 -j KUBE-SVC-WEB", "-t nat did not finish in its share of the collector's time"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("missing %q in:\n%s", want, body)
		}
	}
	if len(notes) != 1 || !strings.Contains(notes[0], "overran its time") {
		t.Errorf("notes %q, want the overrun", notes)
	}
}

// The rendering from netlink says a verdict map's data type is verdict
// and not its key's: kube-proxy's service-ips map, as google/nftables
// reads it, lost its key type to its data type.
func TestRenderVerdictMapType(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and nftables rules")
	}
	name := fmt.Sprintf("pttest-vmap-%06x", rand.IntN(1<<24))
	ipCmd(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(`table ip pttest-vmap {
	map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; elements = { 10.96.0.80 . tcp . 80 : goto svc } }
	map addrs { type ipv4_addr : ipv4_addr; elements = { 10.96.0.80 : 10.244.20.31 } }
	chain svc { }
}
`)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	conn := nftIn(t, "/run/netns/"+name)
	var b strings.Builder
	if err := renderRuleset(&b, conn, nil, nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"map service-ips { type ? : verdict;", "map addrs { type ipv4_addr : ipv4_addr;"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("missing %q in:\n%s", want, b.String())
		}
	}
}

// nftIn talks nftables netlink in the netns at path for the rest of the test.
func nftIn(t *testing.T, path string) nftConn {
	t.Helper()
	conn, done, err := openNFTables(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { done() })
	return conn
}

// googleNFT lists rules and set elements as the rendering did before it
// streamed them: with google/nftables' GetRules and GetSetElements, a
// whole chain or set at once.
type googleNFT struct{ nftConn }

func (g googleNFT) Rules(t *nftables.Table, c *nftables.Chain, fn func(uint64, []expr.Any) error) error {
	rules, err := g.GetRules(t, c)
	for _, r := range rules {
		if err := fn(r.Handle, r.Exprs); err != nil {
			return err
		}
	}
	return err
}

func (g googleNFT) SetElements(s *nftables.Set, fn func(nftables.SetElement) error) error {
	elems, err := g.GetSetElements(s)
	for _, e := range elems {
		if err := fn(e); err != nil {
			return err
		}
	}
	return err
}

// nftNetns makes a netns for the rest of the test and loads ruleset
// there with nft.
func nftNetns(t *testing.T, prefix, ruleset string) string {
	t.Helper()
	name := fmt.Sprintf("pttest-%s-%06x", prefix, rand.IntN(1<<24))
	ipCmd(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(ruleset)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	return "/run/netns/" + name
}

// Rules and set elements rendered as they are read write what
// google/nftables' GetRules and GetSetElements gave, byte for byte: rules
// of every kind of expression, iptables-nft's xtables ones, long chains;
// sets, interval sets, maps, verdict maps with concatenated keys, a rule's
// anonymous sets; whole and narrowed.
func TestRenderAsGoogleNFTables(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and nftables rules")
	}
	var long, rules []string
	for i := range 300 {
		long = append(long, fmt.Sprintf("10.96.%d.%d . tcp . 80 : goto svc", i/250, i%250+1))
		rules = append(rules, fmt.Sprintf("\t\tip daddr 10.96.%d.%d tcp dport 80 counter goto ep2", i/250, i%250+1))
	}
	path := nftNetns(t, "render", `table ip pttest-sets {
	set addrs { type ipv4_addr; elements = { 10.96.0.1, 10.120.0.80 } }
	set nets { type ipv4_addr; flags interval; elements = { 10.244.0.0/16, 192.168.1.1-192.168.1.9 } }
	set empty { type ipv4_addr; }
	set seen { type ipv4_addr; flags dynamic,timeout; timeout 1h; elements = { 10.0.0.1 timeout 1h } }
	map backends { type ipv4_addr : ipv4_addr; elements = { 10.120.0.80 : 10.244.20.31 } }
	map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; elements = { 10.120.0.80 . tcp . 80 : goto svc, `+strings.Join(long, ", ")+` } }
	chain svc {
		numgen random mod 2 vmap { 0 : goto ep1, 1 : goto ep2 }
	}
	chain ep1 {
		ip daddr { 10.120.0.80, 10.120.0.81 } meta l4proto tcp dnat to 10.244.20.31:3000
	}
	chain ep2 {
		meta l4proto tcp dnat to 10.244.20.32:3000
	}
	chain services {
		ip daddr 10.120.0.80 tcp dport 80 counter goto svc
`+strings.Join(rules, "\n")+`
	}
	set talkers { type ipv4_addr; flags dynamic; }
	counter hits { }
	chain kinds {
		type filter hook input priority 0; policy accept;
		ct state established,related accept
		iifname "lo" accept
		tcp dport 22 limit rate 10/second log prefix "ssh " level info accept
		tcp dport 23 quota over 10 mbytes reject with tcp reset
		udp dport 53 update @talkers { ip saddr } counter name "hits" accept
		ip saddr 10.0.0.1-10.0.0.9 fib daddr type local drop
		tcp flags syn tcp option maxseg size 1-500 drop
		meta mark set jhash ip saddr mod 4 notrack
		ct count over 10 drop
		meta l4proto icmp reject with icmp port-unreachable
	}
	chain post {
		type nat hook postrouting priority 100; policy accept;
		oifname "eth0" masquerade random
	}
	chain pre {
		type nat hook prerouting priority -100; policy accept;
		tcp dport 8080 redirect to :80
	}
}
`)
	wants := []string{"0x0a780050 (10.120.0.80) : 0x0af4141f (10.244.20.31)", "cmp reg 1 == 0x0a780050 (10.120.0.80)", "chain kinds {"}
	if _, err := exec.LookPath("iptables-nft-restore"); err == nil {
		wants = append(wants, "xt -j DNAT --to-destination 10.244.20.31:3000")
		cmd := exec.Command("ip", "netns", "exec", strings.TrimPrefix(path, "/run/netns/"), "iptables-nft-restore")
		cmd.Stdin = strings.NewReader(`*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-WEB - [0:0]
:KUBE-SEP-A - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.120.0.80/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-WEB
-A KUBE-SVC-WEB -m comment --comment "default/web:http" -m statistic --mode random --probability 0.5 -j KUBE-SEP-A
-A KUBE-SEP-A -p tcp -m comment --comment "default/web:http" -m tcp -j DNAT --to-destination 10.244.20.31:3000
-A KUBE-SEP-A -m conntrack --ctstate NEW -m addrtype --dst-type LOCAL -j MARK --set-xmark 0x4000/0x4000
COMMIT
`)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("iptables-nft-restore: %v: %s", err, out)
		}
	}
	conn := nftIn(t, path)
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{
		{Source: discover.SourceNFTables, Table: "ip pttest-sets", Chains: []string{"services", "svc"}},
		{Source: discover.SourceNFTables, Table: "ip nat", Chains: []string{"KUBE-SERVICES", "KUBE-SVC-WEB", "KUBE-SEP-A"}},
	}
	focus := newNFTFocus(node, []netip.Addr{netip.MustParseAddr(testVIP)})
	focus.always = true
	for _, f := range []*nftFocus{nil, focus} {
		var got, want strings.Builder
		if err := renderRuleset(&got, conn, f, nil); err != nil {
			t.Fatal(err)
		}
		if err := renderRuleset(&want, googleNFT{conn}, f, nil); err != nil {
			t.Fatal(err)
		}
		if got.String() != want.String() {
			t.Errorf("focus %v: rendered\n%s\nwant, as from GetSetElements:\n%s", f != nil, got.String(), want.String())
		}
		for _, want := range wants {
			if !strings.Contains(got.String(), want) {
				t.Errorf("focus %v: %q is missing:\n%s", f != nil, want, got.String())
			}
		}
	}
}

// A set of 200,000 elements (a node's blocklist) and a chain of 50,000
// rules are rendered within memory: they are written as the kernel sends
// them, not held all at once first (that took the rendering's peak RSS
// over 100 MiB for the set, to 170 MB for the chain).
func TestRenderBigWithinMemory(t *testing.T) {
	if path := os.Getenv("PTTEST_RENDER_NETNS"); path != "" {
		// The child: renders the ruleset of path, says its peak RSS.
		conn := nftIn(t, path)
		if err := renderRuleset(newTopicWriter(DefaultFileBytes), conn, nil, nil); err != nil {
			t.Fatal(err)
		}
		status, err := os.ReadFile("/proc/self/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(line, "VmHWM:") {
				fmt.Println(line)
			}
		}
		return
	}
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and nftables rules")
	}
	if raceDetector {
		// make test runs it without -race first; -race's shadow memory
		// (70 MiB where the rendering takes 23) would be measured too.
		t.Skip("-race: its memory is the race detector's as much as the rendering's; measured in the run without it")
	}
	var ruleset strings.Builder
	ruleset.WriteString("table inet pttest-blocklist {\n\tset blocked { type ipv4_addr; elements = { 0.0.0.1")
	for i := 1; i < 200_000; i++ {
		fmt.Fprintf(&ruleset, ", 10.%d.%d.%d", i>>16, i>>8&255, i&255)
	}
	ruleset.WriteString(" } }\n\tchain input {\n\t\ttype filter hook input priority 0; policy accept;\n")
	for i := range 50_000 {
		fmt.Fprintf(&ruleset, "\t\tip saddr 10.%d.%d.%d tcp dport 22 counter drop comment \"host %d\"\n", i>>16, i>>8&255, i&255, i)
	}
	ruleset.WriteString("\t}\n}\n")
	path := nftNetns(t, "big", ruleset.String())
	// A process of its own: its peak RSS is the rendering's alone.
	cmd := exec.Command(os.Args[0], "-test.run=^TestRenderBigWithinMemory$")
	cmd.Env = append(os.Environ(), "PTTEST_RENDER_NETNS="+path)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	var kb int
	if i := strings.Index(string(out), "VmHWM:"); i < 0 {
		t.Fatalf("no VmHWM in: %s", out)
	} else if _, err := fmt.Sscanf(string(out[i+len("VmHWM:"):]), "%d", &kb); err != nil {
		t.Fatal(err)
	}
	t.Logf("rendering peak RSS: %d KiB", kb)
	if kb > 48<<10 {
		t.Errorf("rendering a set of 200,000 elements and a chain of 50,000 rules took a peak RSS of %d KiB, want at most 48 MiB", kb)
	}
}
