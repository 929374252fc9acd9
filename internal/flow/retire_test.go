package flow_test

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestRetireMatchesReport: a flow retired (reported as it ends, in a run
// until stopped) is reported as the end of a run reports it from the same
// evidence, for every recorded scenario in every order: retired all at the
// end (RetireAll), or by the flow timeout once the engine's clock passed
// it (Retire). Retired flows leave the engine; the summary still counts
// them, per verdict.
func TestRetireMatchesReport(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range scenarios {
		for name, order := range orders(s) {
			ref := s.Run(order)
			want, wantSum := ref.Flows(), ref.Summary()
			for _, mode := range []string{"all", "timeout"} {
				e := s.Run(order)
				var got []flow.Flow
				if mode == "all" {
					got = e.RetireAll()
				} else {
					got = e.Retire(flowtest.At(0).Add(24 * time.Hour))
				}
				if len(want) == 0 {
					want = nil
				}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("%s, %s order, retired (%s): %d flows\n%+v\nwant %d\n%+v", s.Name, name, mode, len(got), got, len(want), want)
					continue
				}
				if rest := e.Flows(); len(rest) != 0 {
					t.Errorf("%s, %s order (%s): %d flows left after retiring them all", s.Name, name, mode, len(rest))
				}
				sum := e.Summary()
				if sum.Flows != wantSum.Flows || sum.Retired != len(want) || !reflect.DeepEqual(sum.RewrittenAt, wantSum.RewrittenAt) ||
					sum.UnknownBeforeReady != wantSum.UnknownBeforeReady || !reflect.DeepEqual(sum.Drops, wantSum.Drops) {
					t.Errorf("%s, %s order (%s): summary %+v, want %+v", s.Name, name, mode, sum, wantSum)
				}
				if z := e.Sizes(); z["clients"] != 0 || z["nflows"] != 0 || z["snat"] != 0 || z["socks.flows"] != 0 || z["lateCounts"] != 0 || z["upstreams"] != 0 {
					t.Errorf("%s, %s order (%s): tables still hold retired flows: %v", s.Name, name, mode, z)
				}
			}
		}
	}
}

// TestRetireProxyUpstreamFirst: in a run until stopped, a sidecar proxy's
// upstream connection that closed is retired seconds before the app's
// connection its Pod redirected to the proxy, whose close no point sees
// (it never leaves the Pod): that one still names it as its proxy's
// upstream, as the report at the end of a run does.
func TestRetireProxyUpstreamFirst(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "sidecar-redirect.json"))
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	up := netip.MustParseAddrPort("10.244.8.23:49616")
	for i, dir := range []obs.Dir{obs.DirOut, obs.DirIn} { // its FINs
		o := obs.Observation{Time: flowtest.At(101 + float64(i)), Point: obs.PointPod, Proto: obs.TCP, Dir: dir, Src: up, Dst: netip.MustParseAddrPort("10.120.0.80:80"), Len: 66, TCPFlags: 0x11}
		if dir == obs.DirIn {
			o.Src, o.Dst = o.Dst, o.Src
		}
		e.Add(o)
	}
	retired := e.Retire(flowtest.At(15000))
	if len(retired) != 1 || retired[0].Client != up {
		t.Fatalf("retired %+v, want the closed upstream %s alone", retired, up)
	}
	for _, f := range e.RetireAll() {
		if f.Client == netip.MustParseAddrPort("10.244.8.23:49604") {
			if !reflect.DeepEqual(f.ProxyUpstreams, []int{retired[0].ID}) || !strings.Contains(f.Reason, fmt.Sprintf("flow %d (envoy pid 32051, 300µs after: netfilter)", retired[0].ID)) {
				t.Errorf("proxy_upstreams %v, reason %q: want its retired upstream, flow %d", f.ProxyUpstreams, f.Reason, retired[0].ID)
			}
			return
		}
	}
	t.Fatal("no flow of the redirected connection 10.244.8.23:49604")
}

// closingFlow is churnFlow with the TCP connection's handshake and close
// seen at the Pod's eth0 (SYN, SYN-ACK, FINs both ways).
func closingFlow(i int, svc, be netip.AddrPort, at time.Time) []obs.Observation {
	seq := churnFlow(i, obs.TCP, svc, be, at)
	for j := range seq {
		switch {
		case seq[j].Point == obs.PointPod && seq[j].Dir == obs.DirOut:
			seq[j].TCPFlags = 0x02
		case seq[j].Point == obs.PointPod && seq[j].Dir == obs.DirIn:
			seq[j].TCPFlags = 0x12
		}
	}
	last := seq[len(seq)-1].Time
	c := seq[3].Src
	pod, podIn := seq[3], seq[len(seq)-1]
	pod.Time, pod.TCPFlags = last.Add(time.Millisecond), 0x11
	podIn.Time, podIn.TCPFlags = last.Add(2*time.Millisecond), 0x11
	_ = c
	return append(seq, pod, podIn)
}

