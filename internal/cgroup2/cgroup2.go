// Package cgroup2 finds the cgroup v2 hierarchy and cgroups in it. Its mount
// point moves between distributions and hybrid layouts (/sys/fs/cgroup,
// /sys/fs/cgroup/unified, ...), so it is read from mountinfo, never assumed.
package cgroup2

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Root returns the mount point of the cgroup2 filesystem.
func Root() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	return mountPoint(f)
}

// mountPoint returns the first cgroup2 mount point listed in a mountinfo file.
func mountPoint(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		// 36 35 98:0 /root /mnt/point rw,noatime master:1 - cgroup2 cgroup2 rw
		pre, post, ok := strings.Cut(sc.Text(), " - ")
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

// IsCgroup2 tells whether path is on a cgroup2 filesystem.
func IsCgroup2(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

var errFound = errors.New("found")

// PathOf finds the directory of the cgroup whose id is id (a cgroup's id is
// its kernfs inode number) by walking the hierarchy under root.
func PathOf(root string, id uint64) (string, error) {
	var found string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil // a cgroup removed during the walk is not an error
		}
		var st unix.Stat_t
		if unix.Stat(path, &st) == nil && st.Ino == id {
			found = path
			return errFound
		}
		return nil
	})
	if found != "" {
		return found, nil
	}
	if err != nil && !errors.Is(err, errFound) {
		return "", err
	}
	return "", fmt.Errorf("no cgroup with id %d under %s (gone already?)", id, root)
}
