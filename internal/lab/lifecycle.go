package lab

import (
	"github.com/pathtrace/pathtrace/internal/cgroup2"

	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// State files in the instance's state dir, besides the server's PID file and log.
const (
	readyFile = "ready" // written when the topology is complete
	modeFile  = "mode"  // the mode in force
)

// Up brings the lab up in mode. It is idempotent: a complete lab is only
// switched to mode (clearing every trace of the previous one); anything less
// (nothing, a crashed or half-finished up) is torn down and built anew.
func (l *Lab) Up(ctx context.Context, mode Mode) error {
	if err := l.checkName(); err != nil {
		return err
	}
	if _, err := ParseMode(string(mode)); err != nil {
		return err
	}
	if _, err := cgroup2.Root(); err != nil {
		return fmt.Errorf("lab needs cgroup v2: %w", err)
	}
	if !l.complete() {
		if err := l.Down(); err != nil {
			return fmt.Errorf("clean up before up: %w", err)
		}
		if err := l.build(ctx); err != nil {
			return fmt.Errorf("lab %s up: %w", l.name, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	os.Remove(filepath.Join(l.stateDir(), modeFile))
	if err := l.clearMode(); err != nil {
		return fmt.Errorf("lab %s: clear previous mode: %w", l.name, err)
	}
	if err := l.applyMode(mode); err != nil {
		return fmt.Errorf("lab %s: mode %s: %w", l.name, mode, err)
	}
	return os.WriteFile(filepath.Join(l.stateDir(), modeFile), []byte(mode+"\n"), 0o644)
}

// build makes everything but the mode, marking the lab complete at the end.
func (l *Lab) build(ctx context.Context) error {
	if err := os.MkdirAll(l.stateDir(), 0o755); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	if err := l.buildTopology(); err != nil {
		return err
	}
	if err := createCgroup(l.ClientCgroup()); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := l.startServer(); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(l.stateDir(), readyFile), nil, 0o644)
}

// complete tells whether a finished build is still intact.
func (l *Lab) complete() bool {
	if _, err := os.Stat(filepath.Join(l.stateDir(), readyFile)); err != nil {
		return false
	}
	for _, role := range roles() {
		if !isNetNS(l.netnsPath(role)) {
			return false
		}
	}
	if _, err := os.Stat(l.ClientCgroup()); err != nil {
		return false
	}
	pid, err := readPIDFile(l.serverPIDFile())
	return err == nil && l.isOurWorker(pid, workerServer)
}

// currentMode is the mode in force, "" when none.
func (l *Lab) currentMode() Mode {
	b, err := os.ReadFile(filepath.Join(l.stateDir(), modeFile))
	if err != nil {
		return ""
	}
	return Mode(strings.TrimSpace(string(b)))
}

// Down removes everything of the lab instance, found by name, whatever state
// it is in: worker processes (verified as ours), namespaces (and with them
// their devices and tc programs), the client cgroup (and its programs), the
// state dir (the shared parent /run/pathtrace-lab stays: another instance
// may be creating its own in it). It keeps going after an error and reports them all.
func (l *Lab) Down() error {
	if err := l.checkName(); err != nil {
		return err
	}
	var errs []error
	errs = append(errs, l.killWorkers())
	if dir := l.ClientCgroup(); dir != "" {
		// Detach now rather than wait for the kernel's asynchronous release.
		for _, hook := range l.cgroupHooks(dir) {
			errs = append(errs, detachLabPrograms(hook))
		}
		errs = append(errs, removeCgroup(dir))
	}
	for _, role := range roles() {
		errs = append(errs, deleteNetNS(l.netnsPath(role)))
	}
	if err := os.RemoveAll(l.stateDir()); err != nil {
		errs = append(errs, fmt.Errorf("remove state dir: %w", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("lab %s down: %w", l.name, err)
	}
	return nil
}
