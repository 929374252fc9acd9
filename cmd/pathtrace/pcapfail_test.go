package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// streamRun is a `--pcap -` run whose stdout is a pipe the test holds, with
// the report's JSON lines read from stderr.
type streamRun struct {
	cmd     *exec.Cmd
	r       *os.File // stdout's read end
	lines   chan map[string]any
	done    chan struct{} // closed once cmd.Wait returned waitErr
	waitErr error
}

func startStream(t *testing.T, l *lab.Lab) *streamRun {
	t.Helper()
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--svc", lab.UDPVIP.String()+"/udp",
		"--duration", "60s", "--pcap", "-", "--output", "json")
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = w
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	s := &streamRun{cmd: cmd, r: r, lines: make(chan map[string]any, 64), done: make(chan struct{})}
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-s.done; r.Close() })
	go func() {
		defer close(s.lines)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				s.lines <- m
			}
		}
		s.waitErr = cmd.Wait()
		close(s.done)
	}()
	select { // the node line comes once every observer is attached
	case m := <-s.lines:
		if m["type"] != "node" {
			t.Fatalf("first report line %v, want the node", m)
		}
	case <-time.After(time.Minute):
		t.Fatal("no node line on stderr")
	}
	return s
}

// finish waits up to limit for the run to end and returns its summary line
// and exit code.
func (s *streamRun) finish(t *testing.T, limit time.Duration) (map[string]any, int) {
	t.Helper()
	var summary map[string]any
	timeout := time.After(limit)
	for {
		select {
		case m, ok := <-s.lines:
			if !ok {
				<-s.done
				return summary, exitCode(s.waitErr)
			}
			if m["type"] == "summary" {
				summary = m
			}
		case <-timeout:
			t.Fatalf("pathtrace did not end within %s", limit)
		}
	}
}

// TestPcapWriteErrorExitsOne: a capture that could not be written whole (its
// reader went away here, which ends the run; a full disk is the same) is a
// runtime failure: the report says why, and the exit code says it failed,
// so that a script does not take the cut file for the capture it asked for.
func TestPcapWriteErrorExitsOne(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	s := startStream(t, l)
	s.r.Close() // the reader goes away: the next write fails with EPIPE
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 3}); err != nil {
		t.Fatalf("lab client: %v", err)
	}
	summary, code := s.finish(t, 30*time.Second)
	if summary == nil || summary["stop_reason"] != "reader-gone" {
		t.Fatalf("summary %v, want stop_reason reader-gone", summary)
	}
	if pcap, _ := summary["pcap"].(map[string]any); pcap == nil || pcap["error"] == nil {
		t.Errorf("summary's pcap %v, want the cut stream's error", pcap)
	}
	if code != exitRuntime {
		t.Errorf("exit code %d after a failed capture, want %d", code, exitRuntime)
	}
}

// TestPcapStalledReaderStillStops: a `--pcap -` reader that stops reading
// without going away (a hung Wireshark, a stalled ssh) must not hold
// pathtrace hostage: SIGTERM still ends the run within seconds, with the
// report, and the capture is reported cut.
func TestPcapStalledReaderStillStops(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	s := startStream(t, l) // s.r is never read: the pipe fills up
	// About 7 KB of capture per request: 40 fill the 64 KiB pipe.
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 40}); err != nil {
		t.Fatalf("lab client: %v", err)
	}
	time.Sleep(500 * time.Millisecond) // the frames reach the writer
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	summary, code := s.finish(t, 20*time.Second)
	if summary == nil {
		t.Fatal("no summary line on stderr")
	}
	pcap, _ := summary["pcap"].(map[string]any)
	if pcap == nil || pcap["error"] == nil {
		t.Errorf("summary's pcap %v, want the stalled stream's error", pcap)
	}
	if stop := summary["stop_reason"]; stop != "interrupted" {
		t.Errorf("stop_reason %v, want interrupted: the run ended on SIGTERM, the stream was given up after", stop)
	}
	if code != exitRuntime {
		t.Errorf("exit code %d after a cut capture, want %d", code, exitRuntime)
	}
}

// TestReportWriteErrorExitsOne: a report that could not be written (stdout
// on a full disk) is a runtime failure said on stderr, not a silent exit 0
// with an empty or cut report.
func TestReportWriteErrorExitsOne(t *testing.T) {
	needRoot(t)
	full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
	if err != nil {
		t.Skipf("no /dev/full: %v", err)
	}
	defer full.Close()
	l := upLab(t, lab.ModeTC)
	for _, format := range []string{"table", "json"} {
		cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1s", "--output", format)
		cmd.Stdout = full
		var stderr strings.Builder
		cmd.Stderr = &stderr
		err := cmd.Run()
		if code := exitCode(err); code != exitRuntime || !strings.Contains(stderr.String(), "report") {
			t.Errorf("--output %s into a full disk: exit code %d, want %d, and stderr %q should say the report was not written", format, code, exitRuntime, stderr.String())
		}
	}
}

