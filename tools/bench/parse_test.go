package main

import (
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

func TestParseSchedstat(t *testing.T) {
	got, err := parseSchedstat([]byte("172964825 18827563 486\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := 172964825 * time.Nanosecond; got != want {
		t.Errorf("run time = %v, want %v", got, want)
	}
	if _, err := parseSchedstat([]byte("0 0\n")); err == nil {
		t.Error("short schedstat accepted")
	}
}

func TestParseMinflt(t *testing.T) {
	// The command may hold spaces and parentheses: fields count from the last ")".
	stat := []byte("4242 (path) trace) S 1 4242 4242 0 -1 4194560 2466 0 3 0 12 5 0 0 15 -5 4 0 100 0 0")
	if n, err := parseMinflt(stat); err != nil || n != 2466 {
		t.Errorf("parseMinflt = %d, %v; want 2466", n, err)
	}
	if _, err := parseMinflt([]byte("4242 (pathtrace")); err == nil {
		t.Error("a stat line without its fields: no error")
	}
}

func TestParseSystemBusy(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	stat := "cpu  100 10 50 9000 30 5 20 15 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n"
	got, err := parseSystemBusy([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	if want := ticks(100 + 10 + 50 + 5 + 20 + 15); got != want {
		t.Errorf("busy = %v, want %v", got, want)
	}
	if _, err := parseSystemBusy([]byte("intr 1 2 3\n")); err == nil {
		t.Error("line without cpu accepted")
	}
}

func TestParseTcpdumpStats(t *testing.T) {
	stderr := "tcpdump: listening on bond0, link-type EN10MB (Ethernet), snapshot length 96 bytes\n" +
		"^C\n1234 packets captured\n1300 packets received by filter\n66 packets dropped by kernel\n"
	var res captureResult
	if err := parseTcpdumpStats(stderr, "bond0", &res); err != nil {
		t.Fatal(err)
	}
	if res.Captured["bond0"] != 1234 || res.KernelDrops["bond0"] != 66 {
		t.Errorf("captured %v drops %v, want 1234 and 66", res.Captured, res.KernelDrops)
	}
	// One is "packet": a run that lost a single frame ended the benchmark.
	if err := parseTcpdumpStats("529540 packets captured\n529541 packets received by filter\n1 packet dropped by kernel\n", "bond0", &res); err != nil {
		t.Fatal(err)
	} else if res.Captured["bond0"] != 529540 || res.KernelDrops["bond0"] != 1 {
		t.Errorf("captured %v drops %v, want 529540 and 1", res.Captured, res.KernelDrops)
	}
	if err := parseTcpdumpStats("tcpdump: bond0: No such device exists\n", "bond0", &res); err == nil {
		t.Error("stderr without counters accepted")
	}
}

// TestParseDumpcapStats reads what dumpcap 4.0 printed after a capture on
// two interfaces (-q), \r of its last count line included.
func TestParseDumpcapStats(t *testing.T) {
	stderr := "Capturing on 'veth-a' and 'bond0'\nFile: /tmp/x.pcapng\n\rPackets captured: 857557\n" +
		"Packets received/dropped on interface 'veth-a': 420863/137922 (pcap:6389/dumpcap:131533/flushed:0/ps_ifdrop:0) (75.3%)\n" +
		"Packets received/dropped on interface 'bond0': 436694/122091 (pcap:8433/dumpcap:113658/flushed:2/ps_ifdrop:1) (78.2%)\n"
	var res captureResult
	if err := parseDumpcapStats(stderr, &res); err != nil {
		t.Fatal(err)
	}
	if res.Captured["veth-a"] != 420863 || res.Captured["bond0"] != 436694 || res.totalCaptured() != 857557 {
		t.Errorf("captured %v, want veth-a 420863 and bond0 436694", res.Captured)
	}
	if res.KernelDrops["veth-a"] != 6389 || res.KernelDrops["bond0"] != 8434 {
		t.Errorf("kernel drops %v, want veth-a 6389 and bond0 8434 (pcap + ps_ifdrop)", res.KernelDrops)
	}
	if res.OtherLosses != 131533+113658+2 {
		t.Errorf("queue drops %d, want %d (dumpcap + flushed)", res.OtherLosses, 131533+113658+2)
	}
	if err := parseDumpcapStats("dumpcap: There are no interfaces on which a capture can be done\n", &res); err == nil {
		t.Error("stderr without counters accepted")
	}
}

func TestParsePathtraceSummary(t *testing.T) {
	line := `{"type":"summary","flows":3,"drops":{"host:veth-a kernel_drops":2,"pod:eth0 kernel_drops":0,` +
		`"uplink:bond0 kernel_drops":5,"ringbuf_losses":7,"flows_over_max":1,"pod:eth0 decode_errors":0},` +
		`"observations":{"host":6,"pod":6,"uplink":6,"tc_head":6,"sockaddr":3},` +
		`"packets":{"host:veth-a":6,"pod:eth0":6,"uplink:bond0":4},"cpu_wait":{"total_ms":701.03,"worst_thread_second_ms":110.18}}`
	var res captureResult
	if err := parsePathtraceSummary([]byte(line), &res); err != nil {
		t.Fatal(err)
	}
	if got := res.totalCaptured(); got != 16 {
		t.Errorf("captured %d, want 16", got)
	}
	if got := uplinkCount(res.Captured); got != 4 {
		t.Errorf("uplink %d, want 4", got)
	}
	if res.KernelDrops["host:veth-a"] != 2 || res.KernelDrops["uplink:bond0"] != 5 || res.totalDrops() != 7 {
		t.Errorf("kernel drops %v", res.KernelDrops)
	}
	if res.OtherLosses != 8 || res.LossCounters["ringbuf_losses"] != 7 {
		t.Errorf("other losses %d, want 8 (ring buffer 7 + flows over max 1)", res.OtherLosses)
	}
	if res.Events != 9 || res.Flows != 3 {
		t.Errorf("events %d flows %d, want 9 (tc_head + sockaddr) and 3", res.Events, res.Flows)
	}
	if w := res.CPUWait; w == nil || w.TotalMs != 701.03 || w.WorstSecondMs != 110.18 {
		t.Errorf("CPU wait %+v, want 701.03 / 110.18 ms", w)
	}
	if err := parsePathtraceSummary(nil, &res); err == nil {
		t.Error("missing summary accepted")
	}
}

func TestPercentile(t *testing.T) {
	var s []time.Duration
	for i := 100; i >= 1; i-- {
		s = append(s, time.Duration(i))
	}
	for _, c := range []struct {
		pct  float64
		want time.Duration
	}{{50, 50}, {99, 99}, {100, 100}, {1, 1}} {
		if got := percentile(s, c.pct); got != c.want {
			t.Errorf("p%v = %v, want %v", c.pct, got, c.want)
		}
	}
	if s[0] != 100 {
		t.Error("percentile reordered its input")
	}
}

func TestGroupByRate(t *testing.T) {
	runs := []windowRun{
		{Tool: toolNone, Rate: 10}, {Tool: toolTcpdump, Rate: 10}, {Tool: toolPathtrace, Rate: 10},
		{Tool: toolNone, Rate: 0}, {Tool: toolTcpdump, Rate: 0}, {Tool: toolPathtrace, Rate: 0},
	}
	g := groupByRate(runs)
	if len(g) != 2 || g[0].rate != 10 || g[1].rate != 0 || g[1].pathtrace.Tool != toolPathtrace || g[0].tcpdump.Tool != toolTcpdump {
		t.Errorf("groups %+v", g)
	}
	// Rounds: the same rate again in the next round is a group of its own.
	rounds := []windowRun{
		{Tool: toolNone, Rate: 10, Round: 1}, {Tool: toolPathtrace, Rate: 10, Round: 1},
		{Tool: toolPathtrace, Rate: 10, Round: 2}, {Tool: toolDumpcap, Rate: 10, Round: 2},
	}
	g = groupByRate(rounds)
	if len(g) != 2 || g[0].round != 1 || g[1].round != 2 || g[1].dumpcap.Tool != toolDumpcap || g[1].none.Tool != "" {
		t.Errorf("groups over rounds %+v", g)
	}
}

func TestMedian(t *testing.T) {
	v := []float64{3, 1, 2}
	if got := median(v); got != 2 {
		t.Errorf("median %v = %v, want 2", v, got)
	}
	if v[0] != 3 {
		t.Error("median reordered its input")
	}
	if got := median([]float64{4, 1}); got != 4 {
		t.Errorf("median of two = %v, want the upper one, 4", got)
	}
	if got := median(nil); got != 0 {
		t.Errorf("median of none = %v, want 0", got)
	}
}

// TestSvcFilter: the tcpdumps that keep the bulk flow keep what pathtrace's
// --svc for it watches, the address on that port only.
func TestSvcFilter(t *testing.T) {
	for in, want := range map[string]string{
		"10.244.20.1:5001/tcp": "(host 10.244.20.1 and tcp port 5001)",
		"10.120.0.10:53/udp":   "(host 10.120.0.10 and udp port 53)",
	} {
		if got := svcFilter(in); got != want {
			t.Errorf("svcFilter(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestBulkRatios: each round's run is compared with the nothing-attached run
// of its own round, whatever order the runs come in.
func TestBulkRatios(t *testing.T) {
	runs := []bulkRun{
		{Tool: toolNone, Round: 0, Bps: 20e9}, {Tool: toolPathtrace, Round: 0, Bps: 19e9},
		{Tool: toolPathtrace, Round: 1, Bps: 27e9}, {Tool: toolNone, Round: 1, Bps: 30e9},
		{Tool: toolNone, Round: 2, Bps: 25e9}, {Tool: toolPathtrace, Round: 2, Bps: 25e9},
		{Tool: toolPathtrace, Round: 3, Bps: 1e9}, // no nothing-attached run in round 3
	}
	got := bulkRatios(runs, toolPathtrace)
	want := []float64{0.95, 0.9, 1}
	if len(got) != len(want) {
		t.Fatalf("bulkRatios = %v, want %v", got, want)
	}
	for i := range want {
		if d := got[i] - want[i]; d > 1e-9 || d < -1e-9 {
			t.Fatalf("bulkRatios = %v, want %v", got, want)
		}
	}
	if s := ratioRange(got); s != "0.95× (0.90–1.00)" {
		t.Errorf("ratioRange = %q", s)
	}
	if s := ratioRange(nil); s != "–" {
		t.Errorf("ratioRange(nil) = %q", s)
	}
}

// TestUnrelatedPerRound: the unrelated-traffic runs are compared, rate and
// system CPU per wire packet, with the nothing-attached run of their round;
// a run with too few packets for a per-packet figure is left out of it.
func TestUnrelatedPerRound(t *testing.T) {
	run := func(tool string, round int, sent uint64, sys time.Duration, wire uint64) windowRun {
		return windowRun{Tool: tool, Round: round, Sent: sent, Elapsed: time.Second, SysBusy: sys, Wire: map[string]uint64{lab.Uplink: wire}}
	}
	runs := []windowRun{
		run(toolNone, 1, 100_000, 700*time.Millisecond, 100_000), run(toolPathtrace, 1, 90_000, 720*time.Millisecond, 90_000),
		run(toolTcpdump3, 1, 110_000, 770*time.Millisecond, 110_000),
		run(toolNone, 2, 80_000, 640*time.Millisecond, 80_000), run(toolPathtrace, 2, 80_000, 600*time.Millisecond, 75_000),
		run(toolNone, 3, 50_000, 400*time.Millisecond, 50_000), run(toolPathtrace, 3, 60_000, 10*time.Millisecond, 500),
	}
	near := func(got, want []float64) bool {
		if len(got) != len(want) {
			return false
		}
		for i := range want {
			if d := got[i] - want[i]; d > 1e-9 || d < -1e-9 {
				return false
			}
		}
		return true
	}
	if got, want := sentRatios(runs, toolPathtrace), []float64{0.9, 1, 1.2}; !near(got, want) {
		t.Errorf("sentRatios = %v, want %v", got, want)
	}
	// 8 - 7 µs and 8 - 8 µs; round 3's 500 wire packets give no figure.
	if got, want := sysOverheads(runs, toolPathtrace), []float64{1, 0}; !near(got, want) {
		t.Errorf("sysOverheads = %v, want %v", got, want)
	}
	if got, want := sysOverheads(runs, toolTcpdump3), []float64{0}; !near(got, want) {
		t.Errorf("sysOverheads(tcpdump3) = %v, want %v", got, want)
	}
	if s := diffRange([]float64{1, 0, -0.5}, "µs"); s != "+0.00 µs (-0.50 to +1.00)" {
		t.Errorf("diffRange = %q", s)
	}
	if s := diffRange(nil, "µs"); s != "–" {
		t.Errorf("diffRange(nil) = %q", s)
	}
	if got := median(sentRates(runs, toolNone)); got != 80_000 {
		t.Errorf("median of the nothing-attached rates = %v, want 80000", got)
	}
}

// TestFdinfoProgID reads a BPF program descriptor's fdinfo (Linux 6.x) and
// refuses another descriptor's.
func TestFdinfoProgID(t *testing.T) {
	prog := "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2069\nprog_type:\t3\nprog_jited:\t1\nprog_tag:\tb7b7d387d4b0fe04\nmemlock:\t8192\nprog_id:\t49274\nrun_time_ns:\t0\nrun_cnt:\t0\n"
	if id, ok := fdinfoProgID(prog); !ok || id != 49274 {
		t.Errorf("prog_id %d %v, want 49274", id, ok)
	}
	if _, ok := fdinfoProgID("pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2069\nmap_type:\t27\nmap_id:\t76011\n"); ok {
		t.Error("a map's fdinfo read as a program's")
	}
}

func TestNonZero(t *testing.T) {
	got := nonZero(map[string]uint64{"uplink:bond0": 5, "pod:eth0": 0, "host:veth-a": 3})
	if want := "host:veth-a 3, uplink:bond0 5"; got != want {
		t.Errorf("nonZero = %q, want %q", got, want)
	}
	if got := nonZero(nil); got != "" {
		t.Errorf("nonZero(nil) = %q, want empty", got)
	}
}

func TestCPUCgroup(t *testing.T) {
	for _, c := range []struct{ file, want string }{
		{"9:name=systemd:/\n4:memory:/process_api/7dd\n2:cpuacct:/\n1:cpu:/\n0::/\n", "/"},
		{"3:cpu,cpuacct:/user.slice\n0::/\n", "/user.slice"},
		{"0::/user.slice/user-0.slice/session-3.scope\n", "/user.slice/user-0.slice/session-3.scope"},
		{"2:cpuacct:/a\n0::/b\n", "/b"},
	} {
		if got := cpuCgroup(c.file); got != c.want {
			t.Errorf("cpuCgroup(%q) = %q, want %q", c.file, got, c.want)
		}
	}
}
