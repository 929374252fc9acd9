package incident

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// bigListing writes a listing of n Services in style to a file: the traced
// one, Service n-1, comes last.
func bigListing(t *testing.T, style, n int) string {
	var b strings.Builder
	if style == styleNFT {
		b.WriteString("table ip kube-proxy {\n\tmap service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\t\telements = { ")
		for i := range n {
			fmt.Fprintf(&b, "10.121.%d.%d . tcp . 80 : goto service-%d,\n\t\t\t     ", i/250, i%250+1, i)
		}
		b.WriteString("}\n\t}\n\n\tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n\t}\n")
		for i := range n {
			fmt.Fprintf(&b, "\n\tchain service-%d {\n\t\tnumgen random mod 1 vmap { 0 : goto endpoint-%d }\n\t}\n", i, i)
			fmt.Fprintf(&b, "\n\tchain endpoint-%d {\n\t\tmeta l4proto tcp dnat to 10.245.%d.%d:8080\n\t}\n", i, i/250, i%250+1)
		}
		b.WriteString("}\ntable ip other {\n\tchain endpoint-0 {\n\t\tcounter\n\t}\n}\n")
	} else {
		b.WriteString("*nat\n")
		for i := range n {
			fmt.Fprintf(&b, ":KUBE-SVC-%d - [0:0]\n:KUBE-SEP-%d - [0:0]\n", i, i)
		}
		for i := range n {
			fmt.Fprintf(&b, "-A KUBE-SERVICES -d 10.122.%d.%d/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-%d\n", i/250, i%250+1, i)
			fmt.Fprintf(&b, "-A KUBE-SVC-%d -j KUBE-SEP-%d\n-A KUBE-SEP-%d -p tcp -m tcp -j DNAT --to-destination 10.245.%d.%d:8080\n", i, i, i, i/250, i%250+1)
		}
		b.WriteString("COMMIT\n")
	}
	path := filepath.Join(t.TempDir(), "listing")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestListRulesetTracedChainsFirst: a ruleset listing of 5,000 Services is
// cut at the file's cap; the traced Service's chains, at its end, are in
// the file all the same, before the cut listing, and a VIP that is the
// start of another (10.121.0.1 in 10.121.0.10) picks only its own lines.
func TestListRulesetTracedChainsFirst(t *testing.T) {
	const n = 5000
	for _, tc := range []struct {
		name, source, table string
		style               int
		vip                 string
		chains              []string
		want, wantNot       []string
	}{
		{"nft", discover.SourceNFTables, "ip kube-proxy", styleNFT, "10.121.19.250",
			[]string{"nat-prerouting", "services", "service-4999", "endpoint-4999"},
			[]string{"table ip kube-proxy {", "10.121.19.250 . tcp . 80 : goto service-4999,", "\tchain service-4999 {",
				"\tchain endpoint-4999 {\n\t\tmeta l4proto tcp dnat to 10.245.19.250:8080\n\t}", "\tchain services {"},
			[]string{"10.121.19.25 .", "table ip other", "service-4998"}},
		{"iptables-legacy", discover.SourceIPTablesLegacy, "nat", styleIPTablesSave, "10.122.19.250",
			[]string{"PREROUTING", "KUBE-SERVICES", "KUBE-SVC-4999", "KUBE-SEP-4999"},
			[]string{"-A KUBE-SERVICES -d 10.122.19.250/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-4999\n-A KUBE-SVC-4999 -j KUBE-SEP-4999\n-A KUBE-SEP-4999 -p tcp -m tcp -j DNAT --to-destination 10.245.19.250:8080\n"},
			[]string{"-d 10.122.19.25/32", "KUBE-SVC-4998"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := &discover.NodeInfo{}
			node.Netfilter.Rules = []discover.NATRule{{Source: tc.source, Table: tc.table, Chains: tc.chains}}
			vip := netip.MustParseAddr(tc.vip)
			s := &snapshot{node: node, vips: []netip.Addr{vip}}
			w := newTopicWriter(64 << 10)
			pick := newVIPLines(tc.style, tc.source, node, s.vips, 0)
			if err := s.listRuleset(context.Background(), w, pick, "cat", bigListing(t, tc.style, n)); err != nil {
				t.Fatal(err)
			}
			body, cut := w.finish()
			got := string(body)
			if !cut || len(body) > 64<<10 || !strings.Contains(got, "[pathtrace: truncated here:") {
				t.Fatalf("cut %v, %d bytes", cut, len(body))
			}
			head, _, ok := strings.Cut(got, "# End of the lines about the traced Services.")
			if !ok {
				t.Fatalf("no lines about the traced Service:\n%.2000s", got)
			}
			for _, want := range tc.want {
				if !strings.Contains(head, want) {
					t.Errorf("the lines about %s lack %q:\n%.3000s", tc.vip, want, head)
				}
			}
			for _, not := range tc.wantNot {
				if strings.Contains(head, not) {
					t.Errorf("the lines about %s hold %q:\n%.3000s", tc.vip, not, head)
				}
			}
		})
	}
}
