package session

import (
	"context"
	"net/netip"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestRunLeavesNothingBehind: a session that ended leaves the process as it
// found it: no goroutine, no descriptor (observers, taps, maps, netlink
// sockets) and no process-wide setting of its own, since another session
// of the process may still be capturing (a daemon runs several).
func TestRunLeavesNothingBehind(t *testing.T) {
	name := testNetNS(t, "pttest-leave", "")[0]
	gcPercent := debug.SetGCPercent(100)
	defer debug.SetGCPercent(gcPercent)
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)

	_, err := Run(context.Background(), Options{
		Services: []flow.Service{{Addr: netip.MustParseAddr("192.0.2.80")}},
		Duration: 100 * time.Millisecond,
		Discover: discover.Options{HostNetNS: "/run/netns/" + name},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GC percent %d after the session, want the process's 100 kept", got)
	}
	// What ends asynchronously (a goroutine's last steps) is given a moment.
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		now, open := runtime.NumGoroutine(), openFDs(t)
		if now <= goroutines && slices.Equal(open, fds) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the session: %d goroutines (before: %d), descriptors %v (before: %v)", now, goroutines, open, fds)
		}
	}
}

// openFDs lists the process's open descriptors, with what each refers to.
func openFDs(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name()) // the directory's own descriptor is gone by now
		out = append(out, e.Name()+" "+target)
	}
	return out
}
