package incident

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

func TestTopicWriterKeepsWhatFits(t *testing.T) {
	w := newTopicWriter(100)
	fmt.Fprint(w, "line one\nline two\n")
	got, cut := w.finish()
	if cut || string(got) != "line one\nline two\n" {
		t.Errorf("got %q cut %v", got, cut)
	}
}

func TestTopicWriterCutsAtLineWithMarker(t *testing.T) {
	const limit = 200
	w := newTopicWriter(limit)
	total := 0
	for i := range 100 {
		n, err := fmt.Fprintf(w, "rule %03d: something long enough\n", i)
		if err != nil || n == 0 {
			t.Fatalf("write %d: %d %v", i, n, err)
		}
		total += n
	}
	got, cut := w.finish()
	if !cut || len(got) > limit {
		t.Fatalf("cut %v, %d bytes (limit %d)", cut, len(got), limit)
	}
	body, marker, ok := strings.Cut(string(got), "[pathtrace: truncated here: ")
	if !ok {
		t.Fatalf("no marker:\n%s", got)
	}
	if !strings.HasSuffix(body, "something long enough\n") {
		t.Errorf("not cut at a line boundary:\n%s", got)
	}
	var dropped, capN int
	if _, err := fmt.Sscanf(marker, "%d more bytes not kept (cap %d bytes)]", &dropped, &capN); err != nil {
		t.Fatalf("marker %q: %v", marker, err)
	}
	if kept := len(body); kept+dropped != total || capN != limit {
		t.Errorf("kept %d + dropped %d != written %d (cap %d)", kept, dropped, total, capN)
	}
}

func TestTopicWriterCutsALongLine(t *testing.T) {
	const limit = 120
	w := newTopicWriter(limit)
	fmt.Fprint(w, strings.Repeat("x", 500))
	got, cut := w.finish()
	if !cut || len(got) > limit || !strings.Contains(string(got), "x\n[pathtrace: truncated here: ") {
		t.Errorf("cut %v, %d bytes:\n%s", cut, len(got), got)
	}
}

func TestCollectorTimeoutIsANote(t *testing.T) {
	s := &snapshot{opt: Options{CollectorTimeout: 20 * time.Millisecond}}
	release := make(chan struct{})
	defer close(release)
	stuck := topic{file: "stuck.txt", collect: func(ctx context.Context, w *topicWriter) error {
		<-release // a call that ignores its context
		return nil
	}}
	body, notes, cut := s.run(context.Background(), stuck, 1000)
	if cut || len(notes) != 1 || !strings.Contains(notes[0], "deadline exceeded") || !strings.Contains(string(body), "not collected") {
		t.Errorf("body %q notes %q cut %v", body, notes, cut)
	}

	failing := topic{file: "fail.txt", collect: func(ctx context.Context, w *topicWriter) error {
		fmt.Fprintln(w, "partial")
		return fmt.Errorf("boom")
	}}
	body, notes, _ = s.run(context.Background(), failing, 1000)
	if !strings.HasPrefix(string(body), "partial\n") || !strings.Contains(string(body), "not complete: boom") ||
		len(notes) != 1 || !strings.Contains(notes[0], "boom") {
		t.Errorf("body %q notes %q", body, notes)
	}
}

