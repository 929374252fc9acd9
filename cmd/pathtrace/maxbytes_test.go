package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestMaxBytesBelowHeaderRefusedBeforeAttaching: a --max-bytes that cannot
// hold the capture file's header is bad usage, refused (exit 2, one line)
// before anything is attached. It was found when the file was made, once
// every observer and tap was in place on the node (the tcx observers on the
// lab's host veth), then taken down.
func TestMaxBytesBelowHeaderRefusedBeforeAttaching(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-maxb")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	base := tcxIngress(t, l.NodeNetNS(), "veth-a") // the lab's DNAT
	file := filepath.Join(t.TempDir(), "c.pcapng")
	var stderr strings.Builder
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "1m", "--pcap", file, "--max-bytes", "100")
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill() }()
	// Looked at without pause until it ends: without the fix its observers
	// stayed for the tens of milliseconds of opening the taps and closing.
	linked := false
	var err error
	deadline := time.Now().Add(time.Minute)
	for ended := false; !ended; {
		select {
		case err = <-done:
			ended = true
		default:
			if time.Now().After(deadline) {
				t.Fatalf("still running a minute on (stderr %q)", stderr.String())
			}
			linked = linked || tcxIngress(t, l.NodeNetNS(), "veth-a") > base
		}
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	if code := exitCode(err); code != exitUsage || len(lines) != 1 || !strings.Contains(lines[0], "--max-bytes 100") || !strings.Contains(lines[0], "header") {
		t.Errorf("--max-bytes 100: exit %d, stderr %q; want exit 2 and one line saying the header does not fit", code, stderr.String())
	}
	if linked {
		t.Errorf("--max-bytes 100: refused after attaching (tcx observers came on the host veth); want it refused before")
	}
	if m, _ := filepath.Glob(file + "*"); len(m) > 0 {
		t.Errorf("--max-bytes 100: left %v", m)
	}
}
