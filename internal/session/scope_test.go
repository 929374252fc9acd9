package session

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestInScopeNodeToLocalVIP: with a Pod selected, a node process's query
// to a VIP that is an address of the node (NodeLocal DNSCache) goes from
// that address to itself; it is the node's, in scope, while another Pod's
// query to it stays out.
func TestInScopeNodeToLocalVIP(t *testing.T) {
	pod, node := netip.MustParseAddr("10.244.8.24"), netip.MustParseAddr("10.244.8.2")
	vip, other := netip.MustParseAddr("10.120.0.10"), netip.MustParseAddr("10.244.8.26")
	tr := &tracer{clients: map[netip.Addr]bool{pod: true, node: true}}
	if !tr.inScope(netip.AddrPortFrom(vip, 40000), netip.AddrPortFrom(vip, 53)) {
		t.Error("the node's own VIP -> VIP packet is out of scope")
	}
	if tr.inScope(netip.AddrPortFrom(other, 40000), netip.AddrPortFrom(vip, 53)) || tr.outOfScope != 1 {
		t.Errorf("another Pod's packet to the VIP: in scope, or not counted (out_of_scope %d)", tr.outOfScope)
	}
}

// TestInScopeNodeClientWithNodePortTraced: with a Pod selected and a
// NodePort traced as NODE-IP:PORT, the node's address is the Service's on
// that port only: a node process's connection from it to a ClusterIP (and
// its backend's replies) is the node's, in scope, while an outside
// client's to the NodePort stays out.
func TestInScopeNodeClientWithNodePortTraced(t *testing.T) {
	pod, node := netip.MustParseAddr("10.77.1.9"), netip.MustParseAddr("172.31.9.2")
	outside, backend := netip.MustParseAddrPort("192.0.2.50:51000"), netip.MustParseAddrPort("10.77.2.7:8080")
	tr := &tracer{clients: map[netip.Addr]bool{pod: true}, clientVIPPorts: map[netip.Addr][]uint16{node: {30081}}}
	nodeClient, nodePort := netip.AddrPortFrom(node, 46000), netip.AddrPortFrom(node, 30081)
	if !tr.inScope(nodeClient, netip.MustParseAddrPort("10.96.0.12:80")) || !tr.inScope(backend, nodeClient) {
		t.Error("a node process's request or its reply is out of scope")
	}
	if tr.inScope(outside, nodePort) || tr.inScope(nodePort, outside) || tr.outOfScope != 2 {
		t.Errorf("an outside client's request or reply to the NodePort: in scope, or not counted (out_of_scope %d)", tr.outOfScope)
	}
}

