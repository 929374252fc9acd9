package probe

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"testing"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestForgetTC: the tcx observers' links of a veth that went are closed
// and forgotten, with its name; those of another veth stay.
func TestForgetTC(t *testing.T) {
	needRoot(t)
	name := fmt.Sprintf("pdtc-%06x", rand.IntN(1<<24))
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	path := "/run/netns/" + name
	for _, args := range [][]string{
		{"-n", name, "link", "add", "pa0", "type", "veth", "peer", "name", "pa1"},
		{"-n", name, "link", "add", "pb0", "type", "veth", "peer", "name", "pb1"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	index := map[string]int{}
	if err := nsutil.Do(path, func() error {
		for _, ifname := range []string{"pa0", "pb0"} {
			ifc, err := net.InterfaceByName(ifname)
			if err != nil {
				return err
			}
			index[ifname] = ifc.Index
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	mustAttach(t, p.AttachTC(path, index["pa0"], "pa0"))
	mustAttach(t, p.AttachTC(path, index["pb0"], "pb0"))
	perVeth := len(p.links) / 2
	if perVeth == 0 {
		t.Fatal("no link kept")
	}
	if out, err := exec.Command("ip", "-n", name, "link", "del", "pa0").CombinedOutput(); err != nil {
		t.Fatalf("ip link del: %v: %s", err, out)
	}
	p.ForgetTC(path, index["pa0"])
	if len(p.links) != perVeth || len(p.tcLinks) != 1 || len(p.ifnames) != 1 {
		t.Errorf("after forgetting pa0: %d links, %d interfaces' links, %d names; want pb0's %d, 1, 1", len(p.links), len(p.tcLinks), len(p.ifnames), perVeth)
	}
	for k := range p.ifnames {
		if k.ifindex != index["pb0"] {
			t.Errorf("name kept for ifindex %d, want pb0's (%d)", k.ifindex, index["pb0"])
		}
	}
}
