package incident

import (
	"context"
	"errors"
	"os"
	"path/filepath"
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

// TestInterruptedSaysWhy: the snapshot's context cancelled by the user (a
// second stop signal, its cause) says so in the manifest's notes and the
// files, for the topic running and those after it, not "context canceled".
func TestInterruptedSaysWhy(t *testing.T) {
	const why = "interrupted by a stop signal"
	s := &snapshot{opt: Options{CollectorTimeout: 10 * time.Second, MaxBytes: 1 << 20, MaxFileBytes: 1 << 20}}
	ctx, cancel := context.WithCancelCause(context.Background())
	stuck := topic{file: "conntrack.txt", collect: func(ctx context.Context, w *topicWriter) error {
		cancel(errors.New(why))
		<-ctx.Done()
		return context.Cause(ctx)
	}}
	after := topic{file: "bridges.txt", collect: func(context.Context, *topicWriter) error { return nil }}
	dir := t.TempDir()
	m, err := s.collect(ctx, dir, []topic{stuck, after})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Notes) != 2 {
		t.Fatalf("notes %q, want one for each topic", m.Notes)
	}
	body, err := os.ReadFile(filepath.Join(dir, "conntrack.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, text := range append(m.Notes, string(body)) {
		if !strings.Contains(text, why) || strings.Contains(text, "context canceled") {
			t.Errorf("%q, want %q", text, why)
		}
	}
}
