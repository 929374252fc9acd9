package session

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcapgo"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

var (
	client = netip.MustParseAddrPort("10.244.8.23:40000")
	vip    = netip.MustParseAddrPort("10.120.0.10:53")
	base   = time.Unix(1_700_000_000, 0)
)

// udpFrame is an Ethernet/IPv4/UDP frame from src to dst.
func udpFrame(t testing.TB, src, dst netip.AddrPort) []byte {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, EthernetType: layers.EthernetTypeIPv4}
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolUDP, SrcIP: src.Addr().AsSlice(), DstIP: dst.Addr().AsSlice()}
	udp := &layers.UDP{SrcPort: layers.UDPPort(src.Port()), DstPort: layers.UDPPort(dst.Port())}
	udp.SetNetworkLayerForChecksum(ip)
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, eth, ip, udp, gopacket.Payload("query")); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// testTracer is a tracer of two capture points writing its pcapng to out,
// without a kernel: only the consumer side runs.
func testTracer(t testing.TB, out io.Writer) *tracer {
	t.Helper()
	return testTracerOf(t, out, []tap{{label: "pod:eth0", point: obs.PointPod}, {label: "uplink:bond0", point: obs.PointUplink}})
}

// testTracerOf is testTracer with the given capture points.
func testTracerOf(t testing.TB, out io.Writer, taps []tap) *tracer {
	t.Helper()
	ifaces := make([]export.Interface, len(taps))
	for i, tp := range taps {
		ifaces[i] = export.Interface{Name: tp.label, Snaplen: 96}
	}
	w, err := export.NewStream(out, ifaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}}})
	return &tracer{taps: taps, eng: eng, classes: newClassTable(), free: newBatchPool(freeBatches), freeSmall: newBatchPool(freeBatches), freeObs: newBatchPool(freeObsBatches),
		pcap: &pcapOut{w: w, queues: make([][]*batch, len(taps))}}
}

// frames hands tap one batch of request frames captured at the given
// offsets from base.
func frames(t *testing.T, tr *tracer, tapIdx int, offsets ...time.Duration) string {
	t.Helper()
	b := tr.newBatch(tapIdx, false)
	raw := udpFrame(t, client, vip)
	for _, off := range offsets {
		b.add(&capture.Packet{Time: base.Add(off), Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw})
	}
	return tr.consume(b)
}

type readPacket struct {
	iface   int
	at      time.Time
	comment string
}

func readBack(t *testing.T, data []byte) []readPacket {
	t.Helper()
	r, err := pcapgo.NewNgReader(bytes.NewReader(data), pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatal(err)
	}
	var out []readPacket
	for {
		_, ci, opts, err := r.ReadPacketDataWithOptions()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		p := readPacket{iface: ci.InterfaceIndex, at: ci.Timestamp}
		if len(opts.Comments) > 0 {
			p.comment = opts.Comments[0]
		}
		out = append(out, p)
	}
}

