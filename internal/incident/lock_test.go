package incident

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestLockRefusesASecondIncident(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	release, err := Lock(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = Lock(dir)
	var busy *BusyError
	if !errors.As(err, &busy) || busy.PID != os.Getpid() {
		t.Fatalf("second Lock: got %v, want a BusyError naming pid %d", err, os.Getpid())
	}
	if msg := err.Error(); !strings.Contains(msg, fmt.Sprintf("process %d", os.Getpid())) || !strings.Contains(msg, "incident") {
		t.Errorf("message: %s", msg)
	}
	release()
	release2, err := Lock(dir)
	if err != nil {
		t.Fatalf("Lock after release: %v", err)
	}
	release2()
}

// TestLockHolderProcess is the helper process of TestLockSurvivesACrash: it
// takes the lock, says so and waits to be killed.
func TestLockHolderProcess(t *testing.T) {
	dir := os.Getenv("PTTEST_INCIDENT_LOCK_DIR")
	if dir == "" {
		t.Skip("helper process for TestLockSurvivesACrash")
	}
	if _, err := Lock(dir); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("locked")
	time.Sleep(time.Minute)
	os.Exit(0)
}

// TestLockSurvivesACrash: a holder killed with SIGKILL leaves its PID in the
// file but no lock; the next incident starts.
func TestLockSurvivesACrash(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	cmd := exec.Command(os.Args[0], "-test.run=^TestLockHolderProcess$")
	cmd.Env = append(os.Environ(), "PTTEST_INCIDENT_LOCK_DIR="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "locked\n" {
		t.Fatalf("helper: %q %v", line, err)
	}

	_, err = Lock(dir)
	var busy *BusyError
	if !errors.As(err, &busy) || busy.PID != cmd.Process.Pid {
		t.Fatalf("Lock while the helper holds it: got %v, want a BusyError naming pid %d", err, cmd.Process.Pid)
	}
	cmd.Process.Kill()
	cmd.Wait()
	release, err := Lock(dir)
	if err != nil {
		t.Fatalf("Lock after the holder was killed: %v", err)
	}
	release()
	if b, _ := os.ReadFile(filepath.Join(dir, LockFile)); strings.TrimSpace(string(b)) != fmt.Sprint(os.Getpid()) {
		t.Errorf("lock file holds %q, want our pid", b)
	}
}

// TestLockDirUnwritable: a lock directory that cannot be made (a container's
// read-only root) is named with how to give one.
func TestLockDirUnwritable(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Lock(filepath.Join(file, "run"))
	if err == nil || !strings.Contains(err.Error(), "hostPath") || !strings.Contains(err.Error(), "writable "+filepath.Join(file, "run")) {
		t.Errorf("lock in a directory that cannot be made: %v; want the directory named and how to give one", err)
	}
}
