package session

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writeSchedstat writes a fake /proc/PID/task/TID/schedstat with run_delay
// ns of wait.
func writeSchedstat(t *testing.T, dir, tid string, wait time.Duration) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, tid), 0o755); err != nil {
		t.Fatal(err)
	}
	line := fmt.Sprintf("123456789 %d 42\n", wait.Nanoseconds())
	if err := os.WriteFile(filepath.Join(dir, tid, "schedstat"), []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCPUWaitSampler: each thread's run_delay is followed between samples:
// the total adds every thread's wait, the worst is one thread's within one
// interval, scaled to a second when the interval was longer; a thread that
// starts counts from zero, one that ends is forgotten.
func TestCPUWaitSampler(t *testing.T) {
	dir := t.TempDir()
	t0 := time.Unix(1000, 0)
	writeSchedstat(t, dir, "10", 5*time.Millisecond)
	writeSchedstat(t, dir, "11", 0)
	s := newCPUWaitSampler(dir, t0)

	// One second: thread 10 waited 30 ms more, 11 waited 80 ms.
	writeSchedstat(t, dir, "10", 35*time.Millisecond)
	writeSchedstat(t, dir, "11", 80*time.Millisecond)
	s.sample(t0.Add(time.Second))
	if w := s.result(); w == nil || w.Total != 110*time.Millisecond || w.Worst != 80*time.Millisecond {
		t.Fatalf("after 1 s: %+v, want total 110ms, worst 80ms", w)
	}

	// Two seconds (the tick came late): 11 waited 300 ms, 150 ms a second;
	// thread 12 started and waited 20 ms; 10 ended.
	if err := os.RemoveAll(filepath.Join(dir, "10")); err != nil {
		t.Fatal(err)
	}
	writeSchedstat(t, dir, "11", 380*time.Millisecond)
	writeSchedstat(t, dir, "12", 20*time.Millisecond)
	s.sample(t0.Add(3 * time.Second))
	if w := s.result(); w == nil || w.Total != 430*time.Millisecond || w.Worst != 150*time.Millisecond {
		t.Fatalf("after 3 s: %+v, want total 430ms, worst 150ms", w)
	}

	// A thread id reused by a new thread (its count starts again lower)
	// adds nothing.
	writeSchedstat(t, dir, "11", time.Millisecond)
	s.sample(t0.Add(4 * time.Second))
	if w := s.result(); w == nil || w.Total != 430*time.Millisecond {
		t.Fatalf("after a reused id: total %v, want 430ms", w.Total)
	}
}

// TestCPUWaitSamplerWithoutSchedstat: a kernel without schedstat (or no
// /proc) says nothing rather than a wait of zero.
func TestCPUWaitSamplerWithoutSchedstat(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "10"), 0o755); err != nil {
		t.Fatal(err)
	}
	s := newCPUWaitSampler(dir, time.Now())
	s.sample(time.Now())
	if s.result() != nil {
		t.Error("a wait reported without any schedstat")
	}
	s = newCPUWaitSampler(filepath.Join(dir, "absent"), time.Now())
	if s.result() != nil {
		t.Error("a wait reported without the task directory")
	}
}

// TestCPUWaitOfThisProcess reads this process's own threads, as a run does.
func TestCPUWaitOfThisProcess(t *testing.T) {
	if _, err := os.Stat("/proc/self/schedstat"); err != nil {
		t.Skipf("no schedstat on this kernel: %v", err)
	}
	s := newCPUWaitSampler("/proc/self/task", time.Now())
	s.sample(time.Now())
	if s.result() == nil {
		t.Error("this process's threads' schedstat unread")
	}
}