func TestSysctlPath(t *testing.T) {
	for name, want := range map[string]string{
		"net.ipv4.ip_forward":                  "/proc/sys/net/ipv4/ip_forward",
		"net.bridge.bridge-nf-call-iptables":   "/proc/sys/net/bridge/bridge-nf-call-iptables",
		"net.ipv4.conf.eth0.rp_filter":         "/proc/sys/net/ipv4/conf/eth0/rp_filter",
		"net.ipv4.conf.bond0.200.rp_filter":    "/proc/sys/net/ipv4/conf/bond0.200/rp_filter",
		"net.netfilter.nf_conntrack_count":     "/proc/sys/net/netfilter/nf_conntrack_count",
		"net.ipv4.conf.default.rp_filter":      "/proc/sys/net/ipv4/conf/default/rp_filter",
		"net.ipv6.conf.all.forwarding":         "/proc/sys/net/ipv6/conf/all/forwarding",
		"net.bridge.bridge-nf-call-ip6tables":  "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
		"net.ipv4.conf.veth-a.rp_filter":       "/proc/sys/net/ipv4/conf/veth-a/rp_filter",
		"net.ipv4.conf.lxc.1234.ab.rp_filter":  "/proc/sys/net/ipv4/conf/lxc.1234.ab/rp_filter",
		"net.netfilter.nf_conntrack_max":       "/proc/sys/net/netfilter/nf_conntrack_max",
		"net.ipv4.conf.all.rp_filter":          "/proc/sys/net/ipv4/conf/all/rp_filter",
		"net.ipv4.conf.uplink:0.rp_filter":     "/proc/sys/net/ipv4/conf/uplink:0/rp_filter",
		"net.ipv4.conf.br-pod.rp_filter":       "/proc/sys/net/ipv4/conf/br-pod/rp_filter",
		"net.ipv4.conf.ovs-system.rp_filter":   "/proc/sys/net/ipv4/conf/ovs-system/rp_filter",
		"net.ipv4.conf.cilium_host.rp_filter":  "/proc/sys/net/ipv4/conf/cilium_host/rp_filter",
		"net.ipv4.conf.eth0.100.200.rp_filter": "/proc/sys/net/ipv4/conf/eth0.100.200/rp_filter",
	} {
		if got := sysctlPath(name); got != want {
			t.Errorf("sysctlPath(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestSysctlNames(t *testing.T) {
	node := sysctlNames(true, []string{"veth-a", "bond0", "veth-a"})
	for _, want := range []string{"net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-filter-vlan-tagged", "net.ipv4.ip_forward",
		"net.ipv4.conf.all.rp_filter", "net.ipv4.conf.veth-a.rp_filter", "net.ipv4.conf.bond0.rp_filter", "net.ipv4.conf.veth-a.proxy_arp"} {
		if !containsString(node, want) {
			t.Errorf("node sysctls lack %s: %v", want, node)
		}
	}
	if n := strings.Count(strings.Join(node, " "), "veth-a.rp_filter"); n != 1 {
		t.Errorf("veth-a listed %d times: %v", n, node)
	}
	pod := sysctlNames(false, []string{"eth0"})
	if containsString(pod, "net.ipv4.ip_forward") || containsString(pod, "net.ipv4.conf.eth0.proxy_arp") || !containsString(pod, "net.ipv4.conf.eth0.rp_filter") {
		t.Errorf("pod sysctls: %v", pod)
	}
}

// fakeNFT serves a fixed ruleset: kube-proxy's nftables shape.
type fakeNFT struct {
	table *nftables.Table
	chain []*nftables.Chain
	rules map[string][]*nftables.Rule
	elems []nftables.SetElement // of service-ips; nil: one, 10.120.0.80
	anon  []string              // anonymous sets (a rule's inline map), after service-ips
}

func (f fakeNFT) ListTables() ([]*nftables.Table, error) { return []*nftables.Table{f.table}, nil }
func (f fakeNFT) ListChains() ([]*nftables.Chain, error) { return f.chain, nil }
func (f fakeNFT) Rules(_ *nftables.Table, c *nftables.Chain, fn func(uint64, []expr.Any) error) error {
	for _, r := range f.rules[c.Name] {
		if err := fn(r.Handle, r.Exprs); err != nil {
			return err
		}
	}
	return nil
}
func (f fakeNFT) GetSets(t *nftables.Table) ([]*nftables.Set, error) {
	sets := []*nftables.Set{{Table: t, Name: "service-ips", KeyType: nftables.TypeIPAddr}}
	for _, name := range f.anon {
		sets = append(sets, &nftables.Set{Table: t, Name: name, Anonymous: true, KeyType: nftables.TypeInteger})
	}
	return sets, nil
}
func (f fakeNFT) SetElements(s *nftables.Set, fn func(nftables.SetElement) error) error {
	elems := f.elems
	switch {
	case s.Anonymous:
		elems = []nftables.SetElement{{Key: []byte{0, 0, 0, 0}}}
	case elems == nil:
		elems = []nftables.SetElement{{Key: []byte{10, 120, 0, 80}, VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: "svc-web"}}}
	}
	for _, e := range elems {
		if err := fn(e); err != nil {
			return err
		}
	}
	return nil
}

func TestRenderRuleset(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kube-proxy"}
	prio := nftables.ChainPriority(-100)
	policy := nftables.ChainPolicyAccept
	nat := &nftables.Chain{Name: "nat-prerouting", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: &prio, Policy: &policy}
	svc := &nftables.Chain{Name: "svc-web", Table: table}
	f := fakeNFT{table: table, chain: []*nftables.Chain{nat, svc}, rules: map[string][]*nftables.Rule{
		"nat-prerouting": {{Handle: 3, Exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Lookup{SourceRegister: 1, SetName: "service-ips"},
			&expr.Verdict{Kind: expr.VerdictJump, Chain: "svc-web"},
		}}},
		"svc-web": {{Handle: 7, Exprs: []expr.Any{
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0, 80}},
			&expr.Counter{Packets: 3, Bytes: 180},
			&expr.Immediate{Register: 1, Data: []byte{10, 244, 20, 31}},
			&expr.Immediate{Register: 2, Data: []byte{0x0b, 0xb8}},
			&expr.NAT{Type: expr.NATTypeDestNAT, RegAddrMin: 1, RegProtoMin: 2},
			&expr.Masq{},
		}}},
	}}
	var b strings.Builder
	if err := renderRuleset(&b, f, nil, nil); err != nil {
		t.Fatal(err)
	}
	want := `table ip kube-proxy {
	set service-ips { type ipv4_addr; elements = { 0x0a780050 (10.120.0.80) : goto svc-web } }
	chain nat-prerouting { # type nat hook prerouting priority -100 policy accept
		payload network header +16 len 4 => reg 1; lookup reg 1 in @service-ips; jump svc-web # handle 3
	}
	chain svc-web {
		meta l4proto => reg 1; cmp reg 1 == 0x06; payload transport header +2 len 2 => reg 1; cmp reg 1 == 0x0050 (80); counter packets 3 bytes 180; immediate 0x0af4141f (10.244.20.31) => reg 1; immediate 0x0bb8 (3000) => reg 2; dnat addr reg 1 port reg 2; masq {Random:false FullyRandom:false Persistent:false ToPorts:false RegProtoMin:0 RegProtoMax:0} # handle 7
	}
}
`
	if b.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", b.String(), want)
	}
}

