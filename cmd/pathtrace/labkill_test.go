package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestLabClientKilledTakesItsWorker: `pathtrace lab client` killed by
// SIGKILL (a test's timeout, timeout -s KILL) takes its worker with it. The
// worker, which sends the requests from the Pod, went on alone until its
// --requests were done (1000 at --interval 1s here: a quarter of an hour of
// flows to the Services in every trace run after).
func TestLabClientKilledTakesItsWorker(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-ckill")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeSocket); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	cmd := pathtrace("lab", "client", "--name", l.Name(), "--requests", "1000", "--interval", "1s")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	worker := waitChild(t, cmd.Process.Pid)
	t.Cleanup(func() { _ = syscall.Kill(worker, syscall.SIGKILL) }) // without the fix: still sending
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for alive(worker) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if alive(worker) {
		t.Fatalf("lab client killed: its worker (pid %d) still runs 30 s later; want it gone with its parent", worker)
	}
}

// waitChild returns the PID of the first child of pid, once it has one
// (each thread lists the children it forked).
func waitChild(t *testing.T, pid int) int {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		files, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/children")
		if err != nil || len(files) == 0 {
			t.Fatalf("threads of %d: %v", pid, err)
		}
		for _, path := range files {
			b, _ := os.ReadFile(path) // a thread that ended meanwhile
			if f := strings.Fields(string(b)); len(f) > 0 {
				child, err := strconv.Atoi(f[0])
				if err != nil {
					t.Fatal(err)
				}
				return child
			}
		}
	}
	t.Fatalf("pid %d started no child in a minute", pid)
	return 0
}

// alive tells whether pid runs: it exists and is no zombie.
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// pid (comm) STATE ...: comm may hold spaces, the state follows its ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || !strings.HasPrefix(s[i+1:], " Z")
}
