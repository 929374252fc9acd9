package session

import (
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// TestIntervalKeepsItsSchedule: --report-every D writes the counts every D
// of the run. The run loop looks once a second, and each tick comes a
// little after its second, by a delay that varies: an interval due at 2 s,
// written at 2.004 s, must not push the next one past the tick at 4.001 s
// to the one at 5 s (in a run on a bridged node, --report-every 2s wrote
// its lines 2 or 3 s apart, every other one a second late).
func TestIntervalKeepsItsSchedule(t *testing.T) {
	start := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	var at []time.Duration
	var now time.Time
	tr := &tracer{
		eng:     flow.NewEngine(flow.Config{}),
		pr:      &probe.Probe{},
		cpuWait: &cpuWaitSampler{broken: true},
		opt: Options{ReportEvery: 2 * time.Second, Interval: func(flow.Summary, map[string]uint64, map[string]uint64, *CPUWait) {
			at = append(at, now.Sub(start).Truncate(time.Second))
		}},
	}
	next := start.Add(tr.opt.ReportEvery)
	// The ticks' delays behind their second, in ms: the one after an
	// interval shorter than that interval's.
	late := []int{3, 4, 1, 5, 2, 6, 1, 3, 2, 7, 1}
	for s := 1; s <= 10; s++ {
		now = start.Add(time.Duration(s)*time.Second + time.Duration(late[s])*time.Millisecond)
		tr.interval(now, &next)
	}
	want := []time.Duration{2 * time.Second, 4 * time.Second, 6 * time.Second, 8 * time.Second, 10 * time.Second}
	if len(at) != len(want) {
		t.Fatalf("intervals at %v, want %v", at, want)
	}
	for i := range want {
		if at[i] != want[i] {
			t.Fatalf("intervals at %v, want %v", at, want)
		}
	}
}
