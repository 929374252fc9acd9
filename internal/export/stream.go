package export

import (
	"bytes"
	"errors"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// stallable is a stream's writer when the reader can stop taking data
// without failing: giveUp ends a write blocked in it, and every later one
// (ErrStalled); close ends it once the Writer is done.
type stallable interface {
	io.Writer
	giveUp()
	close()
}

// newStallable wraps w: a pipe or a socket goes through Go's poller
// (pollStream), which costs nothing more than the write; any other writer
// gets a goroutine of its own (stream).
func newStallable(w io.Writer) stallable {
	if f, ok := w.(*os.File); ok {
		if ps, ok := newPollStream(f); ok {
			return ps
		}
	}
	return newStream(w)
}

// ErrStalled is returned by the writes of a stream given up by Abandon.
var ErrStalled = errors.New("the reader stopped reading: the rest of the capture was given up")

// stream writes a capture to a writer that can stop taking data without
// failing (a `--pcap -` reader that hangs, an ssh whose link stalls). The
// writes are made by a goroutine of the stream's own, so that Abandon can
// end a Write that blocks, and every later one: a write(2) into a full pipe cannot be
// interrupted, and it would hold the capture, and its caller's stop, for as
// long as the reader sleeps.
type stream struct {
	w       io.Writer
	req     chan []byte
	res     chan streamResult
	abandon chan struct{}
	once    sync.Once
	// buf is the copy the goroutine writes: a Write given up leaves it to
	// the goroutine, which may still be in write(2) with it, and no Write
	// touches it after that.
	buf []byte
}

type streamResult struct {
	n   int
	err error
}

func newStream(w io.Writer) *stream {
	s := &stream{w: w, req: make(chan []byte), res: make(chan streamResult, 1), abandon: make(chan struct{})}
	go func() {
		for p := range s.req {
			n, err := s.w.Write(p)
			s.res <- streamResult{n, err}
		}
	}()
	return s
}

// Write writes p with one Write of the underlying writer (so that blocks of
// at most PIPE_BUF stay atomic on a pipe); it returns ErrStalled once the
// stream was given up.
func (s *stream) Write(p []byte) (int, error) {
	select {
	case <-s.abandon:
		return 0, ErrStalled
	default:
	}
	s.buf = append(s.buf[:0], p...)
	select {
	case s.req <- s.buf:
	case <-s.abandon:
		return 0, ErrStalled
	}
	select {
	case r := <-s.res:
		return r.n, r.err
	case <-s.abandon:
		return 0, ErrStalled
	}
}

// giveUp ends the Write in progress, if any, and every later one.
func (s *stream) giveUp() { s.once.Do(func() { close(s.abandon) }) }

// close ends the goroutine (unless a write given up still holds it).
func (s *stream) close() {
	s.giveUp()
	close(s.req)
}

// cannotStall tells whether writes to w always return promptly (a regular
// file, memory): they need no goroutine of their own, whose handoff at
// every write costs more than encoding the packets of a block.
func cannotStall(w io.Writer) bool {
	switch w := w.(type) {
	case *bytes.Buffer:
		return true
	case *os.File:
		fi, err := w.Stat()
		return err == nil && fi.Mode().IsRegular()
	}
	return w == io.Discard
}

// pollStream writes to a pipe or a socket through Go's poller: a duplicate
// of the caller's descriptor is put in non-blocking mode, so that a write
// into a full pipe parks its goroutine (not a thread) and giveUp ends it
// with a deadline, at no cost per write (a goroutine handoff per write
// cost 13% more CPU per packet). Non-blocking mode belongs to the pipe's
// open file description, which the caller's descriptor shares: close puts
// it back as it was (blocking, for a process's stdout).
type pollStream struct {
	f           *os.File
	once        sync.Once
	wasBlocking bool
}

func newPollStream(f *os.File) (*pollStream, bool) {
	fi, err := f.Stat()
	if err != nil || fi.Mode()&(os.ModeNamedPipe|os.ModeSocket) == 0 {
		return nil, false
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, false
	}
	dup := -1
	if rc.Control(func(fd uintptr) { dup, err = unix.Dup(int(fd)) }) != nil || err != nil {
		return nil, false
	}
	flags, err := unix.FcntlInt(uintptr(dup), unix.F_GETFL, 0)
	if err != nil || unix.SetNonblock(dup, true) != nil {
		unix.Close(dup)
		return nil, false
	}
	wasBlocking := flags&unix.O_NONBLOCK == 0
	pf := os.NewFile(uintptr(dup), f.Name()) // pollable: non-blocking
	if pf.SetWriteDeadline(time.Time{}) != nil {
		unix.SetNonblock(dup, !wasBlocking)
		pf.Close()
		return nil, false
	}
	return &pollStream{f: pf, wasBlocking: wasBlocking}, true
}

func (s *pollStream) Write(p []byte) (int, error) {
	n, err := s.f.Write(p)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = ErrStalled
	}
	return n, err
}

func (s *pollStream) giveUp() { s.once.Do(func() { s.f.SetWriteDeadline(time.Now()) }) }

func (s *pollStream) close() {
	if rc, err := s.f.SyscallConn(); err == nil && s.wasBlocking {
		rc.Control(func(fd uintptr) { unix.SetNonblock(int(fd), false) })
	}
	s.f.Close()
}
