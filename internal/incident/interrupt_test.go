package incident

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestCollectorInterruptedIsNotATimeout: a collector cut short by the user's
// interrupt (the snapshot's context cancelled, a second Ctrl-C) long before
// its timeout is not said to have run out its time: the manifest's note and
// the file must not claim "after 10s".
func TestCollectorInterruptedIsNotATimeout(t *testing.T) {
	s := &snapshot{opt: Options{CollectorTimeout: 10 * time.Second}}
	release := make(chan struct{})
	defer close(release)
	stuck := topic{file: "conntrack.txt", collect: func(ctx context.Context, w *topicWriter) error {
		<-release // a call that ignores its context
		return nil
	}}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	body, notes, _ := s.run(ctx, stuck, 1000)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("run took %v after the interrupt", took)
	}
	if len(notes) != 1 {
		t.Fatalf("notes %q", notes)
	}
	for _, text := range []string{notes[0], string(body)} {
		if strings.Contains(text, "after 10s") {
			t.Errorf("interrupted after 20ms, but said %q", text)
		}
	}
}
