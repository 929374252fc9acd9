package session

import (
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestRejectICMPAnswer: a reject rule that answers with an ICMP error
// gives the engine that error, worded as the capture words the ones it
// sees (the engine reports it for a node process, which gets it through
// loopback); a TCP reset, a drop and an unknown answer give none.
func TestRejectICMPAnswer(t *testing.T) {
	vip := netip.MustParseAddr("10.96.0.60")
	for _, tc := range []struct {
		verdict, with, want string
	}{
		{"reject", "icmp-port-unreachable", "ICMP destination unreachable (code 3: port unreachable)"},
		{"reject", "icmp-net-unreachable", "ICMP destination unreachable (code 0: net unreachable)"},
		{"reject", "tcp-reset", ""},
		{"reject", "", ""},
		{"drop", "", ""},
	} {
		rules := natRulesOf([]discover.NATRule{{Source: "nftables", Table: "ip fw", Hook: "output", Service: vip, Port: 80, Proto: "tcp", Chains: []string{"out"}, Verdict: tc.verdict, RejectWith: tc.with}})
		if len(rules) != 1 || rules[0].ICMPAnswer != tc.want {
			t.Errorf("%s with %q: got %+v, want ICMP answer %q", tc.verdict, tc.with, rules, tc.want)
		}
	}
}
