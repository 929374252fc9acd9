package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// goneStdout is a pipe's write end whose reader went away (`| head -1` once
// it has its line), for a command's stdout.
func goneStdout(t *testing.T) *os.File {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	t.Cleanup(func() { w.Close() })
	return w
}

// TestHelpReaderGone: `pathtrace help | head -1`: a help, or the version,
// whose reader stopped early got what it wanted: exit 0, nothing said, as
// other Unix tools do. They died of SIGPIPE, exit 141.
func TestHelpReaderGone(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"--help"}, {"help", "lab"}, {"lab", "--help"}, {"incident", "--help"}, {"--version"}} {
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stdout, cmd.Stderr = goneStdout(t), &stderr
		if code := exitCode(cmd.Run()); code != exitOK || stderr.Len() > 0 {
			t.Errorf("pathtrace %s | head: exit %d, stderr %q; want exit 0 and nothing said", strings.Join(args, " "), code, stderr.String())
		}
	}
}

// TestHelpDiskFull: a help or the version written to a full disk (`>
// /dev/full`) was not printed: said on stderr, exit 1. It exited 0, nothing
// said, as if written.
func TestHelpDiskFull(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"--help"}, {"help", "lab"}, {"lab", "--help"}, {"incident", "--help"}, {"--version"}} {
		full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
		if err != nil {
			t.Skipf("no /dev/full: %v", err)
		}
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stdout, cmd.Stderr = full, &stderr
		code := exitCode(cmd.Run())
		full.Close()
		if code != exitRuntime || !strings.Contains(stderr.String(), "no space left") {
			t.Errorf("pathtrace %s > /dev/full: exit %d, stderr %q; want exit 1 saying the disk is full", strings.Join(args, " "), code, stderr.String())
		}
	}
}

// TestSubcommandsReaderGone: `pathtrace lab status | head -1` and the other
// subcommands whose stdout's reader went away each died of SIGPIPE, exit
// 141, nothing said. What lab status and lab client print is what they are
// run for: its loss is said, exit 1, as the main command's report. lab up
// did its work and an incident wrote its bundle, which is what they are run
// for: the loss of their confirmation (SUMMARY.md's copy) is said, with the
// bundle's name, exit 0.
func TestSubcommandsReaderGone(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptcli-pipe")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	out := filepath.Join(t.TempDir(), "inc")
	for _, c := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"lab", "status", "--name", l.Name()}, exitRuntime, "reader went away"},
		{[]string{"lab", "status", "--name", l.Name(), "--json"}, exitRuntime, "reader went away"},
		{[]string{"lab", "client", "--name", l.Name(), "--requests", "1"}, exitRuntime, "reader went away"},
		{[]string{"lab", "up", "--name", l.Name(), "--mode", string(lab.ModeTC)}, exitOK, "reader went away"},
		{[]string{"incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1s", "--out", out}, exitOK, "bundle: " + out + "/"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(c.args...)
		cmd.Stdout, cmd.Stderr = goneStdout(t), &stderr
		if code := exitCode(cmd.Run()); code != c.code || !strings.Contains(stderr.String(), c.says) {
			t.Errorf("pathtrace %s | head: exit %d, stderr %q; want exit %d saying %q", strings.Join(c.args, " "), code, stderr.String(), c.code, c.says)
		}
	}
	if _, err := os.Stat(filepath.Join(out, "SUMMARY.md")); err != nil {
		t.Errorf("the incident's bundle: %v", err)
	}
}
