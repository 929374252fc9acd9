package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
)

func finishedFlow(id int) flow.Flow {
	return flow.Flow{ID: id, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40000"), Service: netip.MustParseAddrPort("10.120.0.80:80"),
		Backend: netip.MustParseAddrPort("10.244.20.31:3000"), RewrittenAt: flow.PlaceNetfilter, By: "rule", Reply: true}
}

// TestFinishedJSON: a run until stopped writes each flow as it ends, as
// Flows writes it, each call's lines at once; the flows left at the end
// and the summary follow.
func TestFinishedJSON(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatJSON)
	w.Finished([]flow.Flow{finishedFlow(1), finishedFlow(2)})
	if n := strings.Count(b.String(), "\n"); n != 2 {
		t.Fatalf("%d lines written by Finished, want 2 at once: %q", n, b.String())
	}
	w.Finished([]flow.Flow{finishedFlow(3)})
	w.Flows([]flow.Flow{finishedFlow(4)})
	retired := 3
	w.Summary(flow.Summary{Flows: 4, Retired: retired, ReportedBefore: &retired}, nil, Run{})
	var types []string
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		types = append(types, m["type"].(string))
	}
	if got := strings.Join(types, ","); got != "flow,flow,flow,flow,summary" {
		t.Errorf("lines %s", got)
	}
	if !strings.Contains(b.String(), `"flows_reported_before":3`) {
		t.Errorf("summary does not say how many were reported before: %s", b.String())
	}
}

// TestFinishedTable: rows come under a header written first and again
// every screenful; the flows left at the end are listed under their own;
// no "no flow was seen" when flows were reported as they ended.
func TestFinishedTable(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	for i := 1; i <= 50; i++ {
		w.Finished([]flow.Flow{finishedFlow(i)})
	}
	if n := strings.Count(b.String(), "REWRITTEN AT"); n != 2 {
		t.Errorf("%d headers over 50 rows, want 2", n)
	}
	w.Flows(nil)
	if strings.Contains(b.String(), "No flow") {
		t.Error("says no flow was seen after reporting 50")
	}
	w.Summary(flow.Summary{Flows: 50, Retired: 50}, nil, Run{})
	if !strings.Contains(b.String(), "50 were reported above as they ended, 0 were still open") {
		t.Errorf("summary does not say the flows were reported as they ended:\n%s", b.String())
	}
}

// TestInterval: the counts so far of a run until stopped are an
// "interval" line, never a "summary" (the run's last line).
func TestInterval(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatJSON)
	s := flow.Summary{Flows: 7, Retired: 5, RewrittenAt: map[flow.Place]int{flow.PlaceNetfilter: 7}, Drops: map[string]uint64{flow.DropFlowsOverMax: 1}}
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	wait := NewCPUWait(1500*time.Millisecond, 254*time.Millisecond)
	w.Interval(at, s, map[string]uint64{"ringbuf_losses": 2}, map[string]uint64{"pod:eth0": 9}, wait)
	var m map[string]any
	if err := json.Unmarshal(b.Bytes(), &m); err != nil || m["type"] != "interval" || m["flows"] != 7.0 || m["at"] == nil {
		t.Fatalf("interval line %s (%v)", b.String(), err)
	}
	if d := m["drops"].(map[string]any); d["ringbuf_losses"] != 2.0 || d[flow.DropFlowsOverMax] != 1.0 {
		t.Errorf("drops %v", d)
	}
	if c, _ := m["cpu_wait"].(map[string]any); c["total_ms"] != 1500.0 || c["worst_thread_second_ms"] != 254.0 {
		t.Errorf("cpu_wait %v", m["cpu_wait"])
	}
	b.Reset()
	w.Interval(at, s, nil, nil, nil)
	if strings.Contains(b.String(), "cpu_wait") {
		t.Errorf("cpu_wait unknown, said as %s", b.String())
	}

	// A table line says the CPU wait only once a capture ring lost frames.
	ringLoss := map[string]uint64{"uplink:bond0 kernel_drops": 40}
	for _, c := range []struct {
		drops map[string]uint64
		wait  *CPUWait
		want  string
	}{
		{nil, wait, "7 flows (netfilter 7), 2 open; drops 1\n"},
		{ringLoss, wait, "7 flows (netfilter 7), 2 open; drops 41 (capture rings among them; a thread of pathtrace's waited up to 254ms in one second for a CPU)\n"},
		{ringLoss, nil, "7 flows (netfilter 7), 2 open; drops 41\n"},
	} {
		b.Reset()
		NewWriter(&b, FormatTable).Interval(at, s, c.drops, nil, c.wait)
		if got := b.String(); !strings.HasSuffix(got, c.want) || strings.Count(got, "\n") != 1 {
			t.Errorf("table interval %q, want it to end %q", got, c.want)
		}
	}
}

