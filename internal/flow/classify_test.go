package flow_test

import (
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestVerdictCacheNeverStale feeds every scenario one observation at a time,
// in every order, with every flow's verdict cached before each observation:
// the cache must always equal a fresh decision.
func TestVerdictCacheNeverStale(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range scenarios {
		t.Run(s.Name, func(t *testing.T) {
			for name, order := range orders(s) {
				if order == nil {
					order = make([]int, len(s.Observations))
					for i := range order {
						order[i] = i
					}
				}
				e := flow.NewEngine(s.Config)
				for step, i := range order {
					e.Add(s.Observations[i])
					if stale := e.StaleVerdicts(); len(stale) > 0 {
						t.Fatalf("%s order, step %d: stale cached verdicts for flows %v", name, step, stale)
					}
					if bad := e.BriefMismatches(); len(bad) > 0 {
						t.Fatalf("%s order, step %d: the verdict without its reason differs for flows %v", name, step, bad)
					}
					e.WarmVerdicts()
				}
			}
		})
	}
}

func TestVerdictCacheFollowsAttribution(t *testing.T) {
	const cgroup = 77
	e := flow.NewEngine(httpConfig(obs.PointSockAddr, obs.PointPod))
	e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockConnect,
		Proto: obs.TCP, Src: client, ReqDst: vip, Dst: backend, Cookie: 1, Cgroup: cgroup})
	pkt := req(1, obs.PointPod, obs.DirOut, backend)
	e.Add(pkt)
	before, ok := e.Classify(pkt)
	if !ok || before.Verdict != flow.PlaceSocket || before.By != "" {
		t.Fatalf("before attribution: %+v %v, want socket without a rewriter", before, ok)
	}
	e.SetCgroupSockPrograms(cgroup, []flow.SockProgram{{AttachType: "connect4", Name: "lab_sock4", ID: 5}})
	after, _ := e.Classify(pkt)
	if after.By != "connect4 lab_sock4 (id 5)" {
		t.Errorf("after attribution: by = %q, want the cgroup's connect4 program", after.By)
	}
	if stale := e.StaleVerdicts(); len(stale) > 0 {
		t.Errorf("stale verdicts %v", stale)
	}
}

// TestVerdictCacheFollowsActivePoints: a point's first observation changes
// the verdicts of flows it never saw (here, why the VIP was not followed).
func TestVerdictCacheFollowsActivePoints(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod))
	pkt := req(0, obs.PointPod, obs.DirOut, vip)
	e.Add(pkt)
	e.WarmVerdicts()
	other := obs.Observation{Time: flowtest.At(1), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP,
		Src: netip.MustParseAddrPort("10.244.8.24:40200"), Dst: vip}
	e.Add(other) // the uplink is active from now on
	if stale := e.StaleVerdicts(); len(stale) > 0 {
		t.Errorf("stale verdicts %v after the uplink became active", stale)
	}
	if f := e.Flows()[0]; !strings.Contains(f.Reason, "the uplink never saw this flow") {
		t.Errorf("reason %q does not say the active uplink missed the flow", f.Reason)
	}
}

// TestVerdictCacheFollowsProcess: the cgroup learned later selects other
// sock_addr programs.
func TestVerdictCacheFollowsProcess(t *testing.T) {
	const cgroup = 77
	cfg := httpConfig(obs.PointSockAddr, obs.PointSockState)
	cfg.Attribution.SockPrograms = []flow.SockProgram{{AttachType: "connect4", Name: "root_lb", ID: 4}}
	cfg.Attribution.SockProgramsByCgroup = map[uint64][]flow.SockProgram{
		cgroup: {{AttachType: "connect4", Name: "pod_lb", ID: 5}},
	}
	e := flow.NewEngine(cfg)
	e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockConnect,
		Proto: obs.TCP, ReqDst: vip, Dst: backend, Cookie: 1})
	e.Add(obs.Observation{Time: flowtest.At(1), Point: obs.PointSockState, Proto: obs.TCP,
		Src: client, Dst: backend, Cookie: 1})
	e.WarmVerdicts()
	// A later sighting at the same point: only the process is new.
	e.Add(obs.Observation{Time: flowtest.At(2), Point: obs.PointSockState, Proto: obs.TCP,
		Src: client, Dst: backend, Cookie: 1, Cgroup: cgroup, PID: 42})
	if stale := e.StaleVerdicts(); len(stale) > 0 {
		t.Errorf("stale verdicts %v after the cgroup was learned", stale)
	}
	if r, ok := e.Classify(req(2, obs.PointPod, obs.DirOut, backend)); !ok || !strings.Contains(r.By, "pod_lb") {
		t.Errorf("Classify = %+v %v, want the cgroup's program pod_lb", r, ok)
	}
}

