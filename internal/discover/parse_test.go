package discover

import (
	"encoding/json"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/kmod"
)

// key is a comparable summary of a NATRule for assertions.
func key(r NATRule) string {
	return r.Hook + " " + r.Service.String() + " " + r.Proto + "/" + strconv.Itoa(int(r.Port)) + " " +
		strings.Join(r.Chains, ">") + " => " + r.Backend.String()
}

// loadIPTablesSave parses an iptables-save testdata file as iptables-legacy's.
func loadIPTablesSave(t *testing.T, path string) *natGraph {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := parseIPTablesSave(f, "iptables-legacy")
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func keys(rules []NATRule) []string {
	var out []string
	for _, r := range rules {
		out = append(out, key(r))
	}
	slices.Sort(out)
	return out
}

func TestParseIPTablesSaveKubeProxy(t *testing.T) {
	g := loadIPTablesSave(t, "testdata/iptables-save-kube-proxy.txt")
	vips := []netip.Addr{netip.MustParseAddr("10.120.0.80"), netip.MustParseAddr("10.120.0.10"), netip.MustParseAddr("10.120.0.77")}
	got := keys(g.match(vips))
	want := []string{
		"output 10.120.0.10 udp/53 OUTPUT>KUBE-SERVICES>KUBE-SVC-DNSXXXXXXXXXXXXX>KUBE-SEP-DNSAAAAAAAAAAAAA => 10.244.20.31:5353",
		"output 10.120.0.80 tcp/80 OUTPUT>KUBE-SERVICES>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBAAAAAAAAAAAAA => 10.244.20.31:3000",
		"output 10.120.0.80 tcp/80 OUTPUT>KUBE-SERVICES>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBBBBBBBBBBBBBB => 10.244.20.32:3000",
		"prerouting 10.120.0.10 udp/53 PREROUTING>KUBE-SERVICES>KUBE-SVC-DNSXXXXXXXXXXXXX>KUBE-SEP-DNSAAAAAAAAAAAAA => 10.244.20.31:5353",
		"prerouting 10.120.0.80 tcp/80 PREROUTING>KUBE-SERVICES>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBAAAAAAAAAAAAA => 10.244.20.31:3000",
		"prerouting 10.120.0.80 tcp/80 PREROUTING>KUBE-SERVICES>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBBBBBBBBBBBBBB => 10.244.20.32:3000",
	}
	if !slices.Equal(got, want) {
		t.Errorf("rules:\n got %q\nwant %q", got, want)
	}
	for _, r := range g.match(vips) {
		if r.Source != "iptables-legacy" || r.Table != "nat" {
			t.Errorf("rule %s: source %q table %q", key(r), r.Source, r.Table)
		}
	}
}

func TestParseIPTablesRuleQuotesAndNegation(t *testing.T) {
	chain, r, err := parseIPTablesRule(`-A KUBE-SVC-X ! -d 10.0.0.0/8 -m comment --comment "a \"-d 1.2.3.4\" -j NOPE" -j KUBE-SEP-Y`)
	if err != nil {
		t.Fatal(err)
	}
	if chain != "KUBE-SVC-X" || !r.dstNeg || len(r.dst) != 1 || r.dst[0] != netip.MustParsePrefix("10.0.0.0/8") ||
		!slices.Equal(r.targets, []string{"KUBE-SEP-Y"}) {
		t.Errorf("got chain %q rule %+v", chain, r)
	}
	if _, _, err := parseIPTablesRule(`-A X -m comment --comment "unterminated -j Y`); err == nil {
		t.Error("unterminated quote: want an error")
	}
	for in, want := range map[string]string{
		"10.244.20.31:3000":       "10.244.20.31:3000",
		"10.244.20.31":            "10.244.20.31:0",
		"10.0.0.1-10.0.0.9:80-90": "10.0.0.1:80",
		"[2001:db8::1]:8080":      "[2001:db8::1]:8080",
	} {
		if got, note := parseDNATTarget(in); got.String() != want || note != "" {
			t.Errorf("parseDNATTarget(%q) = %v %q, want %s", in, got, note, want)
		}
	}
	if got, note := parseDNATTarget("nonsense"); got.IsValid() || note == "" {
		t.Errorf("parseDNATTarget(nonsense) = %v %q, want invalid with a note", got, note)
	}
	for in, want := range map[string]bool{
		"10.244.20.31:3000":       false,
		"10.244.20.31":            false,
		"10.0.0.1-10.0.0.9":       false,
		"10.0.0.1-10.0.0.9:80-90": true,
		"10.0.0.1:80-80":          false,
		"[2001:db8::1]:8080-8090": true,
		"[2001:db8::1]:8080":      false,
	} {
		if got := dnatPortRange(in); got != want {
			t.Errorf("dnatPortRange(%q) = %v, want %v", in, got, want)
		}
	}
}

func TestParseIPVS(t *testing.T) {
	f, err := os.Open("testdata/ip_vs")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := parseIPVS(f)
	b, _ := json.Marshal(got)
	want := `[{"proto":"tcp","service":"10.120.0.80:80","scheduler":"rr","backends":["10.244.20.31:3000","10.244.20.32:3000"]},` +
		`{"proto":"udp","service":"10.120.0.10:53","scheduler":"rr","backends":["10.244.20.31:5353"]},` +
		`{"proto":"tcp","service":"[2001:db8::50]:80","scheduler":"rr","backends":["[2001:db8::20:31]:3000"]}]`
	if string(b) != want {
		t.Errorf("parseIPVS:\n got %s\nwant %s", b, want)
	}
}

// TestNFTUnreadableWithoutModules: nftables is listed only when nfnetlink and
// nf_tables are loaded or built in, or the kernel cannot load modules:
// listing would load them otherwise.
func TestNFTUnreadableWithoutModules(t *testing.T) {
	tree := func(t *testing.T, procModules string, builtin ...string) kmod.Host {
		root := t.TempDir()
		h := kmod.Host{SysModule: root + "/sys/module", ProcModules: root + "/proc/modules",
			ModulesDisabled: root + "/modules_disabled", LibModules: root + "/lib/modules", Release: "r"}
		var lib string
		for _, m := range builtin {
			lib += "kernel/net/netfilter/" + m + ".ko\n"
		}
		if err := os.MkdirAll(root+"/lib/modules/r", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(root+"/lib/modules/r/modules.builtin", []byte(lib), 0o644); err != nil {
			t.Fatal(err)
		}
		if procModules != "-" {
			if err := os.MkdirAll(root+"/proc", 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(h.ProcModules, []byte(procModules), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return h
	}
	for _, tc := range []struct {
		name, proc string
		builtin    []string
		want       string
	}{
		{"loaded", "nfnetlink 1 1 nf_tables, Live 0x0\nnf_tables 1 0 - Live 0x0\n", nil, ""},
		{"built in", "", []string{"nfnetlink", "nf_tables"}, ""},
		{"no module support", "-", nil, ""},
		{"iptables-legacy node", "nfnetlink 1 0 - Live 0x0\nip_tables 1 0 - Live 0x0\n", nil, "absent: nf_tables not loaded (not listed: listing would load it)"},
		{"no netfilter netlink", "ip_tables 1 0 - Live 0x0\n", nil, "absent: nfnetlink not loaded (not listed: listing would load it)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := nftUnreadable(tree(t, tc.proc, tc.builtin...)); got != tc.want {
				t.Errorf("nftUnreadable = %q, want %q", got, tc.want)
			}
		})
	}
	// A container without the node's /lib/modules cannot tell a built-in
	// nf_tables from a missing one: not "absent".
	h := tree(t, "nfnetlink 1 0 - Live 0x0\n")
	if err := os.RemoveAll(h.LibModules); err != nil {
		t.Fatal(err)
	}
	if got := nftUnreadable(h); !strings.HasPrefix(got, "not read: nf_tables is not loaded, or is built in") || !strings.Contains(got, "mount the node's") {
		t.Errorf("no modules.builtin: nftUnreadable = %q, want it not read, maybe built in, and what to mount", got)
	}
}

// TestNodePortRules: a VIP that is an address of the node (a NodePort
// traced as NODE-IP:PORT) reaches its DNATs through the local-destination
// rule (iptables `-m addrtype --dst-type LOCAL`, nftables `fib daddr type
// local`), and the port the nodeports chain selects is the Service's; an
// address that is not the node's never enters that chain.
func TestNodePortRules(t *testing.T) {
	ipt := loadIPTablesSave(t, "testdata/iptables-save-kube-proxy.txt")
	node := netip.MustParseAddr("192.168.1.10")
	local := map[netip.Addr]bool{node: true}
	for _, tc := range []struct {
		g    *natGraph
		want []string
	}{
		{ipt, []string{
			"output 192.168.1.10 tcp/30080 OUTPUT>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-WEBXXXXXXXXXXXXX>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBAAAAAAAAAAAAA => 10.244.20.31:3000",
			"output 192.168.1.10 tcp/30080 OUTPUT>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-WEBXXXXXXXXXXXXX>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBBBBBBBBBBBBBB => 10.244.20.32:3000",
			"prerouting 192.168.1.10 tcp/30080 PREROUTING>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-WEBXXXXXXXXXXXXX>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBAAAAAAAAAAAAA => 10.244.20.31:3000",
			"prerouting 192.168.1.10 tcp/30080 PREROUTING>KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-WEBXXXXXXXXXXXXX>KUBE-SVC-WEBXXXXXXXXXXXXX>KUBE-SEP-WEBBBBBBBBBBBBBB => 10.244.20.32:3000",
		}},
		{kubeProxyNFT(), []string{
			"prerouting 192.168.1.10 tcp/30080 nat-prerouting>services>nodeports>service-web>endpoint-web-a => 10.244.20.31:3000",
			"prerouting 192.168.1.10 tcp/30080 nat-prerouting>services>nodeports>service-web>endpoint-web-b => 10.244.20.32:3000",
		}},
	} {
		if got := keys(tc.g.matchLocal([]netip.Addr{node}, local)); !slices.Equal(got, tc.want) {
			t.Errorf("%s: node address:\n got %q\nwant %q", tc.g.source, got, tc.want)
		}
		if got := tc.g.matchLocal([]netip.Addr{node}, nil); len(got) != 0 {
			t.Errorf("%s: an address that is not the node's matched %q", tc.g.source, keys(got))
		}
	}
}

// sourceKeys are the prerouting paths' chains after the base chain's, each
// with its source conditions.
func sourceKeys(rules []NATRule) []string {
	var out []string
	for _, r := range rules {
		if r.Hook == "prerouting" {
			out = append(out, strings.Join(r.Chains[1:], ">")+" => "+r.Backend.String()+r.fromString())
		}
	}
	slices.Sort(out)
	return out
}

// TestIPTablesSourceConditions: kube-proxy's chain for a NodePort of an
// externalTrafficPolicy: Local Service sends Pods' (-s CLUSTER-CIDR) and
// the node's own (--src-type LOCAL) traffic to the cluster-wide chain and
// the rest to the local one: each path says the sources it is taken from,
// the cluster-wide one once per rule that leads there. Those are jumps, not
// gotos, but to a service chain whose last endpoint takes every packet the
// others leave: what they take is not left to the rules after them, so the
// node's own client is not "one of 2" paths, the local one too.
func TestIPTablesSourceConditions(t *testing.T) {
	g := loadIPTablesSave(t, "testdata/iptables-save-kube-proxy-local-policy.txt")
	node := netip.MustParseAddr("192.168.1.10")
	got := sourceKeys(g.matchLocal([]netip.Addr{node}, map[netip.Addr]bool{node: true}))
	want := []string{
		"KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-LOCALXXXXXXXXXXX>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALAAAAAAAAAAA => 10.244.0.7:8080 from 10.244.0.0/16",
		"KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-LOCALXXXXXXXXXXX>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALAAAAAAAAAAA => 10.244.0.7:8080 from not 10.244.0.0/16 and local",
		"KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-LOCALXXXXXXXXXXX>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALBBBBBBBBBBB => 10.244.1.5:8080 from 10.244.0.0/16",
		"KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-LOCALXXXXXXXXXXX>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALBBBBBBBBBBB => 10.244.1.5:8080 from not 10.244.0.0/16 and local",
		"KUBE-SERVICES>KUBE-NODEPORTS>KUBE-EXT-LOCALXXXXXXXXXXX>KUBE-SVL-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALAAAAAAAAAAA => 10.244.0.7:8080 from not 10.244.0.0/16 and not local",
	}
	if !slices.Equal(got, want) {
		t.Errorf("NodePort paths:\n got %q\nwant %q", got, want)
	}
	// The ClusterIP's path: the masquerade rule's `! -s` is on no DNAT's path.
	got = sourceKeys(g.match([]netip.Addr{netip.MustParseAddr("10.120.0.81")}))
	want = []string{
		"KUBE-SERVICES>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALAAAAAAAAAAA => 10.244.0.7:8080",
		"KUBE-SERVICES>KUBE-SVC-LOCALXXXXXXXXXXX>KUBE-SEP-LOCALBBBBBBBBBBB => 10.244.1.5:8080",
	}
	if !slices.Equal(got, want) {
		t.Errorf("ClusterIP paths:\n got %q\nwant %q", got, want)
	}
}

func TestParseIPTablesRuleSources(t *testing.T) {
	for rule, want := range map[string]string{
		`-A X ! -s 10.244.0.0/16 -j Y`:                                      "not 10.244.0.0/16",
		`-A X --source 10.244.0.7 -j Y`:                                     "10.244.0.7/32",
		`-A X -m addrtype ! --src-type LOCAL -j Y`:                          "not local",
		`-A X -s 10.0.0.0/8 -m addrtype --src-type LOCAL -j Y`:              "10.0.0.0/8 and local",
		`-A X -m addrtype --src-type LOCAL --limit-iface-in -j Y`:           "", // local on the input interface only
		`-A X -m addrtype --src-type UNICAST -j Y`:                          "",
		`-A X -s 10.0.0.0/255.0.255.0 -m comment --comment "odd mask" -j Y`: "", // not read: any source
	} {
		_, r, err := parseIPTablesRule(rule)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimPrefix(NATRule{Sources: r.src}.fromString(), " from "); got != want {
			t.Errorf("%s: sources %q, want %q", rule, got, want)
		}
	}
}

// A DaemonSet's container sees its own cgroup namespace: the default cgroup
// is then not the hierarchy's root, and the socket observers attached there
// would miss every Pod without a word.
func TestCgroupNSNote(t *testing.T) {
	if n := cgroupNSNote("/sys/fs/cgroup", func(string) bool { return true }); n != "" {
		t.Errorf("hierarchy root: got note %q, want none", n)
	}
	n := cgroupNSNote("/sys/fs/cgroup", func(string) bool { return false })
	for _, want := range []string{"/sys/fs/cgroup", "cgroup namespace", "--cgroup", "hostPath"} {
		if !strings.Contains(n, want) {
			t.Errorf("note %q does not say %q", n, want)
		}
	}
}

// TestIPTablesSaveParsedAsReached: a chain's rules are parsed, and the
// chain held, when a walk reaches it; a line that does not parse is an
// error only then (the rest of a node's 100,000 rules is never parsed,
// and its 20,000 chains never held, their names included).
func TestIPTablesSaveParsedAsReached(t *testing.T) {
	save := `*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SVC-B - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A
-A KUBE-SERVICES -d 10.96.0.2/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-B
-A KUBE-SVC-A -p tcp -m tcp -j DNAT --to-destination 10.244.0.1:8080
-A KUBE-SVC-B -m comment --comment "unterminated -j DNAT --to-destination 10.244.0.2:8080
COMMIT
`
	g, err := parseIPTablesSave(strings.NewReader(save), SourceIPTablesLegacy)
	if err != nil {
		t.Fatal(err)
	}
	a := g.match([]netip.Addr{netip.MustParseAddr("10.96.0.1")})
	if len(a) != 1 || a[0].Backend != netip.MustParseAddrPort("10.244.0.1:8080") || g.err != nil {
		t.Fatalf("10.96.0.1: %+v, err %v", a, g.err)
	}
	if _, ok := g.chains["KUBE-SVC-B"]; ok {
		t.Error("KUBE-SVC-B held though no walk reached it")
	}
	g.match([]netip.Addr{netip.MustParseAddr("10.96.0.2")})
	if g.err == nil || !strings.Contains(g.err.Error(), "KUBE-SVC-B") {
		t.Errorf("10.96.0.2: err %v, want the unparsable line of KUBE-SVC-B", g.err)
	}
}
