package report

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestDropRowsFoldZeroPoints: with many capture points, the zero rows of a
// per-point counter fold into one; its non-zero rows and the node-wide
// counters stay, by name.
func TestDropRowsFoldZeroPoints(t *testing.T) {
	drops := map[string]uint64{"ringbuf_losses": 0, "host:veth-a kernel_drops": 7}
	for i := range 5 {
		drops[fmt.Sprintf("pod:eth0@10.0.0.%d kernel_drops", i)] = 0
		drops[fmt.Sprintf("pod:eth0@10.0.0.%d decode_errors", i)] = 0
	}
	drops["host:veth-a decode_errors"] = 0
	var got []string
	for _, r := range dropRows(drops) {
		got = append(got, fmt.Sprintf("%s=%d", r.name, r.count))
	}
	want := "decode_errors at 6 points=0 host:veth-a kernel_drops=7 kernel_drops at 5 points=0 ringbuf_losses=0"
	if strings.Join(got, " ") != want {
		t.Errorf("rows %q\nwant %q", strings.Join(got, " "), want)
	}
	// Few points: every row by name, as before.
	few := map[string]uint64{"pod:eth0 kernel_drops": 0, "host:veth-a kernel_drops": 0, "uplink:bond0 kernel_drops": 0}
	if rows := dropRows(few); len(rows) != 3 {
		t.Errorf("three points: %v, want a row each", rows)
	}
}

// TestDropHints: a loss that a flag can avoid comes with that flag; no
// hint without a loss.
func TestDropHints(t *testing.T) {
	if h := DropHints(map[string]uint64{"uplink:bond0 kernel_drops": 0, "flows_over_max": 0, "ringbuf_losses": 0}); len(h) != 0 {
		t.Errorf("hints without a loss: %q", h)
	}
	h := DropHints(map[string]uint64{"uplink:bond0 kernel_drops": 5, "pod:eth0 kernel_drops": 1, "host:veth-a kernel_drops": 0,
		"flows_over_max": 3, "ringbuf_losses": 7})
	want := []string{"Frames were lost at pod:eth0, uplink:bond0:", "--buffer-size", "raise --max-flows", "Observer events were lost"}
	all := strings.Join(h, "\n")
	for _, w := range want {
		if !strings.Contains(all, w) {
			t.Errorf("hints lack %q:\n%s", w, all)
		}
	}
	if len(h) != 3 {
		t.Errorf("%d hints, want 3: %q", len(h), h)
	}
	h = DropHints(map[string]uint64{"conntrack_drops": 2, "conntrack_errors": 0, "flows_joined": 1, "unmatched_overflow": 4})
	all = strings.Join(h, "\n")
	for _, w := range []string{"Conntrack events were lost", "--nice", "earlier socket's flow", "were evicted"} {
		if !strings.Contains(all, w) {
			t.Errorf("hints lack %q:\n%s", w, all)
		}
	}
	if len(h) != 3 {
		t.Errorf("%d hints, want 3: %q", len(h), h)
	}
	// A flood of other traffic to a backend's other ports: its own room's
	// drops are said to be apart from the traced flows' (not "some flows
	// may lack points").
	h = DropHints(map[string]uint64{"unmatched_overflow": 0, "unrelated_overflow": 134991})
	if len(h) != 1 || !strings.Contains(h[0], "waiting room of its own") || strings.Contains(h[0], "may lack points") {
		t.Errorf("hints %q, want the other traffic's room's", h)
	}
}

// TestSummaryTableNamesFlowsNotFollowed: a run far beyond --max-flows
// (minutes of churn: 4096 rows, 166,005 flows refused) says, beside its
// per-verdict counts, how many flows those counts leave out; a run within
// the bound says nothing of it.
func TestSummaryTableNamesFlowsNotFollowed(t *testing.T) {
	for _, over := range []uint64{0, 166005} {
		var b strings.Builder
		s := flow.Summary{Flows: 4096, RewrittenAt: map[flow.Place]int{flow.PlaceTC: 4096},
			Drops: map[string]uint64{flow.DropFlowsOverMax: over}}
		if err := writeSummaryTable(&b, s, nil, backendCounts{}, Run{}); err != nil {
			t.Fatal(err)
		}
		got := strings.Contains(b.String(), "not followed  166005  beyond --max-flows")
		if got != (over > 0) {
			t.Errorf("flows_over_max %d: table\n%s", over, b.String())
		}
	}
}

// TestCPUWaitSaidWithRingLosses: a run whose rings lost frames says how long
// pathtrace's threads waited for a CPU meanwhile (whether the CPUs held the
// capture back); one without losses does not in the table. JSON always has
// it.
func TestCPUWaitSaidWithRingLosses(t *testing.T) {
	run := Run{CPUWait: NewCPUWait(1340*time.Millisecond, 420*time.Millisecond)}
	for _, lost := range []uint64{0, 5} {
		var b strings.Builder
		drops := map[string]uint64{"uplink:bond0 kernel_drops": lost}
		if err := NewWriter(&b, FormatTable).Summary(flow.Summary{}, drops, run); err != nil {
			t.Fatal(err)
		}
		said := strings.Contains(b.String(), "waited for a CPU while runnable (the kernel's run_delay): one of them 420ms within one second at most, 1.3s in all")
		if said != (lost > 0) {
			t.Errorf("%d frames lost: CPU wait said %v:\n%s", lost, said, b.String())
		}
	}
	var js strings.Builder
	if err := NewWriter(&js, FormatJSON).Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(js.String(), `"cpu_wait":{"total_ms":1340,"worst_thread_second_ms":420}`) {
		t.Errorf("JSON summary lacks the CPU wait: %s", js.String())
	}
}
