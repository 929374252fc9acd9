package lab

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// createCgroup makes the client cgroup (no error when it exists).
func createCgroup(dir string) error {
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create cgroup %s: %w", dir, err)
	}
	return nil
}

// removeCgroup kills whatever still runs in the cgroup and removes it. The
// kernel releases programs attached to it asynchronously after the rmdir.
func removeCgroup(dir string) error {
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0o200); err != nil {
		return fmt.Errorf("kill processes of cgroup %s: %w", dir, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