// iptables-nft's rules (kube-proxy's iptables mode on most nodes) are
// xtables extensions inside nftables: the rendering spells them as
// iptables-save does, so that the Service in a comment, the endpoint of a
// DNAT and an endpoint's weight can be read, and never prints a pointer.
func TestRenderXTExtensions(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "nat"}
	svc := &nftables.Chain{Name: "KUBE-SVC-WEB", Table: table}
	sep := &nftables.Chain{Name: "KUBE-SEP-1", Table: table}
	comment := xt.Comment("default/web:http")
	stat := make(xt.Unknown, 24) // struct xt_statistic_info: random, probability 0.5 of 2^31
	binary.NativeEndian.PutUint32(stat[4:], 0x40000000)
	mark := make(xt.Unknown, 8)
	binary.NativeEndian.PutUint32(mark[0:], 0x4000)
	binary.NativeEndian.PutUint32(mark[4:], 0x4000)
	reject := make(xt.Unknown, 8)
	binary.NativeEndian.PutUint32(reject, 3) // IPT_ICMP_PORT_UNREACHABLE
	f := fakeNFT{table: table, chain: []*nftables.Chain{svc, sep}, rules: map[string][]*nftables.Rule{
		"KUBE-SVC-WEB": {{Handle: 7, Exprs: []expr.Any{
			&expr.Match{Name: "comment", Info: &comment},
			&expr.Match{Name: "statistic", Info: &stat},
			&expr.Verdict{Kind: expr.VerdictJump, Chain: "KUBE-SEP-1"},
		}}},
		"KUBE-SEP-1": {
			{Handle: 8, Exprs: []expr.Any{
				&expr.Match{Name: "comment", Info: &comment},
				&expr.Match{Name: "tcp", Info: &xt.Tcp{SrcPorts: [2]uint16{0, 0xffff}, DstPorts: [2]uint16{0, 0xffff}}},
				&expr.Target{Name: "DNAT", Rev: 2, Info: &xt.NatRange2{NatRange: xt.NatRange{
					Flags: uint(xt.NatRangeMapIPs | xt.NatRangeProtoSpecified), MinIP: net.ParseIP("10.244.20.31"), MaxIP: net.ParseIP("10.244.20.31"),
					MinPort: 3000, MaxPort: 3000}}},
			}},
			{Handle: 9, Exprs: []expr.Any{
				&expr.Match{Name: "addrtype", Rev: 1, Info: &xt.AddrTypeV1{Dest: uint16(xt.AddrTypeLocal)}},
				&expr.Match{Name: "udp", Info: &xt.Udp{SrcPorts: [2]uint16{0, 0xffff}, DstPorts: [2]uint16{30000, 30100}}},
				&expr.Target{Name: "MARK", Rev: 2, Info: &mark},
			}},
			{Handle: 10, Exprs: []expr.Any{
				&expr.Target{Name: "REJECT", Info: &reject},
			}},
			{Handle: 11, Exprs: []expr.Any{
				&expr.Match{Name: "physdev", Info: &xt.Unknown{1, 2}},
			}},
		},
	}}
	var b strings.Builder
	if err := renderRuleset(&b, f, nil, nil); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`xt -m comment --comment "default/web:http"; xt -m statistic --mode random --probability 0.50000000000; jump KUBE-SEP-1 # handle 7`,
		`xt -m comment --comment "default/web:http"; xt -m tcp; xt -j DNAT --to-destination 10.244.20.31:3000 # handle 8`,
		`xt -m addrtype --dst-type LOCAL; xt -m udp --dport 30000:30100; xt -j MARK --set-xmark 0x4000/0x4000 # handle 9`,
		`xt -j REJECT --reject-with icmp-port-unreachable # handle 10`,
		`xt -m physdev (revision 0, not decoded: 0102) # handle 11`,
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("missing %q in:\n%s", want, b.String())
		}
	}
	if strings.Contains(b.String(), "0xc0") {
		t.Errorf("a pointer in:\n%s", b.String())
	}
}