// TestPcapMergesPointsInTimeOrder: two points' batches arrive out of time
// order with each other; the file lists every frame in time order, each with
// its flow's comment, and the engine counted every frame.
func TestPcapMergesPointsInTimeOrder(t *testing.T) {
	var out bytes.Buffer
	tr := testTracer(t, &out)
	ms := time.Millisecond
	for _, step := range []struct {
		tap     int
		offsets []time.Duration
	}{
		{1, []time.Duration{1 * ms, 3 * ms, 5 * ms}}, // the uplink's block comes first
		{0, []time.Duration{0, 2 * ms, 4 * ms}},
		{0, []time.Duration{6 * ms, 300 * ms}},
		{1, []time.Duration{7 * ms, 301 * ms}},
	} {
		if reason := frames(t, tr, step.tap, step.offsets...); reason != "" {
			t.Fatalf("stop reason %q", reason)
		}
	}
	// Frames older than the reorder window behind the newest went out already.
	if tr.pcap.held != 2 {
		t.Errorf("%d frames held, want the 2 within %s of the newest", tr.pcap.held, reorderWindow)
	}
	tr.pcap.release(base.Add(time.Hour), tr)
	if err := tr.pcap.w.Close(nil); err != nil { // writes out what the stream batched
		t.Fatal(err)
	}
	got := readBack(t, out.Bytes())
	if len(got) != 10 {
		t.Fatalf("read %d packets, want 10", len(got))
	}
	for i, p := range got {
		if i > 0 && p.at.Before(got[i-1].at) {
			t.Errorf("packet %d at %s is before packet %d at %s", i, p.at.Sub(base), i-1, got[i-1].at.Sub(base))
		}
		if !strings.HasPrefix(p.comment, "flow 1 request to VIP (not translated); rewritten_at=nowhere") {
			t.Errorf("packet %d comment %q", i, p.comment)
		}
	}
	if got[0].iface != 0 || got[1].iface != 1 {
		t.Errorf("first packets on interfaces %d, %d; want 0 (at 0 ms), 1 (at 1 ms)", got[0].iface, got[1].iface)
	}
	flows := tr.eng.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	perPoint := map[string]uint64{}
	for _, p := range flows[0].Points {
		perPoint[p.Point] += p.Packets
	}
	if perPoint["pod"] != 5 || perPoint["uplink"] != 5 {
		t.Errorf("packets per point %v, want pod 5 and uplink 5", perPoint)
	}
	if tr.free.len() == 0 {
		t.Error("no written batch came back for reuse")
	}
}

// TestPcapHoldIsBounded: beyond maxHeld frames the oldest are written even
// within the reorder window, so memory stays bounded whatever the rate.
func TestPcapHoldIsBounded(t *testing.T) {
	tr := testTracer(t, io.Discard)
	offsets := make([]time.Duration, maxBatch)
	for n := 0; n < maxHeld+3*maxBatch; n += maxBatch {
		for i := range offsets {
			offsets[i] = time.Duration(n+i) * time.Microsecond // all within the window
		}
		frames(t, tr, 0, offsets...)
		if tr.pcap.held > maxHeld {
			t.Fatalf("%d frames held, bound is %d", tr.pcap.held, maxHeld)
		}
	}
	if tr.pcap.w.PerInterface()[0] == 0 {
		t.Error("nothing written although the bound was passed")
	}
}

// TestCommentFollowsVerdict: a kind's cached comment is made again once the
// flow's verdict changes, and a frame no flow claims says so.
func TestCommentFollowsVerdict(t *testing.T) {
	tr := testTracer(t, io.Discard)
	tr.eng = flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointPod: true, obs.PointTCHead: true, obs.PointTCTail: true, obs.PointUplink: true},
	})
	raw := udpFrame(t, client, vip)
	p := &capture.Packet{Time: base, Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw}
	f := &frame{pkt: *p}
	if f.known = tr.classify(0, p, &f.h, &f.kindSlot); !f.known {
		t.Fatal("a request to the VIP was not classified")
	}
	first := tr.comment(0, f)
	if !strings.HasPrefix(first, "flow 1 request to VIP") || strings.Contains(first, "rewritten_at") {
		t.Errorf("comment before any rewrite %q", first)
	}
	// The tc head observer sees the VIP, the tail the backend: rewritten at
	// tc. The pod frame's cached comment must follow.
	backend := netip.MustParseAddrPort("10.244.20.31:5353")
	tr.eng.Add(obs.Observation{Time: base.Add(time.Microsecond), Point: obs.PointTCHead, Dir: obs.DirIn, Proto: obs.UDP, Src: client, Dst: vip})
	tr.eng.Add(obs.Observation{Time: base.Add(2 * time.Microsecond), Point: obs.PointTCTail, Dir: obs.DirIn, Proto: obs.UDP, Src: client, Dst: backend})
	if got := tr.eng.Flows()[0].RewrittenAt; got != flow.PlaceTC {
		t.Fatalf("verdict %s, want tc: the test needs a verdict change", got)
	}
	if again := tr.comment(0, f); !strings.HasPrefix(again, "flow 1 request to VIP (before translation); rewritten_at=tc") {
		t.Errorf("comment after the verdict %q (before: %q)", again, first)
	}
	other := udpFrame(t, netip.MustParseAddrPort("10.244.8.99:1000"), netip.MustParseAddrPort("10.0.0.9:9"))
	o := &capture.Packet{Time: base, Dir: obs.DirOut, Len: len(other), CapLen: len(other), Data: other}
	if got := tr.comment(0, &frame{pkt: *o}); got != "no Service flow known for this packet" {
		t.Errorf("comment of an unrelated frame %q", got)
	}
}