// TestRetireBounded: a run until stopped sees flow after flow; retiring
// them as they end keeps every table of the engine bounded, whatever the
// number of flows: 200,000 short flows (TCP connections that close, UDP
// exchanges that go idle) through an engine of 4096 flows at most, each
// reported once, none refused.
func TestRetireBounded(t *testing.T) {
	const nflows = 200_000
	tcpSvc, udpSvc := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.120.0.10:53")
	tcpBe, udpBe := netip.MustParseAddrPort("10.244.20.31:3000"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{
		Services:    []flow.Service{{Addr: tcpSvc.Addr(), Port: 80, Proto: obs.TCP}, {Addr: udpSvc.Addr(), Port: 53, Proto: obs.UDP}},
		MaxFlows:    4096,
		FlowTimeout: 5 * time.Second,
	})
	start := flowtest.At(0)
	ids := make(map[int]bool, nflows)
	places := map[flow.Place]int{}
	peak := map[string]int{}
	take := func(fs []flow.Flow) {
		for _, f := range fs {
			if ids[f.ID] {
				t.Fatalf("flow id %d reported twice", f.ID)
			}
			ids[f.ID] = true
			places[f.RewrittenAt]++
		}
	}
	for i := range nflows {
		// A flow every 4 ms: 1,250 in a flow timeout; a client port is
		// used again every 50,000 flows (churnFlow), 200 s later.
		at := start.Add(time.Duration(i) * 4 * time.Millisecond)
		var seq []obs.Observation
		if i%2 == 0 {
			seq = closingFlow(i%50000, tcpSvc, tcpBe, at)
		} else {
			seq = churnFlow(i%50000, obs.UDP, udpSvc, udpBe, at)
		}
		for _, o := range seq {
			e.Add(o)
		}
		if i%500 == 0 {
			take(e.Retire(time.Time{}))
			for k, v := range e.Sizes() {
				peak[k] = max(peak[k], v)
			}
		}
	}
	t.Logf("peak sizes: %v", peak)
	take(e.RetireAll())
	sum := e.Summary()
	if len(ids) != nflows || sum.Flows != nflows || sum.Retired != nflows {
		t.Errorf("%d flows reported, summary %d (%d retired), want %d", len(ids), sum.Flows, sum.Retired, nflows)
	}
	if places[flow.PlaceNetfilter] != nflows || sum.RewrittenAt[flow.PlaceNetfilter] != nflows {
		t.Errorf("verdicts %v, summary %v: want every flow netfilter", places, sum.RewrittenAt)
	}
	if n := sum.Drops[flow.DropFlowsOverMax]; n != 0 {
		t.Errorf("%d flows refused beyond --max-flows", n)
	}
	bounds := map[string]int{
		"clients": 4096, "clients.flows": 4096, "nflows": 4096, "snat": 0, "snat.flows": 0,
		"socks": 8192, "socks.order": 8192, "socks.flows": 8192,
		"waiting.queue": 4 * 4096, "waiting.byEnd": 4 * 4096, "replays": 64,
		"waiting.others": 4 * 1024, "waiting.pairs": 4096 + 1024,
		"commented": 1024, "lateCounts": 0, "refused": 0, "refusedClients": 0,
		"retiredKeys": 2 * 4096, "replyOnly": 0, "backends": 2, "backendPorts": 2, "pairs": 2, "labels": 128, "byNames": 16, "cgroups": 0, "podTCPrograms": 0, "hostRedirects": 0,
		"upstreams": 4096, // open redirected connections at most (none here)
	}
	for k, v := range peak {
		b, ok := bounds[k]
		if !ok {
			t.Errorf("table %s (peak %d) has no bound in this test", k, v)
			continue
		}
		if v > b {
			t.Errorf("table %s grew to %d, want at most %d", k, v, b)
		}
	}
	// The open flows peaked at what the timeout holds (TCP ones close).
	if peak["nflows"] < 1000 {
		t.Errorf("at most %d flows open at once: the test retired nothing late", peak["nflows"])
	}
}

// TestRetireContinued: a UDP flow (netfilter NAT) idle past the flow
// timeout is retired; when its client speaks again the next packets make
// a new flow, with a new id, that says which one it continues and has the
// same verdict: conntrack does not report the connection again (its entry
// still stands), which proves nothing against netfilter here.
func TestRetireContinued(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	ready := flowtest.At(0)
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:    ready,
	})
	at := ready.Add(200 * time.Second) // long after the start: conntrack's silence would tell
	for _, o := range churnFlow(7, obs.UDP, svc, be, at) {
		e.Add(o)
	}
	// A second exchange 5 s later: conntrack keeps the stream's entry 120 s.
	for _, o := range resent(churnFlow(7, obs.UDP, svc, be, at.Add(5*time.Second))) {
		e.Add(o)
	}
	if got := e.Retire(at.Add(35 * time.Second)); len(got) != 0 {
		t.Fatalf("retired %d flows before the timeout", len(got))
	}
	first := e.Retire(at.Add(66 * time.Second))
	if len(first) != 1 || first[0].RewrittenAt != flow.PlaceNetfilter || first[0].Backend != be {
		t.Fatalf("retired %+v, want one netfilter flow to %s", first, be)
	}
	// The same socket again, 90 s later: no socket event (connected long
	// ago), no conntrack event (its entry stands).
	again := at.Add(90 * time.Second)
	for _, o := range resent(churnFlow(7, obs.UDP, svc, be, again)) {
		e.Add(o)
	}
	fs := e.Flows()
	if len(fs) != 1 {
		t.Fatalf("%d flows open, want 1", len(fs))
	}
	f := fs[0]
	if f.ID == first[0].ID || f.Continues != first[0].ID {
		t.Errorf("flow id %d continues %d; want a new id continuing %d", f.ID, f.Continues, first[0].ID)
	}
	if f.RewrittenAt != flow.PlaceNetfilter || f.Backend != be {
		t.Errorf("continued flow: %s to %s (%s), want netfilter to %s", f.RewrittenAt, f.Backend, f.Reason, be)
	}
	if f.First.Before(again) {
		t.Errorf("continued flow first seen %s, before it spoke again (%s): the retired flow's evidence leaked into it", f.First, again)
	}
	if sum := e.Summary(); sum.Flows != 2 || sum.RewrittenAt[flow.PlaceNetfilter] != 2 {
		t.Errorf("summary %d flows, %v", sum.Flows, sum.RewrittenAt)
	}
}

