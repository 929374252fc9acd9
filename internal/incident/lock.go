package incident

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// DefaultRunDir holds the lock that makes incidents on one node take turns.
const DefaultRunDir = "/run/pathtrace"

// LockFile is the lock's name inside the run directory.
const LockFile = "incident.lock"

// BusyError says another incident holds the lock.
type BusyError struct {
	Path string
	PID  int // 0 when the holder did not write its PID yet
}

func (e *BusyError) Error() string {
	holder := "another process"
	if e.PID != 0 {
		holder = "process " + strconv.Itoa(e.PID)
	}
	return fmt.Sprintf("another pathtrace incident is running (%s holds %s): wait for it to finish or stop it; incidents on one node take turns", holder, e.Path)
}

// Lock takes the node's incident lock in runDir, or fails at once with a
// *BusyError naming the holder's PID. The lock is a flock(2): the kernel
// drops it when its holder exits, even by SIGKILL, so a crash leaves no stale
// lock. The file itself stays; only the flock on it matters.
func Lock(runDir string) (release func(), err error) {
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		return nil, fmt.Errorf("incident lock: %w%s", err, lockDirHint(runDir))
	}
	path := filepath.Join(runDir, LockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("incident lock: %w%s", err, lockDirHint(runDir))
	}
	// flock locks belong to the open file: a second Lock in the same process
	// (a second session) is refused too.
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &BusyError{Path: path, PID: readPID(f)}
		}
		return nil, fmt.Errorf("incident lock %s: %w", path, err)
	}
	if err := writePID(f); err != nil {
		f.Close() // closing drops the flock
		return nil, fmt.Errorf("incident lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}

// lockDirHint says how to give pathtrace the lock directory it could not
// make: a container with a read-only root (readOnlyRootFilesystem) has no
// writable /run, and one with its own /run locks only against itself.
func lockDirHint(runDir string) string {
	return fmt.Sprintf(" (an incident needs a writable %s; in a container, mount the node's %s there as a hostPath volume, which also makes incidents in containers and on the node take turns)", runDir, runDir)
}

func writePID(f *os.File) error {
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err := f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return err
}

func readPID(f *os.File) int {
	b := make([]byte, 32)
	n, _ := f.ReadAt(b, 0)
	pid, err := strconv.Atoi(strings.TrimSpace(string(b[:n])))
	if err != nil {
		return 0
	}
	return pid
}
