package session

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// CPUWait is how long pathtrace's threads were runnable but waiting for a
// CPU (the kernel's run_delay, /proc/self/task/*/schedstat): what a capture
// that lost frames on saturated CPUs was held by. The rings hold a fraction
// of a second of frames; a thread kept off the CPUs longer loses them.
type CPUWait struct {
	// Total is the wait of all threads over the run.
	Total time.Duration
	// Worst is the longest wait of one thread within one sampling
	// interval (about a second: the session's tick), scaled to a second
	// when the interval was longer.
	Worst time.Duration
}

// cpuWaitSampler follows the run_delay of each thread of the process.
type cpuWaitSampler struct {
	dir    string // /proc/self/task
	last   map[string]time.Duration
	lastAt time.Time
	wait   CPUWait
	broken bool // schedstat unreadable (a kernel without CONFIG_SCHED_INFO)
}

func newCPUWaitSampler(dir string, now time.Time) *cpuWaitSampler {
	s := &cpuWaitSampler{dir: dir}
	s.last, s.broken = readRunDelays(dir)
	s.lastAt = now
	return s
}

// sample adds what each thread waited since the previous sample. A thread
// that started since counts from zero; one that ended takes its last
// interval's wait with it.
func (s *cpuWaitSampler) sample(now time.Time) {
	if s.broken {
		return
	}
	cur, broken := readRunDelays(s.dir)
	if broken {
		s.broken = true
		return
	}
	interval := now.Sub(s.lastAt)
	for tid, d := range cur {
		delta := d - s.last[tid]
		if delta <= 0 {
			continue
		}
		s.wait.Total += delta
		if interval > time.Second {
			delta = delta * time.Second / interval
		}
		s.wait.Worst = max(s.wait.Worst, delta)
	}
	s.last, s.lastAt = cur, now
}

// result is the wait so far; nil when the kernel does not say it.
func (s *cpuWaitSampler) result() *CPUWait {
	if s.broken {
		return nil
	}
	w := s.wait
	return &w
}

// readRunDelays reads the run_delay (second field of schedstat, ns) of
// each thread under dir; broken when none could be read.
func readRunDelays(dir string) (delays map[string]time.Duration, broken bool) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, true
	}
	delays = make(map[string]time.Duration, len(entries))
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), "schedstat"))
		if err != nil {
			continue // the thread ended meanwhile
		}
		fields := bytes.Fields(b)
		if len(fields) < 2 {
			continue
		}
		ns, err := strconv.ParseInt(string(fields[1]), 10, 64)
		if err != nil {
			continue
		}
		delays[e.Name()] = time.Duration(ns)
	}
	return delays, len(delays) == 0
}
