package discover

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

var errFound = errors.New("found")

// CgroupPath finds the cgroup v2 directory whose id is id (a cgroup's id is its
// kernfs inode number) by walking the hierarchy under root.
func CgroupPath(root string, id uint64) (string, error) {
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

// SockProgramsForCgroupID lists the sock_addr programs effective for the cgroup
// with that id (the cgroup a client socket was created in), excluding own.
func SockProgramsForCgroupID(root string, id uint64, own func() []ebpf.ProgramID) (string, []SockProgram, error) {
	path, err := CgroupPath(root, id)
	if err != nil {
		return "", nil, err
	}
	var scratch NodeInfo
	progs := sockPrograms(path, ownSet(own), &scratch)
	if len(scratch.Notes) > 0 && len(progs) == 0 {
		return path, nil, errors.New(scratch.Notes[0])
	}
	return path, progs, nil
}
