package session

import (
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
)

// TestCaptureEnd: a point whose capture ended (a deleted Pod's veth went
// down, then away) is listed as ended, with its interface's down time
// before that, and not as a gap its capture went on across; a point whose
// capture went on keeps its gap.
func TestCaptureEnd(t *testing.T) {
	first := time.Date(2025, 1, 1, 12, 0, 4, 750e6, time.UTC)
	down := capture.Stats{LinkDowns: 1, LinkDown: 300 * time.Millisecond, FirstDown: first}
	const why = "ended at 12:00:05: capture host veth-b: socket error: network is down (the interface was deleted while down)"

	ended, gap := captureEnd(why, down)
	if gap != "" {
		t.Errorf("ended point: gap %q, want none (its capture did not go on)", gap)
	}
	if want := why + "; before that, its interface went down once (first at 12:00:04.750), 0.3 s in all"; ended != want {
		t.Errorf("ended point:\n got %q\nwant %q", ended, want)
	}
	if ended, gap := captureEnd(why, capture.Stats{}); ended != why || gap != "" {
		t.Errorf("ended, never down: %q, %q; want %q and no gap", ended, gap, why)
	}
	ended, gap = captureEnd("", down)
	if ended != "" || !strings.HasPrefix(gap, "went down once") {
		t.Errorf("flapped, went on: ended %q, gap %q; want a gap only", ended, gap)
	}
	if ended, gap := captureEnd("", capture.Stats{}); ended != "" || gap != "" {
		t.Errorf("neither: %q, %q", ended, gap)
	}
}