// icmpError is an ICMP message from `from` to the quoted packet's source
// that quotes the IPv4 header and first 8 bytes of the frame quoted.
func icmpError(t testing.TB, from netip.Addr, typ, code uint8, quoted []byte) []byte {
	t.Helper()
	q := quoted[14 : 14+20+8]
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, EthernetType: layers.EthernetTypeIPv4}
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolICMPv4, SrcIP: from.AsSlice(), DstIP: net.IP(q[12:16])}
	icmp := &layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, code)}
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}, eth, ip, icmp, gopacket.Payload(q)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestICMPErrorComment: an ICMP error about a flow's request is written with
// a comment naming the error and the flow, is never counted as a packet of
// the flow, and one about no known flow names the quoted tuple.
func TestICMPErrorComment(t *testing.T) {
	var out bytes.Buffer
	tr := testTracer(t, &out)
	gw := netip.MustParseAddr("10.244.8.1")
	req := udpFrame(t, client, vip)
	unreach := icmpError(t, gw, 3, 0, req)
	other := icmpError(t, gw, 11, 0, udpFrame(t, client, netip.MustParseAddrPort("10.0.0.9:9")))
	b := tr.newBatch(0, false)
	for i, raw := range [][]byte{req, unreach, other} {
		dir := obs.DirOut
		if i > 0 {
			dir = obs.DirIn
		}
		b.add(&capture.Packet{Time: base.Add(time.Duration(i) * time.Millisecond), Dir: dir, Len: len(raw), CapLen: len(raw), Data: raw})
	}
	if reason := tr.consume(b); reason != "" {
		t.Fatalf("stop reason %q", reason)
	}
	for i, f := range b.frames { // held: within the reorder window
		if f.known != (i == 0) {
			t.Errorf("frame %d classified as a packet of a flow: %v, want %v", i, f.known, i == 0)
		}
	}
	tr.pcap.release(base.Add(time.Hour), tr)
	if err := tr.pcap.w.Close(nil); err != nil {
		t.Fatal(err)
	}
	got := readBack(t, out.Bytes())
	if len(got) != 3 {
		t.Fatalf("read %d packets, want 3", len(got))
	}
	want := []string{
		"flow 1 request to VIP (before translation)",
		"ICMP destination unreachable (code 0: net unreachable) from 10.244.8.1 about flow 1 request to VIP (before translation)",
		"ICMP time exceeded (code 0: TTL exceeded in transit) from 10.244.8.1 about udp 10.244.8.23:40000 -> 10.0.0.9:9 (no Service flow known for it)",
	}
	for i, p := range got {
		if !strings.HasPrefix(p.comment, want[i]) {
			t.Errorf("packet %d comment %q, want %q", i, p.comment, want[i])
		}
	}
	flows := tr.eng.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	var packets uint64
	for _, p := range flows[0].Points {
		packets += p.Packets
	}
	if packets != 1 {
		t.Errorf("the flow counted %d packets, want the request alone", packets)
	}
	// The unreachable answered the flow: reported with it, not as a reply.
	want1 := &flow.ICMPError{Message: "ICMP destination unreachable (code 0: net unreachable)", From: gw, Point: "pod", At: base.Add(time.Millisecond)}
	if e := flows[0].ICMPError; flows[0].Reply || e == nil || *e != *want1 {
		t.Errorf("flow reply %v, ICMP error %+v; want no reply and %+v", flows[0].Reply, e, want1)
	}
}

