package session

import (
	"net/netip"
	"testing"
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