func TestClassify(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink))
	podReq := req(0, obs.PointPod, obs.DirOut, vip)
	uplinkReq := req(3, obs.PointUplink, obs.DirOut, backend)
	uplinkReply := obs.Observation{Time: flowtest.At(4), Point: obs.PointUplink, Dir: obs.DirIn,
		Proto: obs.TCP, Src: backend, Dst: client}
	podReply := obs.Observation{Time: flowtest.At(5), Point: obs.PointPod, Dir: obs.DirIn,
		Proto: obs.TCP, Src: vip, Dst: client}

	if _, ok := e.Classify(podReq); ok {
		t.Fatal("classified a packet of a flow the engine has not seen")
	}
	e.Add(podReq)
	e.Add(req(1, obs.PointNFBefore, obs.DirUnknown, vip))

	// The backend is not known yet: Classify must neither find nor learn it.
	flowsBefore := e.Flows()
	if _, ok := e.Classify(uplinkReq); ok {
		t.Error("classified a packet to a backend the flow has not learned")
	}
	if got := e.Flows(); !reflect.DeepEqual(got, flowsBefore) || len(e.BackendWatches()) != 0 {
		t.Errorf("Classify changed the engine: flows %+v -> %+v, backends %v", flowsBefore, got, e.BackendWatches())
	}

	r, ok := e.Classify(podReq)
	if !ok || r.Reply || r.Translated || r.Verdict != flow.PlaceUnknown {
		t.Errorf("pod request before NAT was seen: %+v %v", r, ok)
	}
	e.Add(req(2, obs.PointNFAfter, obs.DirUnknown, backend))
	for _, o := range []obs.Observation{uplinkReq, uplinkReply, podReply} {
		e.Add(o)
	}
	id := only(t, e).ID
	for _, tc := range []struct {
		name              string
		o                 obs.Observation
		reply, translated bool
	}{
		{"pod request", podReq, false, false},
		{"uplink request", uplinkReq, false, true},
		{"uplink reply", uplinkReply, true, true},
		{"pod reply", podReply, true, false},
	} {
		r, ok := e.Classify(tc.o)
		want := flow.Ref{ID: id, Reply: tc.reply, Translated: tc.translated, Verdict: flow.PlaceNetfilter}
		if !ok || r != want {
			t.Errorf("%s: Classify = %+v %v, want %+v", tc.name, r, ok, want)
		}
	}
	stranger := obs.Observation{Point: obs.PointUplink, Proto: obs.TCP,
		Src: netip.MustParseAddrPort("10.244.9.9:5555"), Dst: backend}
	if _, ok := e.Classify(stranger); ok {
		t.Error("classified another client's packet to the same backend")
	}
}

func TestRefComment(t *testing.T) {
	tests := []struct {
		ref  flow.Ref
		want string
	}{
		{flow.Ref{ID: 3, Translated: true, Verdict: flow.PlaceSocket, By: "connect4 lab_sock4_connect (id 5)"},
			"flow 3 request to backend (after translation); rewritten_at=socket by=connect4 lab_sock4_connect (id 5)"},
		{flow.Ref{ID: 1, Verdict: flow.PlaceUnknown},
			"flow 1 request to VIP (before translation)"},
		{flow.Ref{ID: 2, Reply: true, Translated: true, Verdict: flow.PlaceNowhere},
			"flow 2 reply from backend (before reverse translation); rewritten_at=nowhere"},
		{flow.Ref{ID: 5, Verdict: flow.PlaceNowhere},
			"flow 5 request to VIP (not translated); rewritten_at=nowhere"},
		{flow.Ref{ID: 6, Reply: true, Verdict: flow.PlaceNowhere},
			"flow 6 reply from VIP (not translated); rewritten_at=nowhere"},
		{flow.Ref{ID: 4, Reply: true, Verdict: flow.PlaceNetfilter, By: "nat"},
			"flow 4 reply from VIP (after reverse translation); rewritten_at=netfilter by=nat"},
	}
	for _, tc := range tests {
		if got := tc.ref.Comment(); got != tc.want {
			t.Errorf("Comment() = %q\n want %q", got, tc.want)
		}
	}
}

