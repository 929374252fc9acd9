package flow_test

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// reply is a reply from the VIP to client at the host veth's TX tap, ms
// after the base time, with TCP flags f.
func reply(ms float64, f uint8) obs.Observation {
	return obs.Observation{Time: flowtest.At(ms), Point: obs.PointHost, Dir: obs.DirOut, Proto: obs.TCP, Src: vip, Dst: client, Len: 66, TCPFlags: f}
}

// TestRepliesWithoutRequest: replies of a connection none of whose requests
// is seen make no flow. Within the reordering window they wait (their
// request may be in another ring's later block) and are not counted yet;
// past it the connection counts, its later replies are counted with it at
// once (a handle Repeat takes), and nothing is unmatched.
func TestRepliesWithoutRequest(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
	first := reply(0, 0x18)
	if _, ok := e.AddPacket(first); ok {
		t.Fatal("a reply whose request was never seen was counted in a flow at once; it must wait for its request")
	}
	if !e.ReplyWithoutRequest(first) {
		t.Error("ReplyWithoutRequest = false for a reply whose connection has no flow (its comment)")
	}
	if s := e.Summary(); s.RepliesWithoutRequest != 0 {
		t.Errorf("replies_without_request %d within the reordering window, want 0 (its request may come)", s.RepliesWithoutRequest)
	}
	e.AddPacket(reply(1000, 0x18))
	h, ok := e.AddPacket(reply(4000, 0x18))
	if !ok || !h.ReplyOnly() {
		t.Fatalf("a reply past the reordering window: handle %v ReplyOnly %v, want a reply-only handle", ok, h.ReplyOnly())
	}
	if _, ok := e.CommentOf(&h); ok {
		t.Error("CommentOf names a flow for a reply-only handle")
	}
	if !e.Repeat(&h, obs.PointHost, flowtest.At(4001), 66) {
		t.Error("Repeat refused a reply-only handle's next packet")
	}
	if fs := e.Flows(); len(fs) != 0 {
		t.Fatalf("%d flows, want none (a reply alone has no request to decide on): %+v", len(fs), fs)
	}
	s := e.Summary()
	if s.RepliesWithoutRequest != 1 || s.RequestedAfterReplies != 0 || s.Unmatched != 0 || s.Flows != 0 {
		t.Errorf("summary replies_without_request %d, requested_after_replies %d, unmatched %d, flows %d; want 1, 0, 0, 0",
			s.RepliesWithoutRequest, s.RequestedAfterReplies, s.Unmatched, s.Flows)
	}
	if n, ok := s.Drops[flow.DropRepliesForgotten]; !ok || n != 0 {
		t.Errorf("drop %s = %d (present %v), want 0, present", flow.DropRepliesForgotten, n, ok)
	}
}

// TestRepliesWithoutRequestFlood: a stream of replies alone (a server
// pushing datagrams to a client of before the run) keeps only its first
// replies waiting for a request; the rest are counted with the connection
// at once: the waiting room neither overflows nor counts a loss.
func TestRepliesWithoutRequestFlood(t *testing.T) {
	cfg := httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink)
	cfg.MaxFlows = 4096
	e := flow.NewEngine(cfg)
	var last flow.Handle
	for i := range 10000 {
		if h, ok := e.AddPacket(reply(float64(i)*0.1, 0x18)); ok {
			last = h
		}
	}
	if !last.ReplyOnly() {
		t.Error("the stream's last reply has no reply-only handle")
	}
	if z := e.Sizes()["waiting.queue"]; z > 64 {
		t.Errorf("%d observations wait, want at most the connection's first 64", z)
	}
	e.Stopping(flowtest.At(1000))
	s := e.Summary()
	if s.RepliesWithoutRequest != 1 || s.Drops[flow.DropUnmatchedOverflow] != 0 || s.Unmatched != 0 || s.Flows != 0 {
		t.Errorf("replies_without_request %d, unmatched_overflow %d, unmatched %d, flows %d; want 1, 0, 0, 0",
			s.RepliesWithoutRequest, s.Drops[flow.DropUnmatchedOverflow], s.Unmatched, s.Flows)
	}
}

