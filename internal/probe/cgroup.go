package probe

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// CgroupRoot returns the mount point of the cgroup v2 hierarchy, read from
// /proc/self/mountinfo (its place differs between hosts: /sys/fs/cgroup,
// /sys/fs/cgroup/unified, ...).
func CgroupRoot() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	return cgroup2Mount(f)
}

// cgroup2Mount finds the first cgroup2 mount in mountinfo text: fields are
// "id parent major:minor root mountpoint options [optional...] - fstype ...".
func cgroup2Mount(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		fields, fs := strings.Fields(pre), strings.Fields(post)
		if !ok || len(fields) < 5 || len(fs) < 1 || fs[0] != "cgroup2" {
			continue
		}
		return unescapeMountPath(fields[4]), nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	return "", errors.New("no cgroup2 hierarchy mounted: socket observers need cgroup v2")
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
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
