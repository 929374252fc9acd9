package export_test

import (
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// stallingWriter takes the first n writes, then blocks every later one until
// released (a reader that stopped reading without going away).
type stallingWriter struct {
	mu      sync.Mutex
	n       int
	release chan struct{}
}

func (s *stallingWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	s.n--
	stall := s.n < 0
	s.mu.Unlock()
	if stall {
		<-s.release
	}
	return len(p), nil
}

// TestStreamAbandonEndsStalledWrite: a stream whose reader stalls blocks
// its writes; Abandon ends the one in progress and every later one, so
// that Close returns (with ErrStalled) instead of waiting for the reader.
func TestStreamAbandonEndsStalledWrite(t *testing.T) {
	sw := &stallingWriter{n: 1, release: make(chan struct{})} // the header only
	defer close(sw.release)
	w, err := export.NewStream(sw, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() {
		for i := range 3 {
			if err := w.WritePacket(i, packet(tcpFrame(100), obs.DirOut, 0, 0), "stalls"); err != nil {
				break
			}
		}
		closed <- w.Close(nil) // its write blocks in the stalled stream
	}()
	abandonEndsClose(t, w, closed, 300*time.Millisecond)
	w.Abandon() // after Close: no effect
}

// TestPipeStreamAbandon: a pipe whose reader stops reading blocks the
// stream's writes; Abandon ends them, Close returns ErrStalled, and the
// pipe's write end is left in blocking mode, as the caller had it.
func TestPipeStreamAbandon(t *testing.T) {
	r, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer pw.Close()
	pw.Fd() // blocking mode, as a process's stdout is
	w, err := export.NewStream(pw, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() {
		for i := 0; ; i++ { // until the 64 KiB pipe is full and a write blocks
			if err := w.WritePacket(i%len(testIfaces), packet(tcpFrame(1400), obs.DirOut, 0, 0), "fills the pipe"); err != nil {
				break
			}
			if i > 10000 {
				break
			}
		}
		closed <- w.Close(nil)
	}()
	abandonEndsClose(t, w, closed, 500*time.Millisecond)
	rc, err := pw.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var flags int
	if err := rc.Control(func(fd uintptr) { flags, err = unix.FcntlInt(fd, unix.F_GETFL, 0) }); err != nil {
		t.Fatal(err)
	}
	if flags&unix.O_NONBLOCK != 0 {
		t.Error("the pipe's write end was left non-blocking")
	}
}

// abandonEndsClose checks that the Close reported on closed stays blocked
// for stalled (the stream's reader takes nothing), and that Abandon then
// ends it with ErrStalled.
func abandonEndsClose(t *testing.T, w *export.Writer, closed <-chan error, stalled time.Duration) {
	t.Helper()
	select {
	case err := <-closed:
		t.Fatalf("Close returned %v while the stream was stalled", err)
	case <-time.After(stalled):
	}
	w.Abandon()
	select {
	case err := <-closed:
		if !errors.Is(err, export.ErrStalled) {
			t.Errorf("Close after Abandon: %v, want ErrStalled", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Close still blocked after Abandon")
	}
}