// TestDueStop: a capture cut once the run was due (a stream given up) does
// not change why the run ended; a capture cut before it does.
func TestDueStop(t *testing.T) {
	live := context.Background()
	interrupted, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []struct {
		reason   string
		due, ctx context.Context
		want     string
	}{
		{"pcap-error", live, live, "pcap-error"},                // cut while the run went on
		{"pcap-error", interrupted, interrupted, "interrupted"}, // given up after Ctrl-C
		{"pcap-error", interrupted, live, "duration"},           // given up after --duration
		{"max-bytes", interrupted, interrupted, "max-bytes"},
	} {
		if got := dueStop(c.reason, c.due, c.ctx); got != c.want {
			t.Errorf("dueStop(%s, due ended %v, ctx ended %v) = %s, want %s", c.reason, c.due.Err() != nil, c.ctx.Err() != nil, got, c.want)
		}
	}
}

// TestPcapBoundEndsFileOrRun: a reached bound ends the run, or with
// endsFileOnly (an incident's) only the file: the run goes on, the engine
// still counts every frame, and the frames the file had no room for (held
// when it filled, or captured later) are counted, with when it ended.
func TestPcapBoundEndsFileOrRun(t *testing.T) {
	ms := time.Millisecond
	for _, fileOnly := range []bool{false, true} {
		tr := testTracer(t, io.Discard)
		w, err := export.NewStream(io.Discard, []export.Interface{{Name: "pod:eth0"}, {Name: "uplink:bond0"}}, export.Limits{MaxPackets: 3})
		if err != nil {
			t.Fatal(err)
		}
		tr.pcap = &pcapOut{w: w, queues: make([][]*batch, 2), endsFileOnly: fileOnly}
		want := "max-packets"
		if fileOnly {
			want = ""
		}
		// The frames at 0-2 ms leave the hold behind the one at 300 ms and
		// fill the file; the two at 300 ms and up are then held, the last
		// two come after.
		if got := frames(t, tr, 0, 0, 1*ms, 2*ms, 300*ms, 301*ms); got != want {
			t.Errorf("fileOnly %v: stop reason %q when the file filled, want %q", fileOnly, got, want)
		}
		if got := frames(t, tr, 1, 400*ms, 401*ms); got != want {
			t.Errorf("fileOnly %v: stop reason %q after the file filled, want %q", fileOnly, got, want)
		}
		if got := tr.pcap.release(base.Add(time.Hour), tr); got != want {
			t.Errorf("fileOnly %v: stop reason %q at the end, want %q", fileOnly, got, want)
		}
		if n := tr.pcap.w.Packets(); n != 3 {
			t.Errorf("fileOnly %v: %d packets written, want 3", fileOnly, n)
		}
		if tr.pcap.notWritten != 4 || !tr.pcap.endedAt.Equal(base.Add(2*ms)) {
			t.Errorf("fileOnly %v: %d frames not written, ended at %v; want 4, at 2 ms", fileOnly, tr.pcap.notWritten, tr.pcap.endedAt.Sub(base))
		}
		if tr.pcap.held != 0 || len(tr.pcap.heads) != 0 {
			t.Errorf("fileOnly %v: %d frames still held", fileOnly, tr.pcap.held)
		}
		var packets uint64
		for _, p := range tr.eng.Flows()[0].Points {
			packets += p.Packets
		}
		if packets != 7 {
			t.Errorf("fileOnly %v: the flow counted %d packets, want all 7", fileOnly, packets)
		}
	}
}

