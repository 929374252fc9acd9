package main

import (
	"math"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestMain lets the test binary stand in for the pathtrace binary: the lab
// re-executes it for its workers, and the CLI tests re-execute it as pathtrace.
func TestMain(m *testing.M) {
	lab.RunWorkerIfRequested()
	if nr := os.Getenv(denySyscallEnv); nr != "" {
		denySyscall(nr) // before main, as a container's seccomp profile is
	}
	if os.Getenv(runMainEnv) == "1" {
		os.Args = append([]string{"pathtrace"}, os.Args[1:]...)
		main()
		return
	}
	os.Exit(m.Run())
}

const runMainEnv = "PATHTRACE_TEST_RUN_MAIN"

func TestCaptureProcs(t *testing.T) {
	for cpus, want := range map[int]int{1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 64: 2} {
		if got := captureProcs(cpus); got != want {
			t.Errorf("captureProcs(%d) = %d, want %d", cpus, got, want)
		}
	}
}

func TestBehindProcs(t *testing.T) {
	for cpus, want := range map[int]int{1: 1, 2: 2, 3: 2, 64: 2} {
		if got := behindProcs(cpus); got != want {
			t.Errorf("behindProcs(%d) = %d, want %d", cpus, got, want)
		}
	}
}

// TestMoreProcsWhenBehind: a capture that falls behind gets behindProcs
// threads while it says so, and its captureProcs back once it has not for
// the governor's calm period; a GOMAXPROCS the user set is never changed.
func TestMoreProcsWhenBehind(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	defer func(n int) { availableProcs = n }(availableProcs)
	t.Setenv("GOMAXPROCS", "")
	for _, cpus := range []int{1, 2, 8} {
		availableProcs = cpus
		if moreProcsWhenBehind() == nil {
			t.Fatalf("%d CPUs: no CaptureBehind", cpus)
		}
		low, high := captureProcs(cpus), behindProcs(cpus)
		runtime.GOMAXPROCS(low)
		g := &procsGovernor{low: low, high: high, calm: 100 * time.Millisecond}
		g.behind()
		if got := runtime.GOMAXPROCS(0); got != high {
			t.Errorf("%d CPUs: GOMAXPROCS %d once behind, want %d", cpus, got, high)
		}
		// Said again and again while behind: it keeps them.
		for range 4 {
			time.Sleep(40 * time.Millisecond)
			g.behind()
			if got := runtime.GOMAXPROCS(0); got != high {
				t.Errorf("%d CPUs: GOMAXPROCS %d while behind, want %d", cpus, got, high)
			}
		}
		deadline := time.Now().Add(5 * time.Second)
		for runtime.GOMAXPROCS(0) != low && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if got := runtime.GOMAXPROCS(0); got != low {
			t.Errorf("%d CPUs: GOMAXPROCS %d once calm, want %d", cpus, got, low)
		}
		// Behind again: raised again.
		g.behind()
		if got := runtime.GOMAXPROCS(0); got != high {
			t.Errorf("%d CPUs: GOMAXPROCS %d behind a second time, want %d", cpus, got, high)
		}
		for runtime.GOMAXPROCS(0) != low && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	t.Setenv("GOMAXPROCS", "1")
	if moreProcsWhenBehind() != nil {
		t.Error("with GOMAXPROCS set by the user, a capture that falls behind still changes it")
	}
}

// TestMemoryLimitFor: up to the default --max-flows the soft limit is the
// 40 MiB the 64 MiB target is made of; beyond, each flow gets its share, so
// that a run of --max-flows 100000 (the live heap passed 42 MiB within a
// minute of churn) does not keep the collector running without pause.
func TestMemoryLimitFor(t *testing.T) {
	// --max-flows 9223372036854775807, meaning no bound, wrapped to 24 MiB.
	for maxFlows, want := range map[int]int64{1: 40 << 20, 10: 40 << 20, defaultMaxFlows: 40 << 20,
		defaultMaxFlows + 256: 41 << 20, 100000: 40<<20 + (100000-defaultMaxFlows)*4096, math.MaxInt: math.MaxInt64} {
		if got := memoryLimitFor(maxFlows); got != want {
			t.Errorf("memoryLimitFor(%d) = %d MiB, want %d MiB", maxFlows, got>>20, want>>20)
		}
	}
	var f traceFlags
	if newTraceFlagSet(&f).Parse(nil); f.maxFlows != defaultMaxFlows {
		t.Errorf("--max-flows defaults to %d, the memory limit is made for %d", f.maxFlows, defaultMaxFlows)
	}
}
