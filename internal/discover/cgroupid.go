package discover

import (
	"errors"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
)

// SockProgramsForCgroupID lists the sock_addr programs effective for the cgroup
// with that id (the cgroup a client socket was created in), leaving out the
// programs isObserver names.
func SockProgramsForCgroupID(root string, id uint64, isObserver func(ebpf.ProgramID) bool) (string, []SockProgram, error) {
	path, err := cgroup2.PathOf(root, id)
	if err != nil {
		return "", nil, err
	}
	var scratch NodeInfo
	progs := sockPrograms(path, observerFilter(isObserver), &scratch)
	if len(scratch.Notes) > 0 && len(progs) == 0 {
		return path, nil, errors.New(scratch.Notes[0])
	}
	return path, progs, nil
}
