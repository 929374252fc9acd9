package discover

import "testing"

// TestLinkName: the node's and the traced Pods' interfaces are named as
// discovery read their netns, a Pod's eth0 and other interfaces also when
// its links were not kept; another netns's, or an ifindex not read, are not.
func TestLinkName(t *testing.T) {
	n := &NodeInfo{HostNetNS: NetNS{Inode: 1}, hostLinks: map[int]string{1: "lo", 4: "cni0", 7: "flannel.1"},
		Pods: []Pod{
			{NetNS: NetNS{Inode: 11}, Eth0: Iface{Name: "eth0", Ifindex: 2}, links: map[int]string{1: "lo", 2: "eth0", 5: "net1"}},
			{NetNS: NetNS{Inode: 12}, Eth0: Iface{Name: "eth0", Ifindex: 3}, OtherIfaces: []Iface{{Name: "net1", Ifindex: 4}}},
		}}
	for _, c := range []struct {
		inode   uint64
		ifindex int
		want    string
	}{
		{1, 4, "cni0"}, {1, 7, "flannel.1"}, {1, 1, "lo"}, {1, 9, ""},
		{11, 1, "lo"}, {11, 5, "net1"}, {11, 2, "eth0"},
		{12, 3, "eth0"}, {12, 4, "net1"}, {12, 1, ""},
		{99, 4, ""}, {1, 0, ""}, {0, 4, ""},
	} {
		if got := n.LinkName(c.inode, c.ifindex); got != c.want {
			t.Errorf("LinkName(%d, %d) = %q, want %q", c.inode, c.ifindex, got, c.want)
		}
	}
	if got := (*NodeInfo)(nil).LinkName(1, 4); got != "" {
		t.Errorf("nil node: %q", got)
	}
}
