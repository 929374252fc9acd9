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
	if !tr.inScope(vip, vip) {
		t.Error("the node's own VIP -> VIP packet is out of scope")
	}
	if tr.inScope(other, vip) || tr.outOfScope != 1 {
		t.Errorf("another Pod's packet to the VIP: in scope, or not counted (out_of_scope %d)", tr.outOfScope)
	}
}