// TestRetireContinuedKeepsItsNATRule: a UDP flow that continues a retired
// one rides the conntrack entry its connection made, so it reached the
// backend of the rule of that time even when a rollout since replaced the
// rule (seen in a 25-minute run with endpoints replaced every 30 s: a
// resolver's port reused within conntrack's 30 s read 'no NAT rule read
// names backend'). Its by names that rule, as the retired flow's does.
func TestRetireContinuedKeepsItsNATRule(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	other := netip.MustParseAddrPort("10.244.20.77:5353")
	ready := flowtest.At(0)
	at := ready.Add(200 * time.Second)
	again := at.Add(20 * time.Second) // within conntrack's 30 s for a UDP entry
	rule := func(endpoint string, b netip.AddrPort) flow.NATRule {
		return flow.NATRule{Source: "nftables", Table: "ip kube-proxy", Chain: "service-ZXCVB-default/dns/udp/dns",
			VIP: svc, Proto: obs.UDP, Backends: []netip.AddrPort{b}, Rule: endpoint + " dnat to " + b.String()}
	}
	old, cur := rule("endpoint-OLD", be), rule("endpoint-NEW", other)
	old.Until, cur.Since = at.Add(15*time.Second), at.Add(15*time.Second) // the rollout, between the two
	e := flow.NewEngine(flow.Config{
		Services:    []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		Points:      map[obs.Point]bool{obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:       ready,
		FlowTimeout: 10 * time.Second,
		Attribution: flow.Attribution{NATRules: []flow.NATRule{old, cur}},
	})
	for _, o := range churnFlow(7, obs.UDP, svc, be, at) {
		e.Add(o)
	}
	first := e.Retire(at.Add(14 * time.Second))
	if len(first) != 1 || !strings.Contains(first[0].By, "endpoint-OLD") {
		t.Fatalf("retired %+v, want one flow by endpoint-OLD", first)
	}
	for _, o := range churnFlow(7, obs.UDP, svc, be, again) {
		if o.Point != obs.PointConntrack { // its entry stands: no event
			e.Add(o)
		}
	}
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Continues != first[0].ID {
		t.Fatalf("flows %+v, want one continuing flow %d", fs, first[0].ID)
	}
	if f := fs[0]; f.RewrittenAt != flow.PlaceNetfilter || f.Backend != be || !strings.Contains(f.By, "endpoint-OLD") || strings.Contains(f.By, "no NAT rule") {
		t.Errorf("continued flow: %s to %s by %q; want netfilter to %s by endpoint-OLD, the rule its conntrack entry was made by", f.RewrittenAt, f.Backend, f.By, be)
	}
	// Its entry gone (a resolver's entry lives 30 s), the port's next
	// datagram makes a new one, to a backend of the rules then in force.
	e.Retire(again.Add(14 * time.Second))
	for _, o := range churnFlow(7, obs.UDP, svc, other, again.Add(40*time.Second)) {
		e.Add(o)
	}
	if fs := e.Flows(); len(fs) != 1 || fs[0].Backend != other || !strings.Contains(fs[0].By, "endpoint-NEW") || strings.Contains(fs[0].By, "no NAT rule") {
		t.Errorf("flows %+v, want one to %s by endpoint-NEW, the rule of its time", fs, other)
	}
}

// TestLateConntrackOfAClosedConnection: conntrack events stamped when read,
// 1.5 s after the connection closed (the reader kept off the CPUs: seen in
// a 25-minute run, 48 connections at once), are that connection's when its
// flow, whose SYN was seen, still owes them: not a new connection of the
// port, which was reported as a second flow of conntrack alone, unanswered.
func TestLateConntrackOfAClosedConnection(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}},
		Points:   map[obs.Point]bool{obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
	})
	at := flowtest.At(0)
	var late []obs.Observation
	var closed time.Time
	for _, o := range closingFlow(3, svc, be, at) {
		if o.Point == obs.PointConntrack {
			late = append(late, o)
			continue
		}
		closed = o.Time
		e.Add(o)
	}
	for _, o := range late {
		o.Time = closed.Add(1500 * time.Millisecond)
		e.Add(o)
	}
	fs := e.RetireAll()
	if len(fs) != 1 || fs[0].RewrittenAt != flow.PlaceNetfilter || !fs[0].Reply {
		for _, f := range fs {
			t.Logf("flow %d: %s, reply %v: %s", f.ID, f.RewrittenAt, f.Reply, f.Reason)
		}
		t.Fatalf("%d flows, want one answered netfilter flow", len(fs))
	}
}

// TestRetireTCPReopened: a TCP connection's port reused for a new
// connection (a SYN) after the first closed and was retired is a new
// flow that continues nothing.
func TestRetireTCPReopened(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}})
	at := flowtest.At(0)
	for _, o := range closingFlow(3, svc, be, at) {
		e.Add(o)
	}
	if got := e.Retire(at.Add(5 * time.Second)); len(got) != 0 {
		t.Fatalf("a closed connection retired %v after its close: its reordered observations may still come", got)
	}
	first := e.Retire(at.Add(10 * time.Second))
	if len(first) != 1 {
		t.Fatalf("closed connection not retired 10 s after its close: %v", first)
	}
	for _, o := range closingFlow(3, svc, be, at.Add(20*time.Second)) {
		e.Add(o)
	}
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Continues != 0 || fs[0].ID == first[0].ID || fs[0].RewrittenAt != flow.PlaceNetfilter {
		t.Errorf("reopened: %+v, want one new netfilter flow continuing none", fs)
	}
}

// TestRetiredHandles: the packets of a retired flow still held (a pcapng
// writes them later) get its final comment, which nothing the engine
// learns later changes; their handle counts no more packets (Repeat), and
// the next packet of the same tuple makes a new flow with its own comment.
func TestRetiredHandles(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}})
	c := netip.MustParseAddrPort("10.244.9.1:40000")
	at := flowtest.At(0)
	pkt := obs.Observation{Time: at, Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.TCP, TCPFlags: 0x10, Src: c, Dst: svc, Len: 60}
	h, ok := e.AddPacket(pkt)
	if !ok {
		t.Fatal("no handle")
	}
	before, ok := e.CommentOf(&h)
	if !ok || !strings.HasPrefix(before, "flow 1 ") {
		t.Fatalf("comment %q, %v", before, ok)
	}
	if got := e.Retire(at.Add(2 * time.Minute)); len(got) != 1 || got[0].ID != 1 {
		t.Fatalf("retired %+v", got)
	}
	// What changes every open flow's verdict must not change a retired one's.
	e.SetTCPrograms([]flow.TCProgram{{Direction: "ingress", Kind: "tcx", Name: "lb", ID: 9}})
	if s, ok := e.CommentOf(&h); !ok || s != before {
		t.Errorf("retired flow's comment %q, %v; want %q", s, ok, before)
	}
	pkt.Time = at.Add(3 * time.Minute)
	if e.Repeat(&h, obs.PointPod, pkt.Time, 60) {
		t.Error("a retired flow's handle counted a packet")
	}
	h2, ok := e.AddPacket(pkt)
	if !ok {
		t.Fatal("no handle for the new flow")
	}
	if s, _ := e.CommentOf(&h2); !strings.HasPrefix(s, "flow 2 ") {
		t.Errorf("new flow's comment %q, want flow 2", s)
	}
	if s, _ := e.CommentOf(&h); s != before {
		t.Errorf("retired flow's comment %q after a new flow of its tuple; want %q", s, before)
	}
	if fs := e.Flows(); len(fs) != 1 || fs[0].ID != 2 || fs[0].Continues != 1 {
		t.Errorf("open flows %+v, want flow 2 continuing 1", fs)
	}
}

