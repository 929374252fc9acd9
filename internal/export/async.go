package export

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// asyncDepth bounds the chunks waiting for the disk (each up to flushBytes,
// or one large block): past it, writing blocks (back-pressure). With
// flushBytes of 256 KiB, a stalled disk holds at most 4 MiB.
const asyncDepth = 16

// asyncFile writes the capture file from a goroutine of its own: a disk that
// stalls (a journal commit, writeback throttling) then delays the file, not
// the capture, whose kernel rings would overflow meanwhile (on a local
// filesystem, from the first write that stalls on: see writeDirect). Each
// chunk is written with one write(2), as blockOut hands it over (whole
// blocks, never crossing a page where it can avoid it), so the file stays
// readable after a SIGKILL at any moment. After a failed write (a full
// disk) it cuts the file back to the last whole block it holds and refuses
// every later chunk.
type asyncFile struct {
	f *os.File
	// size is the file's size: what was written before the asyncFile took
	// over (the header), then its own whole chunks. Only run uses it until
	// done is closed.
	size int64
	// reserved is where the blocks reserved ahead of the data end (see
	// reserveAhead); limit caps it (MaxBytes, 0 = none).
	reserved, limit int64
	noReserve       bool // the filesystem cannot reserve: no more tries
	direct          bool // a local filesystem: written with writeDirect
	// cache gives the file's pages back to the page cache once on disk
	// (nil where the file is not on a block device).
	cache  *cacheDropper
	queue  chan chunk
	free   chan []byte
	done   chan struct{}
	mu     sync.Mutex
	err    error
	closed bool
}

// newAsyncFile writes f from its current offset on; limit (0 = none) caps
// the blocks reserved ahead of the data.
func newAsyncFile(f *os.File, limit int64) *asyncFile {
	a := &asyncFile{f: f, limit: limit, queue: make(chan chunk, asyncDepth), free: make(chan []byte, asyncDepth), done: make(chan struct{})}
	// A failed write cuts the file back to its last whole chunk: an offset
	// that must count what was written before (0 for a pipe).
	if off, err := f.Seek(0, io.SeekCurrent); err == nil {
		a.size = off
	}
	var st unix.Statfs_t
	a.direct = unix.Fstatfs(int(f.Fd()), &st) == nil && localFilesystem(int64(st.Type))
	if a.direct && blockBacked(int64(st.Type)) {
		a.cache = newCacheDropper(int(f.Fd()))
	}
	go a.run()
	return a
}

// reserveAhead is how far past the data the file's blocks are reserved
// (fallocate, the size unchanged). A buffered write then finds each new
// page's block already allocated, where ext4 would otherwise make a delayed
// allocation per page: about 4% of pathtrace's CPU at high packet rates.
// Close gives back what the data did not use; a killed capture keeps at
// most this much reserved past the end of its file, never past MaxBytes
// (truncate -s to its size gives it back).
const reserveAhead = 4 << 20

// reserve makes sure the blocks up to end are reserved, a reserveAhead
// more at a time. Where the filesystem cannot (a pipe, no fallocate, no
// space left), writes go on without: only slower, or failing on their own.
func (a *asyncFile) reserve(end int64) {
	if a.noReserve || end <= a.reserved {
		return
	}
	from := max(a.reserved, a.size)
	to := end + reserveAhead
	if a.limit > 0 {
		to = min(to, a.limit)
	}
	if to <= from {
		return
	}
	if err := a.fallocate(from, to-from); err != nil {
		a.noReserve = true
		return
	}
	a.reserved = to
}

// Write queues a copy of p; it returns the error of an earlier chunk, if any.
func (a *asyncFile) Write(p []byte) (int, error) {
	if err := a.failed(); err != nil {
		return 0, err
	}
	var buf []byte
	select {
	case buf = <-a.free:
	default:
	}
	a.queue <- chunk{buf: append(buf[:0], p...)}
	return len(p), nil
}

// handOff queues p itself, without a copy: the caller gives p up and gets
// an empty buffer to fill next (nil when none is free yet). Every page
// boundary of the file that p reaches lies between two of its blocks
// (blockOut's batches), so a write of p cut short keeps its whole pages.
func (a *asyncFile) handOff(p []byte) (next []byte, err error) {
	if err := a.failed(); err != nil {
		return p[:0], err
	}
	a.queue <- chunk{buf: p, pageCut: true}
	select {
	case next = <-a.free:
	default:
	}
	return next[:0], nil
}

// chunk is one write(2). pageCut says that each page boundary of the file
// within it lies between two blocks.
type chunk struct {
	buf     []byte
	pageCut bool
}