// A netdev chain's header names its hook and its devices, which netlink's
// listing leaves out and discovery read (chainDevices).
func TestRenderNetdevChain(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyNetdev, Name: "lb"}
	prio := nftables.ChainPriority(-500)
	in := &nftables.Chain{Name: "in", Table: table, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookIngress, Priority: &prio}
	f := fakeNFT{table: table, chain: []*nftables.Chain{in}, rules: map[string][]*nftables.Rule{}}
	node := &discover.NodeInfo{Netfilter: discover.Netfilter{DeviceChains: []discover.DeviceChain{
		{Family: "netdev", Table: "lb", Chain: "in", Hook: "ingress", Devices: []string{"veth-a"}, Priority: -500}}}}
	var b strings.Builder
	if err := renderRuleset(&b, f, nil, chainDevices(node)); err != nil {
		t.Fatal(err)
	}
	if want := "chain in { # type filter hook ingress devices veth-a priority -500\n"; !strings.Contains(b.String(), want) {
		t.Errorf("got:\n%s\nwant a line %q", b.String(), want)
	}
}

// A big cluster's ruleset narrowed to the traced Service: its chains and
// the base chain whole, its element of the verdict map and its rule of a
// long chain, the rest counted.
func TestRenderRulesetFocused(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kube-proxy"}
	prio := nftables.ChainPriority(-100)
	nat := &nftables.Chain{Name: "nat-prerouting", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: &prio}
	f := fakeNFT{table: table, chain: []*nftables.Chain{nat}, rules: map[string][]*nftables.Rule{
		"nat-prerouting": {{Handle: 1, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: "services"}}}},
	}}
	svcs := &nftables.Chain{Name: "services", Table: table}
	f.chain = append(f.chain, svcs)
	for i := range 3000 {
		vip := []byte{10, 96, byte(i >> 8), byte(i)}
		name := fmt.Sprintf("svc-%d", i)
		f.chain = append(f.chain, &nftables.Chain{Name: name, Table: table})
		f.rules["services"] = append(f.rules["services"], &nftables.Rule{Handle: uint64(10 + i), Exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: vip},
			&expr.Verdict{Kind: expr.VerdictGoto, Chain: name},
		}})
		f.rules[name] = []*nftables.Rule{{Handle: uint64(5000 + i), Exprs: []expr.Any{
			&expr.Lookup{SourceRegister: 1, SetName: fmt.Sprintf("__map%d", i)}}}}
		f.anon = append(f.anon, fmt.Sprintf("__map%d", i))
		f.elems = append(f.elems, nftables.SetElement{Key: append(vip, 0, 0, 0, 6),
			VerdictData: &expr.Verdict{Kind: expr.VerdictGoto, Chain: name}})
	}
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{{Source: discover.SourceNFTables, Table: "ip kube-proxy",
		Chains: []string{"nat-prerouting", "services", "svc-7"}}}
	var b strings.Builder
	if err := renderRuleset(&b, f, newNFTFocus(node, []netip.Addr{netip.MustParseAddr("10.96.0.7")}), nil); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"# 3002 chains: written narrowed to the traced Services (10.96.0.7)",
		"elements = { 0x0a60000700000006 : goto svc-7 } } # 2999 more elements, naming no traced VIP nor leading to their chains, not written",
		"\tchain nat-prerouting { # type nat hook prerouting priority -100\n\t\tjump services # handle 1\n",
		"cmp reg 1 == 0x0a600007 (10.96.0.7); goto svc-7 # handle 17\n\t\t# 2999 more rules, naming no traced VIP nor leading to their chains, not written\n",
		"\tchain svc-7 {\n\t\tlookup reg 1 in @__map7 # handle 5007\n\t}\n",
		"\tset __map7 { type integer; elements = { 0x00000000 (0.0.0.0) } }\n\t# 2999 more anonymous sets, of rules not written, not written\n",
		"\t# 2999 more chains, on no traced Service's path, not written\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%.3000s", want, out)
		}
	}
	if strings.Count(out, "\n") > 20 {
		t.Errorf("%d lines, want the narrowed few:\n%.3000s", strings.Count(out, "\n"), out)
	}

	// A small ruleset is written whole even with a focus.
	b.Reset()
	small := fakeNFT{table: table, chain: f.chain[:5], rules: f.rules, elems: f.elems[:3], anon: f.anon[:3]}
	if err := renderRuleset(&b, small, newNFTFocus(node, []netip.Addr{netip.MustParseAddr("10.96.0.7")}), nil); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "narrowed") || !strings.Contains(b.String(), "chain svc-0 {") || !strings.Contains(b.String(), "set __map2 {") {
		t.Errorf("small ruleset not written whole:\n%s", b.String())
	}
}