// TestRetireContinuedConntrackOnly: where conntrack alone told of netfilter
// (no netfilter observer), the continued flow of a retired UDP flow gets
// no conntrack event (its entry stands): that silence must not exclude
// netfilter (a flow first seen this long after the start otherwise proves
// netfilter did not track it), and it was taken for tc.
func TestRetireContinuedConntrackOnly(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	ready := flowtest.At(0)
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:    ready,
	})
	var retired []flow.Flow
	for i, at := range []time.Time{ready.Add(200 * time.Second), ready.Add(290 * time.Second)} {
		for _, o := range churnFlow(7, obs.UDP, svc, be, at) {
			switch o.Point {
			case obs.PointNFBefore, obs.PointNFAfter, obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
				continue
			case obs.PointConntrack:
				if i > 0 {
					continue
				}
			}
			e.Add(o)
		}
		if i == 0 { // a second exchange: conntrack keeps the stream's entry 120 s
			for _, o := range resent(churnFlow(7, obs.UDP, svc, be, at.Add(5*time.Second))) {
				if o.Point != obs.PointNFBefore && o.Point != obs.PointNFAfter {
					e.Add(o)
				}
			}
		}
		retired = append(retired, e.Retire(at.Add(70*time.Second))...)
	}
	if len(retired) != 2 || retired[0].RewrittenAt != flow.PlaceNetfilter {
		t.Fatalf("retired %+v, want 2 flows, the first netfilter", retired)
	}
	f := retired[1]
	if f.Continues != retired[0].ID || f.RewrittenAt != flow.PlaceUnknown || !strings.Contains(f.Reason, "continues flow") {
		t.Errorf("continued flow: continues %d, %s (%s); want unknown continuing flow %d", f.Continues, f.RewrittenAt, f.Reason, retired[0].ID)
	}
}

// TestRetireQuietNodeMakesDeferredGuess: a backend guess put off for a
// flow (its packet to an address it did not know came 10 ms after its
// last activity) is made before the flow is retired, although no
// observation came since to move the engine's clock and expire it: the
// end of a bounded run makes it (Settle), and so must a run until
// stopped on a quiet node.
func TestRetireQuietNodeMakesDeferredGuess(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	c := netip.MustParseAddrPort("10.244.9.1:40000")
	at := flowtest.At(0)
	obsv := []obs.Observation{
		{Time: at, Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.TCP, Src: c, Dst: svc, Len: 60},
		{Time: at.Add(10 * time.Millisecond), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: c, Dst: be, Len: 60},
	}
	cfg := flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}}
	ref := flow.NewEngine(cfg)
	for _, o := range obsv {
		ref.Add(o)
	}
	ref.Stopping(at.Add(time.Second))
	want := ref.Flows()
	e := flow.NewEngine(cfg)
	for _, o := range obsv {
		e.Add(o)
	}
	got := e.Retire(at.Add(2 * time.Minute))
	if len(want) != 1 || want[0].Backend != be {
		t.Fatalf("the end of a bounded run reports %+v; the test expects backend %s", want, be)
	}
	if len(got) != 1 || got[0].Backend != be {
		t.Errorf("retired %+v, want backend %s as the end of a run reports it", got, be)
	}
}

// TestRetireUDPLongGapContinuesNothing: a UDP client endpoint that speaks
// again longer after its retired flow than conntrack keeps an entry
// starts afresh: a new flow that continues nothing, whose conntrack
// silence counts as for any flow.
func TestRetireUDPLongGapContinuesNothing(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}})
	at := flowtest.At(0)
	for _, o := range churnFlow(7, obs.UDP, svc, be, at) {
		e.Add(o)
	}
	if got := e.Retire(at.Add(2 * time.Minute)); len(got) != 1 {
		t.Fatalf("retired %d flows, want 1", len(got))
	}
	for _, o := range churnFlow(7, obs.UDP, svc, be, at.Add(10*time.Minute)) {
		e.Add(o)
	}
	if fs := e.Flows(); len(fs) != 1 || fs[0].Continues != 0 || fs[0].RewrittenAt != flow.PlaceNetfilter {
		t.Errorf("flows %+v, want one netfilter flow continuing none", fs)
	}
}

// TestRetireForgottenMayBeContinued: on a busy node the engine remembers
// fewer retired flows than it retires; a UDP flow resumed after its
// retired flow was forgotten, within conntrack's entry life, gets no
// conntrack event either (the entry stands): where conntrack alone told of
// netfilter, that silence must not exclude netfilter (it was taken for tc).
func TestRetireForgottenMayBeContinued(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	ready := flowtest.At(0)
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:    ready,
		MaxFlows: 4096,
	})
	t0 := ready.Add(200 * time.Second)
	add := func(i int, at time.Time, conntrack bool) {
		for _, o := range churnFlow(i, obs.UDP, svc, be, at) {
			switch o.Point {
			case obs.PointNFBefore, obs.PointNFAfter, obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
				continue
			case obs.PointConntrack:
				if !conntrack {
					continue
				}
			}
			e.Add(o)
		}
	}
	const n = 9000 // more than the engine remembers (2 x 4096)
	retired := 0
	for i := range n {
		at := t0.Add(time.Duration(i) * time.Millisecond)
		add(i, at, true)
		if i%1000 == 999 || i == n-1 {
			retired += len(e.Retire(at.Add(70 * time.Second)))
		}
	}
	if retired != n {
		t.Fatalf("retired %d flows, want %d", retired, n)
	}
	add(0, t0.Add(100*time.Second), false) // flow 0's client again, its entry standing
	fs := e.Flows()
	if len(fs) != 1 {
		t.Fatalf("%d flows open, want 1", len(fs))
	}
	if f := fs[0]; f.RewrittenAt == flow.PlaceTC || f.RewrittenAt == flow.PlaceNowhere || !strings.Contains(f.Reason, "may continue") {
		t.Errorf("resumed flow: %s (%s); want no verdict that excludes netfilter on conntrack's silence", f.RewrittenAt, f.Reason)
	}
}

