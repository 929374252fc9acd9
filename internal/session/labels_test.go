package session

import (
	"net/netip"
	"slices"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestPointLabels: one Pod keeps the plain "role:ifname" labels; several
// Pods' eth0 points are told apart by the Pod's address (or netns name),
// so that every pcapng interface and counter has a name of its own.
func TestPointLabels(t *testing.T) {
	pod := func(path, ip, name string) discover.Pod {
		p := discover.Pod{NetNS: discover.NetNS{Path: path}, NSName: name}
		if ip != "" {
			p.Eth0.Addrs = []netip.Prefix{netip.MustParsePrefix(ip + "/24")}
		}
		return p
	}
	one := []tap{{role: "pod", ifname: "eth0", netns: "/run/netns/a"}, {role: "host", ifname: "veth1", netns: "/node"}, {role: "uplink", ifname: "bond0", netns: "/node"}}
	if got, want := pointLabels(one, []discover.Pod{pod("/run/netns/a", "10.0.0.5", "a")}), []string{"pod:eth0", "host:veth1", "uplink:bond0"}; !slices.Equal(got, want) {
		t.Errorf("one Pod: %q, want %q", got, want)
	}
	three := []tap{
		{role: "pod", ifname: "eth0", netns: "/proc/10/ns/net"}, {role: "host", ifname: "lxc1", netns: "/node"},
		{role: "pod", ifname: "eth0", netns: "/run/netns/b"}, {role: "host", ifname: "lxc2", netns: "/node"},
		{role: "pod", ifname: "eth0", netns: "/proc/30/ns/net"}, {role: "uplink", ifname: "eth1", netns: "/node"},
	}
	pods := []discover.Pod{pod("/proc/10/ns/net", "10.0.0.5", ""), pod("/run/netns/b", "", "b"), pod("/proc/30/ns/net", "", "")}
	want := []string{"pod:eth0@10.0.0.5", "host:lxc1", "pod:eth0@b", "host:lxc2", "pod:eth0@/proc/30/ns/net", "uplink:eth1"}
	if got := pointLabels(three, pods); !slices.Equal(got, want) {
		t.Errorf("three Pods: %q, want %q", got, want)
	}
	// A Pod whose interface has a name of its own (net0) among Pods with
	// eth0 is named by its address too: each Pod's point says whose it is.
	mixed := []tap{
		{role: "pod", ifname: "eth0", netns: "/run/netns/a"}, {role: "pod", ifname: "net0", netns: "/run/netns/b"},
		{role: "pod", ifname: "eth0", netns: "/run/netns/c"}, {role: "host", ifname: "cali1", netns: "/node"}, {role: "uplink", ifname: "ens5", netns: "/node"},
	}
	want = []string{"pod:eth0@10.0.0.5", "pod:net0@10.0.0.6", "pod:eth0@10.0.0.7", "host:cali1", "uplink:ens5"}
	if got := pointLabels(mixed, []discover.Pod{pod("/run/netns/a", "10.0.0.5", "a"), pod("/run/netns/b", "10.0.0.6", "b"), pod("/run/netns/c", "10.0.0.7", "c")}); !slices.Equal(got, want) {
		t.Errorf("a Pod's net0 among eth0s: %q, want %q", got, want)
	}
	// A Pod deleted and made again with another address in a netns of the
	// same name (a named netns reused): each tap is named by its own Pod's
	// address, told apart by the netns inode (it took the gone Pod's).
	again := []tap{
		{role: "pod", ifname: "eth0", netns: "/run/netns/a", inode: 11}, {role: "pod", ifname: "eth0", netns: "/run/netns/p2", inode: 12},
		{role: "pod", ifname: "eth0", netns: "/run/netns/p2", inode: 13},
	}
	gone, back := pod("/run/netns/p2", "10.0.0.24", "p2"), pod("/run/netns/p2", "10.0.0.25", "p2")
	gone.NetNS.Inode, back.NetNS.Inode = 12, 13
	first := pod("/run/netns/a", "10.0.0.23", "a")
	first.NetNS.Inode = 11
	want = []string{"pod:eth0@10.0.0.23", "pod:eth0@10.0.0.24", "pod:eth0@10.0.0.25"}
	if got := pointLabels(again, []discover.Pod{first, gone, back}); !slices.Equal(got, want) {
		t.Errorf("a Pod made again in a netns of the same name: %q, want %q", got, want)
	}
}