func (a *asyncFile) run() {
	defer close(a.done)
	pageSize := int64(os.Getpagesize())
	for c := range a.queue {
		if a.failed() == nil {
			a.reserve(a.size + int64(len(c.buf)))
			n, err := a.write(c.buf)
			if err != nil {
				// A filesystem write cut short (no space left) ends on a page
				// boundary: keep the whole blocks before it, if they are.
				keep := a.size
				if end := a.size + int64(n); c.pageCut && end-end%pageSize > a.size {
					keep = end - end%pageSize
				}
				if keep != a.size+int64(n) {
					if terr := a.f.Truncate(keep); terr != nil {
						err = fmt.Errorf("%w (and cutting the partial block off failed: %v)", err, terr)
					}
				}
				a.size = keep
				a.mu.Lock()
				a.err = err
				a.mu.Unlock()
			} else {
				a.size += int64(n)
				if a.cache != nil {
					a.cache.offer(a.size)
				}
			}
		}
		if cap(c.buf) <= 2*flushBytes {
			select {
			case a.free <- c.buf:
			default:
			}
		}
	}
}

func (a *asyncFile) failed() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.err
}

// Close waits until every queued chunk is written, gives back the blocks
// reserved past the data, and returns the first write error. It does not
// close the file.
func (a *asyncFile) Close() error {
	if !a.closed {
		a.closed = true
		close(a.queue)
		<-a.done
		if a.cache != nil {
			a.cache.close()
		}
		if a.reserved > a.size {
			// Truncating to the size frees the blocks past it.
			if err := a.f.Truncate(a.size); err != nil && a.failed() == nil {
				return fmt.Errorf("give back the blocks reserved past the end: %w", err)
			}
		}
	}
	return a.failed()
}

// directStall is how long a direct write may take before the file is
// written through the runtime from then on (the disk stalls: let it delay
// the file only). It is wall time: on saturated CPUs a 100 us write that is
// preempted takes milliseconds, and that is no stall. At the capture's
// highest rates the kernel rings hold about three times as long.
var directStall = 50 * time.Millisecond // a variable for tests

// write writes all of b to the file.
func (a *asyncFile) write(b []byte) (int, error) {
	if !a.direct {
		return a.f.Write(b)
	}
	start := time.Now()
	n, err := writeDirect(int(a.f.Fd()), b)
	a.checkStall(start)
	if err != nil {
		err = &os.PathError{Op: "write", Path: a.f.Name(), Err: err} // as os.File.Write says it
	}
	return n, err
}

// fallocate reserves the file's blocks from off on (FALLOC_FL_KEEP_SIZE),
// directly as write does: allocating 4 MiB of extents takes long enough for
// the runtime's hand-off too.
func (a *asyncFile) fallocate(off, n int64) error {
	fd := int(a.f.Fd())
	if !a.direct {
		return unix.Fallocate(fd, unix.FALLOC_FL_KEEP_SIZE, off, n)
	}
	start := time.Now()
	_, _, errno := unix.RawSyscall6(unix.SYS_FALLOCATE, uintptr(fd), unix.FALLOC_FL_KEEP_SIZE, uintptr(off), uintptr(n), 0, 0)
	a.checkStall(start)
	if errno != 0 {
		return errno
	}
	return nil
}

// checkStall ends direct calls once one that began at start took longer
// than directStall.
func (a *asyncFile) checkStall(start time.Time) {
	if stalled(start) {
		a.direct = false
	}
}

// stalled tells whether a direct call that began at start took longer than
// directStall: the next ones go through the runtime.
func stalled(start time.Time) bool { return time.Since(start) > directStall }

// writeDirect is write(2) without the Go runtime's syscall bookkeeping. A
// write of a chunk into the page cache takes 50-100 us: through the
// runtime, its monitor thread takes the processor away (handing it to
// another thread) and then polls every 20 us for a while, which at 100k
// packets a second was half of pathtrace's context switches and about a
// tenth of its CPU per packet. The goroutine keeps its processor instead, so a
// write that blocks (writeback throttling) holds up the capture's other
// goroutines meanwhile, as tcpdump's one thread is held: the kernel rings
// buffer the frames. Only for local filesystems (localFilesystem), where
// writes land in the page cache (a network filesystem can block for long),
// and only until a write takes longer than directStall.
func writeDirect(fd int, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		r, _, errno := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&b[n])), uintptr(len(b)-n))
		switch {
		case errno == unix.EINTR:
			continue
		case errno != 0:
			return n, errno
		case r == 0: // never for a regular file; do not spin on it
			return n, io.ErrShortWrite
		}
		n += int(r)
	}
	return n, nil
}

// blockBacked tells whether a filesystem type keeps its files on a block
// device, whose page cache pages can be given back once written: ext2/3/4,
// XFS, Btrfs and F2FS (not tmpfs or ramfs, whose pages are the data).
func blockBacked(fsType int64) bool {
	switch fsType {
	case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC, unix.F2FS_SUPER_MAGIC:
		return true
	}
	return false
}

// localFilesystem tells whether a filesystem type (statfs f_type) is one of
// the local ones whose writes land in the page cache: ext2/3/4, XFS, Btrfs,
// F2FS, tmpfs, ramfs and overlayfs (a container's root).
func localFilesystem(fsType int64) bool {
	switch fsType {
	case unix.EXT4_SUPER_MAGIC, unix.XFS_SUPER_MAGIC, unix.BTRFS_SUPER_MAGIC, unix.F2FS_SUPER_MAGIC,
		unix.TMPFS_MAGIC, unix.RAMFS_MAGIC, unix.OVERLAYFS_SUPER_MAGIC:
		return true
	}
	return false
}