// TestRetireRefusedStaysRefused: a flow refused for want of room stays
// refused for its life when a retired flow makes room meanwhile: its
// packets after the rewrite are refused with its client, and the rest
// made a flow of its own, "unknown" (no point saw it rewritten) with a
// reason that blamed the node.
func TestRetireRefusedStaysRefused(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}, MaxFlows: 1})
	at := flowtest.At(0)
	for _, o := range churnFlow(1, obs.TCP, svc, be, at) {
		e.Add(o) // flow A takes the only room
	}
	b := churnFlow(2, obs.TCP, svc, be, at.Add(50*time.Second)) // flow B, refused at first
	for _, o := range b[:7] {                                   // up to netfilter after NAT
		e.Add(o)
	}
	if got := e.Retire(time.Time{}); len(got) != 0 {
		t.Fatalf("retired %d flows before A's timeout", len(got))
	}
	if got := e.Retire(at.Add(61 * time.Second)); len(got) != 1 {
		t.Fatalf("retired %d flows, want A", len(got))
	}
	for _, o := range b[7:] {
		e.Add(o)
	}
	if fs := e.Flows(); len(fs) != 0 {
		t.Errorf("flow B, refused at its start, followed from its middle: %s %s (%s)", fs[0].Client, fs[0].RewrittenAt, fs[0].Reason)
	}
	if s := e.Summary(); s.Drops[flow.DropFlowsOverMax] != 1 || s.Flows != 1 {
		t.Errorf("summary: %d flows, %d over max; want 1 and 1", s.Flows, s.Drops[flow.DropFlowsOverMax])
	}
}

// TestRetireRefusedUDPEndsWhenSilent: in a run until stopped, a UDP flow
// refused beyond MaxFlows in a burst is over once silent for the flow
// timeout, as an admitted one would have been retired: the endpoint's
// next datagram, with room again, is a flow of its own (it stayed refused,
// and uncounted, for the rest of the run where no socket observer named
// its sockets, as for an outside client). While it keeps sending, even
// only through Repeat, it stays refused (TestRetireRefusedStaysRefused).
func TestRetireRefusedUDPEndsWhenSilent(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}, MaxFlows: 1, FlowTimeout: 20 * time.Second})
	// Packets only: no socket observer names the sockets.
	exchange := func(i int, at time.Time) (hs []flow.Handle) {
		for _, o := range churnFlow(i, obs.UDP, svc, be, at) {
			switch o.Point {
			case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress:
				continue
			}
			if h, ok := e.AddPacket(o); ok {
				hs = append(hs, h)
			}
		}
		return hs
	}
	at := flowtest.At(0)
	exchange(1, at)                                // flow A takes the only room
	refused := exchange(2, at.Add(time.Second))[0] // flow B, refused
	if !refused.Refused() {
		t.Fatal("flow B was not refused")
	}
	if got := e.Retire(at.Add(30 * time.Second)); len(got) != 1 {
		t.Fatalf("retired %d flows, want A", len(got))
	}
	// B goes on sending, its packets counted by Repeat: past the recheck
	// one goes to Add, which sees B still active.
	pod := refused
	for sec := 2; sec <= 40; sec++ {
		if !e.Repeat(&pod, obs.PointPod, at.Add(time.Duration(sec)*time.Second), 74) {
			h, ok := e.AddPacket(obs.Observation{Time: at.Add(time.Duration(sec) * time.Second), Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.UDP,
				Src: netip.MustParseAddrPort("10.244.9.3:32768"), Dst: svc, Len: 74})
			if !ok || !h.Refused() {
				t.Fatalf("B's packet at %ds, in its stream, was not refused: followed from its middle", sec)
			}
			pod = h
		}
	}
	// A packet of B's stream that Repeat never saw (another point's first,
	// a kind forgotten by the capture path) finds it active too.
	if h, ok := e.AddPacket(obs.Observation{Time: at.Add(41 * time.Second), Point: obs.PointHost, Dir: obs.DirIn, Proto: obs.UDP,
		Src: netip.MustParseAddrPort("10.244.9.3:32768"), Dst: svc, Len: 74}); !ok || !h.Refused() {
		t.Fatal("B's packet at 41s, in its stream, was not refused: followed from its middle")
	}
	if fs := e.Flows(); len(fs) != 0 {
		t.Fatalf("flows %+v while B keeps sending, want none", fs)
	}
	// Silent for longer than the flow timeout, B's endpoint sends again.
	exchange(2, at.Add(5*time.Minute))
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Client != netip.MustParseAddrPort("10.244.9.3:32768") || fs[0].Backend != be {
		t.Fatalf("flows %+v, want the endpoint's new exchange followed", fs)
	}
	if s := e.Summary(); s.Drops[flow.DropFlowsOverMax] != 1 || s.Flows != 2 {
		t.Errorf("summary: %d flows, %d over max; want 2 and 1", s.Flows, s.Drops[flow.DropFlowsOverMax])
	}
}

// TestRetireSYNRetryContinues: a connection whose SYNs get no answer (a
// backend that drops them) retransmits with gaps that double (32 s, 64 s
// with more retries than the default): retired in between, its next SYN
// continues it. Conntrack reported the connection at its first SYN only;
// without that, its silence excluded netfilter for the retransmissions.
func TestRetireSYNRetryContinues(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	c := netip.MustParseAddrPort("10.244.9.1:40000")
	ready := flowtest.At(0)
	e := flow.NewEngine(flow.Config{
		Services:    []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}},
		Points:      map[obs.Point]bool{obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:       ready,
		FlowTimeout: 20 * time.Second,
	})
	syn := func(at time.Time, conntrack bool) {
		e.Add(obs.Observation{Time: at, Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.TCP, TCPFlags: 0x02, Src: c, Dst: svc, Len: 60})
		e.Add(obs.Observation{Time: at.Add(10 * time.Microsecond), Point: obs.PointHost, Dir: obs.DirIn, Proto: obs.TCP, TCPFlags: 0x02, Src: c, Dst: svc, Len: 60})
		if conntrack {
			e.Add(obs.Observation{Time: at.Add(20 * time.Microsecond), Point: obs.PointConntrack, Proto: obs.TCP, Src: c, Dst: svc, NATDst: be})
		}
		e.Add(obs.Observation{Time: at.Add(30 * time.Microsecond), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, TCPFlags: 0x02, Src: c, Dst: be, Len: 60})
	}
	t0 := ready.Add(10 * time.Second)
	for _, s := range []int{0, 1, 3, 7, 15, 31} {
		syn(t0.Add(time.Duration(s)*time.Second), s == 0)
	}
	first := e.Retire(t0.Add(60 * time.Second))
	if len(first) != 1 || first[0].RewrittenAt != flow.PlaceNetfilter {
		t.Fatalf("retired %+v, want the connection, netfilter", first)
	}
	syn(t0.Add(63*time.Second), false) // its next retransmission
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Continues != first[0].ID {
		t.Fatalf("flows %+v, want one continuing flow %d", fs, first[0].ID)
	}
	if p := fs[0].RewrittenAt; p == flow.PlaceTC || p == flow.PlaceNowhere {
		t.Errorf("the retransmissions: %s (%s); conntrack's silence excluded netfilter", p, fs[0].Reason)
	}
}

