package export

import (
	"errors"
	"io"
	"sync"
)

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
