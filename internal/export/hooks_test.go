package export

import "time"

// Hooks for the external tests.

// SetPendingSince sets when the oldest pending block of w was added.
func SetPendingSince(w *Writer, t time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.out.pendingSince = t
}

// FlushPending runs w's flush timer's function now.
func FlushPending(w *Writer) { w.flushPending() }

// HandedOff is how many bytes w handed to its output.
func HandedOff(w *Writer) int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.out.off
}
