package discover

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestPodWatchHints: a veth that appears in the node's netns has the watch
// told to look again every hintEvery for hintFor (its Pod's CNI is setting
// it up, and its containers start right after), so a Pod is followed
// before its first connections rather than at the next periodic look; a
// link of another kind tells nothing, and the hints end with the context.
func TestPodWatchHints(t *testing.T) {
	tb := newTestbed(t)
	node := filepath.Base(tb.node)
	opt := Options{HostNetNS: tb.node}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	w := NewPodWatch(info, opt)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hints := w.Hints(ctx)
	// Links that are no Pod's (a bridge; the subscription may not be
	// made yet for the first, which is why there is a second).
	ipCmd(t, "-n", node, "link", "add", "br7", "type", "bridge")
	time.Sleep(300 * time.Millisecond)
	ipCmd(t, "-n", node, "link", "add", "br8", "type", "bridge")
	ipCmd(t, "-n", node, "link", "set", "br8", "up")
	select {
	case <-hints:
		t.Fatal("a bridge made the watch look again")
	case <-time.After(time.Second):
	}

	late := node + "-hint"
	ipCmd(t, "netns", "add", late)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", late).Run() })
	ipCmd(t, "-n", node, "link", "add", "hv7", "type", "veth", "peer", "name", "eth0", "netns", late)
	added := time.Now()
	select {
	case <-hints:
	case <-time.After(10 * time.Second):
		t.Fatal("no hint within 10 s of a new veth")
	}
	// Hinted again while its Pod may be set up: at least twice more.
	for i := range 2 {
		select {
		case <-hints:
		case <-time.After(hintFor):
			t.Fatalf("hint %d after the veth's first: none within %s", i+2, hintFor)
		}
	}
	// Then no more, hintFor after the veth came (a quiet gap before that
	// is the watch's goroutine kept off a loaded CPU, not its end).
	deadline := added.Add(hintFor + 10*time.Second)
	for quiet := false; !quiet; {
		select {
		case <-hints:
			if time.Now().After(deadline) {
				t.Fatalf("still hinting %s after the veth came", hintFor+10*time.Second)
			}
		case <-time.After(2 * hintEvery):
			quiet = time.Since(added) > hintFor
		}
	}
	cancel()
	select {
	case <-hints: // told before the cancel, still in the channel
	default:
	}
	ipCmd(t, "-n", node, "link", "add", "hv8", "type", "veth", "peer", "name", "eth1", "netns", late)
	select {
	case <-hints:
		t.Error("hinted after the context ended")
	case <-time.After(time.Second):
	}
}
