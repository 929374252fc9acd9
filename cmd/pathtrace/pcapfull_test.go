package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPcapOnFullDiskRefusedWithFlags: a --pcap on a full filesystem is said
// with the flags, before anything is attached, in one line naming the flag,
// exit 1 (a runtime condition: the disk may be freed). The flags passed, so
// the observers and taps went onto the node first, and only the file's
// header then failed: "pcapng DIR/x.pcapng: write pcapng header: write
// DIR/x.pcapng.partial: no space left on device", naming a file that was
// never there. A filesystem with room still passes, and nothing is left in
// either.
func TestPcapOnFullDiskRefusedWithFlags(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a small filesystem")
	}
	dir := t.TempDir()
	if err := unix.Mount("ptfull", dir, "tmpfs", 0, "size=64k"); err != nil {
		t.Skipf("mount a tmpfs: %v", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	validate := func(file string) error {
		t.Helper()
		var f traceFlags
		if err := newTraceFlagSet(&f).Parse([]string{"--svc", "10.0.0.1", "--pcap", file}); err != nil {
			t.Fatal(err)
		}
		_, err := f.validate()
		return err
	}
	file := filepath.Join(dir, "x.pcapng")
	if err := validate(file); err != nil {
		t.Fatalf("--pcap %s with room: %v", file, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "fill"), make([]byte, 64<<10), 0o600); err != nil {
		t.Fatalf("fill the filesystem: %v", err)
	}
	err := validate(file)
	if err == nil || exitFor(err) != exitRuntime || strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), "--pcap "+file+": no space left") {
		t.Errorf("--pcap %s on a full filesystem: %v; want one line naming --pcap and the full disk, exit 1", file, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("left in the directory: %v; want only the filler", ents)
	}
}
