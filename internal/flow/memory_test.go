package flow_test

import (
	"fmt"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// churnFlow is what a node of many Pods in kube-proxy's nftables mode shows
// of one flow of client (Pod i) to svc, DNATed to be: the socket layer, the
// Pod's eth0 and host veth (labelled per Pod, as a session labels them),
// the netfilter observers and conntrack, the uplink, both ways, as the lab
// churn run saw a TCP flow (14 per-point entries; a UDP one has 13).
func churnFlow(i int, proto obs.Proto, svc, be netip.AddrPort, at time.Time) []obs.Observation {
	pod := netip.AddrFrom4([4]byte{10, 244, 9, byte(1 + i%50)})
	c := netip.AddrPortFrom(pod, uint16(32768+i/50))
	podIf, hostIf := fmt.Sprintf("pod:eth0@%s", pod), fmt.Sprintf("host:vp%d", 1+i%50)
	cookie := uint64(1000 + i)
	seq := []obs.Observation{
		{Point: obs.PointSockAddr, Kind: obs.SockConnect, Cookie: cookie, Src: netip.AddrPortFrom(pod, 0), Dst: svc, ReqDst: svc},
		{Point: obs.PointSockState, Cookie: cookie, Src: netip.AddrPortFrom(pod, 0), Dst: svc},
		{Point: obs.PointSockEgress, Cookie: cookie, Src: c, Dst: svc, Len: 60},
		{Point: obs.PointPod, Ifname: podIf, Dir: obs.DirOut, Src: c, Dst: svc, Len: 74},
		{Point: obs.PointHost, Ifname: hostIf, Dir: obs.DirIn, Src: c, Dst: svc, Len: 74},
		{Point: obs.PointNFBefore, Hook: obs.HookPrerouting, Src: c, Dst: svc, Len: 60},
		{Point: obs.PointNFAfter, Hook: obs.HookPrerouting, Src: c, Dst: be, Len: 60},
		{Point: obs.PointConntrack, Src: c, Dst: svc, NATDst: be},
		{Point: obs.PointUplink, Ifname: "uplink:bond0", Dir: obs.DirOut, Src: c, Dst: be, Len: 74, VLAN: 200},
		{Point: obs.PointUplink, Ifname: "uplink:bond0", Dir: obs.DirIn, Src: be, Dst: c, Len: 74, VLAN: 200},
		{Point: obs.PointNFBefore, Hook: obs.HookPrerouting, Src: be, Dst: c, Len: 60},
		{Point: obs.PointNFAfter, Hook: obs.HookPrerouting, Src: be, Dst: c, Len: 60},
		{Point: obs.PointHost, Ifname: hostIf, Dir: obs.DirOut, Src: svc, Dst: c, Len: 74},
		{Point: obs.PointPod, Ifname: podIf, Dir: obs.DirIn, Src: svc, Dst: c, Len: 74},
	}
	for j := range seq {
		seq[j].Proto, seq[j].Time = proto, at.Add(time.Duration(j)*10*time.Microsecond)
	}
	return seq
}

// maxFlowBytes bounds the heap a followed flow keeps (PERFORMANCE.md: "2.4
// KiB each"); the per-point entries of a flow seen at 14 points took 4.8
// KiB when they were 120 bytes each and grew past 12, 3.2 KiB at 88 bytes
// each with their endpoints inline.
const maxFlowBytes = 2560

// TestFlowMemory bounds what a followed flow keeps on the heap: a node's
// --max-flows of them are most of pathtrace's live heap, which the
// collector marks at every cycle under a soft memory limit of 40 MiB (at
// 4.8 KiB a flow, 4096 flows were 20 MiB of the 25 MiB live with 51 Pods,
// and the collector ran without pause once a little more was live).
func TestFlowMemory(t *testing.T) {
	const nflows = 4096
	tcpSvc, udpSvc := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.120.0.10:53")
	tcpBe, udpBe := netip.MustParseAddrPort("10.244.20.31:3000"), netip.MustParseAddrPort("10.244.20.31:5353")
	cfg := flow.Config{
		Services: []flow.Service{{Addr: tcpSvc.Addr(), Port: 80, Proto: obs.TCP}, {Addr: udpSvc.Addr(), Port: 53, Proto: obs.UDP}},
		MaxFlows: nflows,
	}
	var seqs [][]obs.Observation
	start := flowtest.At(0)
	for i := range nflows {
		at := start.Add(time.Duration(i) * time.Millisecond)
		if i%2 == 0 {
			seqs = append(seqs, churnFlow(i, obs.TCP, tcpSvc, tcpBe, at))
		} else {
			seqs = append(seqs, churnFlow(i, obs.UDP, udpSvc, udpBe, at))
		}
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	e := flow.NewEngine(cfg)
	for _, seq := range seqs {
		for _, o := range seq {
			e.Add(o)
		}
	}
	// Past the reordering window: nothing waits any more.
	e.Add(obs.Observation{Point: obs.PointUplink, Time: start.Add(time.Hour)})
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / nflows
	runtime.KeepAlive(e)
	runtime.KeepAlive(seqs)
	if s := e.Summary(); s.Flows != nflows || s.RewrittenAt[flow.PlaceNetfilter] != nflows {
		t.Fatalf("%d flows, %d netfilter; want %d each", s.Flows, s.RewrittenAt[flow.PlaceNetfilter], nflows)
	}
	t.Logf("%.0f bytes per flow", per)
	if per > maxFlowBytes {
		t.Errorf("%.0f bytes per flow, want at most %d", per, maxFlowBytes)
	}
}

// TestCommentsKeptByRecentFlows: only the flows given packet comments last
// keep them; an earlier flow's packets get the same comment, made again.
func TestCommentsKeptByRecentFlows(t *testing.T) {
	const nflows = 3000
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}, MaxFlows: nflows})
	var handles []flow.Handle
	var comments []string
	for i := range nflows {
		c := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, 9, byte(1 + i%200)}), uint16(30000+i))
		h, ok := e.AddPacket(obs.Observation{Time: flowtest.At(float64(i)), Point: obs.PointPod, Dir: obs.DirOut,
			Proto: obs.TCP, TCPFlags: 0x02, Src: c, Dst: svc, Len: 60})
		if !ok {
			t.Fatalf("flow %d: no handle", i)
		}
		s, ok := e.CommentOf(&h)
		if !ok || !strings.Contains(s, "request to VIP") {
			t.Fatalf("flow %d: comment %q, %v", i, s, ok)
		}
		handles, comments = append(handles, h), append(comments, s)
	}
	if n := e.CommentedFlows(); n > 1024 {
		t.Errorf("%d of %d flows keep comments, want at most 1024", n, nflows)
	}
	for _, i := range []int{0, nflows / 2, nflows - 1} {
		if s, ok := e.CommentOf(&handles[i]); !ok || s != comments[i] {
			t.Errorf("flow %d: comment %q, %v; it was %q", i, s, ok, comments[i])
		}
	}
}

// TestByShared: flows of one rule keep one copy of their verdict's "by".
func TestByShared(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/max-flows.json")
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	e.Summary() // caches every verdict
	var first *byte
	n := 0
	for id, p := range e.ByData() {
		if first == nil {
			first = p
		} else if p != first {
			t.Errorf("flow %d: a copy of its by of its own", id)
		}
		n++
	}
	if n != 2 {
		t.Fatalf("%d flows with a by, want 2", n)
	}
}
