package export

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCreatePartial covers both ways of creating the file: unnamed until
// the header is written (O_TMPFILE), and the fallback for filesystems
// without it.
func TestCreatePartial(t *testing.T) {
	for _, tmpfile := range []bool{true, false} {
		path := filepath.Join(t.TempDir(), "cap.pcapng")
		pf, err := createPartial(path, tmpfile)
		if err != nil {
			t.Fatalf("tmpfile %v: %v", tmpfile, err)
		}
		_, statErr := os.Stat(pf.partial)
		if named := statErr == nil; named == tmpfile {
			t.Errorf("tmpfile %v: %s exists before publish: %v", tmpfile, pf.partial, named)
		}
		if _, err := pf.WriteString("header"); err != nil {
			t.Fatal(err)
		}
		if err := pf.publish(); err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat(pf.partial); err != nil || fi.Mode().Perm() != 0o600 || fi.Size() != 6 {
			t.Errorf("tmpfile %v: after publish %s: %v %v, want 6 bytes, mode 0600", tmpfile, pf.partial, fi, err)
		}
		if err := pf.finish(); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(path); err != nil || string(b) != "header" {
			t.Errorf("tmpfile %v: %s holds %q (%v)", tmpfile, path, b, err)
		}
		if _, err := os.Stat(pf.partial); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("tmpfile %v: %s remains after finish", tmpfile, pf.partial)
		}
	}
}

// TestPartialOfRunningCapture: a PATH.partial that a running capture
// writes is told from one an interrupted run left: "remove it" about the
// first would have the user destroy a capture in progress (two pathtraces
// given one --pcap).
func TestPartialOfRunningCapture(t *testing.T) {
	for _, tmpfile := range []bool{true, false} {
		path := filepath.Join(t.TempDir(), "cap.pcapng")
		pf, err := createPartial(path, tmpfile)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pf.WriteString("header"); err != nil {
			t.Fatal(err)
		}
		if err := pf.publish(); err != nil {
			t.Fatal(err)
		}
		if !PartialInUse(path) {
			t.Errorf("tmpfile %v: the running capture's %s.partial is not in use", tmpfile, path)
		}
		_, err = createPartial(path, tmpfile)
		if err == nil || !strings.Contains(err.Error(), "running now") || strings.Contains(err.Error(), "remove it") {
			t.Errorf("tmpfile %v: a second capture to %s: %v; want one saying a capture runs, not to remove it", tmpfile, path, err)
		}
		pf.Close() // the run was killed: its file stays
		if PartialInUse(path) {
			t.Errorf("tmpfile %v: a left %s.partial is in use", tmpfile, path)
		}
		if _, err = createPartial(path, tmpfile); err == nil || !strings.Contains(err.Error(), "interrupted") {
			t.Errorf("tmpfile %v: %v; want a left file said as such", tmpfile, err)
		}
	}
}

// TestFinishPartialRemoved: a PATH.partial removed during the run (its
// directory deleted) is not said to hold the capture when the rename
// fails; one still there is.
func TestFinishPartialRemoved(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "caps")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	pf, err := createPartial(filepath.Join(dir, "cap.pcapng"), false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pf.WriteString("header"); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	err = pf.finish()
	if err == nil || strings.Contains(err.Error(), "stays in") || !strings.Contains(err.Error(), "the capture is lost") {
		t.Errorf("finish after its directory went: %v; want the capture said lost, not kept", err)
	}
}
