package export_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcapgo"
	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// written is one packet given to the writer and what must come back.
type written struct {
	iface   int
	p       *capture.Packet
	comment string
	dirFlag pcapgo.NgEpbFlag
}

// roundTripPackets covers each interface, both directions, both TPIDs of an
// out-of-band tag, no comment and no direction.
func roundTripPackets() []written {
	frame := tcpFrame(200)
	return []written{
		{0, packet(frame, obs.DirOut, 0, 0), "flow 1 request to VIP (before translation)", pcapgo.NgEpbFlagDirectionOutbound},
		{1, packet(frame, obs.DirIn, 0, 0), "flow 1 request to VIP (before translation)", pcapgo.NgEpbFlagDirectionInbound},
		{2, packet(frame, obs.DirOut, tpid8021Q, 200), "flow 1 request to backend (after translation); rewritten_at=tc by=tcx ingress lab_tc (id 9)", pcapgo.NgEpbFlagDirectionOutbound},
		{2, packet(frame, obs.DirIn, tpid8021AD, 200), "flow 1 reply from backend (before reverse translation)", pcapgo.NgEpbFlagDirectionInbound},
		{0, packet(frame, obs.DirUnknown, 0, 0), "", pcapgo.NgEpbFlagDirectionUnknown},
	}
}

func writeFile(t *testing.T, path string, lim export.Limits, pkts []written, stats []export.InterfaceStats) *export.Writer {
	t.Helper()
	w, err := export.Create(path, testIfaces, lim)
	if err != nil {
		t.Fatal(err)
	}
	for i, wp := range pkts {
		if err := w.WritePacket(wp.iface, wp.p, wp.comment); err != nil {
			t.Fatalf("packet %d: %v", i, err)
		}
	}
	if err := w.Close(stats); err != nil {
		t.Fatal(err)
	}
	return w
}

func TestRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rt.pcapng")
	pkts := roundTripPackets()
	stats := []export.InterfaceStats{{Received: 10, Dropped: 1}, {Received: 20}, {Received: 30, Dropped: 3}}
	w := writeFile(t, path, export.Limits{}, pkts, stats)
	rb, err := read(path)
	if err != nil {
		t.Fatal(err)
	}
	if w.Packets() != uint64(len(pkts)) || len(rb.packets) != len(pkts) {
		t.Fatalf("Packets() = %d, read %d, want %d", w.Packets(), len(rb.packets), len(pkts))
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() != w.Bytes() {
		t.Errorf("file size %v (%v), Bytes() = %d", fi.Size(), err, w.Bytes())
	}
	if len(rb.ifaces) != len(testIfaces) {
		t.Fatalf("read %d interfaces, want %d", len(rb.ifaces), len(testIfaces))
	}
	for i, want := range testIfaces {
		got := rb.ifaces[i]
		if got.Name != want.Name || got.Description != want.Description ||
			got.LinkType != layers.LinkTypeEthernet || got.SnapLength != 262144 {
			t.Errorf("interface %d = %q %q %v snaplen %d, want %+v Ethernet, the largest snaplen", i, got.Name, got.Description,
				got.LinkType, got.SnapLength, want)
		}
		if s := got.Statistics; s.PacketsReceived != stats[i].Received || s.PacketsDropped != stats[i].Dropped {
			t.Errorf("interface %d statistics received %d dropped %d, want %+v", i, s.PacketsReceived, s.PacketsDropped, stats[i])
		}
	}
	for i, wp := range pkts {
		checkPacket(t, i, rb.packets[i], wp)
		if !rb.packets[i].at.Equal(wp.p.Time) {
			t.Errorf("packet %d at %s, written at %s (nanosecond timestamps)", i, rb.packets[i].at, wp.p.Time)
		}
	}
	if si := rb.section; si.Application != "pathtrace" || si.Hardware == "" || !strings.HasPrefix(si.OS, "Linux") {
		t.Errorf("section header %+v: want the application, hardware and OS", si)
	}
}

