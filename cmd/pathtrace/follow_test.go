package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestFollowUntilStopped: --duration 0 traces until stopped and reports
// each flow as it ends. With the lab client sending two bursts of requests
// seconds apart, the first burst's flows come out (JSON lines, read while
// pathtrace runs) once their connections closed, before the SIGTERM, with
// their verdict and backend; the second burst's come with the summary at
// the end, which counts both; ids are unique; exit 0; nothing stays
// attached. With --report-every 1s, interval lines come meanwhile, each
// with the flows counted so far and the threads' CPU wait.
func TestFollowUntilStopped(t *testing.T) {
	needRoot(t)
	mode := lab.ModeNetfilter
	l := upLab(t, mode)
	gwMAC, err := l.GatewayMAC()
	if err != nil {
		t.Fatal(err)
	}
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "0", "--report-every", "1s")
	r.withIntervals = true
	r.waitNode(t)
	progs, links := heldBPF(t, r.cmd.Process.Pid)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const first, second = 3, 2
	if res, err := l.Client(ctx, lab.ClientOptions{Requests: first}); err != nil || res.TCP.OK != first {
		t.Fatalf("lab client (first burst): %+v, %v", res.TCP, err)
	}
	// A closed connection is reported once quiet for a few seconds (9 s,
	// and 3 s the sources may be late): well within 30 s.
	ids := map[float64]bool{}
	var early []map[string]any
	deadline := time.After(30 * time.Second)
	for len(early) < first {
		select {
		case m, ok := <-r.lines:
			if !ok {
				t.Fatalf("pathtrace ended before the first burst's flows came (stderr: %s)", r.stderr.String())
			}
			switch m["type"] {
			case "flow":
				early = append(early, m)
			case "interval":
				r.intervals = append(r.intervals, m)
			default:
				t.Fatalf("line before the SIGTERM that is neither a flow nor an interval: %v", m)
			}
		case <-deadline:
			t.Fatalf("%d of the first burst's %d flows reported within 30 s of their end: %s (stderr: %s)", len(early), first, dump(early), r.stderr.String())
		}
	}
	for _, f := range early {
		checkFlow(t, mode, f, gwMAC.String())
		id, _ := f["id"].(float64)
		if ids[id] {
			t.Errorf("flow id %v reported twice", id)
		}
		ids[id] = true
	}
	// The flows came 9 s after their end at the earliest: intervals came
	// meanwhile, the last counting the first burst.
	if len(r.intervals) < 5 {
		t.Errorf("%d interval lines before the first burst's flows came, want one a second", len(r.intervals))
	} else {
		last := r.intervals[len(r.intervals)-1]
		wait, _ := last["cpu_wait"].(map[string]any)
		total, okTotal := wait["total_ms"].(float64)
		worst, okWorst := wait["worst_thread_second_ms"].(float64)
		if n, _ := last["flows"].(float64); n != first || !okTotal || !okWorst || worst < 0 || worst > 1500 || total < worst {
			t.Errorf("last interval line %v, want %d flows and the CPU wait so far", last, first)
		}
	}
	if res, err := l.Client(ctx, lab.ClientOptions{Requests: second}); err != nil || res.TCP.OK != second {
		t.Fatalf("lab client (second burst): %+v, %v", res.TCP, err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	late, summary := r.rest(t) // exit 0, or it fails
	if len(late) != second {
		t.Errorf("%d flows at the end, want the second burst's %d: %s", len(late), second, dump(late))
	}
	for _, f := range late {
		checkFlow(t, mode, f, gwMAC.String())
		id, _ := f["id"].(float64)
		if ids[id] {
			t.Errorf("flow id %v reported twice", id)
		}
		ids[id] = true
	}
	if summary == nil {
		t.Fatal("no summary line")
	}
	if n, _ := summary["flows"].(float64); n != first+second {
		t.Errorf("summary counts %v flows, want %d", summary["flows"], first+second)
	}
	if n, _ := summary["flows_reported_before"].(float64); n != first {
		t.Errorf("summary: %v flows reported before, want %d", summary["flows_reported_before"], first)
	}
	if summary["stop_reason"] != "interrupted" {
		t.Errorf("stop reason %v, want interrupted", summary["stop_reason"])
	}
	// The kernel frees them once their last holder is gone (an RCU grace
	// period or so after the exit).
	for wait := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left := stillThere(progs, links)
		if left == 0 {
			break
		}
		if time.Now().After(wait) {
			t.Errorf("%d of pathtrace's programs and links still exist 10 s after it exited", left)
			break
		}
	}
}

