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

// Root returns the mount point of the cgroup2 filesystem: of one that shows
// the whole hierarchy when there is one. In a cgroup namespace (a container's
// own, as Kubernetes gives even a privileged one on cgroup v2) a cgroup2
// mounted there shows only the namespace's cgroup and what is below it, while
// a mount of the host's hierarchy (a hostPath of /sys/fs/cgroup) shows all:
// that one is taken wherever it is. Without one, the first cgroup2 mount is
// returned: IsHierarchyRoot tells which it is.
func Root() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("find cgroup2 mount: %w", err)
	}
	defer f.Close()
	mps, err := mountPoints(f)
	if err != nil {
		return "", err
	}
	return pickRoot(mps, IsHierarchyRoot), nil
}

// pickRoot is the first of the mount points that isRoot holds for, else the first.
func pickRoot(mps []string, isRoot func(string) bool) string {
	for _, mp := range mps {
		if isRoot(mp) {
			return mp
		}
	}
	return mps[0]
}

// rootCgroupID is the id (kernfs inode number) of the hierarchy's root cgroup.
const rootCgroupID = 1

// IsHierarchyRoot tells whether dir is the root cgroup of the cgroup v2
// hierarchy, not a cgroup below it (the root of a cgroup namespace, a
// subtree bind-mounted).
func IsHierarchyRoot(dir string) bool {
	var st unix.Stat_t
	return IsCgroup2(dir) && unix.Stat(dir, &st) == nil && st.Ino == rootCgroupID
}

// mountPoint returns the first cgroup2 mount point listed in a mountinfo file.
func mountPoint(r io.Reader) (string, error) {
	mps, err := mountPoints(r)
	if err != nil {
		return "", err
	}
	return mps[0], nil
}

// mountPoints returns the cgroup2 mount points listed in a mountinfo file, in
// its order; an error when there is none.
func mountPoints(r io.Reader) ([]string, error) {
	var out []string
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
		out = append(out, unescapeMountPath(fields[4]))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	if len(out) == 0 {
		return nil, errors.New("no cgroup2 filesystem in /proc/self/mountinfo: mount one or pass --cgroup")
	}
	return out, nil
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
