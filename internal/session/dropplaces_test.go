package session

import (
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestDropPlacesNamed: a kernel drop at a capture point is named by its
// label, one elsewhere in the node's or a Pod's netns by that netns and the
// ifindex, and one in a netns pathtrace cannot name keeps its numbers.
func TestDropPlacesNamed(t *testing.T) {
	tr := &tracer{
		taps: []tap{
			{label: "uplink:bond0", inode: 1, ifindex: 7},
			{label: "host:veth-a", inode: 1, ifindex: 9},
			{}, // a slot a run until stopped forgot
			{label: "pod:eth0", inode: 11, ifindex: 2},
		},
		node: &discover.NodeInfo{HostNetNS: discover.NetNS{Path: "/run/netns/node", Inode: 1},
			Pods: []discover.Pod{{NetNS: discover.NetNS{Path: "/run/netns/pod", Inode: 11}}}},
		// A netns looked up once already: not a netns of this machine.
		drops: dropPlaces{netns: map[uint64]string{99: ""}},
	}
	fs := []flow.Flow{{Reason: "no reply; the kernel dropped 1 request packet: NETFILTER_DROP (netns 1, ifindex 7); 2 request packets: NETFILTER_DROP (netns 1, ifindex 3)", KernelDrops: []flow.KernelDrop{
		{Reason: "NETFILTER_DROP", NetNS: 1, Ifindex: 7},
		{Reason: "NETFILTER_DROP", NetNS: 1, Ifindex: 3},
		{Reason: "NO_SOCKET", NetNS: 11, Ifindex: 2},
		{Reason: "NO_SOCKET", NetNS: 11, Ifindex: 0},
		{Reason: "IP_NOPROTO", NetNS: 99, Ifindex: 4},
	}}}
	tr.nameDrops(fs)
	want := []string{
		"NETFILTER_DROP (at uplink:bond0)",
		"NETFILTER_DROP (at the node's netns, ifindex 3)",
		"NO_SOCKET (at pod:eth0)",
		"NO_SOCKET (at Pod netns /run/netns/pod)",
		"IP_NOPROTO (netns 99, ifindex 4)",
	}
	for i, d := range fs[0].KernelDrops {
		if got := d.String(); got != want[i] {
			t.Errorf("drop %d: %q, want %q", i, got, want[i])
		}
	}
	// The reason names the places as the drops do.
	wantReason := "no reply; the kernel dropped 1 request packet: NETFILTER_DROP (at uplink:bond0); 2 request packets: NETFILTER_DROP (at the node's netns, ifindex 3)"
	if fs[0].Reason != wantReason {
		t.Errorf("reason %q, want %q", fs[0].Reason, wantReason)
	}
}
