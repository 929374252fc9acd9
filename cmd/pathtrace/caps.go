package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// requiredCap is a capability a trace cannot do without, and what for.
type requiredCap struct {
	bit  uint
	name string
	why  string
	// orSysAdmin: the kernel accepts CAP_SYS_ADMIN in its place
	// (bpf_capable, perfmon_capable).
	orSysAdmin bool
}

var requiredCaps = []requiredCap{
	{unix.CAP_BPF, "CAP_BPF", "loading the observers", true},
	{unix.CAP_PERFMON, "CAP_PERFMON", "the tracepoint observer and reading kernel memory", true},
	{unix.CAP_NET_ADMIN, "CAP_NET_ADMIN", "nftables, conntrack, tc and netfilter hooks", false},
	{unix.CAP_NET_RAW, "CAP_NET_RAW", "the AF_PACKET capture taps", false},
	{unix.CAP_SYS_ADMIN, "CAP_SYS_ADMIN", "entering the Pods' network namespaces", false},
}

// missingCaps names the required capabilities the effective set eff lacks,
// each with what it is for.
func missingCaps(eff uint64) []string {
	has := func(bit uint) bool { return eff&(1<<bit) != 0 }
	var out []string
	for _, c := range requiredCaps {
		if has(c.bit) || c.orSysAdmin && has(unix.CAP_SYS_ADMIN) {
			continue
		}
		out = append(out, fmt.Sprintf("%s (%s)", c.name, c.why))
	}
	return out
}

// effectiveCaps is this process's effective capability set.
func effectiveCaps() (uint64, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return 0, err
	}
	return uint64(data[0].Effective) | uint64(data[1].Effective)<<32, nil
}

// capsProblem is the one line that says which capabilities pathtrace lacks
// ("" when it has them all), checked before anything is attached: a run
// without one would attach some observers and lose others (no capture
// without CAP_NET_RAW, no NAT rules nor conntrack without CAP_NET_ADMIN).
// Being root is not the test: a container's root may lack some, and a
// non-root user given them all is enough.
func capsProblem(cmd string) string {
	eff, err := effectiveCaps()
	if err != nil {
		return fmt.Sprintf("%s: cannot read its capabilities: %v", cmd, err)
	}
	missing := missingCaps(eff)
	if len(missing) == 0 {
		return ""
	}
	return fmt.Sprintf("%s: needs %s, which this process does not have: run it as root (sudo), or in a container add %s to securityContext.capabilities (privileged has them all)",
		cmd, strings.Join(missing, ", "), capNames(missing))
}

func capNames(missing []string) string {
	names := make([]string, len(missing))
	for i, m := range missing {
		names[i], _, _ = strings.Cut(strings.TrimPrefix(m, "CAP_"), " ")
	}
	return strings.Join(names, ", ")
}

// memlockHint is what cilium/ebpf adds to an EPERM from bpf(): on the kernels
// pathtrace runs on (>= 6.6) BPF memory is charged to the memory cgroup, and
// RLIMIT_MEMLOCK plays no part.
const memlockHint = " (MEMLOCK may be too low, consider rlimit.RemoveMemlock)"

// explainDenied is the message of a run that failed, with why the kernel
// refused when it said EPERM though pathtrace has the capabilities it needs
// (checked before): a seccomp filter (a container's RuntimeDefault profile
// blocks bpf() and setns()) or a security module.
func explainDenied(err error) string {
	msg := err.Error()
	if !errors.Is(err, unix.EPERM) && !strings.Contains(msg, "operation not permitted") {
		return msg
	}
	msg = strings.ReplaceAll(msg, memlockHint, "")
	if seccompFiltered("/proc/self/status") {
		return msg + ": a seccomp filter is on pathtrace (Seccomp: 2 in /proc/self/status; a container's RuntimeDefault profile is one) and refuses this system call though pathtrace has the capabilities: run it unconfined (seccompProfile: Unconfined; a privileged container usually is)"
	}
	return msg + ": refused though pathtrace has the capabilities it needs and no seccomp filter: a security module (AppArmor, SELinux, kernel lockdown) may forbid it"
}

// seccompFiltered tells whether the process status file at path says a
// seccomp filter is on it (mode 2).
func seccompFiltered(path string) bool {
	b, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "Seccomp:"); ok {
			return strings.TrimSpace(v) == "2"
		}
	}
	return false
}