// socketLBFlow is a flow whose VIP a socket LB (connect4) rewrote: no
// packet ever names the VIP, only the socket event does.
func socketLBFlow(proto obs.Proto, c, svc, be netip.AddrPort, cookie uint64, at time.Time) []obs.Observation {
	seq := []obs.Observation{
		{Point: obs.PointSockAddr, Kind: obs.SockConnect, Cookie: cookie, Src: netip.AddrPortFrom(c.Addr(), 0), Dst: be, ReqDst: svc, PID: 4242, Comm: "client", Cgroup: 9001, Time: at.Add(-50 * time.Microsecond)},
		{Point: obs.PointSockEgress, Cookie: cookie, Src: c, Dst: be, Len: 60, Time: at.Add(-time.Microsecond)},
	}
	for j := range seq {
		seq[j].Proto = proto
	}
	return append(seq, socketLBPackets(proto, c, be, at)...)
}

// socketLBPackets are the packets of one exchange of a socket LB's flow.
func socketLBPackets(proto obs.Proto, c, be netip.AddrPort, at time.Time) []obs.Observation {
	seq := []obs.Observation{
		{Point: obs.PointPod, Ifname: "pod:eth0", Dir: obs.DirOut, Src: c, Dst: be, Len: 74},
		{Point: obs.PointHost, Ifname: "host:veth-a", Dir: obs.DirIn, Src: c, Dst: be, Len: 74},
		{Point: obs.PointUplink, Ifname: "uplink:bond0", Dir: obs.DirOut, Src: c, Dst: be, Len: 74, VLAN: 200},
		{Point: obs.PointUplink, Ifname: "uplink:bond0", Dir: obs.DirIn, Src: be, Dst: c, Len: 74, VLAN: 200},
		{Point: obs.PointHost, Ifname: "host:veth-a", Dir: obs.DirOut, Src: be, Dst: c, Len: 74},
		{Point: obs.PointPod, Ifname: "pod:eth0", Dir: obs.DirIn, Src: be, Dst: c, Len: 74},
	}
	for j := range seq {
		seq[j].Proto, seq[j].Time = proto, at.Add(time.Duration(j)*10*time.Microsecond)
	}
	return seq
}

// TestRetireContinuedSocketLB: with a socket LB (Cilium's, the lab's
// socket mode) no packet names the VIP; a connection (or a connected UDP
// socket) idle past the flow timeout that speaks again sends to its
// backend, with no socket event (it connected long ago). Its packets are
// a new flow continuing the retired one, rewritten at the socket as a
// bounded run says of it, not observations matched to nothing
// (Summary.Unmatched): the flow log lost them silently.
func TestRetireContinuedSocketLB(t *testing.T) {
	for _, tc := range []struct {
		proto   obs.Proto
		svc, be netip.AddrPort
	}{
		{obs.TCP, netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")},
		{obs.UDP, netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")},
	} {
		t.Run(tc.proto.String(), func(t *testing.T) {
			ready := flowtest.At(0)
			e := flow.NewEngine(flow.Config{
				Services: []flow.Service{{Addr: tc.svc.Addr(), Port: tc.svc.Port(), Proto: tc.proto}},
				Points:   map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockState: true, obs.PointSockEgress: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
				Ready:    ready,
			})
			c := netip.MustParseAddrPort("10.244.8.23:40001")
			at := ready.Add(time.Second)
			for _, o := range socketLBFlow(tc.proto, c, tc.svc, tc.be, 77, at) {
				e.Add(o)
			}
			// A second exchange: conntrack keeps a UDP stream's entry 120 s.
			for _, o := range socketLBPackets(tc.proto, c, tc.be, at.Add(5*time.Second)) {
				e.Add(o)
			}
			first := e.Retire(at.Add(66 * time.Second))
			if len(first) != 1 || first[0].RewrittenAt != flow.PlaceSocket || first[0].Backend != tc.be {
				t.Fatalf("retired %+v, want one socket flow to %s", first, tc.be)
			}
			again := at.Add(90 * time.Second)
			for _, o := range socketLBPackets(tc.proto, c, tc.be, again) {
				e.Add(o)
			}
			if got := e.Retire(again.Add(5 * time.Second)); len(got) != 0 {
				t.Fatalf("retired %+v 5 s after it spoke again", got)
			}
			fs := e.Flows()
			if len(fs) != 1 {
				t.Fatalf("%d flows open after the idle socket spoke again, want 1 (unmatched %d)", len(fs), e.Summary().Unmatched)
			}
			f := fs[0]
			if f.ID == first[0].ID || f.Continues != first[0].ID {
				t.Errorf("flow id %d continues %d; want a new id continuing %d", f.ID, f.Continues, first[0].ID)
			}
			if f.Service != tc.svc || f.RewrittenAt != flow.PlaceSocket || f.Backend != tc.be || !f.Reply {
				t.Errorf("continued flow: %s via %s at %s to %s, reply %v (%s); want %s at socket to %s with its reply", f.Client, f.Service, f.RewrittenAt, f.Backend, f.Reply, f.Reason, tc.svc, tc.be)
			}
			if f.First.Before(again) {
				t.Errorf("continued flow first seen %s, before it spoke again (%s)", f.First, again)
			}
			if u := e.Summary().Unmatched; u != 0 {
				t.Errorf("%d observations matched no flow", u)
			}
		})
	}
}

// TestRetireSocketLBPortReusedByNewSocket: behind a socket LB, a new
// socket (a resolver's socket per query) that reuses the port of a retired
// flow, its packets delivered before its socket's events, makes one new
// flow that its events claim: not a flow "joined" by another socket
// (flows_joined), and its process is its own.
func TestRetireSocketLBPortReusedByNewSocket(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	ready := flowtest.At(0)
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: svc.Port(), Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockState: true, obs.PointSockEgress: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
		Ready:    ready,
	})
	c := netip.MustParseAddrPort("10.244.8.23:40001")
	at := ready.Add(time.Second)
	for _, o := range socketLBFlow(obs.UDP, c, svc, be, 77, at) {
		e.Add(o)
	}
	if first := e.Retire(at.Add(61 * time.Second)); len(first) != 1 {
		t.Fatalf("retired %d flows, want 1", len(first))
	}
	again := at.Add(90 * time.Second)
	seq := socketLBFlow(obs.UDP, c, svc, be, 78, again)
	for i := range seq[:2] {
		seq[i].PID, seq[i].Comm = 4343, "other"
	}
	for _, o := range append(seq[2:], seq[:2]...) { // packets first
		e.Add(o)
	}
	e.Retire(again.Add(5 * time.Second))
	fs := e.Flows()
	if len(fs) != 1 || fs[0].RewrittenAt != flow.PlaceSocket || fs[0].Backend != be {
		t.Fatalf("flows %+v, want one socket flow to %s", fs, be)
	}
	if j := e.Summary().Drops[flow.DropFlowsJoined]; j != 0 {
		t.Errorf("flows_joined %d: the new socket's flow counted as joined to another's", j)
	}
	if fs[0].PID != 4343 || fs[0].Comm != "other" {
		t.Errorf("process %d %q, want the new socket's 4343 other", fs[0].PID, fs[0].Comm)
	}
}

