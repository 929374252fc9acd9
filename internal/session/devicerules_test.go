package session

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestDeviceRulesOf: the engine gets a device chain's rewrites once per
// device of the chain that is a host veth or an uplink, with its ifindex,
// the chains jumped to, and what it sets ("?" when not read); a chain on
// another device is on no traced Pod's way.
func TestDeviceRulesOf(t *testing.T) {
	vip := netip.MustParseAddr("10.120.0.80")
	node := &discover.NodeInfo{
		CapturePoints: []discover.CapturePoint{
			{Role: discover.RolePod, Ifname: "eth0", Ifindex: 2},
			{Role: discover.RoleHost, Ifname: "veth-a", Ifindex: 7},
			{Role: discover.RoleUplink, Ifname: "bond0", Ifindex: 3},
		},
		Netfilter: discover.Netfilter{DeviceChains: []discover.DeviceChain{
			{Family: "netdev", Table: "t", Chain: "in", Hook: "ingress", Devices: []string{"eth0", "other0", "veth-a"},
				Rewrites: []discover.NATRule{{Service: vip, Port: 80, Proto: "tcp", Chains: []string{"in", "rw"}, Backend: netip.MustParseAddrPort("10.244.20.31:3000")}}},
			{Family: "netdev", Table: "t", Chain: "out", Hook: "egress", Devices: []string{"bond0"},
				Rewrites: []discover.NATRule{{Service: vip, Chains: []string{"out"}, Note: "? (not decoded)"}}},
			{Family: "inet", Table: "i", Chain: "in", Hook: "ingress", Devices: []string{"veth-a"}},
		}},
	}
	var got []string
	for _, r := range attribution(node).DeviceRules {
		got = append(got, fmt.Sprintf("%s %s %s/%d uplink=%v %s/%v %v %s", r.Chain, r.Hook, r.Device, r.Ifindex, r.Uplink, r.VIP, r.Proto, r.Backends, r.Rule))
	}
	want := []string{
		"netdev t/in > rw ingress veth-a/7 uplink=false 10.120.0.80:80/tcp [10.244.20.31:3000] daddr set 10.244.20.31:3000",
		"netdev t/out egress bond0/3 uplink=true 10.120.0.80:0/proto? [] daddr set ? (not decoded)",
	}
	if !slices.Equal(got, want) {
		t.Errorf("device rules:\n got %q\nwant %q", got, want)
	}
}

// TestDeviceRulesOfVethNameAgain: a Pod deleted and made again during a
// bounded run whose host veth has its predecessor's name (Calico names it
// after the Pod) has a capture point of its own, with another ifindex, and
// the node lists both: the chain on that name rewrites the new Pod's
// packets, so its rule holds at the new veth too, not at the gone one only.
func TestDeviceRulesOfVethNameAgain(t *testing.T) {
	vip := netip.MustParseAddr("10.120.0.80")
	cps := []discover.CapturePoint{
		{Role: discover.RoleHost, Ifname: "cali1", Ifindex: 7},  // the Pod that went
		{Role: discover.RoleHost, Ifname: "cali1", Ifindex: 12}, // the Pod made again
	}
	chains := []discover.DeviceChain{{Family: "netdev", Table: "t", Chain: "in", Hook: "ingress", Devices: []string{"cali1"},
		Rewrites: []discover.NATRule{{Service: vip, Port: 80, Proto: "tcp", Chains: []string{"in"}, Backend: netip.MustParseAddrPort("10.244.20.31:3000")}}}}
	var ifindexes []int
	for _, r := range deviceRulesOf(chains, cps) {
		ifindexes = append(ifindexes, r.Ifindex)
	}
	if !slices.Contains(ifindexes, 12) {
		t.Errorf("device rules at ifindexes %v, want one at the new Pod's veth (12)", ifindexes)
	}
}
