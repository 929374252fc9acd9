package discover

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/cgroup2"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestCgroupChainEnds: the walk up from a cgroup ends at the root of the
// cgroup2 mount, and at the top of the path whatever the filesystem says:
// a relative path (--cgroup . in a cgroup2 directory) once looped forever on
// filepath.Dir(".") == ".", growing the chain until memory ran out.
func TestCgroupChainEnds(t *testing.T) {
	cwd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dir, mount string
		want       []string
	}{
		{"/sys/fs/cgroup/unified/a/b", "/sys/fs/cgroup/unified", []string{"/sys/fs/cgroup/unified/a/b", "/sys/fs/cgroup/unified/a", "/sys/fs/cgroup/unified"}},
		{"/sys/fs/cgroup/a/", "/", []string{"/sys/fs/cgroup/a", "/sys/fs/cgroup", "/sys/fs", "/sys", "/"}},
		// Relative paths are taken from the working directory, here on a
		// cgroup2 mount (at "/" to walk the whole way up).
		{".", "/", ancestors(cwd)},
		{"x/y", "/", ancestors(filepath.Join(cwd, "x/y"))},
	} {
		calls := 0
		onMount := func(dir string) bool {
			if calls++; calls > 1000 {
				return false // the loop would never end: stop it here
			}
			if !filepath.IsAbs(dir) { // statfs(2) resolves it from the working directory
				dir = filepath.Join(cwd, dir)
			}
			return dir == tc.mount || strings.HasPrefix(dir, strings.TrimSuffix(tc.mount, "/")+"/")
		}
		if got := cgroupChain(tc.dir, onMount); !slices.Equal(got, tc.want) {
			t.Errorf("cgroupChain(%q), mount %s: got %d dirs %q..., want %q", tc.dir, tc.mount, len(got), got[:min(len(got), 5)], tc.want)
		}
	}
}

// ancestors is dir (absolute), its parent, ..., "/".
func ancestors(dir string) []string {
	var out []string
	for {
		out = append(out, dir)
		if dir == "/" {
			return out
		}
		dir = filepath.Dir(dir)
	}
}

// TestCheckOptionsCgroupAbsolute: a relative --cgroup is made absolute when
// the options are checked (from the cgroup2 mount, as `cd
// /sys/fs/cgroup/unified && pathtrace --cgroup .` does).
func TestCheckOptionsCgroupAbsolute(t *testing.T) {
	root, err := cgroup2.Root()
	if err != nil || !cgroup2.IsCgroup2(root) {
		t.Skipf("no cgroup2 mount here: %v", err)
	}
	t.Chdir(root)
	opt := Options{HostNetNS: nsutil.Self, MaxPods: 1, Cgroup: "."}
	if err := checkOptions(&opt); err != nil {
		t.Fatal(err)
	}
	if opt.Cgroup != root {
		t.Errorf("--cgroup . in %s: got %q, want %q", root, opt.Cgroup, root)
	}
}

// TestTCWatchAddReplacesIfindex: a new Pod's host veth that got the ifindex
// of a veth watched (a Pod deleted and made again) takes its place, where
// both would read the new veth's programs, twice; a Pod's eth0 of that
// ifindex (in its own netns) is no host veth.
func TestTCWatchAddReplacesIfindex(t *testing.T) {
	w := NewTCWatch("/run/netns/x", []CapturePoint{
		{Role: RoleHost, Ifindex: 3, Ifname: "cali1234abcd567"},
		{Role: RoleHost, Ifindex: 4, Ifname: "lxc12ab"},
	}, nil)
	w.Add([]CapturePoint{
		{Role: RolePod, Ifindex: 4, Ifname: "eth0"},
		{Role: RoleHost, Ifindex: 3, Ifname: "cali1234abcd567", MAC: "02:00:00:00:00:03"},
	})
	var got []string
	for _, cp := range w.cps {
		got = append(got, fmt.Sprintf("%s#%d %s", cp.Ifname, cp.Ifindex, cp.MAC))
	}
	if want := []string{"lxc12ab#4 ", "cali1234abcd567#3 02:00:00:00:00:03"}; !slices.Equal(got, want) {
		t.Errorf("watched veths %q, want %q", got, want)
	}
}

