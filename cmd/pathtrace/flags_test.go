package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/report"
)

// TestPodSelectorsConflictFirst: two Pod selectors are refused as such,
// before either is checked (a PID with no /proc entry, or one /proc does
// not show a non-root user, would be reported instead).
func TestPodSelectorsConflictFirst(t *testing.T) {
	for _, args := range [][]string{
		{"--pod-ip", "10.0.0.3", "--pod-pid", "999999999"},
		{"--pod-netns", "/nonexistent", "--pod-pid", "1"},
		{"--pod-ip", "10.0.0.300", "--pod-netns", "/nonexistent"},
	} {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse(append([]string{"--svc", "10.0.0.1"}, args...)); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		if err == nil || !strings.Contains(err.Error(), "give at most one") {
			t.Errorf("%s: %v; want the selectors' conflict", strings.Join(args, " "), err)
		}
	}
}

// TestPodIPSaysWhatToGive: a --pod-ip that is not an address says which
// one to give; copied from `ip addr` with its prefix length, that address.
func TestPodIPSaysWhatToGive(t *testing.T) {
	for _, c := range []struct{ podIP, want string }{
		{"10.244.8.23/22", "--pod-ip 10.244.8.23"},
		{"10.244.8.300", "e.g. --pod-ip "},
		{"fd00::1", "e.g. --pod-ip "},
	} {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pod-ip", c.podIP}); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("--pod-ip %s: %v; want a usage error saying %q", c.podIP, err, c.want)
		}
	}
}

// TestSubcommandAfterFlags: a subcommand given after the main command's
// flags is said to go first, not taken for a stray argument, nor its
// flags for unknown ones (--out).
func TestSubcommandAfterFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--svc", "10.0.0.1", "incident", "--out", "/nonexistent/inc"},
		{"--svc", "10.0.0.1", "--duration", "5s", "incident"},
		{"--svc", "10.0.0.1", "lab", "status"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		msg := strings.TrimSpace(stderr.String())
		if code != exitUsage || strings.Contains(msg, "\n") || !strings.Contains(msg, "give it first") {
			t.Errorf("pathtrace %s: exit %d, stderr %q; want exit 2 and one line saying the subcommand goes first", strings.Join(args, " "), code, msg)
		}
	}
}

// TestFollowPcapMaxPacketsNeedsMaxBytes: --duration 0 with --pcap and
// --max-packets but no --max-bytes is refused for want of a bound on the
// bytes, not said to grow without end: the packets are bounded.
func TestFollowPcapMaxPacketsNeedsMaxBytes(t *testing.T) {
	var f traceFlags
	if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--duration", "0", "--pcap", "/tmp/pf-follow.pcapng", "--max-packets", "1000"}); err != nil {
		t.Fatal(err)
	}
	_, err := f.validate()
	var ue usageError
	if !errors.As(err, &ue) || !strings.Contains(err.Error(), "give --max-bytes") || strings.Contains(err.Error(), "without end") {
		t.Errorf("--duration 0 --pcap --max-packets: %v; want a usage error asking for --max-bytes, not saying the file grows without end", err)
	}
}

// TestDurationHelpNamesStopSignals: --help names every signal that ends a
// run early.
func TestDurationHelpNamesStopSignals(t *testing.T) {
	names := map[os.Signal]string{os.Interrupt: "Ctrl-C", syscall.SIGTERM: "SIGTERM", syscall.SIGHUP: "SIGHUP"}
	usage := newTraceFlagSet(&traceFlags{}).Lookup("duration").Usage
	for _, sig := range stopSignals() {
		if name, ok := names[sig]; !ok || !strings.Contains(usage, name) {
			t.Errorf("--duration's help %q does not say that %v ends the run", usage, sig)
		}
	}
}

