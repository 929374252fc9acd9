package main

import (
	"os"
	"slices"
	"strings"
	"testing"
)

func TestLazyFreeEnv(t *testing.T) {
	for _, c := range []struct {
		env  []string
		want []string // nil: no re-exec
	}{
		{[]string{"PATH=/bin"}, []string{"PATH=/bin", "GODEBUG=madvdontneed=0"}},
		{[]string{"GODEBUG=gctrace=1", "HOME=/root"}, []string{"HOME=/root", "GODEBUG=gctrace=1,madvdontneed=0"}},
		{[]string{"GODEBUG="}, []string{"GODEBUG=madvdontneed=0"}},
		// The user's setting wins, whichever it is.
		{[]string{"GODEBUG=madvdontneed=1"}, nil},
		{[]string{"GODEBUG=gctrace=1,madvdontneed=0"}, nil},
		// Another setting whose name ends so is not it.
		{[]string{"GODEBUG=xmadvdontneed=1"}, []string{"GODEBUG=xmadvdontneed=1,madvdontneed=0"}},
	} {
		got, ok := lazyFreeEnv(c.env)
		if ok != (c.want != nil) || (ok && !slices.Equal(got, c.want)) {
			t.Errorf("lazyFreeEnv(%q) = %q, %v; want %q", c.env, got, ok, c.want)
		}
	}
}

// showGodebugEnv makes the test binary, re-executed by main, print its
// GODEBUG and exit (TestMain).
const showGodebugEnv = "PATHTRACE_TEST_SHOW_GODEBUG"

// TestRunsWithLazyFree: a run re-executes itself with the setting, its
// arguments and its process name kept.
func TestRunsWithLazyFree(t *testing.T) {
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Fatal(err)
	}
	cmd := pathtrace("--svc", "192.0.2.1", "--duration", "1s")
	cmd.Env = append(without(cmd.Env, "GODEBUG"), showGodebugEnv+"=1", "GODEBUG=gctrace=0")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v: %v", cmd, err)
	}
	want := "gctrace=0," + lazyFree + "\n--svc 192.0.2.1 --duration 1s\n" + strings.TrimSpace(string(comm))
	if got := strings.TrimSpace(string(out)); got != want {
		t.Errorf("GODEBUG, arguments and name after the re-exec:\n%s\nwant\n%s", got, want)
	}
}

func without(env []string, name string) []string {
	return slices.DeleteFunc(slices.Clone(env), func(kv string) bool { return strings.HasPrefix(kv, name+"=") })
}
