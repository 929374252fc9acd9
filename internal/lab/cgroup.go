package lab

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// cgroup2Root finds where the cgroup v2 hierarchy is mounted (it differs between
// unified and hybrid layouts, so it is never assumed).
func cgroup2Root() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	return parseCgroup2Root(f)
}

// parseCgroup2Root returns the mount point of the first cgroup2 mount in a
// /proc/PID/mountinfo listing.
func parseCgroup2Root(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		fields, fsFields := strings.Fields(pre), strings.Fields(post)
		if len(fields) >= 5 && len(fsFields) >= 1 && fsFields[0] == "cgroup2" {
			return unescapeMountPath(fields[4]), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	return "", errors.New("no cgroup2 mount found in /proc/self/mountinfo")
}

// unescapeMountPath decodes mountinfo's octal escapes (\040 for a space ...).
func unescapeMountPath(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

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
