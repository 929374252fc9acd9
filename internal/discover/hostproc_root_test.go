package discover

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestHostProcInContainer: pathtrace in a container's own PID namespace (a
// DaemonSet Pod) sees the node's processes only through the host's /proc
// mounted in. A netns held by a process alone (no /run/netns name, no mount)
// is found there, under that path, with the node's PID of its holder; with
// no host /proc the note about unreachable netns says how to give one.
func TestHostProcInContainer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (namespaces, mounts)")
	}
	holder := exec.Command("unshare", "--net", "sleep", "60")
	if err := holder.Start(); err != nil {
		t.Skipf("unshare: %v", err)
	}
	t.Cleanup(func() { holder.Process.Kill(); holder.Wait() })
	path := fmt.Sprintf("/proc/%d/ns/net", holder.Process.Pid)
	var inode uint64
	for range 100 { // unshare execs sleep once the netns is made
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", holder.Process.Pid)); strings.TrimSpace(string(b)) == "sleep" {
			if ino, ok := nsLinkInode(path); ok {
				inode = ino
				break
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if inode == 0 {
		t.Fatal("the holder's netns did not appear")
	}
	hostProc := filepath.Join(t.TempDir(), "hostproc")
	if err := os.Mkdir(hostProc, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, mountHost := range []bool{true, false} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHostProcHelper$", "-test.v")
		cmd.Env = append(os.Environ(), "PTTEST_HOSTPROC="+hostProc, "PTTEST_HOSTPROC_MOUNT="+strconv.FormatBool(mountHost),
			"PTTEST_HOSTPROC_INODE="+strconv.FormatUint(inode, 10))
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWPID}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("host /proc mounted %v: %v\n%s", mountHost, err, out)
		}
	}
}

// TestHostProcHelper runs in the PID and mount namespaces of its own that
// TestHostProcInContainer gives it, as pathtrace in a container.
func TestHostProcHelper(t *testing.T) {
	hostProc := os.Getenv("PTTEST_HOSTPROC")
	if hostProc == "" {
		t.Skip("helper process for TestHostProcInContainer")
	}
	inode, _ := strconv.ParseUint(os.Getenv("PTTEST_HOSTPROC_INODE"), 10, 64)
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""))
	if os.Getenv("PTTEST_HOSTPROC_MOUNT") == "true" {
		must(unix.Mount("/proc", hostProc, "", unix.MS_BIND|unix.MS_REC, ""))
	}
	must(unix.Mount("proc", "/proc", "proc", 0, ""))
	// The container's own /proc mounted again elsewhere is no other view:
	// not scanned twice.
	same := hostProc + "-same"
	must(os.MkdirAll(same, 0o755))
	must(unix.Mount("proc", same, "proc", 0, ""))
	for _, mp := range procMounts(mountInfoPath) {
		if mp == same {
			t.Errorf("%s, a proc of pathtrace's own PID namespace, taken for another view", same)
		}
	}
	// Named netns and netns mounts out of sight, as in a container.
	must(unix.Mount("tmpfs", "/run", "tmpfs", 0, ""))
	if !ownPIDNamespace() {
		t.Fatal("a PID namespace of its own not recognized")
	}
	cands, err := listNetNS(0)
	must(err)
	var found *nsCandidate
	for i := range cands {
		if cands[i].inode == inode {
			found = &cands[i]
		}
	}
	if os.Getenv("PTTEST_HOSTPROC_MOUNT") != "true" {
		if found != nil {
			t.Fatalf("netns %d found at %s with no host /proc mounted", inode, found.path)
		}
		if h := containerHint(ownPIDNamespace(), len(procMounts(mountInfoPath)) > 0); !strings.Contains(h, "hostPID") {
			t.Errorf("no host /proc: hint %q does not say how to get one", h)
		}
		return
	}
	if found == nil {
		t.Fatalf("netns %d held by a process of the node not found through the host /proc at %s", inode, hostProc)
	}
	if !strings.HasPrefix(found.path, hostProc+"/") || found.pid == 0 || found.comm != "sleep" {
		t.Errorf("found %+v: want a path under %s, the node's PID of its holder, and its command sleep", *found, hostProc)
	}
	if h := containerHint(ownPIDNamespace(), len(procMounts(mountInfoPath)) > 0); h != "" {
		t.Errorf("host /proc mounted: hint %q, want none", h)
	}
}

// TestNetNSUnreadableWithoutPtrace: without CAP_SYS_PTRACE (a container given
// only the capabilities pathtrace requires) the netns of another user's
// process (a Pod's pause, 65535) cannot be read: the note on unreachable
// netns says so and names the capability, not that no process holds them.
func TestNetNSUnreadableWithoutPtrace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if _, err := exec.LookPath("setpriv"); err != nil {
		t.Skip("no setpriv")
	}
	if os.Getenv("PTTEST_NOPTRACE") == "1" {
		if n := deniedNetNSLinks(); n == 0 {
			t.Fatal("no netns link denied without CAP_SYS_PTRACE, though a process of another user runs")
		} else if h := ptraceHint(n); !strings.Contains(h, "CAP_SYS_PTRACE") {
			t.Fatalf("hint %q does not name CAP_SYS_PTRACE", h)
		}
		return
	}
	other := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60")
	if err := other.Start(); err != nil {
		t.Skipf("start a process as 65534: %v", err)
	}
	t.Cleanup(func() { other.Process.Kill(); other.Wait() })
	time.Sleep(100 * time.Millisecond)
	if ptraceHint(0) != "" {
		t.Error("a hint with nothing denied")
	}
	cmd := exec.Command("setpriv", "--inh-caps=-all", "--bounding-set=-all,+bpf,+perfmon,+net_admin,+net_raw,+sys_admin", "--",
		os.Args[0], "-test.run=^TestNetNSUnreadableWithoutPtrace$")
	cmd.Env = append(os.Environ(), "PTTEST_NOPTRACE=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("without CAP_SYS_PTRACE: %v\n%s", err, out)
	}
}

// TestPodNetNSTakenForNode: pathtrace in a Pod without hostNetwork (or
// --host-netns naming a Pod's netns) sees that Pod's netns as the node's; a
// note says so and how to give the node's, instead of naming the real node
// behind its veth "not taken for a Pod".
func TestPodNetNSTakenForNode(t *testing.T) {
	tb := newTestbed(t)
	info, err := Node(context.Background(), Options{HostNetNS: tb.pod})
	if err != nil {
		t.Fatal(err)
	}
	if !hasNote(info, "looks like a Pod's", "eth0", "hostNetwork", "--host-netns") {
		t.Errorf("a Pod's netns as the node: notes %q, want one saying it looks like a Pod's", info.Notes)
	}
	info, err = Node(context.Background(), Options{HostNetNS: tb.node})
	if err != nil {
		t.Fatal(err)
	}
	if hasNote(info, "looks like a Pod's") {
		t.Errorf("the node's netns: notes %q, want none saying it looks like a Pod's", info.Notes)
	}
}
