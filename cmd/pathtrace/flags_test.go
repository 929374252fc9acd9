package main

import (
	"os"
	"strings"
	"syscall"
	"testing"
)

// TestDurationHelpNamesStopSignals: --help names every signal that ends a
// run early.
func TestDurationHelpNamesStopSignals(t *testing.T) {
	names := map[os.Signal]string{os.Interrupt: "Ctrl-C", syscall.SIGTERM: "SIGTERM", syscall.SIGHUP: "SIGHUP"}
	usage := newTraceFlagSet(&traceFlags{}).Lookup("duration").Usage
	for _, sig := range stopSignals() {
		if name, ok := names[sig]; !ok || !strings.Contains(usage, name) {
			t.Errorf("--duration's help %q does not say that %v ends the run", usage, sig)
		}
	}
}
