package lab

import (
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestNetNSOutlivesIPNetnsAdd: a lab namespace can be deleted after
// iproute2 set up the named-netns directory (`ip netns add` bind-mounts it
// over itself the first time, when it is no mount point yet). Made first in
// a plain directory, the lab's namespaces stayed mounted underneath that
// bind, and `lab down` failed with EBUSY, leaving them behind.
func TestNetNSOutlivesIPNetnsAdd(t *testing.T) {
	needRoot(t)
	dir := t.TempDir() // a plain directory, as /run/netns is on a fresh machine
	path := filepath.Join(dir, "ptlab-netns-test")
	t.Cleanup(func() {
		// Every mount of the directory, then what was beneath them.
		for unix.Unmount(dir, unix.MNT_DETACH) == nil {
		}
		deleteNetNS(path)
	})
	if err := createNetNS(path); err != nil {
		t.Fatal(err)
	}
	// What `ip netns add` does to the directory before adding its own.
	if err := nsutil.PrepareNamedDir(dir); err != nil {
		t.Fatal(err)
	}
	if !isNetNS(path) {
		t.Fatalf("%s is no network namespace after iproute2's set-up", path)
	}
	if err := deleteNetNS(path); err != nil {
		t.Fatalf("delete after iproute2's set-up: %v", err)
	}
}