// TestRepliesWithoutRequestAtTheEnd: a connection whose replies came in the
// last moments of the run counts once the run is stopping: no request is to
// come.
func TestRepliesWithoutRequestAtTheEnd(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
	e.AddPacket(reply(0, 0x18))
	e.Stopping(flowtest.At(100))
	if s := e.Summary(); s.RepliesWithoutRequest != 1 || s.Unmatched != 0 {
		t.Errorf("replies_without_request %d, unmatched %d once stopping; want 1, 0", s.RepliesWithoutRequest, s.Unmatched)
	}
}

// TestRepliesWithoutRequestThenRequest: a connection counted by its replies
// whose client then speaks is a flow from then on (began before the run),
// counted apart (requested_after_replies); the handles of its replies are
// stale, so that its next replies go to the flow.
func TestRepliesWithoutRequestThenRequest(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink))
	e.AddPacket(reply(0, 0x18))
	h, ok := e.AddPacket(reply(4000, 0x18))
	if !ok || !h.ReplyOnly() {
		t.Fatal("no reply-only handle past the reordering window")
	}
	e.AddPacket(flags(req(5000, obs.PointHost, obs.DirIn, vip), 0x10))
	if e.Repeat(&h, obs.PointHost, flowtest.At(5001), 66) {
		t.Error("Repeat counted a reply with its reply-only connection after a request made its flow")
	}
	if h2, ok := e.AddPacket(reply(5001, 0x18)); !ok || h2.ReplyOnly() {
		t.Errorf("a reply after the request: handle %v ReplyOnly %v, want its flow's", ok, h2.ReplyOnly())
	}
	if e.ReplyWithoutRequest(reply(5001, 0x18)) {
		t.Error("ReplyWithoutRequest still true once the connection has a flow")
	}
	fs := e.Flows()
	if len(fs) != 1 || !fs[0].BeganBeforeRun || !fs[0].Reply {
		t.Fatalf("flows %+v, want one that began before the run, with a reply", fs)
	}
	s := e.Summary()
	if s.RepliesWithoutRequest != 0 || s.RequestedAfterReplies != 1 {
		t.Errorf("replies_without_request %d, requested_after_replies %d; want 0, 1", s.RepliesWithoutRequest, s.RequestedAfterReplies)
	}
}

// TestRepliesWithoutRequestBounded: the connections remembered are bounded
// (two generations of 4096 at --max-flows 4096); those forgotten still
// count, and are counted as forgotten (a later reply of one would count it
// again).
func TestRepliesWithoutRequestBounded(t *testing.T) {
	cfg := httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink)
	cfg.MaxFlows = 4096
	e := flow.NewEngine(cfg)
	const n = 2*4096 + 10
	for i := range n {
		o := reply(float64(i)*2, 0x18) // a few hundred waiting at once: no overflow
		o.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(9 + i/256), byte(i)}), 40000)
		e.AddPacket(o)
	}
	e.Stopping(flowtest.At(float64(n) * 2))
	s := e.Summary()
	if s.RepliesWithoutRequest != n {
		t.Errorf("replies_without_request %d, want %d", s.RepliesWithoutRequest, n)
	}
	if z := e.Sizes()["replyOnly"]; z > 2*4096 {
		t.Errorf("%d connections remembered, want at most 2*4096", z)
	}
	if got := s.Drops[flow.DropRepliesForgotten]; got != 4096 {
		t.Errorf("%s %d, want 4096 (the older generation, dropped once the newer filled)", flow.DropRepliesForgotten, got)
	}
	if s.Drops[flow.DropUnmatchedOverflow] != 0 || s.Unmatched != 0 || s.Flows != 0 {
		t.Errorf("unmatched_overflow %d, unmatched %d, flows %d; want 0", s.Drops[flow.DropUnmatchedOverflow], s.Unmatched, s.Flows)
	}
}

