package session

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestReleaseGone: a Pod tap whose netns path went while another name still
// holds the netns (an app container that restarted in a Pod that lives on)
// is kept, and looks at the other path from then on; once nothing holds the
// netns, the tap is closed and says why.
func TestReleaseGone(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root (and not -short): makes network namespaces")
	}
	name := fmt.Sprintf("pttest-release-%06x", rand.IntN(1<<24))
	first, second := "/run/netns/"+name, "/run/netns/"+name+"-b"
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	run("ip", "netns", "add", name)
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", name).Run()
		exec.Command("umount", second).Run()
		os.Remove(second)
	})
	run("ip", "-n", name, "link", "add", "pt0", "type", "veth", "peer", "name", "pt1")
	inode, err := nsutil.Inode(first)
	if err != nil {
		t.Fatal(err)
	}
	tp, err := capture.Open(capture.Config{NetNS: first, Ifname: "pt0", Role: discover.RolePod})
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Close()
	// A second name for the netns, then the first one goes.
	run("touch", second)
	run("mount", "--bind", first, second)
	run("ip", "netns", "del", name)

	tr := &tracer{taps: []tap{{role: discover.RolePod, ifname: "pt0", netns: first, inode: inode, t: tp, ended: new(string), released: new(string)}}}
	tr.releaseGone(time.Now())
	if got := tr.taps[0]; *got.released != "" || got.netns != second {
		t.Fatalf("netns still held by %s: released %q, looks at %s; want kept, looking there", second, *got.released, got.netns)
	}
	run("umount", second)
	tr.releaseGone(time.Now())
	if *tr.taps[0].released == "" {
		t.Fatal("netns held by nothing but the tap: not released")
	}
	if err := tp.SetFilter(nil); err == nil {
		t.Error("the released tap is still open")
	}
}
