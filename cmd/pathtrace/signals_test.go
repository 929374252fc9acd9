package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"syscall"
	"testing"
)

// TestSecondStopSignalEndsAtOnce: a second stop signal ends pathtrace at
// once, killed by it, without its report, also when it comes close behind the first (two
// senders; a terminal that went away, then the shell's own hangup): one that
// came before the first one's handling gave the signals their default
// action back was lost, and the run went on to write its report.
func TestSecondStopSignalEndsAtOnce(t *testing.T) {
	needRoot(t)
	// Another signal than the first: the kernel merges two of one kind
	// that are pending together.
	var second os.Signal
	for _, s := range []os.Signal{syscall.SIGHUP, os.Interrupt} {
		if !signal.Ignored(s) { // ignored here (nohup, a background job), ignored in pathtrace too
			second = s
			break
		}
	}
	if second == nil {
		t.Skip("SIGHUP and SIGINT are ignored: no second stop signal to send")
	}
	name := fmt.Sprintf("ptr2-sig%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	for i := range 3 {
		r := startJSON(t, "--host-netns", "/run/netns/"+name, "--svc", "192.0.2.80:53/udp", "--duration", "1m")
		r.waitNode(t)
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		_ = r.cmd.Process.Signal(second)
		var after []any
		for m := range r.lines {
			after = append(after, m["type"])
		}
		_ = r.cmd.Wait()
		// Killed by it, not exited 128+signal: a shell's script goes on
		// after a command that exited. Either may be the one taken second:
		// they came together.
		ws := r.cmd.ProcessState.Sys().(syscall.WaitStatus)
		if !ws.Signaled() || ws.Signal() != syscall.SIGTERM && ws.Signal() != second || slices.Contains(after, any("summary")) {
			t.Fatalf("run %d, SIGTERM then %v: %v, lines after the node %v (stderr %q); want pathtrace killed by the second, without its report",
				i+1, second, r.cmd.ProcessState, after, r.stderr.String())
		}
	}
}
