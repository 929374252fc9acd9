package discover

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"golang.org/x/sys/unix"
)

// nsCandidate is a network namespace that may be a pod's, with who holds it.
type nsCandidate struct {
	path  string
	inode uint64
	pid   int    // a process in it (0 if only a /run/netns name holds it)
	comm  string // that process's command
	name  string // its /run/netns name, if any
}

// runNetNSDir is where `ip netns` and CNI runtimes bind-mount named netns.
const runNetNSDir = "/run/netns"

// mountInfoPath lists the mounts pathtrace sees, netns bind mounts among them.
const mountInfoPath = "/proc/self/mountinfo"

// HeldNetNS returns the network namespaces a process or a /run/netns name
// holds, by inode, with a path that opens each: one that is in none is kept
// alive only by sockets in it (a capture's), its Pod gone.
func HeldNetNS() (map[uint64]string, error) {
	cands, err := listNetNS(0)
	if err != nil {
		return nil, err
	}
	held := make(map[uint64]string, len(cands))
	for _, c := range cands {
		held[c.inode] = c.path
	}
	return held, nil
}

// netnsListings counts the calls of listNetNS (for tests: a look behind a
// veth already looked behind lists no netns).
var netnsListings atomic.Int64

// listNetNS returns every network namespace held by a process or a
// /run/netns name, deduplicated by inode, without the one with skipInode.
// Named netns come first (their paths stay valid when processes come and go).
func listNetNS(skipInode uint64) ([]nsCandidate, error) {
	netnsListings.Add(1)
	byInode := map[uint64]int{} // index into out
	var out []nsCandidate
	add := func(c nsCandidate) {
		if c.inode == skipInode {
			return
		}
		if i, ok := byInode[c.inode]; ok {
			if out[i].pid == 0 && c.pid != 0 {
				out[i].pid, out[i].comm = c.pid, c.comm
			}
			return
		}
		byInode[c.inode] = len(out)
		out = append(out, c)
	}

	names, err := os.ReadDir(runNetNSDir)
	if err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("list %s: %w", runNetNSDir, err)
	}
	for _, e := range names {
		path := filepath.Join(runNetNSDir, e.Name())
		inode, err := nsutil.Inode(path)
		if err != nil {
			continue // a stale file, or one removed meanwhile
		}
		add(nsCandidate{path: path, inode: inode, name: e.Name()})
	}

	// Netns mounted elsewhere (CRI-O's namespaces_dir, containerd's
	// sandbox state directory, Docker's /var/run/docker/netns): held by
	// the mount alone, with no process in them, as a Pod's is between
	// restarts of its containers when no pause process holds it.
	for _, m := range nsfsMounts(mountInfoPath) {
		inode, err := nsutil.Inode(m)
		if err != nil {
			continue
		}
		add(nsCandidate{path: m, inode: inode, name: m})
	}

	pids, err := procPIDs("/proc")
	if err != nil {
		return nil, err
	}
	for _, pid := range pids {
		path := fmt.Sprintf("/proc/%d/ns/net", pid)
		inode, ok := nsLinkInode(path)
		if !ok {
			continue // exited meanwhile, or a kernel thread without one
		}
		add(nsCandidate{path: path, inode: inode, pid: pid, comm: procComm(pid)})
	}
	// In a container's own PID namespace the node's processes are seen
	// only through the host's /proc mounted in (a hostPath): its PIDs are
	// the node's, as crictl and ps on the node show them.
	for _, mp := range procMounts(mountInfoPath) {
		pids, err := procPIDs(mp)
		if err != nil {
			continue
		}
		for _, pid := range pids {
			dir := filepath.Join(mp, strconv.Itoa(pid))
			path := filepath.Join(dir, "ns", "net")
			inode, ok := nsLinkInode(path)
			if !ok {
				continue
			}
			add(nsCandidate{path: path, inode: inode, pid: pid, comm: commAt(dir)})
		}
	}
	return out, nil
}

// deniedNetNSLinks counts the processes, in /proc and the other proc mounts,
// whose netns link pathtrace may not read (EACCES: another user's process,
// without CAP_SYS_PTRACE).
func deniedNetNSLinks() int {
	n := 0
	for _, proc := range append([]string{"/proc"}, procMounts(mountInfoPath)...) {
		pids, _ := procPIDs(proc)
		for _, pid := range pids {
			dir := filepath.Join(proc, strconv.Itoa(pid))
			_, err := os.Readlink(filepath.Join(dir, "ns", "net"))
			if errors.Is(err, fs.ErrPermission) && !kernelThread(dir) {
				n++
			}
		}
	}
	return n
}

// kernelThread tells whether the process whose proc directory is dir is a
// kernel thread (an empty command line: no user memory), which holds no
// Pod's netns.
func kernelThread(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "cmdline"))
	return err == nil && len(b) == 0
}

// commAt is the command of the process whose proc directory is dir.
func commAt(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, "comm"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// ownPIDNamespace tells whether pathtrace's /proc is that of a PID namespace
// below the node's (a container's): there, no kernel thread is seen, and PID
// 2 is not kthreadd, as it always is in the node's.
func ownPIDNamespace() bool {
	return commAt("/proc/2") != "kthreadd"
}

func procPIDs(proc string) ([]int, error) {
	entries, err := os.ReadDir(proc)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", proc, err)
	}
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids, nil
}

