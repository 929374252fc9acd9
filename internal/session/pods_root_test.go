package session

import (
	"context"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestLookInterrupted: a look for new Pods that the run's end interrupts
// (Ctrl-C while it looks behind a new veth) is no failure to report.
func TestLookInterrupted(t *testing.T) {
	names := testNetNS(t, "pttest-look", "-node", "-other")
	node, other := names[0], names[1]
	opt := discover.Options{HostNetNS: "/run/netns/" + node}
	info, err := discover.Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	tr := &tracer{pods: &podFollow{watch: discover.NewPodWatch(info, opt), node: info}}
	// A veth whose other end's netns is not set up yet: the look goes
	// behind it.
	run(t, "ip", "-n", node, "link", "add", "hv0", "type", "veth", "peer", "name", "eth0", "netns", other)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	tr.followNewPods(ctx, time.Now(), false, nil)
	if s := tr.pods.summary(); len(s) != 0 {
		t.Errorf("an interrupted look is reported: %q", s)
	}
}