// BenchmarkClassify looks up packets of established netfilter-mode flows, as
// a capture writer does once per written packet.
func BenchmarkClassify(b *testing.B) {
	const nflows = 1000
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink))
	var pkts []obs.Observation
	start := flowtest.At(0)
	for i := range nflows {
		src := netip.AddrPortFrom(client.Addr(), uint16(20000+i))
		for _, o := range []obs.Observation{
			{Point: obs.PointPod, Dir: obs.DirOut, Src: src, Dst: vip},
			{Point: obs.PointNFBefore, Src: src, Dst: vip},
			{Point: obs.PointNFAfter, Src: src, Dst: backend},
			{Point: obs.PointUplink, Dir: obs.DirOut, Src: src, Dst: backend},
			{Point: obs.PointUplink, Dir: obs.DirIn, Src: backend, Dst: src},
		} {
			o.Proto, o.Len, o.Time = obs.TCP, 100, start.Add(time.Duration(len(pkts))*time.Microsecond)
			e.Add(o)
			pkts = append(pkts, o)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if r, ok := e.Classify(pkts[i%len(pkts)]); !ok || r.Verdict != flow.PlaceNetfilter {
			b.Fatalf("packet %d: %+v %v", i%len(pkts), r, ok)
		}
	}
}

// TestNoteICMPError: an ICMP error about a flow's request is kept with the
// flow (the earliest one), is no packet of it, and one about no known flow
// is refused.
func TestNoteICMPError(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointUplink))
	e.Add(req(0, obs.PointPod, obs.DirOut, vip))
	e.Add(req(0.1, obs.PointUplink, obs.DirOut, vip))
	gw := netip.MustParseAddr("10.244.8.1")
	quoted := func(ms float64, p obs.Point) obs.Observation {
		return obs.Observation{Time: flowtest.At(ms), Point: p, Proto: obs.TCP, Src: client, Dst: vip}
	}
	if !e.NoteICMPError(quoted(0.5, obs.PointPod), "later", gw) || !e.NoteICMPError(quoted(0.3, obs.PointUplink), "earliest", gw) {
		t.Fatal("an ICMP error about the flow's request found no flow")
	}
	stranger := quoted(0.4, obs.PointUplink)
	stranger.Src = netip.MustParseAddrPort("10.244.8.99:5000")
	if e.NoteICMPError(stranger, "stranger", gw) {
		t.Error("an ICMP error about an unknown flow was taken")
	}
	flows := e.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	f := flows[0]
	if want := (flow.ICMPError{Message: "earliest", From: gw, Point: "uplink", At: flowtest.At(0.3)}); f.ICMPError == nil || *f.ICMPError != want || f.Reply {
		t.Errorf("ICMP error %+v (reply %v), want %+v and no reply", f.ICMPError, f.Reply, want)
	}
	var packets uint64
	for _, p := range f.Points {
		packets += p.Packets
	}
	if packets != 2 {
		t.Errorf("%d packets counted, want the 2 requests", packets)
	}
}

// TestICMPErrorAboutUntranslatedReply: on a bridge with
// bridge-nf-call-iptables 0, a backend Pod's answer to a UDP client that
// sent to the VIP reaches the client from the backend's address; the
// client's kernel answers it with a port unreachable (its socket is
// connected to the VIP). That message is about the reply, not an answer to
// the request: the flow has no icmp_error, no reply, and names the
// untranslated replies and the client's refusal.
func TestICMPErrorAboutUntranslatedReply(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.10:53")
	be := netip.MustParseAddrPort("10.244.8.30:5353")
	cfg := flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: svc.Port(), Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointPod: true, obs.PointHost: true, obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointUplink: true},
	}
	e := flow.NewEngine(cfg)
	o := func(ms float64, p obs.Point, dir obs.Dir, src, dst netip.AddrPort) obs.Observation {
		return obs.Observation{Time: flowtest.At(ms), Point: p, Dir: dir, Proto: obs.UDP, Src: src, Dst: dst, Len: 70}
	}
	for _, x := range []obs.Observation{
		o(0, obs.PointPod, obs.DirOut, client, svc),
		o(0.01, obs.PointHost, obs.DirIn, client, svc),
		o(0.02, obs.PointNFBefore, obs.DirUnknown, client, svc),
		o(0.03, obs.PointNFAfter, obs.DirUnknown, client, be),
		o(0.04, obs.PointHost, obs.DirOut, client, be), // to the backend Pod's veth
		o(0.10, obs.PointHost, obs.DirIn, be, client),
		o(0.11, obs.PointHost, obs.DirOut, be, client),
		o(0.12, obs.PointPod, obs.DirIn, be, client),
	} {
		e.Add(x)
	}
	// The client's port unreachable, seen leaving its Pod, quotes the reply.
	quoted := o(0.13, obs.PointPod, obs.DirOut, be, client)
	if !e.NoteICMPError(quoted, "ICMP destination unreachable (code 3: port unreachable)", client.Addr()) {
		t.Fatal("the ICMP error about the flow's reply found no flow")
	}
	flows := e.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	f := flows[0]
	if f.RewrittenAt != flow.PlaceNetfilter || f.Backend != be {
		t.Errorf("verdict %s backend %s, want netfilter %s", f.RewrittenAt, f.Backend, be)
	}
	if f.ICMPError != nil {
		t.Errorf("icmp_error %+v: the message refused the reply, it did not answer the request", f.ICMPError)
	}
	if f.Reply {
		t.Error("reply true: the client refused the only reply, which came untranslated")
	}
	if u := f.UntranslatedReplies; u == nil || u.From != be || u.Packets != 1 {
		t.Errorf("untranslated replies %+v, want 1 from %s", u, be)
	}
	if want := "10.244.8.23 sent ICMP destination unreachable (code 3: port unreachable) about them"; !strings.Contains(f.Reason, want) {
		t.Errorf("reason %q lacks %q", f.Reason, want)
	}
}