// TestSummaryReportedBefore: the summary of a run that retires flows says
// how many it reported before, 0 too (a tool subtracting it from "flows"
// must find it); a bounded run's summary has no such field.
func TestSummaryReportedBefore(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	cfg := flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}}
	at := flowtest.At(0)
	bounded, following := flow.NewEngine(cfg), flow.NewEngine(cfg)
	for _, o := range closingFlow(3, svc, be, at) {
		bounded.Add(o)
		following.Add(o)
	}
	if s := bounded.Summary(); s.ReportedBefore != nil {
		t.Errorf("a bounded run's summary says %d reported before", *s.ReportedBefore)
	}
	following.Retire(at.Add(time.Second)) // too soon: nothing retired
	if s := following.Summary(); s.ReportedBefore == nil || *s.ReportedBefore != 0 {
		t.Errorf("summary of a run until stopped that retired nothing: %+v, want flows_reported_before 0", s.ReportedBefore)
	}
	following.Retire(at.Add(20 * time.Second))
	if s := following.Summary(); s.ReportedBefore == nil || *s.ReportedBefore != 1 || s.Flows != 1 {
		t.Errorf("summary after one flow retired: flows %d, reported before %v", s.Flows, s.ReportedBefore)
	}
}

// TestRetireUntranslatedResetStillOpening: a connection whose server's
// reset reached the client untranslated (testdata's
// netfilter-bridge-untranslated-reset) was refused in nothing the client
// heard of: retired between two SYN retransmissions, its next SYN
// continues it, as an unanswered connection's does.
func TestRetireUntranslatedResetStillOpening(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "netfilter-bridge-untranslated-reset.json"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.Config
	cfg.FlowTimeout = 10 * time.Second
	e := flow.NewEngine(cfg)
	start := s.Observations[0].Time
	var retry []obs.Observation // the SYN retransmitted a second later
	for _, o := range s.Observations {
		if o.Time.Sub(start) < time.Second {
			e.Add(o)
		} else {
			retry = append(retry, o)
		}
	}
	first := e.Retire(start.Add(15 * time.Second))
	if len(first) != 1 {
		t.Fatalf("retired %d flows, want the first attempt's", len(first))
	}
	for _, o := range retry { // the client retransmits 16 s later (after 1, 3, 7 s)
		o.Time = o.Time.Add(15 * time.Second)
		e.Add(o)
	}
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Continues != first[0].ID {
		t.Errorf("after the retransmitted SYN: %+v, want one flow continuing %d", fs, first[0].ID)
	}
}