// checkPacket compares a packet read back with the one written.
func checkPacket(t *testing.T, i int, got readPacket, wp written) {
	t.Helper()
	if got.iface != wp.iface || got.direction != wp.dirFlag {
		t.Errorf("packet %d: interface %d direction %d, want %d %d", i, got.iface, got.direction, wp.iface, wp.dirFlag)
	}
	if wantComments := []string{wp.comment}; wp.comment == "" && len(got.comments) != 0 ||
		wp.comment != "" && !slices.Equal(got.comments, wantComments) {
		t.Errorf("packet %d: comments %q, want %q", i, got.comments, wp.comment)
	}
	orig := wp.p.Data
	wantLen, wantData := len(orig), orig
	if wp.p.VLANOutOfBand {
		wantLen += 4
		tag := binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(nil, wp.p.TPID), wp.p.TCI)
		wantData = slices.Concat(orig[:12], tag, orig[12:])
	}
	if snap := testIfaces[wp.iface].Snaplen; len(wantData) > snap {
		wantData = wantData[:snap]
	}
	if got.len != wantLen || got.capLen != len(wantData) || !bytes.Equal(got.data, wantData) {
		t.Errorf("packet %d: length %d captured %d, want %d %d (or the bytes differ)", i, got.len, got.capLen, wantLen, len(wantData))
	}
	dec := gopacket.NewPacket(got.data, layers.LayerTypeEthernet, gopacket.Default)
	eth, _ := dec.Layer(layers.LayerTypeEthernet).(*layers.Ethernet)
	dot1q, _ := dec.Layer(layers.LayerTypeDot1Q).(*layers.Dot1Q)
	tcp, _ := dec.Layer(layers.LayerTypeTCP).(*layers.TCP)
	switch {
	case eth == nil || tcp == nil || tcp.DstPort != 80:
		t.Errorf("packet %d: no Ethernet/TCP to port 80 decoded: %v", i, dec)
	case !wp.p.VLANOutOfBand && dot1q != nil:
		t.Errorf("packet %d: an untagged frame came back tagged", i)
	case wp.p.VLANOutOfBand && (dot1q == nil || dot1q.VLANIdentifier != 200 || dot1q.Priority != 3 ||
		uint16(eth.EthernetType) != wp.p.TPID || dot1q.Type != layers.EthernetTypeIPv4):
		t.Errorf("packet %d: want VLAN 200 priority 3 under TPID %#x, decoded %v", i, wp.p.TPID, dec)
	}
}

func TestMaxPackets(t *testing.T) {
	path := filepath.Join(t.TempDir(), "max.pcapng")
	w, err := export.Create(path, testIfaces, export.Limits{MaxPackets: 3})
	if err != nil {
		t.Fatal(err)
	}
	p := packet(tcpFrame(10), obs.DirOut, 0, 0)
	for i := range 3 {
		if err := w.WritePacket(0, p, ""); err != nil {
			t.Fatalf("packet %d: %v", i, err)
		}
		if stop, want := w.StopReason(), map[bool]string{false: "", true: export.StopMaxPackets}[i == 2]; stop != want {
			t.Errorf("after packet %d: StopReason %q, want %q", i, stop, want)
		}
	}
	if err := w.WritePacket(0, p, ""); !errors.Is(err, export.ErrLimit) {
		t.Errorf("packet beyond MaxPackets: %v, want ErrLimit", err)
	}
	if err := w.Close(nil); err != nil {
		t.Fatal(err)
	}
	if n, err := readAll(path); n != 3 || err != nil {
		t.Errorf("file holds %d packets (%v), want 3", n, err)
	}
}

