package discover

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CgroupRoot returns the mount point of the cgroup2 filesystem, read from
// /proc/self/mountinfo (it moves between distributions and hybrid layouts).
func CgroupRoot() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	return cgroup2Mount(f)
}

// cgroup2Mount returns the first cgroup2 mount point listed in a mountinfo file.
func cgroup2Mount(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		// 36 35 98:0 /root /mnt/point rw,noatime master:1 - cgroup2 cgroup2 rw
		line := sc.Text()
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		fields, fsFields := strings.Fields(pre), strings.Fields(post)
		if len(fields) < 5 || len(fsFields) < 1 || fsFields[0] != "cgroup2" {
			continue
		}
		return unescapeMountPath(fields[4]), nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	return "", errors.New("no cgroup2 filesystem in /proc/self/mountinfo: mount one or pass --cgroup")
}

// unescapeMountPath undoes the octal escapes (\040 for space, ...) mountinfo
// uses for blanks and backslashes in paths.
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// isCgroup2 tells whether path is on a cgroup2 filesystem.
func isCgroup2(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}
