package export

import (
	"fmt"
	"io"
	"os"
	"sync"
)

// asyncDepth bounds the chunks waiting for the disk (each up to flushBytes,
// or one large block): past it, writing blocks (back-pressure). With
// flushBytes of 256 KiB, a stalled disk holds at most 4 MiB.
const asyncDepth = 16

// asyncFile writes the capture file from a goroutine of its own: a disk that
// stalls (a journal commit, writeback throttling) then delays the file, not
// the capture, whose kernel rings would overflow meanwhile. Each chunk is
// written with one write(2), as blockOut hands it over (whole blocks, never
// crossing a page where it can avoid it), so the file stays readable after a
// SIGKILL at any moment. After a failed write it cuts the file back to the
// last whole chunk and refuses every later one.
type asyncFile struct {
	f      *os.File
	start  int64 // the file's size when the asyncFile took over (the header)
	queue  chan []byte
	free   chan []byte
	done   chan struct{}
	mu     sync.Mutex
	err    error
	closed bool
}

func newAsyncFile(f *os.File) *asyncFile {
	a := &asyncFile{f: f, queue: make(chan []byte, asyncDepth), free: make(chan []byte, asyncDepth), done: make(chan struct{})}
	// A failed write cuts the file back to its last whole chunk: an offset
	// that must count what was written before (0 for a pipe).
	if off, err := f.Seek(0, io.SeekCurrent); err == nil {
		a.start = off
	}
	go a.run()
	return a
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
	a.queue <- append(buf[:0], p...)
	return len(p), nil
}

// handOff queues p itself, without a copy: the caller gives p up and gets
// an empty buffer to fill next (nil when none is free yet).
func (a *asyncFile) handOff(p []byte) (next []byte, err error) {
	if err := a.failed(); err != nil {
		return p[:0], err
	}
	a.queue <- p
	select {
	case next = <-a.free:
	default:
	}
	return next[:0], nil
}

func (a *asyncFile) run() {
	defer close(a.done)
	written := a.start
	for buf := range a.queue {
		if a.failed() == nil {
			n, err := a.f.Write(buf)
			if err != nil {
				if n > 0 {
					if terr := a.f.Truncate(written); terr != nil {
						err = fmt.Errorf("%w (and cutting the partial block off failed: %v)", err, terr)
					}
				}
				a.mu.Lock()
				a.err = err
				a.mu.Unlock()
			}
			written += int64(n)
		}
		if cap(buf) <= 2*flushBytes {
			select {
			case a.free <- buf:
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

// Close waits until every queued chunk is written and returns the first
// write error. It does not close the file.
func (a *asyncFile) Close() error {
	if !a.closed {
		a.closed = true
		close(a.queue)
		<-a.done
	}
	return a.failed()
}