// TestInScopeOtherClientsSNAT: with a Pod selected, an outside client's
// connection to a NodePort that the node masquerades leaves the uplink
// from the node's address, a client address: its conntrack entry names
// the source its SNAT gave it, and its packets after the SNAT are left
// out of scope, not fed to the engine to end unmatched. A node process's
// connection given the same port, of the other protocol or to another
// peer, is still the node's.
func TestInScopeOtherClientsSNAT(t *testing.T) {
	pod, node := netip.MustParseAddr("10.60.1.12"), netip.MustParseAddr("192.168.60.2")
	outside, backend := netip.MustParseAddrPort("192.168.60.1:57634"), netip.MustParseAddrPort("10.60.2.12:8080")
	nodePort, snat := netip.AddrPortFrom(node, 30080), netip.AddrPortFrom(node, 10381)
	dnsVIP, dnsBackend := netip.MustParseAddrPort("10.96.60.53:53"), netip.MustParseAddrPort("10.60.2.13:5353")
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: node, Port: 30080, Proto: obs.TCP}, {Addr: dnsVIP.Addr(), Port: 53, Proto: obs.UDP}}})
	tr := &tracer{eng: eng, clients: map[netip.Addr]bool{pod: true}, clientVIPPorts: map[netip.Addr][]uint16{node: {30080}}}
	at := time.Unix(1000, 0)
	tr.add(obs.Observation{Time: at, Point: obs.PointConntrack, Proto: obs.TCP, Src: outside, Dst: nodePort, NATDst: backend, NATSrc: snat})
	if tr.outOfScope != 1 {
		t.Fatalf("the outside client's conntrack entry: out_of_scope %d, want 1", tr.outOfScope)
	}
	for _, o := range []obs.Observation{
		{Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: snat, Dst: backend, Len: 74},
		{Point: obs.PointUplink, Dir: obs.DirIn, Proto: obs.TCP, Src: backend, Dst: snat, Len: 74},
		{Point: obs.PointNFBefore, Proto: obs.TCP, Src: backend, Dst: snat, Len: 60},
	} {
		o.Time = at
		tr.add(o)
	}
	if tr.outOfScope != 4 {
		t.Errorf("the outside client's packets after the node's SNAT: out_of_scope %d, want 4", tr.outOfScope)
	}
	// A node process's DNS query, masqueraded to the same port.
	tr.add(obs.Observation{Time: at, Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.UDP, Src: snat, Dst: dnsBackend, Len: 60})
	tr.add(obs.Observation{Time: at, Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: snat, Dst: netip.MustParseAddrPort("10.60.2.11:8080"), Len: 74})
	if tr.outOfScope != 4 {
		t.Errorf("a node process's packets from the same port, to another backend or of UDP, left out: out_of_scope %d, want 4", tr.outOfScope)
	}
	if got := eng.Summary().Observations["uplink"]; got != 2 {
		t.Errorf("the engine got %d uplink observations, want the node process's 2", got)
	}
}

// TestInScopeOtherClientsOfSelectedBackend: with a Pod selected that is
// itself a traced Service's backend, its eth0 and host veth, and netfilter
// after DNAT, see the other Pods' connections to it (their address to its
// served port): those are left out of scope, not fed to the engine to end
// unmatched. Its own flows stay: one from a client port of it to another
// backend, and its hairpin (itself through the VIP), whose packets reach
// its served port from its own address, the node's, or the source its
// conntrack entry gave it.
func TestInScopeOtherClientsOfSelectedBackend(t *testing.T) {
	pod, node, other := netip.MustParseAddr("10.244.8.50"), netip.MustParseAddr("10.244.8.254"), netip.MustParseAddr("10.244.8.51")
	vip := netip.MustParseAddrPort("10.120.0.90:80")
	served := netip.AddrPortFrom(pod, 3000)
	eng := flow.NewEngine(flow.Config{
		Services:    []flow.Service{{Addr: vip.Addr(), Port: 80, Proto: obs.TCP}},
		Attribution: flow.Attribution{NATRules: []flow.NATRule{{Source: "nftables", VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{served}}}},
	})
	tr := &tracer{eng: eng, clients: map[netip.Addr]bool{pod: true, node: true}}
	at := time.Unix(1000, 0)
	otherClient := netip.AddrPortFrom(other, 43362)
	for _, o := range []obs.Observation{
		{Point: obs.PointPod, Dir: obs.DirIn, Src: otherClient, Dst: served, Len: 74},
		{Point: obs.PointPod, Dir: obs.DirOut, Src: served, Dst: otherClient, Len: 74},
		{Point: obs.PointHost, Dir: obs.DirOut, Src: otherClient, Dst: served, Len: 74},
		{Point: obs.PointNFAfter, Src: otherClient, Dst: served, Len: 60},
	} {
		o.Time, o.Proto = at, obs.TCP
		tr.add(o)
	}
	if tr.outOfScope != 4 {
		t.Errorf("another Pod's connection to the selected Pod as a backend: out_of_scope %d, want 4", tr.outOfScope)
	}
	own := netip.AddrPortFrom(pod, 51000)
	for _, o := range []obs.Observation{
		{Point: obs.PointPod, Dir: obs.DirOut, Src: own, Dst: vip, Len: 74},
		{Point: obs.PointNFAfter, Src: own, Dst: served, Len: 60},                                         // its hairpin after DNAT
		{Point: obs.PointPod, Dir: obs.DirIn, Src: netip.AddrPortFrom(node, 51000), Dst: served, Len: 74}, // after the hairpin's masquerade
		{Point: obs.PointPod, Dir: obs.DirOut, Src: netip.AddrPortFrom(pod, 52000), Dst: netip.MustParseAddrPort("10.244.20.31:3000"), Len: 74},
		// A hairpin SNAT to an address that is no client's: its
		// conntrack entry names it.
		{Point: obs.PointConntrack, Src: netip.AddrPortFrom(pod, 53000), Dst: vip, NATDst: served, NATSrc: netip.MustParseAddrPort("10.244.8.253:53000")},
		{Point: obs.PointPod, Dir: obs.DirOut, Src: netip.AddrPortFrom(pod, 53000), Dst: vip, Len: 74},
		{Point: obs.PointPod, Dir: obs.DirIn, Src: netip.MustParseAddrPort("10.244.8.253:53000"), Dst: served, Len: 74},
	} {
		o.Time, o.Proto = at, obs.TCP
		tr.add(o)
	}
	if tr.outOfScope != 4 {
		t.Errorf("the selected Pod's own packets left out: out_of_scope %d, want 4", tr.outOfScope)
	}
	if got := eng.Summary().Observations["pod"]; got != 5 {
		t.Errorf("the engine got %d pod observations, want the selected Pod's own 5", got)
	}
}