// A whole rendering (a ruleset of few chains) whose set is longer than
// the file keeps (a blocklist, one line), or a chain, is narrowed from
// where it outgrows half the file: the traced Service's element and chains after it are
// kept, what is left out counted, not cut whole at the file's last newline.
func TestRenderLongSetLeavesRoom(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kube-proxy"}
	prio := nftables.ChainPriority(-100)
	nat := &nftables.Chain{Name: "nat-prerouting", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: &prio}
	svc := &nftables.Chain{Name: "svc-web", Table: table}
	other := &nftables.Chain{Name: "other", Table: table}
	f := fakeNFT{table: table, chain: []*nftables.Chain{nat, svc, other}, rules: map[string][]*nftables.Rule{
		"nat-prerouting": {{Handle: 3, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: "svc-web"}}}},
		"svc-web":        {{Handle: 7, Exprs: []expr.Any{&expr.Immediate{Register: 1, Data: []byte{10, 244, 20, 31}}}}},
	}}
	for i := range 20_000 {
		f.elems = append(f.elems, nftables.SetElement{Key: []byte{10, byte(i >> 16), byte(i >> 8), byte(i)}})
		if i == 15_000 {
			f.elems = append(f.elems, nftables.SetElement{Key: []byte{10, 120, 0, 80}})
		}
	}
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{{Source: discover.SourceNFTables, Table: "ip kube-proxy",
		Chains: []string{"nat-prerouting", "svc-web"}}}
	focus := newNFTFocus(node, []netip.Addr{netip.MustParseAddr("10.120.0.80")})
	const limit = 64 << 10
	w := newTopicWriter(limit)
	focus.room = limit
	if err := renderRuleset(w, f, focus, nil); err != nil {
		t.Fatal(err)
	}
	// fits says whether w's file holds every want, whole.
	fits := func(w *topicWriter, wants ...string) {
		t.Helper()
		got, cut := w.finish()
		out := string(got)
		for _, want := range wants {
			if !strings.Contains(out, want) {
				t.Errorf("missing %q in:\n%.600s\n...\n%s", want, out, out[max(len(out)-600, 0):])
			}
		}
		if cut || len(got) > limit {
			t.Errorf("cut %v, %d bytes (limit %d)", cut, len(got), limit)
		}
	}
	fits(w,
		"\tset service-ips { type ipv4_addr; elements = { 0x0a000000 (10.0.0.0), 0x0a000001 (10.0.0.1),",
		", 0x0a780050 (10.120.0.80) } } # ",
		" more elements, naming no traced VIP nor leading to their chains, not written\n",
		"\tchain nat-prerouting { # type nat hook prerouting priority -100\n\t\tjump svc-web # handle 3\n\t}\n",
		"\tchain svc-web {\n\t\timmediate 0x0af4141f (10.244.20.31) => reg 1 # handle 7\n\t}\n",
		"\t# 1 more chains, on no traced Service's path, not written\n",
		"# written whole up to 32768 bytes, half of what this file keeps: narrowed from there on to the traced Services (10.120.0.80)",
	)

	// So is a long chain, from the rule at which the rendering outgrows
	// half its file.
	filterPrio := nftables.ChainPriority(0)
	input := &nftables.Chain{Name: "input", Table: table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: &filterPrio}
	long := fakeNFT{table: table, chain: []*nftables.Chain{input, nat, svc}, rules: map[string][]*nftables.Rule{
		"nat-prerouting": f.rules["nat-prerouting"], "svc-web": f.rules["svc-web"]}}
	for i := range 5000 {
		long.rules["input"] = append(long.rules["input"], &nftables.Rule{Handle: uint64(100 + i), Exprs: []expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{10, 100, byte(i >> 8), byte(i)}},
			&expr.Verdict{Kind: expr.VerdictDrop},
		}})
	}
	w = newTopicWriter(limit)
	if err := renderRuleset(w, long, focus, nil); err != nil {
		t.Fatal(err)
	}
	fits(w,
		"\tchain input { # type filter hook input priority 0\n\t\tpayload network header +12 len 4 => reg 1; cmp reg 1 == 0x0a640000 (10.100.0.0); drop # handle 100\n",
		" more rules, naming no traced VIP nor leading to their chains, not written\n\t}\n\tchain nat-prerouting {",
		"\tchain svc-web {\n",
	)

	// A ruleset within half its file is written as without a bound.
	small := fakeNFT{table: table, chain: f.chain, rules: f.rules}
	var whole strings.Builder
	if err := renderRuleset(&whole, small, nil, nil); err != nil {
		t.Fatal(err)
	}
	w = newTopicWriter(limit)
	if err := renderRuleset(w, small, focus, nil); err != nil {
		t.Fatal(err)
	}
	if got, _ := w.finish(); string(got) != whole.String() {
		t.Errorf("got:\n%s\nwant:\n%s", got, whole.String())
	}
}

