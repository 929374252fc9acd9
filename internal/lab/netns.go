package lab

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// createNetNS makes a network namespace kept alive by a bind mount at path, as
// `ip netns add` does, so other tools find it under /run/netns.
func createNetNS(path string) error {
	if err := nsutil.PrepareNamedDir(filepath.Dir(path)); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return fmt.Errorf("create netns file: %w", err)
	}
	f.Close()

	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread() // unshare failed: the thread is unchanged
			errc <- fmt.Errorf("unshare netns: %w", err)
			return
		}
		// The thread now lives in the new netns. It stays locked, so it ends
		// with this goroutine instead of being reused in the wrong namespace.
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(self, path, "none", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind-mount netns to %s: %w", path, err)
			return
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// deleteNetNS undoes createNetNS; the kernel frees the namespace (and its
// devices and their BPF programs) once nothing else holds it. A missing or
// half-made namespace is not an error.
func deleteNetNS(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil &&
		!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount netns %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove netns %s: %w", path, err)
	}
	return nil
}

// isNetNS tells whether path is a mounted network namespace.
func isNetNS(path string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && fs.Type == unix.NSFS_MAGIC
}

// setSysctls writes net sysctls (dotted names) inside the netns at path.
func setSysctls(path string, values map[string]string) error {
	return nsutil.Do(path, func() error {
		for key, val := range values {
			if err := os.WriteFile(sysctlPath(key), []byte(val), 0o644); err != nil {
				return fmt.Errorf("sysctl %s=%s in %s: %w", key, val, path, err)
			}
		}
		return nil
	})
}

// readSysctl reads one net sysctl inside the netns at path.
func readSysctl(path, key string) (string, error) {
	var val string
	err := nsutil.Do(path, func() error {
		b, err := os.ReadFile(sysctlPath(key))
		val = strings.TrimSpace(string(b))
		return err
	})
	return val, err
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

// openNetNS opens a netns file; its fd selects the netns for netlink sockets.
func openNetNS(path string) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	return f, nil
}