// TestUnscopedSocketEventsOfPodFoundLater: a Pod that starts during the
// run connects to a VIP before the next look finds it; a tc program on its
// host veth rewrites the request, so only its socket events saw the VIP.
// They are kept, and replayed once the Pod is found: its flow is made,
// with the backend its packets went to, and nothing stays out of scope.
// Another netns's events, never found, stay out.
func TestUnscopedSocketEventsOfPodFoundLater(t *testing.T) {
	const hostNS, podNS, otherNS = 1, 42, 43
	vip, backend := netip.MustParseAddrPort("192.168.200.20:80"), netip.MustParseAddrPort("172.20.2.11:8080")
	client := netip.MustParseAddrPort("172.20.1.11:38368")
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: 80, Proto: obs.TCP}},
		Points: map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockEgress: true, obs.PointNFBefore: true, obs.PointUplink: true}})
	tr := &tracer{eng: eng, pods: &podFollow{}, scope: map[uint64]bool{hostNS: true}}
	at := time.Now()
	ms := func(n float64) time.Time { return at.Add(time.Duration(n * float64(time.Millisecond))) }
	for _, o := range []obs.Observation{
		{Time: ms(0), Point: obs.PointSockAddr, Kind: obs.SockConnect, Proto: obs.TCP, Src: netip.AddrPortFrom(client.Addr(), 0), Dst: vip, ReqDst: vip, Cookie: 7, NetNS: podNS},
		{Time: ms(0.02), Point: obs.PointSockEgress, Proto: obs.TCP, Src: client, Dst: vip, Cookie: 7, NetNS: podNS, TCPFlags: 2, Len: 60},
		{Time: ms(0.03), Point: obs.PointSockAddr, Kind: obs.SockConnect, Proto: obs.TCP, Src: netip.MustParseAddrPort("10.99.0.5:0"), Dst: vip, ReqDst: vip, Cookie: 8, NetNS: otherNS},
		{Time: ms(0.05), Point: obs.PointNFBefore, Hook: obs.HookPrerouting, Proto: obs.TCP, Src: client, Dst: backend, TCPFlags: 2, Len: 60},
		{Time: ms(0.06), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: client, Dst: backend, TCPFlags: 2, Len: 74},
		{Time: ms(0.2), Point: obs.PointUplink, Dir: obs.DirIn, Proto: obs.TCP, Src: backend, Dst: client, TCPFlags: 18, Len: 74},
	} {
		tr.add(o)
	}
	tr.scope[podNS] = true // the next look found the Pod
	tr.replayUnscoped(ms(500))
	flows := eng.Flows()
	if len(flows) != 1 || flows[0].Client != client || flows[0].Service != vip || flows[0].Backend != backend || !flows[0].Reply {
		t.Fatalf("flows %+v, want one of %s to %s, backend %s, answered", flows, client, vip, backend)
	}
	if tr.outOfScope != 1 || len(tr.unscoped) != 1 {
		t.Errorf("out_of_scope %d, %d events held: want 1 and 1 (the other netns's)", tr.outOfScope, len(tr.unscoped))
	}
}