// TestBufferSizeHoldsSnaplen: a --buffer-size whose ring blocks cannot hold
// one frame of --snaplen is a usage error; it opened no tap, and with
// --pcap ended in "no interface to capture on" (exit 1).
func TestBufferSizeHoldsSnaplen(t *testing.T) {
	for _, c := range []struct {
		snaplen, bufSize string
		ok               bool
	}{
		{"65535", "64K", false},
		{"65535", "16K", false},
		{"9000", "16K", false},
		{"65535", "272K", true},
		{"96", "16K", true},
		{"65535", "4M", true},
	} {
		var f traceFlags
		args := []string{"--svc", "10.0.0.1", "--snaplen", c.snaplen, "--buffer-size", c.bufSize}
		if err := newTraceFlagSet(&f).Parse(args); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		if c.ok && err != nil {
			t.Errorf("%s: %v", strings.Join(args, " "), err)
		}
		if !c.ok && (err == nil || !strings.Contains(err.Error(), "--snaplen "+c.snaplen)) {
			t.Errorf("%s: %v; want a usage error naming --snaplen", strings.Join(args, " "), err)
		}
	}
}

// TestStartInterrupted: a stop signal during start-up is said as such, not
// as "context canceled"; a cancellation the signals did not cause (a
// library's own) is not mistaken for one.
func TestStartInterrupted(t *testing.T) {
	signalled, stop := context.WithCancel(context.Background())
	stop()
	wrapped := fmt.Errorf("discover pods: %w", context.Canceled)
	if !startInterrupted(signalled, wrapped) {
		t.Errorf("a wrapped cancellation after the stop signal is not an interrupted start")
	}
	if startInterrupted(context.Background(), wrapped) {
		t.Errorf("a cancellation without a stop signal is taken for an interrupted start")
	}
	if startInterrupted(signalled, errors.New("attach: permission denied")) {
		t.Errorf("another error after the stop signal is taken for an interrupted start")
	}
}

// TestPcapDirectory: --pcap naming a directory (--pcap /var/tmp, meaning
// "write it there") is told as such, with a file to give instead, not as
// a capture that exists and will not be overwritten.
func TestPcapDirectory(t *testing.T) {
	dir := t.TempDir()
	var f traceFlags
	if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", dir}); err != nil {
		t.Fatal(err)
	}
	_, err := f.validate()
	var ue usageError
	if !errors.As(err, &ue) || !strings.Contains(err.Error(), "a directory") || !strings.Contains(err.Error(), dir+"/svc.pcapng") {
		t.Errorf("--pcap %s: %v; want a usage error saying it is a directory, with a file in it to give", dir, err)
	}
}

// TestPcapStdoutTerminal: --pcap - on a terminal (the pipe to Wireshark
// forgotten) is refused before anything is attached, not a screenful of
// binary that leaves the terminal garbled; into a pipe it is fine.
func TestPcapStdoutTerminal(t *testing.T) {
	defer func(f func() bool) { stdoutIsTerminal = f }(stdoutIsTerminal)
	for _, tty := range []bool{true, false} {
		stdoutIsTerminal = func() bool { return tty }
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", "-"}); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		var ue usageError
		if tty && (!errors.As(err, &ue) || !strings.Contains(err.Error(), "terminal")) {
			t.Errorf("--pcap - on a terminal: %v; want a usage error saying so", err)
		}
		if !tty && err != nil {
			t.Errorf("--pcap - into a pipe: %v", err)
		}
	}
}

// TestReportEveryAtLeastASecond: the counts are taken on the run's
// one-second tick, so an interval under a second is refused rather than
// silently made a second; a second is taken.
func TestReportEveryAtLeastASecond(t *testing.T) {
	for _, c := range []struct {
		every string
		ok    bool
	}{{"1ns", false}, {"500ms", false}, {"1s", true}, {"1m", true}} {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--duration", "0", "--report-every", c.every}); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		if (err == nil) != c.ok || err != nil && exitFor(err) != exitUsage {
			t.Errorf("--report-every %s: %v; want taken %v (refused: exit 2)", c.every, err, c.ok)
		}
	}
}