// TestUntranslatedComments: in the capture file, the reply that entered the
// client's Pod from the backend's address says nothing translated it back,
// and the client's reset of it says what it answers, rather than "request
// to backend (after translation)" at a point before any rewrite; so does
// the client's host veth, and the backend Pod's keeps the usual comments.
func TestUntranslatedComments(t *testing.T) {
	c := netip.MustParseAddrPort("10.244.1.10:56800")
	b := netip.MustParseAddrPort("10.244.1.11:8080")
	checkComments(t, "netfilter-bridge-untranslated-reply.json", obs.TCP, 0.2, []commentCase{
		{obs.PointPod, obs.DirIn, b, c, "flow 1 reply from backend, not translated back to the VIP (the client does not take it); rewritten_at=netfilter"},
		{obs.PointPod, obs.DirOut, c, b, "flow 1 to backend from the client, answering a reply that came untranslated; rewritten_at=netfilter"},
		{obs.PointHost, obs.DirOut, b, c, "flow 1 reply from backend, not translated back to the VIP (the client does not take it); rewritten_at=netfilter"},
		{obs.PointHost, obs.DirIn, c, b, "flow 1 to backend from the client, answering a reply that came untranslated; rewritten_at=netfilter"},
		// The backend Pod's side: as usual.
		{obs.PointHost, obs.DirIn, b, c, "flow 1 reply from backend (before reverse translation); rewritten_at=netfilter"},
		{obs.PointHost, obs.DirOut, c, b, "flow 1 request to backend (after translation); rewritten_at=netfilter"},
	})
}

// commentCase is a packet at a point and the start of the comment its
// flow gives it in the capture file.
type commentCase struct {
	p        obs.Point
	dir      obs.Dir
	src, dst netip.AddrPort
	want     string
}

// checkComments runs a scenario and checks the comments of packets at its
// time at (seconds), once every observation is in.
func checkComments(t *testing.T, scenario string, proto obs.Proto, at float64, cases []commentCase) {
	t.Helper()
	s, err := flowtest.Load(filepath.Join(scenarioDir, scenario))
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	for _, o := range s.Observations {
		e.Add(o)
	}
	for _, tc := range cases {
		o := obs.Observation{Time: flowtest.At(at), Point: tc.p, Dir: tc.dir, Proto: proto, Src: tc.src, Dst: tc.dst}
		r, ok := e.Classify(o)
		if !ok || !strings.HasPrefix(r.Comment(), tc.want) {
			t.Errorf("%s %s %s -> %s: comment %q (%v), want it to begin %q", tc.p, tc.dir, tc.src, tc.dst, r.Comment(), ok, tc.want)
		}
	}
}