// TestPcapCommentsFollowTheEngineBetweenReleases: the frames of a flow at
// two taps written by one release share its comment; those written by
// a later one, after the engine learned the flow's rewrite, carry the new
// verdict (a comment is never reused across releases).
func TestPcapCommentsFollowTheEngineBetweenReleases(t *testing.T) {
	var out bytes.Buffer
	// Two taps of the client Pod (its eth0 and a second capture of it):
	// the verdict below needs the VIP seen before tc only.
	tr := testTracerOf(t, &out, []tap{{label: "pod:eth0", point: obs.PointPod}, {label: "pod:eth0-again", point: obs.PointPod}})
	tr.eng = flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointPod: true, obs.PointTCHead: true, obs.PointTCTail: true},
	})
	ms := time.Millisecond
	frames(t, tr, 0, 0, 2*ms)
	frames(t, tr, 1, 1*ms, 3*ms)
	tr.pcap.release(base.Add(10*ms), tr)
	backend := netip.MustParseAddrPort("10.244.20.31:5353")
	tr.eng.Add(obs.Observation{Time: base.Add(time.Microsecond), Point: obs.PointTCHead, Dir: obs.DirIn, Proto: obs.UDP, Src: client, Dst: vip})
	tr.eng.Add(obs.Observation{Time: base.Add(2 * time.Microsecond), Point: obs.PointTCTail, Dir: obs.DirIn, Proto: obs.UDP, Src: client, Dst: backend})
	if got := tr.eng.Flows()[0].RewrittenAt; got != flow.PlaceTC {
		t.Fatalf("verdict %s, want tc: the test needs a verdict change", got)
	}
	frames(t, tr, 0, 6*ms)
	frames(t, tr, 1, 7*ms)
	tr.pcap.release(base.Add(time.Hour), tr)
	if err := tr.pcap.w.Close(nil); err != nil {
		t.Fatal(err)
	}
	got := readBack(t, out.Bytes())
	if len(got) != 6 {
		t.Fatalf("read %d packets, want 6", len(got))
	}
	for i, p := range got {
		rewritten := strings.Contains(p.comment, "rewritten_at=tc")
		if !strings.HasPrefix(p.comment, "flow 1 request to VIP (before translation)") || rewritten != (i >= 4) {
			t.Errorf("packet %d (interface %d) comment %q; rewritten at tc from packet 4 on", i, p.iface, p.comment)
		}
	}
}

// TestPcapBoundEndsFileNamedThen: in a run until stopped, the file a bound
// ended is closed and named PATH then, readable whole while the run goes
// on for days; it stayed PATH.partial until the run stopped (for ever if it
// was killed, and the next run refused to start over it).
func TestPcapBoundEndsFileNamedThen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.pcapng")
	tr := testTracer(t, io.Discard)
	w, err := export.Create(path, []export.Interface{{Name: "pod:eth0"}, {Name: "uplink:bond0"}}, export.Limits{MaxPackets: 3})
	if err != nil {
		t.Fatal(err)
	}
	tr.pcap = &pcapOut{w: w, path: path, queues: make([][]*batch, 2), endsFileOnly: true}
	ms := time.Millisecond
	if got := frames(t, tr, 0, 0, 1*ms, 2*ms, 300*ms, 301*ms); got != "" {
		t.Fatalf("stop reason %q when the file filled, want none", got)
	}
	tr.pcap.endFile(tr.taps) // the run's next tick
	if _, err := os.Stat(path + ".partial"); err == nil {
		t.Errorf("%s.partial still there once the bound ended the file", path)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the file a bound ended is not named %s while the run goes on: %v", path, err)
	}
	if n := len(readBack(t, data)); n != 3 {
		t.Errorf("%d packets in the ended file, want 3", n)
	}
	// The run goes on: frames are counted, a tap that starts is no error.
	if got := frames(t, tr, 1, 400*ms, 401*ms); got != "" {
		t.Errorf("stop reason %q after the file ended, want none", got)
	}
	if got := tr.pcap.addInterface(tap{label: "pod:eth0@new"}, 96); got != "" {
		t.Errorf("a tap added after the file ended: stop reason %q, want none", got)
	}
	tr.pcap.endFile(tr.taps)
	res := tr.pcap.close(tr.taps)
	if res.Error != "" || res.Packets != 3 || res.StopReason != "max-packets" || tr.pcap.notWritten != 4 {
		t.Errorf("summary %+v, %d not written; want 3 packets, max-packets, no error, 4 not written", res, tr.pcap.notWritten)
	}
	if data2, err := os.ReadFile(path); err != nil || !bytes.Equal(data, data2) {
		t.Errorf("the file changed after it ended (%v)", err)
	}
}