// TestRetireTCPReusedAfterContinuedClose: an idle keep-alive connection is
// retired by the flow timeout; its close (FINs both ways, the server's
// idle timeout) makes a flow that continues it; then its client port opens
// a new connection to the VIP, whose conntrack event is delivered ahead of
// the taps' blocks with its SYN. That new connection continues nothing:
// the close ended the retired flow's connection. Whether the closed flow
// was retired before (more than 9 s after its close) or not.
func TestRetireTCPReusedAfterContinuedClose(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	c := netip.MustParseAddrPort("10.244.9.1:40000")
	pkt := func(at time.Time, p obs.Point, reply bool, flags uint8) obs.Observation {
		o := obs.Observation{Time: at, Point: p, Ifname: "pod:eth0", Dir: obs.DirOut, Proto: obs.TCP, Src: c, Dst: svc, Len: 60, TCPFlags: flags}
		if p == obs.PointUplink {
			o.Ifname, o.Dst, o.VLAN = "uplink:bond0", be, 200
		}
		if reply {
			o.Dir, o.Src, o.Dst = obs.DirIn, o.Dst, o.Src
		}
		return o
	}
	ms := func(at time.Time, n float64) time.Time { return at.Add(time.Duration(n * float64(time.Millisecond))) }
	exchange := func(at time.Time, flags ...uint8) []obs.Observation {
		var seq []obs.Observation
		for i, f := range flags {
			t0 := ms(at, float64(i))
			seq = append(seq, pkt(t0, obs.PointPod, false, f), pkt(ms(t0, 0.05), obs.PointUplink, false, f))
			if f != 0x10 {
				ack := f
				if f == 0x02 {
					ack = 0x12
				}
				seq = append(seq, pkt(ms(t0, 0.3), obs.PointUplink, true, ack), pkt(ms(t0, 0.35), obs.PointPod, true, ack))
			}
		}
		return seq
	}
	connect := func(at time.Time) []obs.Observation {
		// conntrack's NEW event delivered ahead of the taps' blocks
		ct := obs.Observation{Time: ms(at, 0.1), Point: obs.PointConntrack, Proto: obs.TCP, Src: c, Dst: svc, NATDst: be}
		return append([]obs.Observation{ct}, exchange(at, 0x02, 0x10, 0x18)...)
	}
	for _, retireClosed := range []bool{true, false} {
		ready := flowtest.At(0)
		e := flow.NewEngine(flow.Config{
			Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}},
			Points:   map[obs.Point]bool{obs.PointConntrack: true, obs.PointPod: true, obs.PointUplink: true},
			Ready:    ready,
		})
		at := ready.Add(10 * time.Second)
		for _, o := range connect(at) {
			e.Add(o)
		}
		first := e.Retire(at.Add(61 * time.Second)) // idle: the flow timeout
		if len(first) != 1 {
			t.Fatalf("retired %+v, want the idle connection", first)
		}
		end := at.Add(70 * time.Second)
		for _, o := range exchange(end, 0x11, 0x10) {
			e.Add(o)
		}
		again := end.Add(2 * time.Second)
		if retireClosed {
			if closed := e.Retire(end.Add(10 * time.Second)); len(closed) != 1 || closed[0].Continues != first[0].ID {
				t.Fatalf("closing: retired %+v, want one flow continuing %d", closed, first[0].ID)
			}
			again = end.Add(12 * time.Second)
		}
		for _, o := range connect(again) {
			e.Add(o)
		}
		var fresh []flow.Flow
		for _, f := range e.Flows() {
			if !f.First.Before(again) {
				fresh = append(fresh, f)
			}
		}
		if len(fresh) != 1 || fresh[0].Continues != 0 || fresh[0].RewrittenAt != flow.PlaceNetfilter || fresh[0].Backend != be {
			t.Errorf("closed flow retired %v: the port's new connection: %+v, want one netfilter flow to %s continuing none", retireClosed, fresh, be)
		}
	}
}

// resent is what is seen of a later exchange of a flow of churnFlow's: no
// socket event (it connected before), no conntrack event (its entry
// stands).
func resent(seq []obs.Observation) []obs.Observation {
	return slices.DeleteFunc(seq, func(o obs.Observation) bool {
		switch o.Point {
		case obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointConntrack:
			return true
		}
		return false
	})
}

// TestRetireUDPEntryLife: a retired UDP flow is continued only while its
// conntrack entry stands, as nf_conntrack_udp_packet keeps it: the plain
// timeout after one exchange (or exchanges within 2 s of the first
// packet), the stream one after a reply and a later packet; a datagram
// after that makes a new entry, a new flow. The node's timeouts count.
func TestRetireUDPEntryLife(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	for _, c := range []struct {
		name      string
		exchanges []time.Duration // from the first, of the retired flow
		cfg       flow.Config
		gap       time.Duration // from its last exchange to the next datagram
		continues bool
	}{
		{"one exchange, within the timeout", []time.Duration{0}, flow.Config{}, 25 * time.Second, true},
		{"one exchange, past the timeout", []time.Duration{0}, flow.Config{}, 35 * time.Second, false},
		{"two exchanges in 1 s, past the timeout", []time.Duration{0, time.Second}, flow.Config{}, 35 * time.Second, false},
		{"stream, within its timeout", []time.Duration{0, 5 * time.Second}, flow.Config{}, 110 * time.Second, true},
		{"stream, past its timeout", []time.Duration{0, 5 * time.Second}, flow.Config{}, 125 * time.Second, false},
		{"the node's timeout", []time.Duration{0}, flow.Config{UDPTimeout: 60 * time.Second}, 50 * time.Second, true},
		{"the node's stream timeout", []time.Duration{0, 5 * time.Second}, flow.Config{UDPStreamTimeout: 60 * time.Second}, 70 * time.Second, false},
	} {
		cfg := c.cfg
		cfg.Services = []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}
		cfg.FlowTimeout = 10 * time.Second
		e := flow.NewEngine(cfg)
		at := flowtest.At(0)
		for _, d := range c.exchanges {
			for _, o := range churnFlow(7, obs.UDP, svc, be, at.Add(d)) {
				e.Add(o)
			}
		}
		last := at.Add(c.exchanges[len(c.exchanges)-1])
		first := e.Retire(last.Add(20 * time.Second))
		if len(first) != 1 {
			t.Fatalf("%s: retired %d flows, want 1", c.name, len(first))
		}
		for _, o := range churnFlow(7, obs.UDP, svc, be, last.Add(c.gap)) {
			e.Add(o)
		}
		fs := e.Flows()
		want := 0
		if c.continues {
			want = first[0].ID
		}
		if len(fs) != 1 || fs[0].Continues != want || fs[0].ID == first[0].ID {
			t.Errorf("%s: flows %+v, want one new flow continuing %d", c.name, fs, want)
		}
	}
}

// TestRetireContinuedByNewSocket: a new socket on the port of a retired UDP
// flow (a process per query) whose flow its socket events made, before its
// port was known, continues the retired flow while the conntrack entry
// stands, as a flow its packets made does: it rides that entry, and
// conntrack reports nothing of it.
func TestRetireContinuedByNewSocket(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	for _, c := range []struct {
		gap       time.Duration
		continues bool
	}{{20 * time.Second, true}, {130 * time.Second, false}} {
		e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}, FlowTimeout: 10 * time.Second})
		at := flowtest.At(0)
		add := func(at time.Time, cookie uint64) {
			for _, o := range churnFlow(7, obs.UDP, svc, be, at) {
				if o.Cookie != 0 {
					o.Cookie = cookie
				}
				e.Add(o)
			}
		}
		add(at, 1)
		add(at.Add(3*time.Second), 1) // a stream: its entry stands 120 s
		first := e.Retire(at.Add(20 * time.Second))
		add(at.Add(3*time.Second+c.gap), 2) // its socket's events first, then its packets
		fs := e.Flows()
		want := 0
		if c.continues {
			want = first[0].ID
		}
		if len(first) != 1 || len(fs) != 1 || fs[0].Continues != want {
			t.Errorf("%s later: retired %+v, open %+v; want one open flow continuing %d", c.gap, first, fs, want)
		}
	}
}