// TestBeganBeforeRun: a TCP flow whose first packets seen are mid-connection
// (no SYN, no SYN-ACK, no connect()) began before the run: it says so first
// in its reason, its verdict rests on its packets (tc here: the tcx head
// saw the VIP, the uplink the backend, the netfilter observer never saw it
// at a NAT hook), and the server's RST that ends
// it refuses nothing. Seen from its SYN, or from its SYN-ACK (its SYN not
// captured), it began during the run.
func TestBeganBeforeRun(t *testing.T) {
	points := []obs.Point{obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointUplink}
	rst := reply(0.9, 0x14)
	for _, tc := range []struct {
		name string
		obs  []obs.Observation
		want bool
	}{
		{"mid-connection", []obs.Observation{
			flags(req(0, obs.PointHost, obs.DirIn, vip), 0x18), flags(req(0.1, obs.PointTCHead, obs.DirIn, vip), 0x18),
			flags(req(0.2, obs.PointNFBefore, obs.DirUnknown, backend), 0x18), flags(req(0.3, obs.PointUplink, obs.DirOut, backend), 0x18), reply(0.5, 0x10), rst}, true},
		{"from its SYN", []obs.Observation{
			flags(req(0, obs.PointHost, obs.DirIn, vip), 0x02), flags(req(0.1, obs.PointTCHead, obs.DirIn, vip), 0x02),
			flags(req(0.2, obs.PointNFBefore, obs.DirUnknown, backend), 0x02), flags(req(0.3, obs.PointUplink, obs.DirOut, backend), 0x02), reply(0.5, 0x12),
			flags(req(0.6, obs.PointHost, obs.DirIn, vip), 0x10), rst}, false},
		{"from its SYN-ACK", []obs.Observation{
			reply(0.5, 0x12), flags(req(0.6, obs.PointHost, obs.DirIn, vip), 0x10),
			flags(req(0.65, obs.PointTCHead, obs.DirIn, vip), 0x10),
			flags(req(0.66, obs.PointNFBefore, obs.DirUnknown, backend), 0x10), flags(req(0.7, obs.PointUplink, obs.DirOut, backend), 0x10), rst}, false},
	} {
		e := flow.NewEngine(httpConfig(points...))
		for _, o := range tc.obs {
			e.Add(o)
		}
		fs := e.Flows()
		if len(fs) != 1 {
			t.Fatalf("%s: %d flows, want 1: %+v", tc.name, len(fs), fs)
		}
		f := fs[0]
		if f.BeganBeforeRun != tc.want || strings.HasPrefix(f.Reason, "the connection began before the run") != tc.want {
			t.Errorf("%s: began_before_run %v, reason %q; want %v, said first", tc.name, f.BeganBeforeRun, f.Reason, tc.want)
		}
		if f.RewrittenAt != flow.PlaceTC {
			t.Errorf("%s: rewritten_at %s, want tc (from the packets): %s", tc.name, f.RewrittenAt, f.Reason)
		}
		if tc.want && f.Refused {
			t.Errorf("%s: refused: the RST ending a connection seen from its middle refuses nothing", tc.name)
		}
		if s := e.Summary(); s.RepliesWithoutRequest != 0 {
			t.Errorf("%s: replies_without_request %d, want 0", tc.name, s.RepliesWithoutRequest)
		}
		if !tc.want {
			continue
		}
		// Once a tap lost frames, the handshake may have been among them.
		e.CaptureLost(obs.PointPod)
		if r := e.Flows()[0].Reason; !strings.HasPrefix(r, "the connection began before the run (or its handshake was among the frames a capture lost") {
			t.Errorf("%s: reason %q once the Pod's tap lost frames, want it to say the handshake may be lost", tc.name, r)
		}
	}
}

