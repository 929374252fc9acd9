package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCgroupFlagAbsolute: a relative --cgroup reaches discovery and the
// observers' attachment as an absolute path (walking up from "." never
// reached "/" and looped until memory ran out).
func TestCgroupFlagAbsolute(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	for in, want := range map[string]string{".": dir, "sub": filepath.Join(dir, "sub"), "./sub/..": dir} {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.96.0.10", "--cgroup", in}); err != nil {
			t.Fatal(err)
		}
		opt, err := f.validate()
		if err != nil {
			t.Fatalf("--cgroup %s: %v", in, err)
		}
		if opt.Discover.Cgroup != want {
			t.Errorf("--cgroup %s: got %q, want %q", in, opt.Discover.Cgroup, want)
		}
	}
}
