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