// TestMaxBytes: the file never exceeds MaxBytes and holds every packet that
// fits, for every bound between the header size and the unbounded size.
func TestMaxBytes(t *testing.T) {
	dir := t.TempDir()
	var pkts []written
	for i := range 40 {
		pkts = append(pkts, written{iface: i % 3, p: packet(tcpFrame(i*37%900), obs.DirOut, [3]uint16{0, tpid8021Q, tpid8021AD}[i%3], 200),
			comment: "flow " + string(rune('a'+i%26))})
	}
	stats := make([]export.InterfaceStats, len(testIfaces))
	// Unbounded: the size after each packet.
	w, err := export.Create(filepath.Join(dir, "unbounded.pcapng"), testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(nil)
	sizes := []int64{w.Bytes()}
	for _, wp := range pkts {
		if err := w.WritePacket(wp.iface, wp.p, wp.comment); err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, w.Bytes())
	}
	for _, max := range []int64{sizes[0], sizes[0] + 3, sizes[1], sizes[7] - 1, sizes[7], sizes[20] + 50, sizes[len(sizes)-1] + 10} {
		path := filepath.Join(dir, "bounded.pcapng")
		os.Remove(path)
		bw, err := export.Create(path, testIfaces, export.Limits{MaxBytes: max})
		if err != nil {
			t.Fatalf("MaxBytes %d: %v", max, err)
		}
		written := 0
		for _, wp := range pkts {
			err := bw.WritePacket(wp.iface, wp.p, wp.comment)
			if errors.Is(err, export.ErrLimit) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			written++
		}
		fits := 0
		for fits < len(pkts) && sizes[fits+1] <= max {
			fits++
		}
		wantStop := ""
		if fits < len(pkts) {
			wantStop = export.StopMaxBytes
		}
		if written != fits || bw.StopReason() != wantStop || bw.Bytes() != sizes[fits] {
			t.Errorf("MaxBytes %d: wrote %d packets, %d bytes, stop %q; want %d, %d, %q",
				max, written, bw.Bytes(), bw.StopReason(), fits, sizes[fits], wantStop)
		}
		if err := bw.Close(stats); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(path)
		if err != nil || fi.Size() > max || fi.Size() != bw.Bytes() {
			t.Errorf("MaxBytes %d: file size %v (%v), Bytes() %d", max, fi.Size(), err, bw.Bytes())
		}
		if n, err := readAll(path); n != fits || err != nil {
			t.Errorf("MaxBytes %d: file holds %d packets (%v), want %d", max, n, err, fits)
		}
	}
}

func TestMaxBytesBelowHeader(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.pcapng")
	if _, err := export.Create(path, testIfaces, export.Limits{MaxBytes: 64}); !errors.Is(err, export.ErrLimit) {
		t.Errorf("Create with MaxBytes below the header: %v, want ErrLimit", err)
	}
	for _, p := range []string{path, path + ".partial"} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind (%v)", p, err)
		}
	}
}

// TestHeaderSize: HeaderSize is what Create writes before any packet, so a
// bound refused by it is the one Create refuses: at it the header fits, a
// byte below it does not.
func TestHeaderSize(t *testing.T) {
	n, err := export.HeaderSize(true, testIfaces)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "h.pcapng")
	w, err := export.Create(path, testIfaces, export.Limits{MaxBytes: n})
	if err != nil {
		t.Fatalf("Create with MaxBytes HeaderSize %d: %v", n, err)
	}
	fi, err := os.Stat(path + ".partial")
	if err != nil || fi.Size() != n {
		t.Errorf("header written: %v (%v), HeaderSize %d", fi.Size(), err, n)
	}
	w.Close(nil)
	if _, err := export.Create(filepath.Join(t.TempDir(), "h.pcapng"), testIfaces, export.Limits{MaxBytes: n - 1}); !errors.Is(err, export.ErrLimit) {
		t.Errorf("Create with MaxBytes HeaderSize-1: %v, want ErrLimit", err)
	}
}