// TestUnscopedSocketEventsUnfollowed: a Pod's connection through a socket
// LB before the next look found it was followed by no later point (its
// netns was out of the observers' scope): replayed, its flow does not say
// the node dropped the request because the uplink never saw it.
func TestUnscopedSocketEventsUnfollowed(t *testing.T) {
	const hostNS, podNS = 1, 42
	vip, backend := netip.MustParseAddrPort("192.168.200.20:80"), netip.MustParseAddrPort("172.20.2.11:8080")
	client := netip.MustParseAddrPort("172.20.1.11:38368")
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: 80, Proto: obs.TCP}},
		Points: map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockEgress: true, obs.PointUplink: true}})
	tr := &tracer{eng: eng, pods: &podFollow{}, scope: map[uint64]bool{hostNS: true}}
	at := time.Now()
	tr.add(obs.Observation{Time: at, Point: obs.PointSockAddr, Kind: obs.SockConnect, Proto: obs.TCP, Src: netip.AddrPortFrom(client.Addr(), 0), Dst: backend, ReqDst: vip, Cookie: 7, NetNS: podNS})
	tr.add(obs.Observation{Time: at.Add(20 * time.Microsecond), Point: obs.PointSockEgress, Proto: obs.TCP, Src: client, Dst: backend, Cookie: 7, NetNS: podNS, TCPFlags: 2, Len: 60})
	tr.scope[podNS] = true // the next look found the Pod
	tr.replayUnscoped(at.Add(time.Second))
	flows := eng.Flows()
	if len(flows) != 1 || flows[0].Backend != backend || strings.Contains(flows[0].Reason, "never saw the request") {
		t.Fatalf("flows %+v, want one to %s whose reason does not blame the node for what no point followed", flows, backend)
	}
}

// TestUnscopedEventsBounded: the socket events of netns out of scope that a
// run keeps for Pods not found yet stay within unscopedMax, the newest
// kept, whatever comes (with a Pod selected, every other Pod's events).
func TestUnscopedEventsBounded(t *testing.T) {
	tr := &tracer{pods: &podFollow{}, scope: map[uint64]bool{1: true}}
	at := time.Now()
	const n = 5000
	for i := range n {
		tr.holdUnscoped(obs.Observation{Time: at.Add(time.Duration(i) * time.Microsecond), Point: obs.PointSockEgress, NetNS: 42})
	}
	if len(tr.unscoped) > unscopedMax || len(tr.unscoped) < unscopedMax*3/4 {
		t.Fatalf("%d events held, want between %d and %d", len(tr.unscoped), unscopedMax*3/4, unscopedMax)
	}
	if last := tr.unscoped[len(tr.unscoped)-1].Time; !last.Equal(at.Add((n - 1) * time.Microsecond)) {
		t.Errorf("the newest event held is of %v, want the last one", last.Sub(at))
	}
}

// BenchmarkHoldUnscoped: what an out-of-scope socket event costs once the
// held events are full (with a Pod selected, every other Pod's).
func BenchmarkHoldUnscoped(b *testing.B) {
	tr := &tracer{pods: &podFollow{}, scope: map[uint64]bool{1: true}}
	o := obs.Observation{Time: time.Now(), Point: obs.PointSockEgress, NetNS: 42}
	for b.Loop() {
		o.Time = o.Time.Add(time.Microsecond)
		tr.holdUnscoped(o)
	}
}
