package export

import (
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// A capture file keeps up to cacheBudget bytes in the page cache; beyond
// that, its pages are written back and dropped from the cache in steps of
// cacheWindow, behind the writer (variables for tests).
var (
	cacheBudget int64 = 32 << 20
	cacheWindow int64 = 4 << 20
)

// cacheDropper keeps a capture file from filling the page cache: once the
// file is larger than cacheBudget, each window of it written is written
// back at once, and dropped from the cache at the next pass. A capture then
// does not push a busy node's cached files out (tcpdump's file takes the
// whole run's data in page cache until the kernel writes it back and
// reclaims it), and each new page of the file reuses one it just gave
// back instead of one that sat in the free lists. On
// a VM that hands free memory back to its host, a page the guest takes
// again costs a fault in the host: in the lab, with the capture files
// kept, pathtrace spent 0.66-0.85 us per captured packet at 100k/s without
// this (and lost frames) against 0.26-0.36 with it.
//
// It runs beside the file's writer goroutine, never in its way: starting
// writeback can wait for a busy device, and then the windows it has not
// reached stay in the cache, as without it. Pages still being written
// back when their window is dropped stay until the kernel reclaims them.
type cacheDropper struct {
	sizes chan int64 // the file's size, the latest only
	done  chan struct{}
	// startWriteback and drop are sync_file_range(2) and fadvise(2) on the
	// file (fields for tests).
	startWriteback func(off, n int64) error
	drop           func(off, n int64) error
	started        int64 // writeback started for the file up to here
	dropped        int64 // dropped from the cache up to here
	// viaRuntime: the calls go through the Go runtime's syscall path, not
	// directly (see call).
	viaRuntime bool
}

func newCacheDropper(fd int) *cacheDropper {
	d := &cacheDropper{
		sizes: make(chan int64, 1),
		done:  make(chan struct{}),
		// Both calls take these arguments in this order on 64-bit x86
		// and ARM; elsewhere they go through the runtime (unix's wrappers
		// know the other orders).
		viaRuntime: runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64",
	}
	d.startWriteback = func(off, n int64) error {
		if d.viaRuntime {
			return unix.SyncFileRange(fd, off, n, unix.SYNC_FILE_RANGE_WRITE)
		}
		return d.call(unix.SYS_SYNC_FILE_RANGE, fd, off, n, unix.SYNC_FILE_RANGE_WRITE)
	}
	d.drop = func(off, n int64) error {
		if d.viaRuntime {
			return unix.Fadvise(fd, off, n, unix.FADV_DONTNEED)
		}
		return d.call(unix.SYS_FADVISE64, fd, off, n, unix.FADV_DONTNEED)
	}
	go d.run()
	return d
}

// call makes the system call trap(fd, off, n, flag) directly, as
// writeDirect writes. Through the runtime, a call of this length (each
// covers a 4 MiB window) let its monitor thread take the processor away,
// hand it to another thread, and then poll every 20 us for a while: in
// lab captures that thread woke 125-133 times a second at 10k packets a
// second and 314-385 at 100k, against 49-57 and 72-110 with direct calls
// (3.2 and 5.5 ms of CPU a second against 1.3-1.5). A call that takes
// longer than directStall (a congested device) sends the next ones
// through the runtime, which gives the processor to the capture meanwhile.
func (d *cacheDropper) call(trap uintptr, fd int, off, n int64, flag int) error {
	start := time.Now()
	_, _, errno := unix.RawSyscall6(trap, uintptr(fd), uintptr(off), uintptr(n), uintptr(flag), 0, 0)
	if stalled(start) {
		d.viaRuntime = true
	}
	if errno != 0 {
		return errno
	}
	return nil
}

// offer hands the file's size over, in place of one not taken yet. Only
// the writer goroutine calls it.
func (d *cacheDropper) offer(size int64) {
	for {
		select {
		case d.sizes <- size:
			return
		default:
		}
		select {
		case <-d.sizes:
		default:
		}
	}
}

func (d *cacheDropper) run() {
	defer close(d.done)
	for size := range d.sizes {
		if !d.pass(size) {
			for range d.sizes { // a filesystem that refused: writes go on
			}
		}
	}
}

// pass drops what was written back of the windows whose writeback an
// earlier pass started, and starts that of the whole windows written
// since; false when the filesystem refuses either.
func (d *cacheDropper) pass(size int64) bool {
	if size < cacheBudget {
		return true // a short capture is left to the kernel's writeback
	}
	// The windows started before this pass had one pass's time to reach
	// the disk; a straggler of the window before them is retried once.
	if d.started > d.dropped {
		from := max(0, d.dropped-cacheWindow)
		if d.drop(from, d.started-from) != nil {
			return false
		}
		d.dropped = d.started
	}
	if end := size - size%cacheWindow; end > d.started {
		if d.startWriteback(d.started, end-d.started) != nil {
			return false
		}
		d.started = end
	}
	return true
}

// close waits until the last size offered is taken care of.
func (d *cacheDropper) close() {
	close(d.sizes)
	<-d.done
}