// TestPcapReplyWithoutRequestComment: replies from the Service to a client
// whose requests were never seen (a connection begun before the run) are
// in no flow; each frame says so, those that waited for a request within
// the reordering window as well as those counted with the connection after
// it, and the summary counts the connection, nothing unmatched.
func TestPcapReplyWithoutRequestComment(t *testing.T) {
	var out bytes.Buffer
	tr := testTracer(t, &out)
	raw := udpFrame(t, vip, client)
	for _, off := range []time.Duration{0, time.Second, 4 * time.Second, 4*time.Second + time.Millisecond} {
		b := tr.newBatch(0, false)
		b.add(&capture.Packet{Time: base.Add(off), Dir: obs.DirIn, Len: len(raw), CapLen: len(raw), Data: raw})
		if reason := tr.consume(b); reason != "" {
			t.Fatalf("stop reason %q", reason)
		}
	}
	tr.pcap.release(base.Add(time.Hour), tr)
	if err := tr.pcap.w.Close(nil); err != nil {
		t.Fatal(err)
	}
	got := readBack(t, out.Bytes())
	if len(got) != 4 {
		t.Fatalf("read %d packets, want 4", len(got))
	}
	for i, p := range got {
		if p.comment != flow.CommentReplyWithoutRequest {
			t.Errorf("packet %d comment %q, want %q", i, p.comment, flow.CommentReplyWithoutRequest)
		}
	}
	if fs := tr.eng.Flows(); len(fs) != 0 {
		t.Errorf("%d flows, want none: %+v", len(fs), fs)
	}
	if s := tr.eng.Summary(); s.RepliesWithoutRequest != 1 || s.Unmatched != 0 {
		t.Errorf("replies_without_request %d, unmatched %d; want 1, 0", s.RepliesWithoutRequest, s.Unmatched)
	}
}

// TestCommentOfFrameWhoseFlowCameLater: a Pod that started during the run
// sends before the next look finds it; the uplink's frame of its request,
// to the backend, waits in the engine for its flow until the Pod's socket
// events, kept meanwhile, are added once it is found, over a second later,
// and the engine then counts it in that flow. Its comment names that flow:
// it was written 200 ms after its capture, saying no Service flow was known,
// while the report counted it in the flow.
func TestCommentOfFrameWhoseFlowCameLater(t *testing.T) {
	var out bytes.Buffer
	tr := testTracer(t, &out)
	tr.eng = flow.NewEngine(flow.Config{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Points:   map[obs.Point]bool{obs.PointPod: true, obs.PointSockAddr: true, obs.PointSockEgress: true, obs.PointUplink: true},
	})
	newPod := netip.MustParseAddrPort("10.244.8.77:41000")
	backend := netip.MustParseAddrPort("10.244.20.31:5353")
	b := tr.newBatch(1, false)
	raw := udpFrame(t, newPod, backend)
	b.add(&capture.Packet{Time: base, Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw})
	if reason := tr.consume(b); reason != "" {
		t.Fatalf("stop reason %q", reason)
	}
	if b.frames[0].known {
		t.Fatal("the new Pod's frame had a flow before its socket events: the test needs one that waits")
	}
	ms := time.Millisecond
	// Another Pod's requests go on meanwhile: the file moves past the frame.
	for _, at := range []time.Duration{100 * ms, 400 * ms, 700 * ms, 1000 * ms} {
		frames(t, tr, 0, at)
	}
	// The Pod is found: its socket events of before are added.
	for _, o := range []obs.Observation{
		{Time: base.Add(-50 * time.Microsecond), Point: obs.PointSockAddr, Kind: obs.SockSendmsg, Proto: obs.UDP, Src: newPod, Dst: vip, ReqDst: vip, Cookie: 9},
		{Time: base.Add(-20 * time.Microsecond), Point: obs.PointSockEgress, Proto: obs.UDP, Src: newPod, Dst: backend, Cookie: 9, Len: 40},
	} {
		tr.add(o)
	}
	for _, at := range []time.Duration{1300 * ms, 1600 * ms} {
		frames(t, tr, 0, at)
	}
	tr.eng.Settle()
	tr.pcap.release(base.Add(time.Hour), tr)
	if err := tr.pcap.w.Close(nil); err != nil {
		t.Fatal(err)
	}
	var counted uint64
	var id int
	for _, f := range tr.eng.Flows() {
		if f.Client == newPod {
			id = f.ID
			for _, p := range f.Points {
				if p.Point == "uplink" {
					counted += p.Packets
				}
			}
		}
	}
	if counted != 1 {
		t.Fatalf("the new Pod's flow counted %d uplink frames, want its 1: the test needs the engine to count it", counted)
	}
	for _, p := range readBack(t, out.Bytes()) {
		if want := fmt.Sprintf("flow %d request to backend", id); p.iface == 1 && !strings.HasPrefix(p.comment, want) {
			t.Errorf("the new Pod's uplink frame: comment %q, want its flow's, in which the report counts it", p.comment)
		}
	}
}