// TestRewritersBounded: a run until stopped meets ever new rules (a
// kube-proxy chain per endpoint set); the summary table lists a bounded
// number per verdict and says there were more.
func TestRewritersBounded(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	for i := range 1000 {
		f := finishedFlow(i + 1)
		f.By = fmt.Sprintf("rule-%d", i)
		w.Finished([]flow.Flow{f})
	}
	b.Reset()
	w.Summary(flow.Summary{Flows: 1000, Retired: 1000, RewrittenAt: map[flow.Place]int{flow.PlaceNetfilter: 1000}}, nil, Run{})
	out := b.String()
	if n := strings.Count(out, "rule-"); n >= maxRewritersListed || !strings.Contains(out, "and others") {
		t.Errorf("summary lists %d rewriters of 1000 (bound %d):\n%s", n, maxRewritersListed, out)
	}
}

// TestFinishedTableAligned: rows written as flows end line up under their
// header whatever their cells' widths (a tc program's "by" longer than the
// column's start, a MAC with " gw", an 802.1ad tag); a column that widens
// starts a new header, so that the rows below it line up again.
func TestFinishedTableAligned(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	short := finishedFlow(1)
	vid := uint16(200)
	long := finishedFlow(2)
	long.RewrittenAt, long.By = flow.PlaceTC, "tcx ingress cil_from_container (id 74917)"
	long.VLAN, long.VLANProto = &vid, "802.1ad"
	long.UplinkDstMAC, long.UplinkDstIsGateway = "ce:58:b4:73:6f:47", true
	w.Finished([]flow.Flow{short})
	w.Finished([]flow.Flow{long})
	w.Finished([]flow.Flow{short})
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	var col int // where REPLY starts under the last header
	headers := 0
	for _, l := range lines {
		if l == "" {
			continue
		}
		if strings.HasPrefix(l, "ID ") {
			col, headers = strings.Index(l, "REPLY"), headers+1
			continue
		}
		if !strings.HasSuffix(l, "yes") || len(l)-len("yes") != col {
			t.Errorf("row not under its header's REPLY (column %d):\n%s", col, b.String())
			break
		}
	}
	if headers != 2 {
		t.Errorf("%d headers, want 2 (the wider row starts a new one):\n%s", headers, b.String())
	}
}

// TestFinishedCountsGrammar: "1 was still open", not "1 were".
func TestFinishedCountsGrammar(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	w.Finished([]flow.Flow{finishedFlow(1)})
	w.Flows([]flow.Flow{finishedFlow(2)})
	w.Summary(flow.Summary{Flows: 2, Retired: 1}, nil, Run{})
	if !strings.Contains(b.String(), "Of the 2 flows, 1 was reported above as it ended, 1 was still open at the end.") {
		t.Errorf("summary:\n%s", b.String())
	}
}

// TestFinishedTableHeaderEveryScreenful: flows that end together (a busy
// node retires hundreds a second, handed over at once) still get the
// header again every finishedScreen rows, as README's "Until stopped"
// promises: not one header over a batch of 100 rows.
func TestFinishedTableHeaderEveryScreenful(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	var batch []flow.Flow
	for i := 1; i <= 100; i++ {
		batch = append(batch, finishedFlow(i))
	}
	w.Finished(batch)
	w.Finished([]flow.Flow{finishedFlow(101)})
	rows := 0
	for _, l := range strings.Split(b.String(), "\n") {
		switch {
		case strings.HasPrefix(l, "ID "):
			rows = 0
		case strings.HasSuffix(l, "yes"):
			if rows++; rows > finishedScreen {
				t.Fatalf("more than %d rows under one header:\n%s", finishedScreen, b.String())
			}
		}
	}
}

// TestSummaryRewritersNameTheirFlows: a row's BY is shortened, and rules
// that differ in their endpoint chain or their hook shorten alike: the
// summary lists each rewriter with its flows (at most maxRewriterIDs ids,
// then how many in all), so that a row's rule can be told.
func TestSummaryRewritersNameTheirFlows(t *testing.T) {
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	var flows []flow.Flow
	for id := 1; id <= 14; id++ {
		f := finishedFlow(id)
		f.By = "PREROUTING -> KUBE-SEP-B1"
		if id == 2 {
			f.By = "OUTPUT -> KUBE-SEP-B1"
		}
		flows = append(flows, f)
	}
	w.Flows(flows)
	w.Summary(flow.Summary{Flows: 14, RewrittenAt: map[flow.Place]int{flow.PlaceNetfilter: 14}}, nil, Run{})
	out := b.String()
	for _, want := range []string{
		"PREROUTING -> KUBE-SEP-B1  (flows 1, 3-11, ... 13 in all)",
		"OUTPUT -> KUBE-SEP-B1  (flow 2)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
}
