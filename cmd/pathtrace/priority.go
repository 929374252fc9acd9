package main

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"
)

// defaultNice is the nice value pathtrace runs at. A capture must drain its
// rings while the traffic it watches keeps the node's CPUs busy: at nice 0,
// the lab's saturated benchmark left the whole process unscheduled for about
// 120 ms now and then, and all three rings overflowed together (frames lost
// in 5 of 10 runs of the 100k pps and faster steps; in 1 of 18 at -5). The
// capture's CPU is the same either way, bounded by the traffic: it only
// gets it sooner. The kernel weighs nice values within a scheduling group
// only (the CPU cgroup; in the root cgroup with autogroup, the session):
// against Pods in other cgroups their cgroups' weights decide.
const defaultNice = -5

// setNice gives every thread of the process nice value n. Linux keeps the
// nice value per thread and a new thread inherits its creator's, so once
// every thread has it, so do the Go runtime's later ones; a thread created
// while the list is read is caught by the next pass, which repeats until
// the list stands still.
func setNice(n int) error {
	var done []int
	for range 10 {
		tids, err := threads()
		if err != nil {
			return err
		}
		if slices.Equal(tids, done) {
			return nil
		}
		for _, tid := range tids {
			err := unix.Setpriority(unix.PRIO_PROCESS, tid, n)
			if err != nil && !errors.Is(err, unix.ESRCH) { // ESRCH: the thread ended
				if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) {
					// A container's root often lacks it: say which. The
					// kernel refuses a nice value below the thread's own,
					// which is not 0 under nice(1) or a unit's Nice=.
					now := niceOf(tid)
					return fmt.Errorf("set nice %d: %w (a nice value below the one pathtrace has, %d, needs CAP_SYS_NICE; --nice %d asks for none)", n, err, now, now)
				}
				return fmt.Errorf("set nice %d: %w", n, err)
			}
		}
		done = tids
	}
	return fmt.Errorf("set nice %d: the process kept starting threads", n)
}

// niceOf is the nice value of thread tid (0 when it cannot be read).
func niceOf(tid int) int {
	prio, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return 0
	}
	return 20 - prio // the system call's value, 40 for nice -20 to 1 for 19
}

// threads lists the process's thread ids, sorted.
func threads() ([]int, error) {
	entries, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(entries))
	for _, e := range entries {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	slices.Sort(tids)
	return tids, nil
}