// failingLists gives n rules of each chain and n elements of each set,
// then fails the listing.
type failingLists struct {
	fakeNFT
	n int
}

func (f failingLists) Rules(_ *nftables.Table, c *nftables.Chain, fn func(uint64, []expr.Any) error) error {
	for _, r := range f.rules[c.Name][:f.n] {
		if err := fn(r.Handle, r.Exprs); err != nil {
			return err
		}
	}
	return errors.New("no buffer space available")
}

func (f failingLists) SetElements(_ *nftables.Set, fn func(nftables.SetElement) error) error {
	for _, e := range f.elems[:f.n] {
		if err := fn(e); err != nil {
			return err
		}
	}
	return errors.New("no buffer space available")
}

// A chain or set whose listing fails says so: not read at all, or after
// the rules or elements already written.
func TestRenderListingsNotAllRead(t *testing.T) {
	table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kube-proxy"}
	f := fakeNFT{table: table, chain: []*nftables.Chain{{Name: "services", Table: table}}, rules: map[string][]*nftables.Rule{"services": {
		{Handle: 1, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: "svc-a"}}},
		{Handle: 2, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: "svc-b"}}},
	}}, elems: []nftables.SetElement{{Key: []byte{10, 96, 0, 1}}, {Key: []byte{10, 96, 0, 2}}}}
	for n, wants := range [][]string{{
		"\tset service-ips { type ipv4_addr } # elements not read: no buffer space available\n",
		"\tchain services {\n\t\t# rules not read: no buffer space available\n\t}\n",
	}, {
		"\tset service-ips { type ipv4_addr; elements = { 0x0a600001 (10.96.0.1) } } # the elements after these not read: no buffer space available\n",
		"\tchain services {\n\t\tgoto svc-a # handle 1\n\t\t# the rules after these not read: no buffer space available\n\t}\n",
	}} {
		var b strings.Builder
		if err := renderRuleset(&b, failingLists{f, n}, nil, nil); err != nil {
			t.Fatal(err)
		}
		for _, want := range wants {
			if !strings.Contains(b.String(), want) {
				t.Errorf("%d read: got:\n%s\nwant %q", n, b.String(), want)
			}
		}
	}
}