// nsLinkInode reads the inode from a /proc/PID/ns/net link ("net:[4026531840]"),
// cheaper than a stat through it.
func nsLinkInode(path string) (uint64, bool) {
	target, err := os.Readlink(path)
	if err != nil {
		return 0, false
	}
	s, ok := strings.CutPrefix(target, "net:[")
	if !ok {
		return 0, false
	}
	inode, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64)
	return inode, err == nil
}

func procComm(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// holderOf describes the candidate holding a given netns path picked by the
// user: the process or name the path gives, and what else holds it, as a
// scan of the node's Pods finds it (a Pod selected by its name has its
// pause process too; one that has none is between its containers' restarts).
func holderOf(path string, inode uint64) nsCandidate {
	c := nsCandidate{path: path, inode: inode}
	if rest, ok := strings.CutPrefix(path, "/proc/"); ok {
		if pid, err := strconv.Atoi(strings.SplitN(rest, "/", 2)[0]); err == nil {
			c.pid, c.comm = pid, procComm(pid)
		}
	} else if c.pid, c.comm = otherProcHolder(path); c.pid == 0 {
		if dir, name := filepath.Split(path); filepath.Clean(dir) == runNetNSDir {
			c.name = name
		}
	}
	held, _ := listNetNS(0)
	if i := slices.IndexFunc(held, func(h nsCandidate) bool { return h.inode == inode }); i >= 0 {
		if c.pid == 0 {
			c.pid, c.comm = held[i].pid, held[i].comm
		}
		if c.name == "" {
			c.name = held[i].name
		}
	}
	return c
}

// otherProcHolder is the process whose netns path is PROC/PID/ns/net under a
// proc mount other than /proc (the host's in a container), with its command
// read there; 0 when path is not one.
func otherProcHolder(path string) (int, string) {
	dir, ok := strings.CutSuffix(filepath.Clean(path), "/ns/net")
	if !ok {
		return 0, ""
	}
	pid, err := strconv.Atoi(filepath.Base(dir))
	if err != nil || pid <= 0 {
		return 0, ""
	}
	var st unix.Statfs_t
	if unix.Statfs(filepath.Dir(dir), &st) != nil || st.Type != unix.PROC_SUPER_MAGIC {
		return 0, ""
	}
	comm := commAt(dir)
	if comm == "" {
		return 0, ""
	}
	return pid, comm
}

// nsfsMounts are the mount points of network namespaces in the mountinfo
// file at path (a netns bind-mounted: fstype nsfs, root "net:[INODE]"),
// but those under /run/netns (listed by name) and those of the same netns
// mounted again (a mount propagated to another place), each once.
func nsfsMounts(path string) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []string
	seen := map[string]bool{}
	for line := range strings.Lines(string(b)) {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
		pre, post, ok := strings.Cut(strings.TrimRight(line, "\n"), " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 1 || g[0] != "nsfs" || !strings.HasPrefix(f[3], "net:[") || seen[f[3]] {
			continue
		}
		mp := unescapeMountField(f[4])
		if dir := filepath.Dir(mp); dir == runNetNSDir || dir == "/var/run/netns" {
			continue
		}
		seen[f[3]] = true
		out = append(out, mp)
	}
	return out
}

// unescapeMountField undoes mountinfo's octal escapes (a space is \040).
func unescapeMountField(s string) string {
	if !strings.Contains(s, "\\") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
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

// OtherProcNetNS is, for a PID that pathtrace's own /proc does not have, the
// netns path of that PID under another proc mount that has it ("" if none):
// in a container's PID namespace, a Pod's PID as the node knows it (crictl
// inspect) exists only in the host's /proc, mounted in as a hostPath.
func OtherProcNetNS(pid int) string {
	for _, mp := range procMounts(mountInfoPath) {
		path := filepath.Join(mp, strconv.Itoa(pid), "ns", "net")
		if _, err := os.Stat(path); err == nil {
			return path
		}
	}
	return ""
}

// procMounts are the mount points of proc filesystems in the mountinfo file
// at path but /proc itself.
func procMounts(path string) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []string
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(strings.TrimRight(line, "\n"), " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 1 || g[0] != "proc" || f[3] != "/" {
			continue
		}
		if mp := unescapeMountField(f[4]); mp != "/proc" && !sameProc(mp) {
			out = append(out, mp)
		}
	}
	return out
}

// sameProc tells whether the proc mount at mp shows /proc's PID namespace
// (the host's /proc mounted in too, with hostPID): pathtrace has the same PID
// in both. Scanning it again would only double the work.
func sameProc(mp string) bool {
	self, err := os.Readlink("/proc/self")
	if err != nil {
		return false
	}
	other, err := os.Readlink(filepath.Join(mp, "self"))
	return err == nil && other == self
}

// PodPIDMissing is the usage error for a --pod-pid that pathtrace's /proc
// does not have.
func PodPIDMissing(pid int) error {
	if other := OtherProcNetNS(pid); other != "" {
		return usagef("--pod-pid %d: no such process in pathtrace's PID namespace (a container's own?), but %s exists: give --pod-netns %s", pid, other, other)
	}
	return usagef("--pod-pid %d: no such process; give the PID of a process in the pod (when pathtrace runs in a container's own PID namespace, run it with the host's PID namespace, or mount the host's /proc and give --pod-netns HOSTPROC/%d/ns/net)", pid, pid)
}
