package main

import (
	"os"
	"testing"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestMain lets the test binary stand in for the pathtrace binary: the lab
// re-executes it for its workers, and the CLI tests re-execute it as pathtrace.
func TestMain(m *testing.M) {
	lab.RunWorkerIfRequested()
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
