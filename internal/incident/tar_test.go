package incident

import (
	"archive/tar"
	"compress/gzip"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// testBundle writes a bundle directory: the summary and manifest, small text
// files, a subdirectory, and an incompressible "capture" of size pcapBytes.
func testBundle(t *testing.T, pcapBytes int) (string, map[string][]byte) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "incident-20250101T000000")
	if err := os.MkdirAll(filepath.Join(dir, "extra"), 0o700); err != nil {
		t.Fatal(err)
	}
	pcap := make([]byte, pcapBytes)
	rand.Read(pcap)
	files := map[string][]byte{
		SummaryFile:        []byte("# summary\n"),
		ManifestText:       []byte("manifest\n"),
		ManifestJSON:       []byte("{}\n"),
		"nftables.txt":     []byte(strings.Repeat("table ip nat {}\n", 200)),
		"extra/notes.txt":  []byte("nested\n"),
		"capture.pcapng":   pcap,
		"report.jsonl":     []byte(`{"type":"node"}` + "\n"),
		"net-pod-1.txt":    []byte("links\n"),
		"conntrack.txt":    []byte(""),
		"bpf-links.txt":    []byte("no BPF links\n"),
		"iptables-nat.txt": []byte("*nat\nCOMMIT\n"),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, filepath.FromSlash(name)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir, files
}

// readArchive returns the members of a .tar.gz, in order, and their bytes.
func readArchive(t *testing.T, path string) ([]string, map[string][]byte) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	var order []string
	got := map[string][]byte{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Mode != 0o600 {
			t.Errorf("%s: mode %o", h.Name, h.Mode)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		order = append(order, h.Name)
		got[h.Name] = b
	}
	return order, got
}

func TestTarRoundTrip(t *testing.T) {
	dir, files := testBundle(t, 100<<10)
	out := dir + ".tar.gz"
	if err := Tar(dir, out, 0); err != nil {
		t.Fatal(err)
	}
	order, got := readArchive(t, out)
	base := filepath.Base(dir) + "/"
	if len(order) < 3 || order[0] != base+SummaryFile || order[1] != base+ManifestText || order[2] != base+ManifestJSON {
		t.Errorf("the summary and manifest must come first: %v", order)
	}
	if len(got) != len(files) {
		t.Errorf("archive has %d members, bundle %d files: %v", len(got), len(files), order)
	}
	for name, want := range files {
		if b, ok := got[base+name]; !ok || string(b) != string(want) {
			t.Errorf("%s: in archive %v, %d bytes, want %d", name, ok, len(b), len(want))
		}
	}
	if st, err := os.Stat(out); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("archive: %v mode %v", err, st.Mode())
	}
	if _, err := os.Stat(out + ".partial"); !os.IsNotExist(err) {
		t.Errorf("partial file left behind: %v", err)
	}
}

func TestTarLeavesOutWhatDoesNotFit(t *testing.T) {
	dir, files := testBundle(t, 300<<10)
	out := dir + ".tar.gz"
	const maxBytes = 64 << 10
	err := Tar(dir, out, maxBytes)
	var om *OmittedError
	if !errors.As(err, &om) {
		t.Fatalf("want an OmittedError, got %v", err)
	}
	if len(om.Files) != 1 || om.Files[0].Name != "capture.pcapng" || om.Files[0].Bytes != 300<<10 {
		t.Errorf("omitted: %+v, want only capture.pcapng", om.Files)
	}
	if !strings.Contains(err.Error(), "capture.pcapng") || !strings.Contains(err.Error(), "65536 bytes") {
		t.Errorf("message does not say what was left out and why: %v", err)
	}
	st, err := os.Stat(out)
	if err != nil || st.Size() > maxBytes {
		t.Fatalf("archive: %v, %d bytes, bound %d", err, st.Size(), maxBytes)
	}
	_, got := readArchive(t, out)
	base := filepath.Base(dir) + "/"
	if list := string(got[base+OmittedFile]); !strings.Contains(list, "capture.pcapng\t307200 bytes") {
		t.Errorf("%s: %q", OmittedFile, list)
	}
	for name, want := range files {
		if name == "capture.pcapng" {
			continue
		}
		if string(got[base+name]) != string(want) {
			t.Errorf("%s missing or different in the archive", name)
		}
	}
}

func TestTarRefusesWhatCannotBeHonest(t *testing.T) {
	dir, _ := testBundle(t, 1000)
	out := dir + ".tar.gz"
	if err := Tar(dir, out, 4096); err == nil || !strings.Contains(err.Error(), "not written") {
		t.Errorf("a bound below the summary and manifest: got %v", err)
	}
	for _, p := range []string{out, out + ".partial"} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s exists after a refused archive", p)
		}
	}
	if err := Tar(dir, filepath.Join(dir, "self.tar.gz"), 0); err == nil || !strings.Contains(err.Error(), "inside the bundle") {
		t.Errorf("an archive inside its own directory: got %v", err)
	}
}

func TestPlanArchiveSmallestFirst(t *testing.T) {
	files := []File{{Name: SummaryFile, Bytes: 100}, {Name: "a", Bytes: 50 << 10}, {Name: "b", Bytes: 10 << 10},
		{Name: "c", Bytes: 20 << 10}}
	keep, omitted := planArchive(files, 48<<10)
	var kept []string
	for _, f := range keep {
		kept = append(kept, f.Name)
	}
	if !slices.Equal(kept, []string{SummaryFile, "b", "c"}) || len(omitted) != 1 || omitted[0].Name != "a" {
		t.Errorf("kept %v omitted %+v", kept, omitted)
	}
}
