package session

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestLookInterrupted: a look for new Pods that the run's end interrupts
// (Ctrl-C while it looks behind a new veth) is no failure to report.
func TestLookInterrupted(t *testing.T) {
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root (and not -short): makes network namespaces")
	}
	name := fmt.Sprintf("pttest-look-%06x", rand.IntN(1<<24))
	node, other := name+"-node", name+"-other"
	for _, ns := range []string{node, other} {
		if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add %s: %v: %s", ns, err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	}
	opt := discover.Options{HostNetNS: "/run/netns/" + node}
	info, err := discover.Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	tr := &tracer{pods: &podFollow{watch: discover.NewPodWatch(info, opt), node: info}}
	// A veth whose other end's netns is not set up yet: the look goes
	// behind it.
	if out, err := exec.Command("ip", "-n", node, "link", "add", "hv0", "type", "veth", "peer", "name", "eth0", "netns", other).CombinedOutput(); err != nil {
		t.Fatalf("ip link add: %v: %s", err, out)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	tr.followNewPods(ctx, time.Now(), nil)
	if s := tr.pods.summary(); len(s) != 0 {
		t.Errorf("an interrupted look is reported: %q", s)
	}
}
