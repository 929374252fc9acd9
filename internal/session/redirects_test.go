package session

import (
	"maps"
	"slices"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestHostRedirects: the engine gets the mirred redirects at the host
// veths' ingress, which take a Pod's packets past netfilter; a mirror (the
// packet itself goes on), an egress filter and an uplink's are left out.
func TestHostRedirects(t *testing.T) {
	node := &discover.NodeInfo{TCRedirects: []discover.TCRedirect{
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "ingress", Filter: "u32 pref 10", Action: "egress redirect", To: "bond0"},
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "ingress", Filter: "u32 pref 11", Action: "egress mirror", To: "mon0"},
		{Ifname: "veth-a", Ifindex: 5, Role: discover.RoleHost, Dir: "egress", Filter: "u32 pref 1", Action: "egress redirect", To: "bond0"},
		{Ifname: "bond0", Ifindex: 3, Role: discover.RoleUplink, Dir: "ingress", Filter: "matchall pref 1", Action: "egress redirect", To: "veth-a"},
	}}
	got := attribution(node).HostRedirects
	if len(got) != 1 || got[0].Ifindex != 5 || got[0].Text != "veth-a ingress u32 pref 10: mirred egress redirect to bond0" {
		t.Errorf("host redirects %+v, want the ingress redirect of veth-a alone", got)
	}
}

// TestAttributionNetfilterPrograms: the netfilter BPF programs found in
// another netns than the node's are no candidates for the node's flows;
// the others are, with their hook and priority.
func TestAttributionNetfilterPrograms(t *testing.T) {
	node := &discover.NodeInfo{}
	node.Netfilter.BPFPrograms = []discover.NetfilterProgram{
		{Family: "ipv4", Hook: "prerouting", Priority: -150, Name: "elsewhere_drop", ID: 7, Elsewhere: true},
		{Family: "ipv4", Hook: "forward", Priority: 0, Name: "node_drop", ID: 8},
	}
	got := attribution(node).NetfilterPrograms
	want := []flow.NetfilterProgram{{Family: "ipv4", Hook: "forward", Priority: 0, Name: "node_drop", ID: 8}}
	if !slices.Equal(got, want) {
		t.Errorf("netfilter programs %+v, want %+v", got, want)
	}
}

// TestAttributionXDPPrograms: the engine gets the uplinks' XDP programs and
// the host veths' (by veth), each with its mode as its kind.
func TestAttributionXDPPrograms(t *testing.T) {
	node := &discover.NodeInfo{XDPPrograms: []discover.XDPProgram{
		{Ifname: "eth0", Ifindex: 2, Role: discover.RoleUplink, Mode: "xdpdrv", Name: "cil_xdp_entry", ID: 7},
		{Ifname: "lxc1", Ifindex: 9, Role: discover.RoleHost, Mode: "xdpgeneric", Name: "veth_lb", ID: 8},
	}}
	a := attribution(node)
	up := []flow.TCProgram{{Kind: "xdpdrv", Name: "cil_xdp_entry", ID: 7, Ifindex: 2}}
	host := []flow.TCProgram{{Kind: "xdpgeneric", Name: "veth_lb", ID: 8, Ifindex: 9}}
	if !slices.Equal(a.UplinkXDPPrograms, up) || !slices.Equal(a.HostXDPPrograms, host) {
		t.Errorf("uplink XDP %+v, host XDP %+v, want %+v and %+v", a.UplinkXDPPrograms, a.HostXDPPrograms, up, host)
	}
}

// TestAttributionHairpinOffUplinks: the engine gets the uplinks that are
// bridge ports with hairpin mode off, with their bridge; one with it on,
// one whose mode was not read and a host veth are left out.
func TestAttributionHairpinOffUplinks(t *testing.T) {
	off, on := false, true
	node := &discover.NodeInfo{CapturePoints: []discover.CapturePoint{
		{Role: discover.RoleUplink, Ifname: "up0", Ifindex: 2, Master: "br0", MasterKind: "bridge", Hairpin: &off},
		{Role: discover.RoleUplink, Ifname: "up1", Ifindex: 3, Master: "br0", MasterKind: "bridge", Hairpin: &on},
		{Role: discover.RoleUplink, Ifname: "eth1", Ifindex: 4},
		{Role: discover.RoleHost, Ifname: "veth-a", Ifindex: 5, Master: "br0", MasterKind: "bridge"},
	}}
	got := attribution(node).HairpinOffUplinks
	if want := map[int]flow.BridgePort{2: {Port: "up0", Bridge: "br0"}}; !maps.Equal(got, want) {
		t.Errorf("hairpin-off uplinks %+v, want %+v", got, want)
	}
}
