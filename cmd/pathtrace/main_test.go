package main

import (
	"errors"
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestMain lets the test binary stand in for the pathtrace binary: the lab
// re-executes it for its workers, and the CLI tests re-execute it as pathtrace.
func TestMain(m *testing.M) {
	lab.RunWorkerIfRequested()
	if os.Getenv(runMainEnv) == "1" {
		if err := setTracefs(os.Getenv(tracefsEnv)); err != nil {
			fmt.Fprintf(os.Stderr, "test setup: %v\n", err)
			os.Exit(1)
		}
		os.Args = append([]string{"pathtrace"}, os.Args[1:]...)
		main()
		return
	}
	os.Exit(m.Run())
}

const runMainEnv = "PATHTRACE_TEST_RUN_MAIN"

// tracefsEnv asks the re-executed pathtrace to mount ("mount") or hide
// ("unmount") tracefs first. Only for a process in a mount namespace of its
// own (pathtraceInMountNS): the node's mounts stay as they are.
const tracefsEnv = "PATHTRACE_TEST_TRACEFS"

func setTracefs(want string) error {
	switch want {
	case "":
		return nil
	case "mount":
		if err := unix.Mount("tracefs", "/sys/kernel/tracing", "tracefs", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount tracefs: %w", err)
		}
		return nil
	case "unmount":
		// Both places cilium/ebpf looks for the tracepoint IDs.
		for _, dir := range []string{"/sys/kernel/tracing", "/sys/kernel/debug/tracing", "/sys/kernel/debug"} {
			for unix.Unmount(dir, unix.MNT_DETACH) == nil {
			}
		}
		return nil
	}
	return fmt.Errorf("%s=%q: want mount or unmount", tracefsEnv, want)
}
