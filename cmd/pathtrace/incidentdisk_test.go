package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestIncidentOnSmallDisk runs an incident whose --out filesystem holds far
// less than its --max-bytes: the bundle and its archive still fit, with both
// reports, instead of the capture filling the disk and the snapshot and the
// reports (the verdicts) failing on ENOSPC.
func TestIncidentOnSmallDisk(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=4m"); err != nil {
		t.Skipf("cannot mount a small tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	out := filepath.Join(dir, "incident")
	cmd, stderr := startIncident(t, out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--svc", lab.UDPVIP.String(), "--duration", "6s") // --max-bytes 256M by default
	// Far more capture than 4 MiB: 300 requests of bulk-free TCP and UDP
	// are about 2 MB at three points; the snapshot and reports add theirs.
	for range 3 {
		if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 300}); err != nil {
			t.Fatal(err)
		}
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident on a 4 MiB filesystem: %v\n%s", err, stderr.String())
	}
	for _, name := range []string{"report.json", "report.txt", "SUMMARY.md"} {
		if st, err := os.Stat(filepath.Join(out, name)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := os.Stat(out + ".tar.gz"); err != nil {
		t.Errorf("archive: %v", err)
	}
	// The budget, lowered to fit the disk, left the capture file less than
	// the traffic: the file ended, not the run, and SUMMARY.md says what
	// to change.
	summary, _ := os.ReadFile(filepath.Join(out, "SUMMARY.md"))
	for _, want := range []string{"Capture stopped: duration; the capture file filled after ",
		"of --max-bytes, lowered to ", "Give --out a filesystem with more free space to keep more."} {
		if !strings.Contains(string(summary), want) {
			t.Errorf("SUMMARY.md lacks %q:\n%s", want, summary)
		}
	}
}

func TestFitDisk(t *testing.T) {
	for _, c := range []struct {
		budget, avail, want int64
		err                 bool
	}{
		{256 << 20, 10 << 30, 256 << 20, false}, // room: unchanged
		{256 << 20, 100 << 20, 50 << 20, false}, // half the free space
		{256 << 20, 3 << 19, 0, true},           // not even 1 MiB each
	} {
		got, err := fitDisk(c.budget, c.avail)
		if got != c.want || (err != nil) != c.err {
			t.Errorf("fitDisk(%d, %d) = %d, %v; want %d (error %v)", c.budget, c.avail, got, err, c.want, c.err)
		}
	}
}

// TestIncidentDiskFilledByOther: another process fills --out's filesystem
// during the run: the bundle cannot be written (exit 1, what was written
// left in DIR.partial), and the run's verdicts are printed on stdout rather
// than lost with it.
func TestIncidentDiskFilledByOther(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=8m"); err != nil {
		t.Skipf("cannot mount a small tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	out := filepath.Join(dir, "incident")
	cmd := pathtrace("incident", "--out", out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "4s")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	waitFor(t, filepath.Join(out+".partial", "capture.pcapng.partial"), cmd)
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 3}); err != nil {
		t.Fatal(err)
	}
	filler, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	chunk := make([]byte, 64<<10)
	for {
		if _, err := filler.Write(chunk); err != nil {
			break
		}
	}
	filler.Close()
	err = cmd.Wait()
	if exitCode(err) != exitRuntime || !strings.Contains(stderr.String(), "no space left on device") || !strings.Contains(stderr.String(), out+".partial") {
		t.Fatalf("bundle on a disk filled by another process: exit %d, stderr %q; want exit 1 naming ENOSPC and %s.partial", exitCode(err), stderr.String(), out)
	}
	if !strings.Contains(stdout.String(), lab.TCPVIP.String()) || !strings.Contains(stdout.String(), "REWRITTEN AT") || !strings.Contains(stdout.String(), "netfilter") {
		t.Errorf("the run's report is not on stdout:\n%s", stdout.String())
	}
}