// TestFollowReportLost: a run until stopped whose report can no longer be
// written (stdout on a full disk, here /dev/full) ends at once with exit 1
// and says why; it traced on with nothing to show until stopped.
func TestFollowReportLost(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
	if err != nil {
		t.Skip(err)
	}
	defer full.Close()
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "0", "--output", "json")
	var stderr strings.Builder
	cmd.Stdout, cmd.Stderr = full, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if code := exitCode(err); code != exitRuntime || !strings.Contains(stderr.String(), "could not be written") {
			t.Errorf("exit %d, stderr %q; want exit 1 saying the report could not be written", code, stderr.String())
		}
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("still tracing 30 s after its report could not be written (stderr %q)", stderr.String())
	}
}

// stillThere counts the BPF programs and links of ids that still exist.
func stillThere(progs, links []uint32) int {
	left := 0
	for _, id := range links {
		if lk, err := link.NewFromID(link.ID(id)); err == nil {
			lk.Close()
			left++
		}
	}
	for _, id := range progs {
		if p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id)); err == nil {
			p.Close()
			left++
		}
	}
	return left
}

// TestFollowBadUsage: --duration 0 refuses what would grow without end or
// is time-bounded by nature, with one line that says what to give.
func TestFollowBadUsage(t *testing.T) {
	for _, args := range [][]string{
		{"--svc", "10.0.0.1", "--duration", "0", "--pcap", "/tmp/pf-follow.pcapng"},
		{"--svc", "10.0.0.1", "--duration", "0", "--flow-timeout", "1s"},
		{"--svc", "10.0.0.1", "--duration", "5s", "--report-every", "1s"},
		{"--svc", "10.0.0.1", "--duration", "0", "--report-every", "500ms"},
		{"--svc", "10.0.0.1", "--duration", "5s", "--flow-timeout", "30s"},
		{"--svc", "10.0.0.1", "--flow-timeout", "-1s"},
		{"incident", "--svc", "10.0.0.1", "--duration", "0", "--out", "/tmp/pf-follow-incident"},
	} {
		out, err := pathtrace(args...).CombinedOutput()
		msg := strings.TrimSpace(string(out))
		if code := exitCode(err); code != exitUsage || msg == "" || strings.Contains(msg, "\n") {
			t.Errorf("pathtrace %v: exit %d, output %q; want exit 2 and one line", args, code, out)
		}
	}
}

// startFollowInto starts a run until stopped on the lab's TCP VIP, with
// extra arguments, with its stdout (the JSON report, or the --pcap -
// stream) written to w, which it closes on its side; done gets the run's
// end.
func startFollowInto(t *testing.T, l *lab.Lab, w *os.File, extra ...string) (cmd *exec.Cmd, stderr *strings.Builder, done chan error) {
	t.Helper()
	return startInto(t, w, append([]string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "0", "--output", "json"}, extra...)...)
}

// startInto starts pathtrace with args, its stdout written to w, which it
// closes on its side; done gets the run's end.
func startInto(t *testing.T, w *os.File, args ...string) (cmd *exec.Cmd, stderr *strings.Builder, done chan error) {
	t.Helper()
	cmd = pathtrace(args...)
	stderr = &strings.Builder{}
	cmd.Stdout, cmd.Stderr = w, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	done = make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return cmd, stderr, done
}

// wantReaderGoneExit waits up to within for the run to end with exit 1
// saying its report's reader went away.
func wantReaderGoneExit(t *testing.T, cmd *exec.Cmd, stderr *strings.Builder, done chan error, within time.Duration, what string) {
	t.Helper()
	select {
	case err := <-done:
		if code := exitCode(err); code != exitRuntime || !strings.Contains(stderr.String(), "reader went away") {
			t.Errorf("exit %d (%v), stderr %q; want exit 1 saying the report's reader went away", code, err, stderr.String())
		}
	case <-time.After(within):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("still tracing %s after its report's reader went away%s (stderr %q)", within, what, stderr.String())
	}
}