// TestUnwritablePlacesRefused: a --pcap or an incident's --out where no file
// can be made is refused with the flags, exit 2 and one line, before
// anything is attached: root passes the access check on /proc and /sys, so
// the run started and failed to create its file (exit 1); a dangling
// symbolic link passed the check and took the name when the file was made.
// A named pipe is told how to stream into it. A writable directory is
// taken, and the check leaves nothing in it.
func TestUnwritablePlacesRefused(t *testing.T) {
	dir := t.TempDir()
	fifo, dangling := filepath.Join(dir, "fifo"), filepath.Join(dir, "dangling")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, "nowhere", "x"), dangling); err != nil {
		t.Fatal(err)
	}
	oneLine := func(what string, err error) {
		t.Helper()
		if err == nil || exitFor(err) != exitUsage || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v; want a usage error in one line", what, err)
		}
	}
	for _, p := range []string{"/proc/x.pcapng", "/sys/x", "/sys/kernel/x.pcapng", fifo, dangling, "/dev/full"} {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", p}); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		oneLine("--pcap "+p, err)
		if p == fifo && err != nil && !strings.Contains(err.Error(), "--pcap - > "+fifo) {
			t.Errorf("--pcap %s: %v; want the way to stream into the pipe", p, err)
		}
	}
	for _, out := range []string{"/proc/inc", "/sys/inc"} {
		f := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
		_, _, err := incidentOptions(&f, out, "256M")
		oneLine("incident --out "+out, err)
	}
	ok := filepath.Join(t.TempDir(), "svc.pcapng")
	var f traceFlags
	if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", ok}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.validate(); err != nil {
		t.Errorf("--pcap %s: %v", ok, err)
	}
	if left, _ := os.ReadDir(filepath.Dir(ok)); len(left) > 0 {
		t.Errorf("checking --pcap %s left %s behind", ok, left[0].Name())
	}
}