// TestDirectComments: in the capture file, the datagrams a resolver's
// unconnected socket sent to the backend itself, besides its queries to the
// VIP, and the backend's answers to them, say so at the client's Pod and
// host veth, not that they answer, or are, replies that came untranslated.
func TestDirectComments(t *testing.T) {
	c := netip.MustParseAddrPort("10.244.8.23:57451")
	b := netip.MustParseAddrPort("10.244.20.31:5353")
	vip := netip.MustParseAddrPort("10.120.0.10:53")
	checkComments(t, "udp-unconnected-vip-and-backend-netfilter.json", obs.UDP, 0.6, []commentCase{
		{obs.PointPod, obs.DirOut, c, b, "flow 1 request to backend from the client itself, not to the VIP; rewritten_at=netfilter"},
		{obs.PointPod, obs.DirIn, b, c, "flow 1 reply from backend to the client's own request to it, not to the VIP; rewritten_at=netfilter"},
		{obs.PointHost, obs.DirIn, c, b, "flow 1 request to backend from the client itself, not to the VIP; rewritten_at=netfilter"},
		{obs.PointHost, obs.DirOut, b, c, "flow 1 reply from backend to the client's own request to it, not to the VIP; rewritten_at=netfilter"},
		// The queries to the VIP: as usual.
		{obs.PointPod, obs.DirOut, c, vip, "flow 1 request to VIP (before translation); rewritten_at=netfilter"},
		{obs.PointPod, obs.DirIn, vip, c, "flow 1 reply from VIP (after reverse translation); rewritten_at=netfilter"},
	})
}

// TestSharedCommentsAreEqual: two packets whose handles SharesComment says
// share a comment (the capture file's writer then makes it once for a run
// of them) have the same comment, over every scenario's packets: a reply
// that entered the client's Pod untranslated is commented apart from the
// same reply at another point.
func TestSharedCommentsAreEqual(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	shared := 0
	for _, s := range scenarios {
		e := flow.NewEngine(s.Config)
		var handles []flow.Handle
		for _, o := range s.Observations {
			if o.Point == obs.PointPod || o.Point == obs.PointHost || o.Point == obs.PointUplink {
				if h, ok := e.AddPacket(o); ok {
					handles = append(handles, h)
				}
				continue
			}
			e.Add(o)
		}
		comments := make([]string, len(handles))
		for i := range handles {
			comments[i], _ = e.CommentOf(&handles[i])
		}
		for i := range handles {
			for j := range i {
				if !handles[i].SharesComment(&handles[j]) {
					continue
				}
				shared++
				if comments[i] != comments[j] {
					t.Errorf("%s: packets said to share a comment have %q and %q", s.Name, comments[j], comments[i])
				}
			}
		}
	}
	if shared == 0 {
		t.Fatal("no packets shared a comment: the test checked nothing")
	}
}

// TestICMPErrorQuotingBackend: a tc program rewrote the request to the VIP
// and does not translate ICMP errors back: the backend's port unreachable
// reaches the client's Pod quoting the request to the backend, not to the
// VIP the client sent to, and the client's connected socket never gets it.
// The flow's ICMP error says what it quoted there, and its reason says so;
// the same message with the VIP quoted at the Pod (conntrack translated it
// back) is not flagged.
func TestICMPErrorQuotingBackend(t *testing.T) {
	const message = "ICMP destination unreachable (code 3: port unreachable)"
	for _, tc := range []struct {
		name      string
		atPod     netip.AddrPort // the destination quoted at the Pod's eth0 and host veth
		wantQuote netip.AddrPort
	}{
		{"untranslated", backend, backend},
		{"translated back", vip, netip.AddrPort{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
			e.Add(req(0, obs.PointPod, obs.DirOut, vip))
			e.Add(req(0.01, obs.PointHost, obs.DirIn, vip))
			e.Add(req(0.02, obs.PointUplink, obs.DirOut, backend))
			quoted := func(ms float64, p obs.Point, dir obs.Dir, dst netip.AddrPort) obs.Observation {
				return obs.Observation{Time: flowtest.At(ms), Point: p, Dir: dir, Proto: obs.TCP, Src: client, Dst: dst}
			}
			for _, o := range []obs.Observation{
				quoted(0.1, obs.PointUplink, obs.DirIn, backend),
				quoted(0.11, obs.PointHost, obs.DirOut, tc.atPod),
				quoted(0.12, obs.PointPod, obs.DirIn, tc.atPod),
			} {
				if !e.NoteICMPError(o, message, backend.Addr()) {
					t.Fatalf("the ICMP error at %s found no flow", o.Point)
				}
			}
			flows := e.Flows()
			if len(flows) != 1 || flows[0].ICMPError == nil {
				t.Fatalf("flows %+v, want one with its ICMP error", flows)
			}
			f := flows[0]
			if got := f.ICMPError.QuotedDst; got != tc.wantQuote {
				t.Errorf("quoted_dst %v, want %v", got, tc.wantQuote)
			}
			says := strings.Contains(f.Reason, "quoting its request to "+backend.String()+", not to "+vip.String())
			if says != tc.wantQuote.IsValid() {
				t.Errorf("reason %q: says the quote is untranslated %v, want %v", f.Reason, says, tc.wantQuote.IsValid())
			}
		})
	}
}