// TestSynAckBeforeItsSyn: a SYN-ACK delivered before its SYN (another
// capture ring's block came first) waits for it: meanwhile its comment says
// no request was seen so far; once the SYN comes it is its flow's, which
// began during the run, and no connection counts as seen by its replies.
func TestSynAckBeforeItsSyn(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointUplink))
	synAck := reply(0.5, 0x12)
	if _, ok := e.AddPacket(synAck); ok {
		t.Fatal("the SYN-ACK was counted before its SYN came: it must wait")
	}
	if !e.ReplyWithoutRequest(synAck) {
		t.Error("ReplyWithoutRequest = false for the SYN-ACK while its SYN is not seen")
	}
	for _, o := range []obs.Observation{
		flags(req(0, obs.PointPod, obs.DirOut, vip), 0x02), flags(req(0.01, obs.PointHost, obs.DirIn, vip), 0x02),
		flags(req(0.02, obs.PointTCHead, obs.DirIn, vip), 0x02),
		flags(req(0.025, obs.PointNFBefore, obs.DirUnknown, backend), 0x02), flags(req(0.03, obs.PointUplink, obs.DirOut, backend), 0x02),
		flags(req(0.6, obs.PointHost, obs.DirIn, vip), 0x10),
	} {
		e.AddPacket(o)
	}
	if e.ReplyWithoutRequest(synAck) {
		t.Error("ReplyWithoutRequest still true once its SYN came")
	}
	if r, ok := e.Classify(synAck); !ok || !r.Reply {
		t.Errorf("Classify(SYN-ACK) = %+v %v, want its flow's reply", r, ok)
	}
	// Past the reordering window nothing changes.
	e.AddPacket(flags(req(5000, obs.PointHost, obs.DirIn, vip), 0x10))
	e.Stopping(flowtest.At(5001))
	fs := e.Flows()
	if len(fs) != 1 || fs[0].BeganBeforeRun || !fs[0].Reply || fs[0].RewrittenAt != flow.PlaceTC {
		t.Fatalf("flows %+v, want one tc flow with a reply that did not begin before the run", fs)
	}
	if s := e.Summary(); s.RepliesWithoutRequest != 0 || s.RequestedAfterReplies != 0 || s.Unmatched != 0 {
		t.Errorf("replies_without_request %d, requested_after_replies %d, unmatched %d; want 0", s.RepliesWithoutRequest, s.RequestedAfterReplies, s.Unmatched)
	}
}

// TestReplyOnlyNotTheClientsOwn: a Pod talks to a backend directly, then
// from the same port to the VIP, NATed to the other backend
// (netfilter-direct-and-vip-same-port). Delivered first, the VIP
// connection's SYN-ACK (from the VIP at the Pod) makes a connection seen by
// its replies alone; the direct connection's SYN to the backend, seen at
// the Pod going there, is not that connection's request, nor are its
// sightings past the Pod: in every order that moves one observation first
// or last, one flow, the VIP's. Before ownRequest, "observation 22 first"
// and "observation 23 first" gave the direct connection a VIP flow of its
// own ("backend 172.29.3.12:80 seen at pod eth0 TX, but no active
// observation point saw the VIP before it").
func TestReplyOnlyNotTheClientsOwn(t *testing.T) {
	s, err := flowtest.Load(scenarioDir + "/netfilter-direct-and-vip-same-port.json")
	if err != nil {
		t.Fatal(err)
	}
	wantInEveryOrder(t, s, movedOrders(len(s.Observations)))
}

