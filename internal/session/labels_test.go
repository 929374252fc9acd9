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
}
