package flow_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestDroppedUnrewrittenAnsweredByICMP: a node without a route for the VIP
// drops the request after netfilter's NAT, the VIP still its destination
// (IP_INNOROUTES in ip_error), and its own address answers with an ICMP
// net unreachable: nowhere, the reason naming the drop and the answer,
// with no word of an uplink capture (the node has none). The same drop
// seen in another netns (a Pod's, where an ifindex means another device)
// proves nothing of the node's netfilter: unknown.
func TestDroppedUnrewrittenAnsweredByICMP(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/kernel-drops-request-no-route.json")
	if err != nil {
		t.Fatal(err)
	}
	client := netip.MustParseAddrPort("10.244.1.5:40300")
	for _, tc := range []struct {
		name  string
		netns uint64
		want  flow.Place
	}{
		{"node netns", s.Config.HostNetNS, flow.PlaceNowhere},
		{"another netns", 4026532999, flow.PlaceUnknown},
	} {
		e := flow.NewEngine(s.Config)
		for _, o := range s.Observations {
			if o.Src != client {
				continue
			}
			if o.Point == obs.PointDrop {
				o.NetNS = tc.netns
			}
			e.Add(o)
		}
		quoted := obs.Observation{Time: flowtest.At(0.05), Point: obs.PointHost, Dir: obs.DirOut, Proto: obs.TCP,
			Src: client, Dst: netip.MustParseAddrPort("10.96.0.50:80")}
		if !e.NoteICMPError(quoted, "ICMP destination unreachable (code 0: net unreachable)", netip.MustParseAddr("10.244.1.1")) {
			t.Fatalf("%s: no flow took the ICMP error", tc.name)
		}
		fs := e.Flows()
		if len(fs) != 1 {
			t.Fatalf("%s: %d flows, want 1", tc.name, len(fs))
		}
		f := fs[0]
		if f.RewrittenAt != tc.want {
			t.Errorf("%s: rewritten_at %s, want %s (reason %q)", tc.name, f.RewrittenAt, tc.want, f.Reason)
		}
		if tc.want != flow.PlaceNowhere {
			continue
		}
		for _, want := range []string{
			"and the node dropped the request with it as destination after that NAT: IP_INNOROUTES in ip_error",
			"the ICMP destination unreachable (code 0: net unreachable) from 10.244.1.1 is its answer",
		} {
			if !strings.Contains(f.Reason, want) {
				t.Errorf("%s: reason %q lacks %q", tc.name, f.Reason, want)
			}
		}
		if strings.Contains(f.Reason, "uplink") {
			t.Errorf("%s: reason %q speaks of an uplink the node does not have captured", tc.name, f.Reason)
		}
		if f.Reply || f.ICMPError == nil {
			t.Errorf("%s: reply %v, icmp_error %v: want no reply, the ICMP error", tc.name, f.Reply, f.ICMPError)
		}
	}
}
