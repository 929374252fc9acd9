// Package nsutil runs code inside another network namespace. Per-netns kernel
// objects (AF_PACKET sockets, tcx and netfilter links, netlink sockets) are bound
// to the netns of the thread that creates them and keep working from any thread
// afterwards, so creating them is all that needs to happen "inside".
package nsutil

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Do runs fn on a locked OS thread that has joined the network namespace at
// path (a /run/netns/NAME or /proc/PID/ns/net file). An empty path runs fn in
// the caller's namespace. The thread returns to its original namespace before
// it is unlocked; if that fails the thread is left locked so the Go runtime
// destroys it instead of reusing it in the wrong namespace.
func Do(path string, fn func() error) error {
	if path == "" {
		return fn()
	}
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()

	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns %s: %w", path, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: it dies with this goroutine.
			errc <- fmt.Errorf("return from netns %s: %w", path, err)
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// Command is exec.CommandContext for the programs pathtrace runs to read the
// node (nft, iptables-legacy-save, ovs-vsctl), tied to pathtrace's life: the
// kernel kills the program when pathtrace dies, even by SIGKILL, instead of
// leaving it to run to its end (`nft list ruleset` on a node of thousands of
// Services takes seconds and hundreds of MB). The kernel sends that signal
// when the thread that started the program exits; Go keeps its threads, but
// for one left locked by a goroutine that ends (Do, when it cannot return to
// its netns), which happens only after fn returned: run and wait for the
// program within one fn.
func Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// Inode returns the inode number of a namespace file, the identity of the
// namespace (two paths name the same netns when their inodes are equal).
func Inode(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return st.Ino, nil
}

// Cookie returns the cookie of the network namespace at path: unlike its
// inode, which the kernel gives a deleted namespace's successor, never
// reused while the system runs (SO_NETNS_COOKIE, Linux 5.14).
func Cookie(path string) (uint64, error) {
	var cookie uint64
	err := Do(path, func() error {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		cookie, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("netns cookie of %s: %w", path, err)
	}
	return cookie, nil
}

// Self is the path of the calling process's network namespace.
const Self = "/proc/self/ns/net"

// netlinkTimeout bounds each netlink request made through Netlink: a reader
// of node state never hangs on a busy kernel.
const netlinkTimeout = 5 * time.Second

// Netlink runs fn with a netlink handle whose sockets live in the netns at
// path (no thread switching needed: the sockets are created inside it).
func Netlink(path string, fn func(h *netlink.Handle) error) error {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	h, err := HandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in netns %s: %w", path, err)
	}
	defer h.Close()
	return fn(h)
}

// HandleAt returns a netlink handle whose sockets live in the netns ns,
// each request bounded by the same timeout as Netlink's. The caller closes it.
func HandleAt(ns netns.NsHandle) (*netlink.Handle, error) {
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, err
	}
	if err := h.SetSocketTimeout(netlinkTimeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink timeout: %w", err)
	}
	return h, nil
}

// PrepareNamedDir makes dir (/run/netns) ready to hold named network
// namespaces as iproute2 does: a mount point of its own, with shared
// propagation. Otherwise the first `ip netns add` run afterwards
// bind-mounts dir over itself, and the namespaces mounted in it before stay
// mounted underneath, where no unmount by path reaches them: removing one
// then fails with EBUSY (a lab that cannot be taken down).
func PrepareNamedDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	for bound := false; ; bound = true {
		err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if err == nil {
			return nil
		}
		if err != unix.EINVAL || bound {
			return fmt.Errorf("make %s a shared mount: %w", dir, err)
		}
		// Not a mount point yet: make it one (iproute2's first netns add).
		if err := unix.Mount(dir, dir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind-mount %s onto itself: %w", dir, err)
		}
	}
}
