package flow_test

import (
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

func TestCommentBy(t *testing.T) {
	tests := []struct{ by, want string }{
		// Short ones stay whole.
		{"connect4 lab_sock4_connect (id 5)", "connect4 lab_sock4_connect (id 5)"},
		{"tcx ingress lab_from_container (id 120)", "tcx ingress lab_from_container (id 120)"},
		{"nftables ip kube-proxy nat-prerouting -> services -> dnat to 10.0.0.1:80", "nftables ip kube-proxy nat-prerouting -> services -> dnat to 10.0.0.1:80"},
		// kube-proxy nftables: the Service's chain, and "…" for the chains left out.
		{"nftables ip kube-proxy nat-prerouting -> services -> service-Z3XHB2ZZ-default/dns/udp/dns -> endpoint-SI4LMZL3-default/dns/udp/dns__10.244.20.31/5353 -> dnat to 10.244.20.31:5353",
			"nftables ip kube-proxy … service-Z3XHB2ZZ-default/dns/udp/dns -> … -> dnat to 10.244.20.31:5353"},
		// kube-proxy iptables.
		{"iptables-legacy nat PREROUTING -> KUBE-SERVICES -> KUBE-SVC-TCOU7JCQXEZGVUNU -> KUBE-SEP-6E7XQMQ4RAYOWTTM -> -j DNAT --to-destination 10.244.20.31:5353",
			"iptables-legacy nat … KUBE-SVC-TCOU7JCQXEZGVUNU -> … -> -j DNAT --to-destination 10.244.20.31:5353"},
		// No Service chain: the last chain; the first: no "…" before it.
		{"nftables ip custom-lb-with-a-long-table-name prerouting-chain-of-that-table -> rewrite-the-vip-chain -> dnat to 10.0.0.1:80",
			"nftables ip custom-lb-with-a-long-table-name … rewrite-the-vip-chain -> dnat to 10.0.0.1:80"},
		{"iptables-legacy nat KUBE-SVC-TCOU7JCQXEZGVUNU -> KUBE-SEP-6E7XQMQ4RAYOWTTM -> -j DNAT --to-destination 10.244.20.31:5353",
			"iptables-legacy nat KUBE-SVC-TCOU7JCQXEZGVUNU -> … -> -j DNAT --to-destination 10.244.20.31:5353"},
		// A long rule in one chain stays whole: nothing repeats there.
		{"nftables ip custom-lb-with-a-long-table-name prerouting -> ip daddr 10.120.0.80 tcp dport 80 dnat to 10.244.20.31:3000",
			"nftables ip custom-lb-with-a-long-table-name prerouting -> ip daddr 10.120.0.80 tcp dport 80 dnat to 10.244.20.31:3000"},
		// A program's cgroup: its last directory.
		{"connect4 cil_sock4_connect (id 1234) on /sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b.slice",
			"connect4 cil_sock4_connect (id 1234) on …/kubepods-burstable-pod0a1b.slice"},
	}
	for _, tc := range tests {
		if got := flow.CommentBy(tc.by); got != tc.want {
			t.Errorf("CommentBy(%q)\n = %q\n want %q", tc.by, got, tc.want)
		}
	}
}

// TestCommentsCarryShortBy: a flow's packet comments carry its verdict's
// "by" as CommentBy shortens it, the report the whole of it.
func TestCommentsCarryShortBy(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	backend := netip.MustParseAddrPort("10.244.20.31:3000")
	rule := flow.NATRule{Source: "nftables", Table: "ip kube-proxy",
		Chain: "nat-prerouting -> services -> service-ULMVA6XW-default/web/tcp/http -> endpoint-TUXOSQTE-default/web/tcp/http__10.244.20.31/3000",
		VIP:   netip.MustParseAddrPort("10.120.0.80:80"), Backends: []netip.AddrPort{backend}, Rule: "dnat to " + backend.String()}
	cfg := s.Config
	cfg.Attribution.NATRules = []flow.NATRule{rule}
	e := flow.NewEngine(cfg)
	var pod *obs.Observation
	for i, o := range s.Observations {
		e.Add(o)
		if o.Point == obs.PointPod && pod == nil {
			pod = &s.Observations[i]
		}
	}
	if pod == nil {
		t.Fatal("the scenario has no packet at the Pod")
	}
	ref, ok := e.Classify(*pod)
	if !ok {
		t.Fatalf("the Pod's packet %+v is of no flow", *pod)
	}
	for _, f := range e.Flows() {
		if f.ID != ref.ID {
			continue
		}
		if f.RewrittenAt != flow.PlaceNetfilter || f.By != rule.String() {
			t.Fatalf("flow %d rewritten at %s by %q, want netfilter by %q", f.ID, f.RewrittenAt, f.By, rule.String())
		}
		want := "nftables ip kube-proxy … service-ULMVA6XW-default/web/tcp/http -> … -> dnat to 10.244.20.31:3000"
		if ref.By != want {
			t.Errorf("the comment's by %q, want %q", ref.By, want)
		}
		return
	}
	t.Fatalf("no flow %d in the report", ref.ID)
}

// TestBySocketDualStack: a dual-stack socket's connect to a v4-mapped
// VIP runs the connect6 hooks only, so a socket LB's connect6 program, not
// its connect4 one, rewrote it; an IPv4 socket's connect names connect4.
func TestBySocketDualStack(t *testing.T) {
	for _, c := range []struct {
		kind obs.SockKind
		want string
	}{
		{obs.SockConnect, "connect4 lb_sock4_connect (id 41)"},
		{obs.SockConnect6, "connect6 lb_sock6_connect (id 45)"},
	} {
		s, err := flowtest.Load(scenarioDir + "/socket-tcp.json")
		if err != nil {
			t.Fatal(err)
		}
		s.Config.Attribution.SockPrograms = []flow.SockProgram{
			{AttachType: "connect4", Name: "lb_sock4_connect", ID: 41},
			{AttachType: "sendmsg4", Name: "lb_sock4_sendmsg", ID: 42},
			{AttachType: "connect6", Name: "lb_sock6_connect", ID: 45},
		}
		for i, o := range s.Observations {
			if o.Point == obs.PointSockAddr {
				s.Observations[i].Kind = c.kind
			}
		}
		fs := s.Run(nil).Flows()
		if len(fs) != 1 || fs[0].RewrittenAt != flow.PlaceSocket || fs[0].By != c.want {
			t.Errorf("kind %d: flows %+v, want one rewritten at socket by %q", c.kind, fs, c.want)
		}
	}
}

// TestBySocketProgramsOfTheirTime: a client's cgroup read again after a
// socket LB was loaded on it keeps the programs it had, one detached since
// among them, and names each flow only the programs loaded before its
// socket rewrote.
func TestBySocketProgramsOfTheirTime(t *testing.T) {
	const cg = 77
	e := flow.NewEngine(httpConfig(obs.PointSockAddr, obs.PointSockState))
	connect := func(ms float64, port uint16, cookie uint64) {
		src := netip.AddrPortFrom(client.Addr(), port)
		e.Add(obs.Observation{Time: flowtest.At(ms), Point: obs.PointSockAddr, Kind: obs.SockConnect,
			Proto: obs.TCP, Src: netip.AddrPortFrom(client.Addr(), 0), ReqDst: vip, Dst: backend, Cookie: cookie, Cgroup: cg})
		e.Add(obs.Observation{Time: flowtest.At(ms + 0.01), Point: obs.PointSockState, Proto: obs.TCP,
			Src: src, Dst: backend, Cookie: cookie, Cgroup: cg})
	}
	old := flow.SockProgram{AttachType: "connect4", Name: "old_lb", ID: 5}
	e.SetCgroupSockPrograms(cg, []flow.SockProgram{old})
	connect(0, 40001, 1)
	loaded := flow.SockProgram{AttachType: "connect4", Name: "new_lb", ID: 9, Since: flowtest.At(500)}
	e.SetCgroupSockPrograms(cg, []flow.SockProgram{old, loaded})
	connect(1000, 40002, 2)
	e.SetCgroupSockPrograms(cg, nil) // both detached
	want := map[uint16]string{
		40001: "connect4 old_lb (id 5)",
		40002: "one of 2: connect4 old_lb (id 5); connect4 new_lb (id 9)",
	}
	fs := e.Flows()
	if len(fs) != len(want) {
		t.Fatalf("%d flows, want %d: %+v", len(fs), len(want), fs)
	}
	for _, f := range fs {
		if f.RewrittenAt != flow.PlaceSocket || f.By != want[f.Client.Port()] {
			t.Errorf("flow from %s: %s by %q, want socket by %q", f.Client, f.RewrittenAt, f.By, want[f.Client.Port()])
		}
	}
}
