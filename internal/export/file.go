package export

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrTaken is the cause of a Create refused because PATH or PATH.partial
// exists (a capture from before, or one another pathtrace writes now, which
// took the name after this run checked its flags): the user gives another
// file.
var ErrTaken = errors.New("the capture file's name is taken")

// takenError says which name is taken and why; it is ErrTaken.
type takenError struct{ msg string }

func (e takenError) Error() string        { return e.msg }
func (e takenError) Is(target error) bool { return target == ErrTaken }

func taken(format string, a ...any) error { return takenError{fmt.Sprintf(format, a...)} }

// partialFile is the capture being written: an unnamed file until its header
// is written, then PATH.partial, renamed to PATH by finish.
type partialFile struct {
	*os.File
	path    string
	partial string
	unnamed bool // O_TMPFILE: named by publish
}

// createPartial refuses to overwrite PATH or PATH.partial. It creates the file
// unnamed (O_TMPFILE) where the filesystem supports it, so that PATH.partial
// never exists without a complete header; tmpfile false forces the fallback
// (PATH.partial created directly, empty until the header is written).
func createPartial(path string, tmpfile bool) (*partialFile, error) {
	pf := &partialFile{path: path, partial: path + ".partial"}
	if _, err := os.Lstat(path); err == nil {
		return nil, taken("%s exists: pathtrace does not overwrite capture files", path)
	}
	if _, err := os.Lstat(pf.partial); err == nil {
		return nil, partialExists(path)
	}
	if tmpfile {
		fd, err := unix.Open(filepath.Dir(path), unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
		switch {
		case err == nil:
			pf.File, pf.unnamed = os.NewFile(uintptr(fd), pf.partial), true
		case !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EINVAL):
			return nil, fmt.Errorf("create %s: %w", pf.partial, err)
		}
	}
	if pf.File == nil {
		f, err := os.OpenFile(pf.partial, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", pf.partial, err)
		}
		pf.File = f
	}
	// The writer's lock tells its PATH.partial from one an interrupted
	// run left (PartialInUse); best effort: a filesystem without locks
	// only loses that distinction.
	_ = unix.Flock(int(pf.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	// Captures hold payload: 0600 whatever the umask.
	if err := pf.Chmod(0o600); err != nil {
		pf.discard()
		return nil, fmt.Errorf("chmod %s: %w", pf.partial, err)
	}
	return pf, nil
}

// publish gives an unnamed file its name PATH.partial.
func (pf *partialFile) publish() error {
	if !pf.unnamed {
		return nil
	}
	proc := "/proc/self/fd/" + strconv.Itoa(int(pf.Fd()))
	if err := unix.Linkat(unix.AT_FDCWD, proc, unix.AT_FDCWD, pf.partial, unix.AT_SYMLINK_FOLLOW); errors.Is(err, unix.EEXIST) {
		return partialExists(pf.path)
	} else if err != nil {
		return fmt.Errorf("name the capture file %s: %w", pf.partial, err)
	}
	pf.unnamed = false
	return nil
}

// PartialInUse tells whether PATH.partial is the file of a capture being
// written now, whose writer (another pathtrace) holds its lock, rather than
// one an interrupted run left.
func PartialInUse(path string) bool {
	f, err := os.Open(path + ".partial")
	if err != nil {
		return false
	}
	defer f.Close()
	return errors.Is(unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB), unix.EWOULDBLOCK)
}

// partialExists says why PATH.partial, which exists, is in the way: a
// capture running now, which removing it would destroy, or one an
// interrupted run left.
func partialExists(path string) error {
	if PartialInUse(path) {
		return taken("%s.partial is being written by a capture running now (another pathtrace): give another file", path)
	}
	return taken("%s.partial exists (left by an interrupted capture?): remove it or choose another file", path)
}

// finish makes the file durable and renames it to PATH, never over an
// existing file.
func (pf *partialFile) finish() error {
	if err := pf.Sync(); err != nil {
		pf.Close()
		return fmt.Errorf("sync %s: %w", pf.partial, err)
	}
	if err := pf.Close(); err != nil {
		return fmt.Errorf("close %s: %w", pf.partial, err)
	}
	err := unix.Renameat2(unix.AT_FDCWD, pf.partial, unix.AT_FDCWD, pf.path, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// No RENAME_NOREPLACE on this filesystem: link (which refuses an
		// existing name), then drop the old one.
		if err = os.Link(pf.partial, pf.path); err == nil {
			err = os.Remove(pf.partial)
		}
	}
	if err != nil {
		if _, statErr := os.Lstat(pf.partial); errors.Is(statErr, os.ErrNotExist) {
			// Removed during the run, or its directory: what was written
			// went with it.
			return fmt.Errorf("rename %s to %s: %w (%s was removed during the run, or its directory: the capture is lost)", pf.partial, pf.path, err, pf.partial)
		}
		return fmt.Errorf("rename %s to %s (the capture stays in %s): %w", pf.partial, pf.path, pf.partial, err)
	}
	if d, err := os.Open(filepath.Dir(pf.path)); err == nil {
		d.Sync() // best effort: makes the rename durable
		d.Close()
	}
	return nil
}

// renamedError is an error met while the file was PATH.partial, told once
// it was renamed to PATH: it names the file as it is on disk.
type renamedError struct {
	err           error
	partial, path string
}

func (e renamedError) Error() string { return strings.ReplaceAll(e.err.Error(), e.partial, e.path) }
func (e renamedError) Unwrap() error { return e.err }

// discard closes and removes the file (a Create that failed).
func (pf *partialFile) discard() {
	pf.Close()
	if !pf.unnamed {
		os.Remove(pf.partial)
	}
}