// TestCommentOfFrameStillWaiting: a frame the engine keeps waiting for its
// flow is held no longer than the engine's window: written then (a quiet
// node, whose engine's clock stands still), its comment says that its flow
// may still come, not that there is none.
func TestCommentOfFrameStillWaiting(t *testing.T) {
	var out bytes.Buffer
	tr := testTracer(t, &out)
	b := tr.newBatch(1, false)
	raw := udpFrame(t, netip.MustParseAddrPort("10.244.8.77:41000"), netip.MustParseAddrPort("10.244.20.31:5353"))
	b.add(&capture.Packet{Time: base, Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw})
	tr.consume(b)
	tr.pcap.release(base.Add(time.Second), tr) // a tick
	if tr.pcap.held != 1 {
		t.Fatalf("%d frames held a second later, want the waiting one", tr.pcap.held)
	}
	tr.pcap.release(base.Add(flow.WaitWindow), tr)
	if err := tr.pcap.w.Close(nil); err != nil {
		t.Fatal(err)
	}
	if got := readBack(t, out.Bytes()); len(got) != 1 || got[0].comment != commentFlowNotYetKnown {
		t.Errorf("read %+v, want the frame with the comment %q", got, commentFlowNotYetKnown)
	}
}

// TestPcapDiskFullNamesFileOnDisk: a capture cut by a full disk is still
// renamed to PATH at the end; the error the summary gives (and the CLI
// prints) names the file there, not PATH.partial, which no longer exists.
func TestPcapDiskFullNamesFileOnDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a small tmpfs")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=256k"); err != nil {
		t.Skipf("cannot mount a small tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	path := filepath.Join(dir, "c.pcapng")
	tr := testTracer(t, io.Discard)
	w, err := export.Create(path, []export.Interface{{Name: "pod:eth0"}, {Name: "uplink:bond0"}}, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	tr.pcap = &pcapOut{w: w, path: path, queues: make([][]*batch, 2)}
	for i := range 100000 {
		if frames(t, tr, 0, time.Duration(i)*time.Millisecond) != "" {
			break // the disk is full
		}
	}
	res := tr.pcap.close(tr.taps)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the cut capture is not at %s: %v", path, err)
	}
	if !strings.Contains(res.Error, "no space left") || !strings.Contains(res.Error, path) || strings.Contains(res.Error, ".partial") {
		t.Errorf("error %q, want the full disk's, naming %s as it is on disk", res.Error, path)
	}
}