// TestRepliesWithoutRequestAfterRetire: in a run until stopped, a reply of
// a connection whose flow was reported as ended (its requests were seen)
// continues that flow, as its request would: it is no connection seen by
// its replies alone. A reply of a connection never seen stays one: the
// engine remembers at most two generations of them (Sizes).
func TestRepliesWithoutRequestAfterRetire(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointConntrack: true, obs.PointPod: true, obs.PointHost: true, obs.PointUplink: true},
	})
	at := flowtest.At(0)
	seq := churnFlow(7, obs.UDP, svc, be, at)
	for _, o := range seq {
		e.Add(o)
	}
	// A second exchange 5 s later: conntrack keeps the stream's entry 120 s.
	for _, o := range resent(churnFlow(7, obs.UDP, svc, be, at.Add(5*time.Second))) {
		e.Add(o)
	}
	first := e.Retire(at.Add(66 * time.Second))
	if len(first) != 1 {
		t.Fatalf("retired %d flows, want 1", len(first))
	}
	late := seq[len(seq)-1] // the answer at the Pod, from the VIP
	late.Time = at.Add(67 * time.Second)
	e.Add(late)
	stranger := late
	stranger.Dst = netip.AddrPortFrom(late.Dst.Addr(), late.Dst.Port()+1)
	e.Add(stranger)
	e.Stopping(at.Add(68 * time.Second))
	fs := e.Flows()
	if len(fs) != 1 || fs[0].Continues != first[0].ID || fs[0].Client != late.Dst {
		t.Fatalf("flows %+v, want one of %s continuing flow %d", fs, late.Dst, first[0].ID)
	}
	if s := e.Summary(); s.RepliesWithoutRequest != 1 {
		t.Errorf("replies_without_request %d, want 1 (%s's, never seen before)", s.RepliesWithoutRequest, stranger.Dst)
	}
	if n := e.Sizes()["replyOnly"]; n != 1 {
		t.Errorf("%d connections remembered by their replies alone, want 1", n)
	}
}

// TestRepliesOfRefusedFlows: beyond MaxFlows, a refused flow's replies and
// the kernel's drops of its packets are refused with it: no connection
// counts as seen by its replies alone, nothing waits for a flow that will
// never be made (the waiting room would overflow on a busy DNS client's
// node, whose every new socket is a flow), nothing is unmatched.
func TestRepliesOfRefusedFlows(t *testing.T) {
	for _, proto := range []obs.Proto{obs.TCP, obs.UDP} {
		t.Run(proto.String(), func(t *testing.T) { testRepliesOfRefusedFlows(t, proto) })
	}
}

func testRepliesOfRefusedFlows(t *testing.T, proto obs.Proto) {
	cfg := httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink, obs.PointDrop)
	cfg.Services[0].Proto = proto
	cfg.MaxFlows = 2
	e := flow.NewEngine(cfg)
	const n = 50
	for i := range n {
		c := netip.AddrPortFrom(client.Addr(), uint16(41000+i))
		ms := float64(i)
		e.Add(obs.Observation{Time: flowtest.At(ms), Point: obs.PointHost, Dir: obs.DirIn, Proto: proto, Src: c, Dst: vip, Len: 74, TCPFlags: 0x02})
		e.Add(obs.Observation{Time: flowtest.At(ms + 0.2), Point: obs.PointHost, Dir: obs.DirOut, Proto: proto, Src: vip, Dst: c, Len: 74, TCPFlags: 0x12})
		// The client's socket is gone: the kernel drops its last reply.
		e.Add(obs.Observation{Time: flowtest.At(ms + 0.4), Point: obs.PointDrop, Proto: proto, Src: vip, Dst: c, Len: 54, TCPFlags: 0x10,
			NetNS: 1, Drop: &obs.KernelDrop{Reason: "NO_SOCKET"}})
	}
	if z := e.Sizes()["waiting.queue"]; z != 0 {
		t.Errorf("%d observations wait for a flow, want none (the refused flows' replies and drops are refused with them)", z)
	}
	e.Settle()
	s := e.Summary()
	if s.Flows != cfg.MaxFlows || s.Drops[flow.DropFlowsOverMax] != n-uint64(cfg.MaxFlows) || s.RepliesWithoutRequest != 0 || s.Unmatched != 0 {
		t.Errorf("flows %d, flows_over_max %d, replies_without_request %d, unmatched %d; want %d, %d, 0, 0",
			s.Flows, s.Drops[flow.DropFlowsOverMax], s.RepliesWithoutRequest, s.Unmatched, cfg.MaxFlows, n-cfg.MaxFlows)
	}
	for _, f := range e.Flows() {
		if len(f.KernelDrops) != 1 || f.KernelDrops[0].Direction != "reply" || f.KernelDrops[0].Reason != "NO_SOCKET" {
			t.Errorf("flow %d (%v): kernel drops %+v, want its reply's NO_SOCKET", f.ID, f.Client, f.KernelDrops)
		}
	}
}

