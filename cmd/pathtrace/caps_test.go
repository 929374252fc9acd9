package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/net/bpf"
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

// TestNiceDeniedSaysWhatAsksForNone: started at nice 5 (under nice(1), a
// unit's Nice=) without CAP_SYS_NICE, pathtrace may not go below 5, to 3 as
// to -5: the warning names the nice value it has as the one that asks for
// no capability. It said a value below 0 needs CAP_SYS_NICE and that
// --nice 0 asks for none, which was refused the same.
func TestNiceDeniedSaysWhatAsksForNone(t *testing.T) {
	needRoot(t)
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	ns := fmt.Sprintf("ptcli-nice%d", os.Getpid()%100000)
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v %s", ns, err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	for _, n := range []string{"3", "0"} {
		// Discovery ends the run (no Pod has that address): nothing is attached.
		cmd := exec.Command("nice", "-n", "5", "setpriv", "--inh-caps=-all", "--bounding-set=-sys_nice", "--", os.Args[0],
			"--host-netns", "/run/netns/"+ns, "--svc", "10.120.0.80", "--pod-ip", "203.0.113.77", "--nice", n)
		cmd.Env = append(os.Environ(), runMainEnv+"=1")
		out, _ := cmd.CombinedOutput()
		if !strings.Contains(string(out), "set nice "+n+": permission denied") || !strings.Contains(string(out), "--nice 5 asks for none") {
			t.Errorf("--nice %s at nice 5 without CAP_SYS_NICE: %q; want it refused, saying --nice 5 asks for none", n, out)
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

// denySyscallEnv names a system call that the test binary, run as
// pathtrace, has fail with EPERM through a seccomp filter of its own.
const denySyscallEnv = "PATHTRACE_TEST_DENY_SYSCALL"

func denySyscall(nrText string) {
	nr, err := strconv.Atoi(nrText)
	if err != nil {
		panic(err)
	}
	prog, err := bpf.Assemble([]bpf.Instruction{
		bpf.LoadAbsolute{Off: 0, Size: 4}, // seccomp_data.nr
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(nr), SkipFalse: 1},
		bpf.RetConstant{Val: 0x00050000 | uint32(unix.EPERM)}, // SECCOMP_RET_ERRNO
		bpf.RetConstant{Val: 0x7fff0000},                      // SECCOMP_RET_ALLOW
	})
	if err != nil {
		panic(err)
	}
	filter := make([]unix.SockFilter, len(prog))
	for i, p := range prog {
		filter[i] = unix.SockFilter{Code: p.Op, Jt: p.Jt, Jf: p.Jf, K: p.K}
	}
	fp := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		panic(err)
	}
	// SECCOMP_FILTER_FLAG_TSYNC: every thread of the Go runtime, not this one only.
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, 1, 1, uintptr(unsafe.Pointer(&fp))); e != 0 {
		panic(e)
	}
}

// TestSeccompDeniedNamed: a container's seccomp profile refusing bpf() or
// setns() though pathtrace has every capability: the failure says a seccomp
// filter refused it and how to run unconfined, not "MEMLOCK may be too low".
func TestSeccompDeniedNamed(t *testing.T) {
	needRoot(t)
	for name, nr := range map[string]int{"bpf": unix.SYS_BPF, "setns": unix.SYS_SETNS} {
		cmd := pathtrace("--svc", "10.120.0.80", "--duration", "1s", "--nice", "0")
		cmd.Env = append(cmd.Env, denySyscallEnv+"="+strconv.Itoa(nr))
		out, err := cmd.CombinedOutput()
		msg := string(out)
		if exitCode(err) != exitRuntime || !strings.Contains(msg, "seccomp filter") || strings.Contains(msg, "MEMLOCK") {
			t.Errorf("%s refused by seccomp: exit %d, output %q; want exit 1 naming the seccomp filter", name, exitCode(err), msg)
		}
	}
}

func TestSeccompFiltered(t *testing.T) {
	dir := t.TempDir()
	for status, want := range map[string]bool{
		"Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t1\n": true,
		"Name:\tx\nSeccomp:\t0\nSeccomp_filters:\t0\n": false,
		"Name:\tx\n": false,
	} {
		path := filepath.Join(dir, "status")
		if err := os.WriteFile(path, []byte(status), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := seccompFiltered(path); got != want {
			t.Errorf("%q: %v, want %v", status, got, want)
		}
	}
}

// TestPtraceDeniedBlamesTheRightCause: a netns refused to a process that
// lacks CAP_SYS_PTRACE names the capability; one refused to a process that
// has it (root, under a security module's policy) does not claim it lacks
// it.
func TestPtraceDeniedBlamesTheRightCause(t *testing.T) {
	denied := &os.PathError{Op: "stat", Path: "/proc/1/ns/net", Err: syscall.EACCES}
	lacks := ptraceDeniedWith("--pod-pid", "1", denied, 0, true).Error()
	if !strings.Contains(lacks, "which this process lacks") {
		t.Errorf("without CAP_SYS_PTRACE: %q", lacks)
	}
	has := ptraceDeniedWith("--pod-pid", "1", denied, 1<<unix.CAP_SYS_PTRACE, true).Error()
	if strings.Contains(has, "lacks") || !strings.Contains(has, "although this process has CAP_SYS_PTRACE") {
		t.Errorf("with CAP_SYS_PTRACE: %q; want it not to blame the capability", has)
	}
}
