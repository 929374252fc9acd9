package main

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMissingCaps: each capability a trace cannot do without is named when
// missing; CAP_BPF and CAP_PERFMON are not, while CAP_SYS_ADMIN stands in
// for them as the kernel lets it.
func TestMissingCaps(t *testing.T) {
	all := uint64(0)
	for _, c := range requiredCaps {
		all |= 1 << c.bit
	}
	if m := missingCaps(all); len(m) != 0 {
		t.Errorf("all capabilities: missing %q", m)
	}
	for _, c := range requiredCaps {
		m := missingCaps(all &^ (1 << c.bit))
		if c.orSysAdmin {
			if len(m) != 0 {
				t.Errorf("without %s but with CAP_SYS_ADMIN: missing %q, want none", c.name, m)
			}
			continue
		}
		if len(m) != 1 || !strings.HasPrefix(m[0], c.name+" (") {
			t.Errorf("without %s: missing %q, want it alone", c.name, m)
		}
	}
	m := missingCaps(all &^ (1<<unix.CAP_SYS_ADMIN | 1<<unix.CAP_BPF))
	if len(m) != 2 || !strings.HasPrefix(m[0], "CAP_BPF") || !strings.HasPrefix(m[1], "CAP_SYS_ADMIN") {
		t.Errorf("without CAP_SYS_ADMIN and CAP_BPF: missing %q, want both", m)
	}
	if got := capNames(missingCaps(0)); got != "BPF, PERFMON, NET_ADMIN, NET_RAW, SYS_ADMIN" {
		t.Errorf("capability names for a container's securityContext: %q", got)
	}
}

// TestMissingCapExitsOne: root whose bounding set lacks a capability pathtrace
// needs (a container's, not privileged) is refused with one line naming it
// and exit 1, before anything is attached.
func TestMissingCapExitsOne(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	for _, drop := range []string{"net_admin", "net_raw", "sys_admin"} {
		var keep []string
		for _, c := range []string{"bpf", "perfmon", "net_admin", "net_raw", "sys_admin"} {
			if c != drop {
				keep = append(keep, "+"+c)
			}
		}
		caps := "-all," + strings.Join(keep, ",")
		cmd := exec.Command("setpriv", "--inh-caps=-all", "--bounding-set="+caps, "--", os.Args[0], "--svc", "10.120.0.80", "--duration", "1s", "--nice", "0")
		cmd.Env = append(os.Environ(), runMainEnv+"=1")
		out, err := cmd.CombinedOutput()
		ee, _ := err.(*exec.ExitError)
		want := "CAP_" + strings.ToUpper(drop)
		if ee == nil || ee.ExitCode() != exitRuntime || strings.Count(string(out), "\n") != 1 || !strings.Contains(string(out), "needs "+want) {
			t.Errorf("without %s: exit %v, output %q; want exit 1 and one line naming %s", want, err, out, want)
		}
	}
}

// TestReadOnlyOutputExitsTwo: a --pcap or incident --out in a read-only
// directory (a container's read-only root or volume) is refused up front,
// one line, exit 2 as a missing directory is, before anything is attached or
// the node-wide incident lock taken; nothing is left in it.
func TestReadOnlyOutputExitsTwo(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a read-only filesystem")
	}
	dir := t.TempDir()
	if err := unix.Mount("ptro", dir, "tmpfs", unix.MS_RDONLY, "size=64m"); err != nil {
		t.Skipf("mount a read-only tmpfs: %v", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	for _, args := range [][]string{
		{"--svc", "10.0.0.1", "--duration", "1s", "--pcap", dir + "/x.pcapng"},
		{"incident", "--svc", "10.0.0.1", "--duration", "1s", "--out", dir + "/inc"},
	} {
		cmd := pathtrace(args...)
		out, err := cmd.CombinedOutput()
		msg := strings.TrimSpace(string(out))
		if exitCode(err) != exitUsage || strings.Contains(msg, "\n") || !strings.Contains(msg, "read-only file system") {
			t.Errorf("pathtrace %s: exit %d, output %q; want exit 2 and one line saying the directory is read-only", strings.Join(args, " "), exitCode(err), msg)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("left in the read-only directory: %v", ents)
	}
}

// TestPtraceDeniedExitsOne: a --pod-pid or --pod-netns /proc/PID/ns/net of
// another user's process (a Pod's pause) without CAP_SYS_PTRACE is a missing
// capability, named, exit 1: not "permission denied" as bad input.
func TestPtraceDeniedExitsOne(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	other := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60")
	if err := other.Start(); err != nil {
		t.Skipf("start a process as 65534: %v", err)
	}
	defer func() { other.Process.Kill(); other.Wait() }()
	pid := strconv.Itoa(other.Process.Pid)
	for _, sel := range [][]string{{"--pod-pid", pid}, {"--pod-netns", "/proc/" + pid + "/ns/net"}} {
		args := append([]string{"--inh-caps=-all", "--bounding-set=-all,+bpf,+perfmon,+net_admin,+net_raw,+sys_admin", "--",
			os.Args[0], "--svc", "10.120.0.80", "--duration", "1s", "--nice", "0"}, sel...)
		cmd := exec.Command("setpriv", args...)
		cmd.Env = append(os.Environ(), runMainEnv+"=1")
		out, err := cmd.CombinedOutput()
		if exitCode(err) != exitRuntime || strings.Count(string(out), "\n") != 1 || !strings.Contains(string(out), "CAP_SYS_PTRACE") {
			t.Errorf("%s without CAP_SYS_PTRACE: exit %d, output %q; want exit 1 and one line naming CAP_SYS_PTRACE", strings.Join(sel, " "), exitCode(err), out)
		}
	}
}