// TestFollowReaderGone: a run whose report's reader went away (`pathtrace
// --duration 0 -o json | head -1`, a log shipper that died) ends with exit
// 1 and says so, as for a full disk: it was killed by SIGPIPE at its first
// write, exit 141 with nothing said. So does a bounded run without --pcap
// (`pathtrace --duration 1m | head -1`), which has nothing else to show:
// it ends then, not a minute later.
func TestFollowReaderGone(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"until stopped", []string{"--duration", "0", "--output", "json"}},
		{"bounded", []string{"--duration", "1m"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			r.Close() // the reader is gone before the first line
			defer w.Close()
			cmd, stderr, done := startInto(t, w, append([]string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()}, c.args...)...)
			wantReaderGoneExit(t, cmd, stderr, done, 20*time.Second, "")
		})
	}
}

// TestFollowReaderGoneWhileIdle: `pathtrace --duration 0 | head -1` with no
// flow to the VIP: the reader goes away after the node line, and nothing
// is written after it for as long as no client reaches the VIP. The run
// ends when the reader goes (exit 1, said on stderr), not at a write
// that may never come.
func TestFollowReaderGoneWhileIdle(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	cmd, stderr, done := startFollowInto(t, l, w)
	line, err := bufio.NewReader(r).ReadString('\n') // the node line, as head -1 reads it
	if err != nil || !strings.Contains(line, `"type":"node"`) {
		t.Fatalf("first line %.80q (%v), want the node", line, err)
	}
	r.Close()
	wantReaderGoneExit(t, cmd, stderr, done, 15*time.Second, ", nothing to write")
}

// TestBoundedReaderGoneAfterNode: `pathtrace --duration 1m -o json | head
// -1`: the reader goes away once it has the node line, and a bounded run
// writes nothing more until its end. Without a --pcap file to go on writing, the
// run ends when the reader goes (exit 1, said on stderr), not a minute
// later.
func TestBoundedReaderGoneAfterNode(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	cmd, stderr, done := startInto(t, w, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1m", "--output", "json")
	line, err := bufio.NewReader(r).ReadString('\n') // as head -1 reads it
	if err != nil || !strings.Contains(line, `"type":"node"`) {
		t.Fatalf("first line %.80q (%v), want the node", line, err)
	}
	r.Close()
	wantReaderGoneExit(t, cmd, stderr, done, 15*time.Second, ", with nothing else to write")
}

// TestFollowPcapReaderGone: `pathtrace --duration 0 --pcap - | head -c
// 1000`: the stream's reader goes away, which ends the run (exit 1, the
// stream is cut), and the report on stderr says so in its stop reason:
// it said "interrupted", as for a Ctrl-C or a SIGTERM. So does a bounded
// run's (`--duration 1m --pcap - | head -c 1000`), which ends then, not a
// minute later.
func TestFollowPcapReaderGone(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"until stopped", []string{"--duration", "0", "--max-bytes", "1M"}},
		{"bounded", []string{"--duration", "1m"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			cmd, stderr, done := startInto(t, w, append([]string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--output", "json", "--pcap", "-"}, c.args...)...)
			if _, err := io.ReadFull(r, make([]byte, 4)); err != nil { // the pcapng header's start, as head -c reads it
				t.Fatalf("reading the stream: %v (stderr %q)", err, stderr.String())
			}
			if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 3}); err != nil {
				t.Fatalf("lab client: %v", err)
			}
			r.Close()
			var code int
			select {
			case err := <-done:
				code = exitCode(err)
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
				t.Fatalf("still tracing 30 s after the stream's reader went away (stderr %q)", stderr.String())
			}
			wantPcapReaderGone(t, stderr.String(), code)
		})
	}
}

// wantPcapReaderGone checks the end of a run whose --pcap - stream's
// reader went away: the summary on stderr says reader-gone, exit 1.
func wantPcapReaderGone(t *testing.T, stderr string, code int) {
	t.Helper()
	var summary map[string]any
	for _, line := range strings.Split(stderr, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["type"] == "summary" {
			summary = m
		}
	}
	if summary == nil || summary["stop_reason"] != "reader-gone" {
		t.Errorf("summary %v, want stop_reason reader-gone (stderr %q)", summary, stderr)
	}
	if code != exitRuntime {
		t.Errorf("exit %d, want %d: the stream was cut", code, exitRuntime)
	}
}