// TestPartialThenRename: PATH.partial (mode 0600 whatever the umask, readable
// within the flush interval) while writing, PATH after Close.
func TestPartialThenRename(t *testing.T) {
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })
	path := filepath.Join(t.TempDir(), "cap.pcapng")
	w, err := export.Create(path, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	syscall.Umask(old)
	partial := path + ".partial"
	if fi, err := os.Stat(partial); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s: %v %v, want mode 0600", partial, fi, err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s exists before Close (%v)", path, err)
	}
	if n, err := readAll(partial); n != 0 || err != nil {
		t.Errorf("fresh %s: %d packets, %v; want a readable empty capture", partial, n, err)
	}
	if err := w.WritePacket(1, packet(tcpFrame(100), obs.DirIn, 0, 0), "x"); err != nil {
		t.Fatal(err)
	}
	// The packet reaches the file without Close, within the flush interval.
	deadline := time.Now().Add(5 * time.Second)
	for n, _ := readAll(partial); n != 1; n, _ = readAll(partial) {
		if time.Now().After(deadline) {
			t.Fatalf("the packet never reached %s before Close", partial)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := w.Close(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(partial); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still exists after Close (%v)", partial, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("%s: %v %v, want mode 0600", path, fi, err)
	}
	if n, err := readAll(path); n != 1 || err != nil {
		t.Errorf("%s: %d packets, %v; want 1", path, n, err)
	}
	if err := w.WritePacket(0, packet(tcpFrame(1), obs.DirIn, 0, 0), ""); err == nil {
		t.Error("WritePacket after Close succeeded")
	}
}

func TestRefusesToOverwrite(t *testing.T) {
	dir := t.TempDir()
	for _, existing := range []string{"cap.pcapng", "cap.pcapng.partial"} {
		path := filepath.Join(dir, "cap.pcapng")
		if err := os.WriteFile(filepath.Join(dir, existing), []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := export.Create(path, testIfaces, export.Limits{}); err == nil {
			t.Errorf("Create over an existing %s succeeded", existing)
		}
		if b, _ := os.ReadFile(filepath.Join(dir, existing)); string(b) != "keep" {
			t.Errorf("%s was changed", existing)
		}
		os.Remove(filepath.Join(dir, existing))
	}
	// PATH appearing while the capture runs is not overwritten either.
	path := filepath.Join(dir, "race.pcapng")
	w, err := export.Create(path, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(nil); err == nil {
		t.Error("Close renamed over a file created meanwhile")
	}
	if b, _ := os.ReadFile(path); string(b) != "keep" {
		t.Error("the file created meanwhile was overwritten")
	}
	if n, err := readAll(path + ".partial"); err != nil || n != 0 {
		t.Errorf("the capture was not kept in .partial: %d packets, %v", n, err)
	}
}

// blockWrites records each Write of a stream (the flush timer writes from
// a goroutine of its own).
type blockWrites struct {
	mu     sync.Mutex
	writes [][]byte
}

func (b *blockWrites) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.writes = append(b.writes, bytes.Clone(p))
	return len(p), nil
}

func (b *blockWrites) all() [][]byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.writes)
}