func TestTopicsCoverEveryPodUpToTheBound(t *testing.T) {
	node := &discover.NodeInfo{}
	for i := range maxPodNetNS + 3 {
		node.Pods = append(node.Pods, discover.Pod{NetNS: discover.NetNS{Path: fmt.Sprintf("/run/netns/p%d", i)}})
	}
	s := &snapshot{node: node, hostPath: "/proc/self/ns/net"}
	pods := 0
	for _, tp := range s.topics() {
		if strings.HasPrefix(tp.file, "net-pod-") {
			pods++
		}
	}
	if pods != maxPodNetNS {
		t.Errorf("%d pod files, want %d", pods, maxPodNetNS)
	}
}

func TestSplitBudget(t *testing.T) {
	for _, c := range []struct{ max, snap int64 }{{1 << 20, 1 << 18}, {1 << 30, DefaultSnapshotBytes}} {
		snap, rest := SplitBudget(c.max)
		if snap != c.snap || snap+rest != c.max {
			t.Errorf("SplitBudget(%d) = %d, %d", c.max, snap, rest)
		}
	}
}

// TestSnapshotBulkyFileLeavesRoom: a ruleset of thousands of Services
// (megabytes) collected first does not use up a small bundle's snapshot
// budget: the small files after it are still collected, whole, and the
// bulky one is cut with its marker.
func TestSnapshotBulkyFileLeavesRoom(t *testing.T) {
	const budget = 512 << 10 // --max-bytes 2M
	// Writing the bulky file takes over a second under the race detector
	// on a loaded machine: the timeout is not what is tested here.
	s := &snapshot{opt: Options{MaxBytes: budget, MaxFileBytes: DefaultFileBytes, CollectorTimeout: time.Minute}}
	bulky := topic{file: "nftables.txt", collect: func(ctx context.Context, w *topicWriter) error {
		for i := range 200000 {
			fmt.Fprintf(w, "\tchain KUBE-SEP-%016d {\n", i)
		}
		return nil
	}}
	topics := []topic{bulky}
	for i := range 10 {
		topics = append(topics, topic{file: fmt.Sprintf("small-%d.txt", i), collect: func(ctx context.Context, w *topicWriter) error {
			fmt.Fprint(w, strings.Repeat("entry of the VIP\n", 500)) // 8.5 KB
			return nil
		}})
	}
	dir := t.TempDir()
	m, err := s.collect(context.Background(), dir, topics)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Files) != len(topics) {
		t.Fatalf("%d files collected, want %d; notes %q", len(m.Files), len(topics), m.Notes)
	}
	var sum int64
	for _, f := range m.Files {
		sum += f.Bytes
		if f.Truncated != (f.Name == "nftables.txt") {
			t.Errorf("%s: truncated %v", f.Name, f.Truncated)
		}
	}
	if sum > budget {
		t.Errorf("files hold %d bytes, budget %d", sum, budget)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "nftables.txt"))
	if !strings.Contains(string(b), "[pathtrace: truncated here:") {
		t.Errorf("nftables.txt cut without a marker")
	}
}

// TestGonePodNetStateIsANote: a Pod that went during the incident has no
// netns left to read: its file says so, and its note names the Pod going,
// not a collection that failed; where another netns holds its path now (a
// StatefulSet's Pod made again), that netns is not said gone.
func TestGonePodNetStateIsANote(t *testing.T) {
	s := &snapshot{opt: Options{CollectorTimeout: 10 * time.Second}}
	gone := discover.Pod{NetNS: discover.NetNS{Path: filepath.Join(t.TempDir(), "gone-pod"), Inode: 4026532999}}
	body, notes, _ := s.run(context.Background(), topic{file: "net-pod-1.txt", collect: s.podNetState(gone)}, 1000)
	if strings.Contains(string(body), "not complete") || !strings.Contains(string(body), "the Pod went during the incident") ||
		len(notes) != 1 || !strings.Contains(notes[0], "the Pod went during the incident: its netns "+gone.NetNS.Path+" is gone") {
		t.Errorf("body %q notes %q; want the Pod said gone, not a failure", body, notes)
	}
	// A path that now opens another netns (a PID given to another process).
	other := discover.Pod{NetNS: discover.NetNS{Path: "/proc/self/ns/net", Inode: 1}}
	body, notes, _ = s.run(context.Background(), topic{file: "net-pod-2.txt", collect: s.podNetState(other)}, 1000)
	if !strings.Contains(string(body), "the Pod went during the incident") || strings.Contains(string(body), "gone") ||
		len(notes) != 1 || !strings.Contains(notes[0], "another netns holds its path /proc/self/ns/net now") || strings.Contains(notes[0], "gone") {
		t.Errorf("body %q notes %q; want another netns at the Pod's path said there, not read as the Pod's nor said gone", body, notes)
	}
}

