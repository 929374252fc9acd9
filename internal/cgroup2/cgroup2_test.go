package cgroup2

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMountPoint(t *testing.T) {
	for _, tc := range []struct {
		file, want string
	}{
		{"mountinfo-hybrid", "/sys/fs/cgroup/unified"},
		{"mountinfo-escaped", "/mnt/my cgroups"},
		{"mountinfo-unified", "/sys/fs/cgroup"},
	} {
		f, err := os.Open("testdata/" + tc.file)
		if err != nil {
			t.Fatal(err)
		}
		got, err := mountPoint(f)
		f.Close()
		if err != nil || got != tc.want {
			t.Errorf("%s: got %q, %v; want %q", tc.file, got, err, tc.want)
		}
	}
	f, err := os.Open("testdata/mountinfo-nocgroup2")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got, err := mountPoint(f); err == nil {
		t.Errorf("no cgroup2 mount: got %q, want an error", got)
	}
}

// PathOf finds this process's own cgroup (root) by its id.
func TestPathOfRoot(t *testing.T) {
	root, err := Root()
	if err != nil {
		t.Skipf("no cgroup2 here: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		t.Fatal(err)
	}
	got, err := PathOf(root, st.Ino)
	if err != nil || got != root {
		t.Fatalf("PathOf(root id) = %q, %v; want %q", got, err, root)
	}
	if _, err := PathOf(root, 1<<62); err == nil {
		t.Fatal("PathOf of an id no cgroup has: want an error")
	}
}

// In a cgroup namespace (a container's) the cgroup2 mounted at the usual
// place shows only the namespace's subtree; a mount of the whole hierarchy
// elsewhere (the host's, a hostPath) is the one the socket observers need.
func TestPickRootPrefersHierarchyRoot(t *testing.T) {
	isRoot := func(mp string) bool { return mp == "/host/sys/fs/cgroup" }
	if got := pickRoot([]string{"/sys/fs/cgroup", "/host/sys/fs/cgroup"}, isRoot); got != "/host/sys/fs/cgroup" {
		t.Errorf("got %q, want the hierarchy's root /host/sys/fs/cgroup", got)
	}
	if got := pickRoot([]string{"/sys/fs/cgroup", "/mnt/cg"}, isRoot); got != "/sys/fs/cgroup" {
		t.Errorf("no hierarchy root: got %q, want the first mount", got)
	}
}

// The root of the hierarchy is one; a cgroup below it (what a cgroup
// namespace's mount shows as its root) is not.
func TestIsHierarchyRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a cgroup")
	}
	root, err := Root()
	if err != nil {
		t.Skipf("no cgroup2 here: %v", err)
	}
	if !IsHierarchyRoot(root) {
		t.Skipf("%s is not the hierarchy's root (this test runs in a cgroup namespace)", root)
	}
	sub, err := os.MkdirTemp(root, "cgroup2-test-")
	if err != nil {
		t.Skipf("cannot make a cgroup: %v", err)
	}
	defer os.Remove(sub)
	if IsHierarchyRoot(sub) {
		t.Errorf("%s: a cgroup below the root taken for the root", sub)
	}
	if IsHierarchyRoot(os.TempDir()) {
		t.Errorf("%s: not a cgroup at all, taken for the root", os.TempDir())
	}
}