// TestSIGHUPEndsLikeSIGTERM: the terminal going away (an ssh session that
// drops at 3 a.m.) sends SIGHUP: the trace ends as on SIGTERM, its capture
// file complete under its name, as tcpdump does, instead of dying with the
// file left as FILE.partial and no report.
func TestSIGHUPEndsLikeSIGTERM(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	path := filepath.Join(t.TempDir(), "hup.pcapng")
	hupNotIgnored(t)
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "60s", "--pcap", path)
	r.waitNode(t)
	_ = r.cmd.Process.Signal(syscall.SIGHUP)
	_, summary := r.rest(t) // fails unless it exits 0
	if summary == nil || summary["stop_reason"] != "interrupted" {
		t.Errorf("summary %v, want stop_reason interrupted", summary)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("capture file after SIGHUP: %v", err)
	}
}

// hupNotIgnored makes the pathtrace a test starts get SIGHUP with its
// default action whatever this test process got: run under nohup (a CI
// runner's background job), SIGHUP is ignored here and that passes on to
// every child, which then rightly keeps running (TestNohupKeepsRunning).
// A signal this process handles is reset to its default in a child.
func hupNotIgnored(t *testing.T) {
	if !signal.Ignored(syscall.SIGHUP) {
		return
	}
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGHUP)
	// Ignored again, as it came. Not with signal.Stop: it gives SIGHUP
	// back to SIG_IGN but leaves signal.Ignored false, and a later test
	// took it for a signal its pathtrace would get.
	t.Cleanup(func() { signal.Ignore(syscall.SIGHUP) })
}

// TestHupNotIgnoredTwice: under nohup, each test that calls hupNotIgnored
// starts a pathtrace that gets SIGHUP, and SIGHUP is ignored again after.
func TestHupNotIgnoredTwice(t *testing.T) {
	if !signal.Ignored(syscall.SIGHUP) { // as under nohup
		signal.Ignore(syscall.SIGHUP)
		t.Cleanup(func() { signal.Reset(syscall.SIGHUP) })
	}
	for i := range 2 {
		t.Run(fmt.Sprint(i+1), func(t *testing.T) {
			hupNotIgnored(t)
			if childIgnoresHUP(t) {
				t.Error("a child started after hupNotIgnored ignores SIGHUP")
			}
		})
	}
	if !childIgnoresHUP(t) || !signal.Ignored(syscall.SIGHUP) {
		t.Errorf("after the tests: SIGHUP ignored in a child %v, signal.Ignored %v; want both", childIgnoresHUP(t), signal.Ignored(syscall.SIGHUP))
	}
}

// childIgnoresHUP: a child started now ignores SIGHUP (its SigIgn mask).
func childIgnoresHUP(t *testing.T) bool {
	t.Helper()
	out, err := exec.Command("grep", "SigIgn", "/proc/self/status").Output()
	if err != nil {
		t.Fatal(err)
	}
	mask, err := strconv.ParseUint(strings.TrimSpace(strings.TrimPrefix(string(out), "SigIgn:")), 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	return mask&(1<<(syscall.SIGHUP-1)) != 0
}

// TestNohupKeepsRunning: started under nohup (SIGHUP ignored), pathtrace
// does not end on SIGHUP, so a capture left running in the background
// outlives the ssh session that started it; SIGTERM still ends it with its
// report.
func TestNohupKeepsRunning(t *testing.T) {
	needRoot(t)
	nohup, err := exec.LookPath("nohup")
	if err != nil {
		t.Skip("no nohup on this machine")
	}
	l := upLab(t, lab.ModeTC)
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "60s", "--output", "json")
	cmd.Path, cmd.Args = nohup, append([]string{nohup}, cmd.Args...) // nohup runs it
	r := startCmdJSON(t, cmd)
	r.waitNode(t)
	_ = r.cmd.Process.Signal(syscall.SIGHUP)
	// Idle (no traffic), it writes nothing more until it ends.
	select {
	case m, ok := <-r.lines:
		t.Fatalf("pathtrace under nohup ended on SIGHUP (wrote %v, output open %v; stderr: %s)", m, ok, r.stderr.String())
	case <-time.After(2 * time.Second):
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	stuck := time.AfterFunc(30*time.Second, func() { _ = r.cmd.Process.Kill() }) // then rest fails
	defer stuck.Stop()
	_, summary := r.rest(t) // fails unless it exits 0
	if summary == nil || summary["stop_reason"] != "interrupted" {
		t.Errorf("summary %v, want stop_reason interrupted", summary)
	}
}

// TestSecondSignalEndsStuckRun: a report that cannot be written (its
// output a pipe nobody reads, full) holds the run; the first SIGTERM asks
// for the report, which stays stuck; the second must end pathtrace, as
// Ctrl-C twice does at 3 a.m., not be swallowed.
func TestSecondSignalEndsStuckRun(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close() // never read: the node block fills the smallest pipe
	if _, err := unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, 4096); err != nil {
		t.Fatal(err)
	}
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "60s")
	cmd.Stdout = w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	done := make(chan struct{}) // closed when pathtrace has exited
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(done) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	time.Sleep(3 * time.Second) // attached, the node block written into the full pipe
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
		t.Skipf("pathtrace ended on the first SIGTERM (%v): the pipe did not hold it", waitErr)
	case <-time.After(2 * time.Second):
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("pathtrace still runs 5 s after a second SIGTERM")
	}
}
