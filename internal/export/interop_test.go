package export_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// interopFile writes the round-trip packets, then enough others of varied
// sizes that the file holds filler blocks too.
func interopFile(t *testing.T) (string, []written) {
	t.Helper()
	pkts := roundTripPackets()
	for i := range 60 {
		p := packet(tcpFrame(i*61%1400), obs.DirIn, 0, 0)
		p.Time = t0.Add(time.Duration(i+1) * time.Millisecond)
		pkts = append(pkts, written{iface: 1, p: p, comment: "flow 2", dirFlag: 1})
	}
	path := filepath.Join(t.TempDir(), "interop.pcapng")
	writeFile(t, path, export.Limits{}, pkts, []export.InterfaceStats{{Received: 5}, {Received: 61}, {Received: 2, Dropped: 1}})
	if fillers(t, path) == 0 {
		t.Fatal("the file holds no filler block: the test does not cover them")
	}
	return path, pkts
}

// fillers counts the blocks of a type for local use.
func fillers(t *testing.T, path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for len(b) >= 12 {
		if binary.LittleEndian.Uint32(b)&0x80000000 != 0 {
			n++
		}
		b = b[binary.LittleEndian.Uint32(b[4:]):]
	}
	return n
}

// TestTshark reads a file back with Wireshark's reader (CI installs tshark).
func TestTshark(t *testing.T) {
	tshark, err := exec.LookPath("tshark")
	if err != nil {
		t.Skip("tshark not installed (apt-get install tshark): the gopacket round trip still runs")
	}
	path, pkts := interopFile(t)
	rows, err := tsharkFields(tshark, path, "frame.interface_name", "frame.interface_description",
		"vlan.id", "ieee8021ad.id", "frame.comment", "frame.packet_flags_direction", "frame.len", "frame.cap_len")
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(pkts) {
		t.Fatalf("tshark read %d packets, want %d", len(rows), len(pkts))
	}
	for i, wp := range pkts {
		ifc := testIfaces[wp.iface]
		vlan8021Q, vlan8021AD := "", ""
		switch wp.p.TPID {
		case tpid8021Q:
			vlan8021Q = "200"
		case tpid8021AD:
			vlan8021AD = "200"
		}
		wantLen := len(wp.p.Data)
		if wp.p.VLANOutOfBand {
			wantLen += 4
		}
		want := []string{ifc.Name, ifc.Description, vlan8021Q, vlan8021AD, wp.comment,
			fmt.Sprintf("0x%08x", wp.dirFlag), strconv.Itoa(wantLen), strconv.Itoa(min(wantLen, ifc.Snaplen))}
		if got := rows[i]; strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("packet %d: tshark says\n %q\nwant\n %q", i+1, got, want)
		}
	}
}

// TestTcpdump: libpcap reads the file too, and `tcpdump -e` shows the tags.
func TestTcpdump(t *testing.T) {
	tcpdump, err := exec.LookPath("tcpdump")
	if err != nil {
		t.Skip("tcpdump not installed")
	}
	path, pkts := interopFile(t)
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(tcpdump, "-e", "-n", "-r", path)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("tcpdump -r: %v: %s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	if len(lines) != len(pkts) {
		t.Fatalf("tcpdump printed %d packets, want %d", len(lines), len(pkts))
	}
	for i, wp := range pkts {
		if tagged := strings.Contains(lines[i], "vlan 200, p 3"); tagged != wp.p.VLANOutOfBand {
			t.Errorf("packet %d: tcpdump -e shows %q; tagged %v", i+1, lines[i], wp.p.VLANOutOfBand)
		}
	}
}

// TestCutFileIsDetected checks the oracle of TestReadableAfterSIGKILL: a file
// ending inside a block is an error for both readers.
func TestCutFileIsDetected(t *testing.T) {
	path, pkts := interopFile(t)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, fi.Size()-200); err != nil {
		t.Fatal(err)
	}
	if n, err := readAll(path); err == nil {
		t.Errorf("gopacket read %d of %d packets of a cut file without error", n, len(pkts))
	}
	if tshark, err := exec.LookPath("tshark"); err == nil {
		if n, err := tsharkCount(tshark, path); err == nil {
			t.Errorf("tshark read %d of %d packets of a cut file without error", n, len(pkts))
		}
	}
}