// TestStream: a stream gets the header at once and each packet within the
// flush interval, in writes of whole blocks of at most PIPE_BUF bytes (atomic
// on a pipe: a reader never sees part of a block, whenever the writer dies)
// or of one larger block, and reads back like a file.
func TestStream(t *testing.T) {
	var out blockWrites
	w, err := export.NewStream(&out, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.all()) == 0 {
		t.Error("the header was not written at once")
	}
	pkts := roundTripPackets()
	for range 20 { // beyond PIPE_BUF: more than one batch
		pkts = append(pkts, pkts[0])
	}
	pkts = append(pkts, written{0, packet(tcpFrame(5000), obs.DirOut, 0, 0), "a frame above PIPE_BUF", pcapgo.NgEpbFlagDirectionOutbound})
	for _, wp := range pkts {
		if err := w.WritePacket(wp.iface, wp.p, wp.comment); err != nil {
			t.Fatal(err)
		}
	}
	// Before Close: the flush timer writes what is pending.
	deadline := time.Now().Add(2 * time.Second)
	for {
		rb, err := readFrom(bytes.NewReader(bytes.Join(out.all(), nil)))
		if err == nil && len(rb.packets) == len(pkts) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("2 s after the last WritePacket the stream holds %d of %d packets (%v)", len(rb.packets), len(pkts), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := w.Close([]export.InterfaceStats{{Received: 1}}); err != nil {
		t.Fatal(err)
	}
	writes := out.all()
	batched, alone := 0, 0
	for i, b := range writes {
		blocks := 0
		for rest := b; len(rest) > 0; blocks++ {
			if len(rest) < 12 || int(binary.LittleEndian.Uint32(rest[4:])) > len(rest) {
				t.Fatalf("write %d of %d bytes does not hold whole blocks", i, len(b))
			}
			rest = rest[binary.LittleEndian.Uint32(rest[4:]):]
		}
		if len(b) > 4096 && blocks > 1 {
			t.Errorf("write %d holds %d blocks in %d bytes, beyond PIPE_BUF", i, blocks, len(b))
		}
		if blocks > 1 {
			batched++
		}
		if len(b) > 4096 {
			alone++
		}
	}
	if batched < 2 || alone != 1 {
		t.Errorf("%d writes of several blocks (want 2 or more), %d of one block above PIPE_BUF (want 1)", batched, alone)
	}
	rb, err := readFrom(bytes.NewReader(bytes.Join(writes, nil)))
	if err != nil || len(rb.packets) != len(pkts) {
		t.Fatalf("stream read back %d packets, %v", len(rb.packets), err)
	}
	for i, wp := range pkts {
		checkPacket(t, i, rb.packets[i], wp)
	}
}

// TestDiskFullLeavesReadableFile: when the filesystem fills up mid-capture
// the error reaches the caller, and the file still ends after a whole block
// (the header is counted where a failed write is cut back).
func TestDiskFullLeavesReadableFile(t *testing.T) {
	path := filepath.Join(export.SmallFilesystem(t, "512k"), "full.pcapng")
	w, err := export.Create(path, testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	p := packet(tcpFrame(1400), obs.DirOut, 0, 0)
	var werr error
	for i := 0; i < 100000 && werr == nil; i++ {
		werr = w.WritePacket(i%len(testIfaces), p, "flow 1 request to VIP (before translation)")
	}
	cerr := w.Close(nil)
	if werr == nil && cerr == nil {
		t.Fatal("no error although the filesystem filled up")
	}
	for _, err := range []error{werr, cerr} {
		if err != nil && !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("error %v, want ENOSPC", err)
		}
	}
	file := path
	if _, err := os.Stat(file); err != nil {
		file = path + ".partial" // the rename may fail on a full filesystem
	}
	if cerr != nil && (!strings.Contains(cerr.Error(), file) || file == path && strings.Contains(cerr.Error(), ".partial")) {
		t.Errorf("Close: %v; want the file named as it is on disk, %s", cerr, file)
	}
	n, err := readAll(file)
	if err != nil || n == 0 {
		t.Errorf("%s after the disk filled: %d packets, %v; want whole blocks only", file, n, err)
	}
	// The counters say what the file holds, not what was handed to the
	// writer before the error surfaced.
	var perIface uint64
	for _, c := range w.PerInterface() {
		perIface += c
	}
	st, _ := os.Stat(file)
	if w.Packets() != uint64(n) || perIface != uint64(n) || st == nil || w.Bytes() != st.Size() {
		t.Errorf("after the disk filled: Packets %d, PerInterface %v, Bytes %d; the file holds %d packets in %v bytes",
			w.Packets(), w.PerInterface(), w.Bytes(), n, st.Size())
	}
}

// TestHeldWritesLikeWritePacket: a run of packets written through Hold makes
// the same stream as WritePacket one by one, bounds included.
func TestHeldWritesLikeWritePacket(t *testing.T) {
	pkts := roundTripPackets()
	lim := export.Limits{MaxPackets: uint64(len(pkts) - 1)}
	var one, held bytes.Buffer
	w1, err := export.NewStream(&one, testIfaces, lim)
	if err != nil {
		t.Fatal(err)
	}
	w2, err := export.NewStream(&held, testIfaces, lim)
	if err != nil {
		t.Fatal(err)
	}
	h := w2.Hold()
	for i, wp := range pkts {
		err1 := w1.WritePacket(wp.iface, wp.p, wp.comment)
		err2 := h.WritePacket(wp.iface, wp.p, wp.comment)
		if !errors.Is(err2, err1) {
			t.Errorf("packet %d: held write returned %v, WritePacket %v", i, err2, err1)
		}
	}
	h.Release()
	if w2.StopReason() != export.StopMaxPackets || w2.Packets() != lim.MaxPackets {
		t.Errorf("held writer: stop %q after %d packets, want %q after %d", w2.StopReason(), w2.Packets(), export.StopMaxPackets, lim.MaxPackets)
	}
	for _, w := range []*export.Writer{w1, w2} {
		if err := w.Close(nil); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(one.Bytes(), held.Bytes()) {
		t.Errorf("held writes made %d bytes, WritePacket %d: the streams differ", held.Len(), one.Len())
	}
}

// TestAddInterface: an interface added after packets were written (a Pod
// that started during the capture) gets the next index; its description is
// written with its first packet, so its packets are read back on it, with
// its name, by gopacket and by tshark where installed. Older packets written
// after it was added (held back for time order) keep the room they need
// under MaxBytes; one that had no packet is declared by Close for its
// statistics, room permitting.
func TestAddInterface(t *testing.T) {
	path := filepath.Join(t.TempDir(), "add.pcapng")
	w, err := export.Create(path, testIfaces[:2], export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	frame := tcpFrame(20)
	late := export.Interface{Name: "pod:eth0@10.244.9.3", Description: "pod: eth0 ifindex 2, netns /run/netns/late", Snaplen: 96}
	idle := export.Interface{Name: "pod:eth0@10.244.9.4", Description: "pod: eth0 ifindex 2, netns /run/netns/idle", Snaplen: 96}
	for i, step := range []func() error{
		func() error { return w.WritePacket(0, packet(frame, obs.DirOut, 0, 0), "flow 1") },
		func() error { return w.AddInterface(late) },
		func() error { return w.AddInterface(idle) },
		func() error { return w.WritePacket(1, packet(frame, obs.DirIn, 0, 0), "flow 1") },
		func() error { return w.WritePacket(2, packet(frame, obs.DirOut, 0, 0), "flow 2") },
	} {
		if err := step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
	if err := w.Close([]export.InterfaceStats{{Received: 1}, {Received: 1}, {Received: 1}, {Received: 0}}); err != nil {
		t.Fatal(err)
	}
	rb, err := read(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(rb.ifaces) != 4 || rb.ifaces[2].Name != late.Name || rb.ifaces[3].Name != idle.Name || len(rb.packets) != 3 || rb.packets[2].iface != 2 || rb.packets[2].comments[0] != "flow 2" {
		t.Fatalf("read %d interfaces (%+v) and %d packets (%+v); want the late one third, with its packet, and the idle one fourth", len(rb.ifaces), rb.ifaces, len(rb.packets), rb.packets)
	}
	// Section header, the two first descriptions, packet, packet, the late
	// description, its packet, statistics, the idle description before its
	// own.
	if got, want := blockTypes(t, path), []uint32{0x0A0D0D0A, 1, 1, 6, 6, 1, 6, 5, 5, 5, 1, 5}; !slices.Equal(got, want) {
		t.Errorf("blocks %x, want %x: a late description comes with its first packet", got, want)
	}
	if got := w.PerInterface(); !slices.Equal(got, []uint64{1, 1, 1, 0}) {
		t.Errorf("packets per interface %v, want 1, 1, 1, 0", got)
	}
	if tshark, err := exec.LookPath("tshark"); err == nil {
		rows, err := tsharkFields(tshark, path, "frame.interface_name")
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 3 || rows[2][0] != late.Name {
			t.Errorf("tshark reads interfaces %v, want the late one on the third packet", rows)
		}
	}

	// Room for the header and two packets: an interface added before them
	// leaves them their room, and the capture stops at max-bytes when its
	// own first packet comes.
	pkt := packet(frame, obs.DirOut, 0, 0)
	probe := filepath.Join(t.TempDir(), "probe.pcapng")
	head, err := export.Create(probe, testIfaces[:1], export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := head.WritePacket(0, pkt, "flow 1"); err != nil {
			t.Fatal(err)
		}
	}
	head.Close(nil)
	path = filepath.Join(t.TempDir(), "full.pcapng")
	w, err = export.Create(path, testIfaces[:1], export.Limits{MaxBytes: head.Bytes()})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.AddInterface(late); err != nil {
		t.Fatalf("AddInterface: %v", err)
	}
	for i := range 2 {
		if err := w.WritePacket(0, pkt, "flow 1"); err != nil {
			t.Fatalf("older packet %d after AddInterface: %v; want it written", i+1, err)
		}
	}
	if err := w.WritePacket(1, pkt, "flow 2"); !errors.Is(err, export.ErrLimit) || w.StopReason() != export.StopMaxBytes {
		t.Errorf("the late interface's packet beyond MaxBytes: %v, stop reason %q; want ErrLimit and max-bytes", err, w.StopReason())
	}
	if err := w.Close([]export.InterfaceStats{{Received: 2}, {Received: 1}}); err != nil {
		t.Fatal(err)
	}
	if rb, err := read(path); err != nil || len(rb.packets) != 2 || len(rb.ifaces) != 1 {
		t.Errorf("file at its bound: %d packets on %d interfaces, %v; want 2 on 1", len(rb.packets), len(rb.ifaces), err)
	}
	if st, err := os.Stat(path); err != nil || st.Size() > head.Bytes() {
		t.Errorf("file at its bound: %v bytes, %v; want at most %d", st.Size(), err, head.Bytes())
	}
}

// blockTypes lists the types of a pcapng file's blocks, in file order.
func blockTypes(t *testing.T, path string) []uint32 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var types []uint32
	for len(b) >= 12 {
		n := binary.LittleEndian.Uint32(b[4:])
		if n < 12 || int(n) > len(b) {
			t.Fatalf("block of length %d with %d bytes left", n, len(b))
		}
		types = append(types, binary.LittleEndian.Uint32(b))
		b = b[n:]
	}
	return types
}

// TestFlushTimerWaitsForYoungerBlocks: the flush timer writes the pending
// blocks once the oldest is flushInterval old; when those it was armed for
// went out meanwhile (a write of full pages), the younger ones wait for
// their own time instead of cutting the file's writes off their
// boundaries.
func TestFlushTimerWaitsForYoungerBlocks(t *testing.T) {
	w, err := export.Create(filepath.Join(t.TempDir(), "timer.pcapng"), testIfaces, export.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(nil)
	if err := w.WritePacket(0, packet(tcpFrame(64), obs.DirOut, 0, 0), "young"); err != nil {
		t.Fatal(err)
	}
	before := export.HandedOff(w)
	export.SetPendingSince(w, time.Now().Add(time.Hour)) // pending for less than the interval
	export.FlushPending(w)
	if got := export.HandedOff(w); got != before {
		t.Fatalf("the timer wrote blocks pending for less than the interval: %d bytes out, had %d", got, before)
	}
	export.SetPendingSince(w, time.Now().Add(-time.Hour))
	export.FlushPending(w)
	if got := export.HandedOff(w); got <= before {
		t.Fatalf("the timer did not write blocks pending for longer than the interval (%d bytes out)", got)
	}
}