// TestDropOfReplyWithoutRequest: the kernel's drop of a reply of a
// connection seen by its replies alone is taken with that connection: it
// does not wait for a flow that its requests never make.
func TestDropOfReplyWithoutRequest(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink, obs.PointDrop))
	e.AddPacket(reply(0, 0x18))
	e.AddPacket(reply(4000, 0x18))
	before := e.Sizes()["waiting.queue"]
	e.Add(obs.Observation{Time: flowtest.At(4001), Point: obs.PointDrop, Proto: obs.TCP, Src: vip, Dst: client, Len: 66, TCPFlags: 0x18,
		NetNS: 1, Drop: &obs.KernelDrop{Reason: "NO_SOCKET"}})
	if z := e.Sizes()["waiting.queue"]; z != before {
		t.Errorf("the drop of a reply-only connection's reply waits (%d observations waiting, %d before it)", z, before)
	}
	if fs := e.Flows(); len(fs) != 0 {
		t.Errorf("%d flows, want none", len(fs))
	}
}

// TestDropsOfOnePlaceCountedTogether: the drops of one kernel address are
// one entry, whether or not their events named its function yet (the probe
// reads a new address's function aside: its first events come without).
func TestDropsOfOnePlaceCountedTogether(t *testing.T) {
	e := flow.NewEngine(httpConfig(obs.PointPod, obs.PointHost, obs.PointUplink, obs.PointDrop))
	e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointHost, Dir: obs.DirIn, Proto: obs.TCP, Src: client, Dst: vip, Len: 74, TCPFlags: 0x02})
	for i, fn := range []string{"", "nft_do_chain [nf_tables]", ""} {
		e.Add(obs.Observation{Time: flowtest.At(1 + float64(i)), Point: obs.PointDrop, Proto: obs.TCP, Src: vip, Dst: client, Len: 74, TCPFlags: 0x12,
			NetNS: 1, Ifindex: 3, Drop: &obs.KernelDrop{Reason: "NETFILTER_DROP", Location: 0xffffffffc0a01234, Func: fn}})
	}
	e.Add(obs.Observation{Time: flowtest.At(4), Point: obs.PointDrop, Proto: obs.TCP, Src: vip, Dst: client, Len: 74, TCPFlags: 0x12,
		NetNS: 1, Ifindex: 3, Drop: &obs.KernelDrop{Reason: "NETFILTER_DROP", Location: 0xffffffffc0a05678, Func: "nft_do_chain [nf_tables]"}})
	fs := e.Flows()
	if len(fs) != 1 {
		t.Fatalf("%d flows, want 1", len(fs))
	}
	var got []string
	for _, d := range fs[0].KernelDrops {
		got = append(got, fmt.Sprintf("%d %s", d.Count, d.String()))
	}
	want := []string{"3 NETFILTER_DROP in nft_do_chain [nf_tables] (netns 1, ifindex 3)", "1 NETFILTER_DROP in nft_do_chain [nf_tables] (netns 1, ifindex 3)"}
	if !slices.Equal(got, want) {
		t.Errorf("kernel drops %q, want %q", got, want)
	}
}
