package main

import (
	"os"
	"strings"
	"syscall"
)

// lazyFree is the Go runtime setting that returns freed heap pages to the
// kernel with MADV_FREE instead of MADV_DONTNEED: the kernel takes them back
// only when it needs memory, and a page the heap uses again meanwhile costs
// nothing, where a page given back with MADV_DONTNEED costs a page fault
// and a zeroed page on its next use. A run loads the kernel's BTF at start
// (about 70 MB allocated, most of it garbage once the observers are
// loaded); the runtime gives those pages back, and the flows of the first
// seconds take them again: in the lab, about 1.6 page faults per new
// connection over the first 1500, a third of pathtrace's CPU then (a page
// fault costs microseconds in a VM). The peak RSS stays what the heap
// reached; what the process gave back counts in its RSS until the kernel
// reclaims it.
const lazyFree = "madvdontneed=0"

// runWithLazyFree re-executes pathtrace with lazyFree added to GODEBUG (the
// runtime reads the setting once, at start, and from nowhere else), unless
// GODEBUG already sets madvdontneed: the user's choice wins. It returns only
// when it did not re-execute (the exec failed, the binary was removed): the run
// then goes on as it is.
func runWithLazyFree() {
	env, ok := lazyFreeEnv(os.Environ())
	if !ok {
		return
	}
	// The binary's own path, not /proc/self/exe: the process is named
	// after the file it runs (ps, top, pkill pathtrace).
	if exe, err := os.Executable(); err == nil {
		_ = syscall.Exec(exe, os.Args, env)
	}
}

// lazyFreeEnv is env with lazyFree added to its GODEBUG; false when its
// GODEBUG already sets madvdontneed.
func lazyFreeEnv(env []string) ([]string, bool) {
	out := make([]string, 0, len(env)+1)
	godebug := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "GODEBUG="); ok {
			godebug = v // the last one, as getenv takes it
			continue
		}
		out = append(out, kv)
	}
	for _, setting := range strings.Split(godebug, ",") {
		if strings.HasPrefix(setting, "madvdontneed=") {
			return env, false
		}
	}
	if godebug != "" {
		godebug += ","
	}
	return append(out, "GODEBUG="+godebug+lazyFree), true
}
