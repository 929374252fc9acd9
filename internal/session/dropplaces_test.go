package session

import (
	"errors"
	"fmt"
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
		drops: dropPlaces{netns: map[uint64]heldNetNS{99: {}},
			linkName: func(string, int) (string, error) { return "", errors.New("no such interface") }},
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

// TestDropPlacesNameInterfaces: a kernel drop at an interface that is no
// capture point is named by the interface's name, with its ifindex: as
// discovery read the node's and a traced Pod's interfaces, else as the
// kernel names it when the drop is first named (an interface that appeared
// during the run, one of a netns not traced), each looked up once and at
// most maxIfaceLookups a run; one that cannot be looked up keeps its
// ifindex alone.
func TestDropPlacesNameInterfaces(t *testing.T) {
	lookups := map[string]int{}
	tr := &tracer{
		taps: []tap{{label: "uplink:flannel.1", inode: 1, ifindex: 7}},
		node: &discover.NodeInfo{HostNetNS: discover.NetNS{Path: "/run/netns/node", Inode: 1},
			Pods: []discover.Pod{{NetNS: discover.NetNS{Path: "/run/netns/pod", Inode: 11},
				Eth0:        discover.Iface{Name: "eth0", Ifindex: 2},
				OtherIfaces: []discover.Iface{{Name: "net1", Ifindex: 3}}}}},
		drops: dropPlaces{netns: map[uint64]heldNetNS{99: {name: "netns /run/netns/ovx-n2", path: "/run/netns/ovx-n2"}},
			linkName: func(path string, ifindex int) (string, error) {
				lookups[fmt.Sprintf("%s %d", path, ifindex)]++
				switch {
				case path == "/run/netns/node" && ifindex == 4:
					return "cni0", nil
				case path == "/run/netns/ovx-n2" && ifindex == 2:
					return "eth1", nil
				}
				return "", errors.New("no such interface")
			}},
	}
	fs := []flow.Flow{{Reason: "no reply; the kernel dropped 2 reply packets: NO_SOCKET (netns 11, ifindex 2)", KernelDrops: []flow.KernelDrop{
		{Reason: "NETFILTER_DROP", NetNS: 1, Ifindex: 7},
		{Reason: "NETFILTER_DROP", NetNS: 1, Ifindex: 4},
		{Reason: "NO_SOCKET", NetNS: 11, Ifindex: 2},
		{Reason: "NO_SOCKET", NetNS: 11, Ifindex: 3},
		{Reason: "IP_NOPROTO", NetNS: 99, Ifindex: 2},
		{Reason: "QDISC_DROP", NetNS: 1, Ifindex: 9},
	}}, {KernelDrops: []flow.KernelDrop{
		{Reason: "NETFILTER_DROP", NetNS: 1, Ifindex: 4},
		{Reason: "QDISC_DROP", NetNS: 1, Ifindex: 9},
	}}}
	tr.nameDrops(fs)
	want := []string{
		"NETFILTER_DROP (at uplink:flannel.1)",
		"NETFILTER_DROP (at the node's netns, cni0 (ifindex 4))",
		"NO_SOCKET (at Pod netns /run/netns/pod, eth0 (ifindex 2))",
		"NO_SOCKET (at Pod netns /run/netns/pod, net1 (ifindex 3))",
		"IP_NOPROTO (at netns /run/netns/ovx-n2, eth1 (ifindex 2))",
		"QDISC_DROP (at the node's netns, ifindex 9)",
		"NETFILTER_DROP (at the node's netns, cni0 (ifindex 4))",
		"QDISC_DROP (at the node's netns, ifindex 9)",
	}
	got := append(fs[0].KernelDrops, fs[1].KernelDrops...)
	for i, d := range got {
		if s := d.String(); s != want[i] {
			t.Errorf("drop %d: %q, want %q", i, s, want[i])
		}
	}
	if wantReason := "no reply; the kernel dropped 2 reply packets: NO_SOCKET (at Pod netns /run/netns/pod, eth0 (ifindex 2))"; fs[0].Reason != wantReason {
		t.Errorf("reason %q, want %q", fs[0].Reason, wantReason)
	}
	// Discovery's names need no lookup; the others are looked up once.
	wantLookups := map[string]int{"/run/netns/node 4": 1, "/run/netns/ovx-n2 2": 1, "/run/netns/node 9": 1}
	if fmt.Sprint(lookups) != fmt.Sprint(wantLookups) {
		t.Errorf("lookups %v, want %v", lookups, wantLookups)
	}
	// Bounded: past maxIfaceLookups interfaces looked up, no more lookups.
	for i := range maxIfaceLookups {
		tr.dropPlace(1, 100+i)
	}
	n := len(lookups)
	if got := tr.dropPlace(1, 1000); got != "the node's netns, ifindex 1000" {
		t.Errorf("past the bound: %q", got)
	}
	if len(lookups) != n || len(tr.drops.ifaces) > maxIfaceLookups {
		t.Errorf("looked up past the bound: %d lookups, %d cached", len(lookups)-n, len(tr.drops.ifaces))
	}
}