// TestBoundedPcapReaderGoneWhileIdle: `pathtrace --duration 1m --pcap - |
// tshark -r - -c 5`: the stream's reader goes away, and no frame comes
// after it. The run ends then (exit 1, stop reason reader-gone), as it
// does at the next frame it cannot write; it traced on for the whole
// minute with nowhere to write what it captured.
func TestBoundedPcapReaderGoneWhileIdle(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptpc-pipe")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	out, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1m", "--output", "json", "--pcap", "-")
	cmd.Stdout, cmd.Stderr = outW, errW
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	outW.Close()
	errW.Close()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	// Tracing has begun once the node is reported; the reader goes then.
	stderr := bufio.NewReader(errR)
	var said strings.Builder
	for !strings.Contains(said.String(), `"type":"node"`) {
		line, err := stderr.ReadString('\n')
		said.WriteString(line)
		if err != nil {
			t.Fatalf("no node line: %v (stderr %q)", err, said.String())
		}
	}
	out.Close()
	rest := make(chan string, 1)
	go func() { b, _ := io.ReadAll(stderr); rest <- string(b) }()
	select {
	case err := <-done:
		said.WriteString(<-rest)
		wantPcapReaderGone(t, said.String(), exitCode(err))
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("still tracing 20 s after the stream's reader went away, with no frame to write (stderr %q)", said.String()+<-rest)
	}
}

// TestPcapReaderGoneBeforeTracing: `pathtrace --pcap - | true`: the
// stream's reader is gone before tracing begins, and the run says whose
// reader it was, the stream's on stdout; it said the report's, which goes
// to stderr with --pcap - and was being read.
func TestPcapReaderGoneBeforeTracing(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptpc-pipe")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	for _, duration := range []string{"0", "1m"} {
		var stderr strings.Builder
		cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", duration, "--max-bytes", "1M", "--pcap", "-")
		cmd.Stdout, cmd.Stderr = goneStdout(t), &stderr
		if code := exitCode(cmd.Run()); code != exitRuntime || !strings.Contains(stderr.String(), "the capture stream's reader went away (stdout closed) before tracing began") {
			t.Errorf("--duration %s --pcap - | true: exit %d, stderr %q; want exit 1 saying the stream's reader went away", duration, code, stderr.String())
		}
	}
}

// TestPcapReaderGoneWhileAttaching: the stream's reader goes away while the
// observers attach (`--pcap - | tshark -Y BADFILTER`, which exits in half a
// second): the run says it was the stream's reader, before tracing began,
// as when it went before. The run's end is not looked at while attaching,
// so the header's write met the closed pipe first, and pathtrace said only
// "pcapng -: write pcapng header: write /dev/stdout: broken pipe". A full
// pipe holds the header back until the reader is closed, once pathtrace's
// tcx observers are on the lab's host veth.
func TestPcapReaderGoneWhileAttaching(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-attach")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	r, w := os.NewFile(uintptr(p[0]), "reader"), os.NewFile(uintptr(p[1]), "stdout")
	defer r.Close()
	defer w.Close()
	chunk := make([]byte, 4096)
	for {
		if _, err := unix.Write(p[1], chunk); err == unix.EAGAIN {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.SetNonblock(p[1], false); err != nil { // as a shell's pipe is
		t.Fatal(err)
	}
	base := tcxIngress(t, l.NodeNetNS(), "veth-a") // the lab's DNAT
	var stderr strings.Builder
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1m", "--pcap", "-")
	cmd.Stdout, cmd.Stderr = w, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill() }()
	for tcxIngress(t, l.NodeNetNS(), "veth-a") == base {
		select {
		case err := <-done:
			t.Fatalf("pathtrace ended before attaching: %v (stderr %q)", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	r.Close()
	select {
	case err := <-done:
		if code := exitCode(err); code != exitRuntime || !strings.Contains(stderr.String(), "the capture stream's reader went away (stdout closed) before tracing began") {
			t.Errorf("--pcap - whose reader went while attaching: exit %d, stderr %q; want exit 1 saying the stream's reader went away before tracing began", code, stderr.String())
		}
	case <-time.After(time.Minute):
		t.Fatalf("still running a minute after the stream's reader went away (stderr %q)", stderr.String())
	}
}
