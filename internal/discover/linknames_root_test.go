package discover

import (
	"context"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestNodeNamesLinks: discovery keeps the names of the node's and the
// traced Pod's interfaces (a kernel drop at one that is no capture point,
// the bridge, is named by them), and an interface that appears later is
// named by LinkNameIn.
func TestNodeNamesLinks(t *testing.T) {
	tb := newTestbed(t)
	info, err := Node(context.Background(), Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP)})
	if err != nil {
		t.Fatal(err)
	}
	if len(info.Pods) != 1 {
		t.Fatalf("pods: got %+v, want one", info.Pods)
	}
	ifindex := func(path, name string) int {
		t.Helper()
		var idx int
		if err := nsutil.Netlink(path, func(h *netlink.Handle) error {
			l, err := h.LinkByName(name)
			if err == nil {
				idx = l.Attrs().Index
			}
			return err
		}); err != nil {
			t.Fatalf("%s in %s: %v", name, path, err)
		}
		return idx
	}
	podInode := info.Pods[0].NetNS.Inode
	for _, c := range []struct {
		inode uint64
		path  string
		name  string
	}{
		{info.HostNetNS.Inode, tb.node, "br0"},
		{info.HostNetNS.Inode, tb.node, "up0"},
		{podInode, tb.pod, "lo"},
		{podInode, tb.pod, "eth0"},
	} {
		if got := info.LinkName(c.inode, ifindex(c.path, c.name)); got != c.name {
			t.Errorf("%s in %s: named %q", c.name, c.path, got)
		}
	}
	ipCmd(t, "-n", filepath.Base(tb.node), "link", "add", "new0", "type", "veth", "peer", "name", "new1")
	idx := ifindex(tb.node, "new0")
	if got := info.LinkName(info.HostNetNS.Inode, idx); got != "" {
		t.Errorf("an interface added after discovery named %q by it", got)
	}
	if got, err := LinkNameIn(tb.node, idx); err != nil || got != "new0" {
		t.Errorf("LinkNameIn: %q, %v; want new0", got, err)
	}
	if _, err := LinkNameIn(tb.node, 1<<20); err == nil {
		t.Errorf("LinkNameIn of no interface: no error")
	}
}