// TestNSFSMounts: the netns mounts of a mountinfo file, each netns once
// (the first of a mount propagated elsewhere), without /run/netns's (listed
// by name), mountinfo's escapes undone.
func TestNSFSMounts(t *testing.T) {
	const info = `22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
590 28 0:4 net:[4026532894] /run/netns/hc-node rw shared:295 - nsfs nsfs rw
591 28 0:4 net:[4026532894] /var/run/netns/hc-node rw shared:295 - nsfs nsfs rw
612 24 0:4 net:[4026533100] /var/run/docker/netns/1a2b3c4d rw shared:300 - nsfs nsfs rw
613 24 0:4 net:[4026533100] /run/docker/netns/1a2b3c4d rw shared:300 - nsfs nsfs rw
620 24 0:4 net:[4026533200] /var/lib/my\040pods/cni-0a1b rw - nsfs nsfs rw
621 24 0:4 mnt:[4026533300] /run/ns/mnt rw - nsfs nsfs rw
630 24 0:52 / /run/netns rw shared:1 - tmpfs tmpfs rw
`
	path := filepath.Join(t.TempDir(), "mountinfo")
	if err := os.WriteFile(path, []byte(info), 0o644); err != nil {
		t.Fatal(err)
	}
	got := nsfsMounts(path)
	if want := []string{"/var/run/docker/netns/1a2b3c4d", "/var/lib/my pods/cni-0a1b"}; !slices.Equal(got, want) {
		t.Errorf("nsfs mounts %q, want %q", got, want)
	}
}

// A container's /proc is its own PID namespace's; the host's, mounted in as
// a hostPath, is where a Pod's PID as the node knows it can be found.
func TestProcMounts(t *testing.T) {
	const info = `22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
23 1 0:22 / /host/proc rw,nosuid,nodev,noexec,relatime - proc proc rw
24 22 0:23 / /proc/sys/fs/binfmt_misc rw - binfmt_misc binfmt_misc rw
25 1 0:21 /sys /host/proc-sys ro - proc proc rw
26 1 0:24 / /mnt/other\040proc rw - proc none rw
`
	path := filepath.Join(t.TempDir(), "mountinfo")
	if err := os.WriteFile(path, []byte(info), 0o644); err != nil {
		t.Fatal(err)
	}
	if got, want := procMounts(path), []string{"/host/proc", "/mnt/other proc"}; !slices.Equal(got, want) {
		t.Errorf("proc mounts %q, want %q", got, want)
	}
}

// A netns given as PROC/PID/ns/net under any proc mount (the host's /proc
// mounted into a container) is held by that process, named from there.
func TestOtherProcHolder(t *testing.T) {
	pid, comm := otherProcHolder(fmt.Sprintf("/proc/%d/ns/net", os.Getpid()))
	if pid != os.Getpid() || comm == "" {
		t.Errorf("own netns: got pid %d comm %q, want pid %d and a command", pid, comm, os.Getpid())
	}
	dir := filepath.Join(t.TempDir(), "123", "ns")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if pid, _ := otherProcHolder(filepath.Join(dir, "net")); pid != 0 {
		t.Errorf("a path not on a proc filesystem taken for process %d", pid)
	}
}

// A named netns's file seen without the mount on it (its directory
// bind-mounted without submounts into a container) is an empty file: the
// error says why, not only "not a network namespace".
func TestNetNSPathEmptyFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "node")
	// ip netns add makes the file with mode 0, which only root opens:
	// readable here, so the test runs as a normal user too.
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	err := checkNetNSPath("--host-netns", path)
	var ue *UsageError
	if !errors.As(err, &ue) || !strings.Contains(ue.Msg, "an empty file") || !strings.Contains(ue.Msg, "HostToContainer") {
		t.Errorf("empty file: %v, want a usage error saying the netns mount is not visible", err)
	}
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := checkNetNSPath("--host-netns", path); err == nil || strings.Contains(err.Error(), "an empty file") {
		t.Errorf("a file with content: %v, want only 'not a network namespace'", err)
	}
}

// TestTCWatchWatchesUplinks: the uplinks are watched with the host veths,
// at the start and for a Pod that started (a tc program on the uplink,
// Cilium's bpf_host, comes and goes with its agent too); a Pod's eth0 is
// not.
func TestTCWatchWatchesUplinks(t *testing.T) {
	w := NewTCWatch("/run/netns/x", []CapturePoint{
		{Role: RoleHost, Ifindex: 3, Ifname: "lxc12ab"},
		{Role: RoleUplink, Ifindex: 2, Ifname: "eth0"},
	}, nil)
	w.Add([]CapturePoint{
		{Role: RolePod, Ifindex: 2, Ifname: "eth0"},
		{Role: RoleUplink, Ifindex: 5, Ifname: "eth1"},
	})
	var got []string
	for _, cp := range w.cps {
		got = append(got, fmt.Sprintf("%s %s#%d", cp.Role, cp.Ifname, cp.Ifindex))
	}
	if want := []string{"host lxc12ab#3", "uplink eth0#2", "uplink eth1#5"}; !slices.Equal(got, want) {
		t.Errorf("watched %q, want %q", got, want)
	}
}
