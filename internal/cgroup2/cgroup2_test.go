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
