package session

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestStopWhileAttachingEndsStart: a stop (Ctrl-C) that comes while the
// observers attach ends the start there: Run returns context.Canceled
// (pathtrace then says nothing was traced, exit 1) and nothing stays on the
// cgroup. Start-up looked at the stop during discovery only: it went on to
// attach everything and open every ring (seconds on a node of many Pods),
// then ran for no time and returned an empty run's report. The stop is
// given as soon as the socket observers are on the cgroup; a stop seen so
// late that the start was over is an interrupted run as before, so each of
// a few tries may be one, but not all.
func TestStopWhileAttachingEndsStart(t *testing.T) {
	name := testNetNS(t, "pttest-stop", "")[0]
	root, err := cgroup2.Root()
	if err != nil {
		t.Skipf("cgroup2: %v", err)
	}
	dir := filepath.Join(root, fmt.Sprintf("pttest-stop-%06x", rand.IntN(1<<24)))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	observed := func() int {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(cg.Fd()), Attach: ebpf.AttachCGroupInet4Connect})
		if err != nil {
			t.Errorf("query the cgroup: %v", err)
			return -1
		}
		return len(res.Programs)
	}
	var outcomes []string
	for try := range 5 {
		ctx, cancel := context.WithCancel(context.Background())
		watched := make(chan struct{})
		go func() {
			defer close(watched)
			for ctx.Err() == nil {
				if observed() != 0 {
					cancel()
					return
				}
			}
		}()
		res, err := Run(ctx, Options{
			Services: []flow.Service{{Addr: netip.MustParseAddr("192.0.2.80")}},
			Duration: time.Minute,
			Discover: discover.Options{HostNetNS: "/run/netns/" + name, Cgroup: dir},
		})
		cancel()
		<-watched
		if n := observed(); n != 0 {
			t.Fatalf("try %d: %d socket observers stay on the cgroup after Run", try+1, n)
		}
		switch {
		case errors.Is(err, context.Canceled):
			return
		case err != nil:
			t.Fatalf("try %d: %v", try+1, err)
		}
		outcomes = append(outcomes, fmt.Sprintf("a run stopped %q after %s", res.StopReason, res.Stopped.Sub(res.Began).Round(time.Millisecond)))
	}
	t.Errorf("stopped as the observers attached, 5 times: %v; want the start ended (context.Canceled) in some", outcomes)
}