// TestFlagGivenTwice: a flag that takes one value, given twice, is refused
// naming it, in every command: the last one silently won (--pod-ip A
// --pod-ip B traced B alone). --svc is repeatable. Each command line also
// has a bad input that the checks after parsing refuse, so that none can
// start a trace whatever the parsing does.
func TestFlagGivenTwice(t *testing.T) {
	for _, c := range []struct {
		args  []string
		twice string
	}{
		{[]string{"--svc", "10.0.0.1", "--pod-ip", "10.0.0.2", "--pod-ip", "10.0.0.3", "--output", "xml"}, "--pod-ip"},
		{[]string{"--svc", "10.0.0.1", "--duration=10s", "--duration", "1h", "--output", "xml"}, "--duration"},
		{[]string{"--svc", "10.0.0.1", "-w", "/tmp/a.pcapng", "--pcap", "/tmp/b.pcapng", "--output", "xml"}, "--pcap"},
		{[]string{"--svc", "10.0.0.1", "--svc", "10.0.0.2", "--output", "xml"}, ""},
		{[]string{"incident", "--svc", "10.0.0.1", "--duration", "1s", "--duration", "1m", "--out", "/nonexistent-dir/x"}, "--duration"},
		{[]string{"lab", "client", "--name", "ptbadinput", "--requests", "1", "--requests", "2", "--timeout", "0"}, "--requests"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(c.args...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		msg := strings.TrimSpace(stderr.String())
		want := "not saying a flag is given twice"
		if c.twice != "" {
			want = "saying " + c.twice + " is given twice"
		}
		if named := strings.Contains(msg, c.twice+" given twice"); code != exitUsage || strings.Contains(msg, "\n") || named != (c.twice != "") {
			t.Errorf("pathtrace %s: exit %d, stderr %q; want exit 2 and one line %s", strings.Join(c.args, " "), code, msg, want)
		}
	}
}

// TestSizeTypos: a size written as other tools take it (10MB, 4MiB) is
// refused saying how to write it, and one too large as such: --buffer-size
// 4MB was told "use 16K to 256M", which 4MB looks to be, and an incident's
// --max-bytes 10MB or 999999999999G "give a size of at least 1M".
func TestSizeTypos(t *testing.T) {
	trace := func(args ...string) error {
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse(append([]string{"--svc", "10.0.0.1"}, args...)); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		return err
	}
	incident := func(maxBytes string) error {
		f := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
		_, _, err := incidentOptions(&f, filepath.Join(t.TempDir(), "inc"), maxBytes)
		return err
	}
	pcap := filepath.Join(t.TempDir(), "x.pcapng")
	for _, c := range []struct {
		what string
		err  error
		want string
	}{
		{"--buffer-size 4MB", trace("--buffer-size", "4MB"), "write 4M:"},
		{"--buffer-size 4MiB", trace("--buffer-size", "4MiB"), "write 4M:"},
		{"--buffer-size 99999999999G", trace("--buffer-size", "99999999999G"), "too large"},
		{"--max-bytes 10MB", trace("--pcap", pcap, "--max-bytes", "10MB"), "write 10M:"},
		{"incident --max-bytes 10MB", incident("10MB"), "write 10M:"},
		{"incident --max-bytes 999999999999G", incident("999999999999G"), "too large"},
		{"incident --max-bytes 1023K", incident("1023K"), "at least 1M"},
	} {
		if c.err == nil || exitFor(c.err) != exitUsage || !strings.Contains(c.err.Error(), c.want) {
			t.Errorf("%s: %v; want a usage error saying %q", c.what, c.err, c.want)
		}
	}
	for _, args := range [][]string{{"--buffer-size", "4m"}, {"--buffer-size", "65536"}, {"--pcap", pcap, "--max-bytes", "10M"}} {
		if err := trace(args...); err != nil {
			t.Errorf("%s: %v", strings.Join(args, " "), err)
		}
	}
	if err := incident("1G"); err != nil {
		t.Errorf("incident --max-bytes 1G: %v", err)
	}
}

// TestPodPIDNotANumber: a --pod-pid that is no number is refused as the
// other number flags are, saying what it takes, in both commands: it said
// `strconv.Atoi: parsing "abc": invalid syntax`.
func TestPodPIDNotANumber(t *testing.T) {
	for _, args := range [][]string{
		{"--svc", "10.0.0.1", "--pod-pid", "abc"},
		{"incident", "--svc", "10.0.0.1", "--pod-pid", "99999999999999999999", "--out", "/nonexistent-dir/x"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		msg := strings.TrimSpace(stderr.String())
		if code != exitUsage || strings.Contains(msg, "\n") || strings.Contains(msg, "strconv") || !strings.Contains(msg, "must be a process id") {
			t.Errorf("pathtrace %q: exit %d, stderr %q; want exit 2 and one line saying --pod-pid must be a process id", args, code, msg)
		}
	}
}

// TestEmptyValueRefused: a flag given an empty value (a script's --pod-ip
// "$IP" whose variable was not set) is refused naming it: it read as the
// flag left out, tracing every Pod, pathtrace's own netns, or writing no
// capture. Each command line also has a bad input that the checks after
// parsing refuse, so that none can start a trace whatever the parsing does.
func TestEmptyValueRefused(t *testing.T) {
	for _, c := range []struct {
		args  []string
		empty string
	}{
		{[]string{"--svc", "10.0.0.1", "--pod-ip", "", "--output", "xml"}, "--pod-ip"},
		{[]string{"--svc", "10.0.0.1", "--host-netns=", "--output", "xml"}, "--host-netns"},
		{[]string{"--svc", "10.0.0.1", "--pcap", "", "--output", "xml"}, "--pcap"},
		{[]string{"incident", "--svc", "10.0.0.1", "--cgroup", "", "--out", "/nonexistent-dir/x"}, "--cgroup"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(c.args...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		msg := strings.TrimSpace(stderr.String())
		if code != exitUsage || strings.Contains(msg, "\n") || !strings.Contains(msg, c.empty+" is empty") {
			t.Errorf("pathtrace %q: exit %d, stderr %q; want exit 2 and one line saying %s is empty", c.args, code, msg, c.empty)
		}
	}
}

// TestLabCommandFirst: `pathtrace lab --name x status`, flags before the
// command as the main command takes them, is told to give the command
// first, not that "--name" is an unknown command.
func TestLabCommandFirst(t *testing.T) {
	err := labCommand([]string{"--name", "x", "status"}, io.Discard)
	var ue usageError
	if !errors.As(err, &ue) || !strings.Contains(err.Error(), "give the command first") {
		t.Errorf("lab --name x status: %v; want a usage error saying to give the command first", err)
	}
}

// TestNameTooLongRefused: a --pcap or --out whose NAME.partial, under which
// it is built, is longer than its filesystem's names (255 bytes here) is
// refused with the flags: the capture failed to name its file, exit 1, once
// the observers were attached. A name that fits with .partial is taken.
func TestNameTooLongRefused(t *testing.T) {
	dir := t.TempDir()
	long := filepath.Join(dir, strings.Repeat("a", 250)+".pcapng") // 265 bytes with .partial
	var f traceFlags
	if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", long}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.validate(); err == nil || exitFor(err) != exitUsage || !strings.Contains(err.Error(), "shorter name") {
		t.Errorf("--pcap of a 257-byte name: %v; want a usage error asking for a shorter name", err)
	}
	inc := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
	if _, _, err := incidentOptions(&inc, filepath.Join(dir, strings.Repeat("b", 250)), "256M"); err == nil || exitFor(err) != exitUsage || !strings.Contains(err.Error(), "shorter name") {
		t.Errorf("incident --out of a 250-byte name: %v; want a usage error asking for a shorter name", err)
	}
	fits := filepath.Join(dir, strings.Repeat("c", 240)+".pcapng") // 255 bytes with .partial
	f = traceFlags{}
	if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", fits}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.validate(); err != nil {
		t.Errorf("--pcap of a 247-byte name: %v", err)
	}
}

// TestIncidentArchiveNameTooLongRefused: an incident's longest name is its
// archive's, DIR.tar.gz.partial: an --out whose DIR.partial fits but whose
// archive does not is refused with the flags, not after the whole incident
// (the archive failed, 'file name too long', exit 1, the bundle unarchived).
func TestIncidentArchiveNameTooLongRefused(t *testing.T) {
	dir := t.TempDir()
	inc := traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
	// 253 bytes with .partial, 260 with .tar.gz.partial.
	if _, _, err := incidentOptions(&inc, filepath.Join(dir, strings.Repeat("b", 245)), "256M"); err == nil || exitFor(err) != exitUsage || !strings.Contains(err.Error(), "shorter name") {
		t.Errorf("incident --out of a 245-byte name: %v; want a usage error asking for a shorter name", err)
	}
	// 255 bytes with .tar.gz.partial.
	inc = traceFlags{svcs: []string{"10.0.0.1"}, duration: time.Second, output: "table", snaplen: 96, bufSize: "4M", maxFlows: 4096}
	if _, _, err := incidentOptions(&inc, filepath.Join(dir, strings.Repeat("c", 240)), "256M"); err != nil {
		t.Errorf("incident --out of a 240-byte name: %v", err)
	}
}

// TestLabStatusJSONUnhealthy: lab status exits 1 when its health check
// fails, with --json too (a script reads the exit, not only "healthy"): it
// exited 0 on a lab that does not exist.
func TestLabStatusJSONUnhealthy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: lab status reads the lab's namespaces")
	}
	name := fmt.Sprintf("ptnone%d", os.Getpid()) // never made
	var out bytes.Buffer
	err := labCommand([]string{"status", "--name", name, "--json"}, &out)
	if err == nil || !strings.Contains(out.String(), `"healthy": false`) {
		t.Errorf("lab status --json of a lab that does not exist: %v, printed %q; want the failed health check as an error (exit 1) after the JSON", err, out.String())
	}
}

// TestHelpDropHintsPromise: --help says of the drop counters what the
// report does: which flag to change where one could have avoided the loss
// (README: "with what to change when a flag could have avoided the loss").
// It said "a non-zero one says which flag to change", which decode errors
// and the kernel's learning errors, which no flag avoids, do not.
func TestHelpDropHintsPromise(t *testing.T) {
	var without []string
	for _, c := range []string{"uplink:bond0 kernel_drops", "uplink:bond0 decode_errors", flow.DropFlowsOverMax, flow.DropFlowsJoined,
		flow.DropUnmatchedOverflow, flow.DropUnrelatedOverflow, flow.DropRepliesForgotten, "ringbuf_losses", "kernel_learn_errors",
		"filter_update_errors", "event_decode_errors", "conntrack_errors", "conntrack_drops"} {
		if len(report.DropHints(map[string]uint64{c: 1})) == 0 {
			without = append(without, c)
		}
	}
	if len(without) > 0 && strings.Contains(traceUsage, "a non-zero one says which flag to change") {
		t.Errorf("--help says every non-zero drop counter names a flag to change; the report names none for %v", without)
	}
}