// TestTCOfPodsThatWent: tc.txt does not list, as a Pod's that went during
// the incident, what is now at its netns path (a Pod made again with its
// name, as a StatefulSet's) or under its host veth's name (that Pod's new
// veth): the programs there came after it, as the Pod's netns file says;
// nor does a Pod whose netns is gone make a failure to read, there or in
// sysctl.txt.
func TestTCOfPodsThatWent(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: tc.txt and sysctl.txt are read by entering the netns (setns), even pathtrace's own")
	}
	self, err := nsutil.Inode(nsutil.Self)
	if err != nil {
		t.Fatal(err)
	}
	pod := func(path string, inode uint64) discover.Pod {
		return discover.Pod{NetNS: discover.NetNS{Path: path, Inode: inode}, Eth0: discover.Iface{Name: "lo", Ifindex: 1}}
	}
	deleted := filepath.Join(t.TempDir(), "gone-pod")
	node := &discover.NodeInfo{
		// The first Pod went and another came at its path; the third went.
		Pods: []discover.Pod{pod(nsutil.Self, self+1), pod(nsutil.Self, self), pod(deleted, 4026532999)},
		CapturePoints: []discover.CapturePoint{
			{Role: discover.RolePod, NetNS: nsutil.Self, Ifname: "lo", Ifindex: 1},
			{Role: discover.RolePod, NetNS: nsutil.Self, Ifname: "lo", Ifindex: 1},
			{Role: discover.RolePod, NetNS: deleted, Ifname: "lo", Ifindex: 1},
			// The first Pod's host veth, whose name the new one's has.
			{Role: discover.RoleHost, NetNS: nsutil.Self, Ifname: "lo", Ifindex: 999},
		},
	}
	s := &snapshot{node: node, hostPath: nsutil.Self, opt: Options{CollectorTimeout: 10 * time.Second}, own: map[ebpf.ProgramID]bool{}}
	body, notes, _ := s.run(context.Background(), topic{file: "tc.txt", collect: s.tcPrograms}, 100000)
	got := string(body)
	if n := strings.Count(got, "## pod lo (ifindex 1, netns "+nsutil.Self+")"); n != 1 {
		t.Errorf("the live Pod's eth0 listed %d times, want once:\n%s", n, got)
	}
	if n := strings.Count(got, "the Pod went during the incident"); n != 2 {
		t.Errorf("%d Pods said gone, want 2:\n%s", n, got)
	}
	if !strings.Contains(got, "## host lo (ifindex 999, netns "+nsutil.Self+"): gone during the incident") || strings.Contains(got, "## host lo (ifindex 1,") {
		t.Errorf("the gone host veth not said gone, or its name's new interface listed as it:\n%s", got)
	}
	if len(notes) != 0 {
		t.Errorf("notes %q, want none: nothing failed", notes)
	}
	body, notes, _ = s.run(context.Background(), topic{file: "sysctl.txt", collect: s.sysctls}, 100000)
	if !strings.Contains(string(body), "# netns "+deleted+"\nthe Pod went during the incident: its netns "+deleted+" is gone") || len(notes) != 0 {
		t.Errorf("sysctl.txt %q notes %q: want the gone Pod's netns said gone, not a failure", body, notes)
	}
	// A Pod that went and whose path another netns holds now: that netns
	// is there, not gone, and not the Pod's.
	const taken = "/proc/thread-self/ns/net"
	node.Pods = []discover.Pod{pod(taken, 1)}
	node.CapturePoints = []discover.CapturePoint{{Role: discover.RolePod, NetNS: taken, Ifname: "lo", Ifindex: 1}}
	body, notes, _ = s.run(context.Background(), topic{file: "sysctl.txt", collect: s.sysctls}, 100000)
	if !strings.Contains(string(body), "# netns "+taken+"\nthe Pod went during the incident: another netns holds its path "+taken+" now, not read") || len(notes) != 0 {
		t.Errorf("sysctl.txt %q notes %q: want the Pod said gone and another netns at its path, not read", body, notes)
	}
}
