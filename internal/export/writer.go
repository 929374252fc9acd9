// Package export writes what pathtrace captured as a pcapng file Wireshark
// opens as is: one interface per capture point, VLAN tags back in the frames,
// a direction flag and a comment on every packet, bounded in packets and
// bytes, and readable at any moment, even after the writer was killed.
package export

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/capture"
)

// ErrLimit is returned by WritePacket once a bound of Limits is reached; the
// packet was not written, nor will any later one be.
var ErrLimit = errors.New("capture file limit reached")

// Stop reasons (Writer.StopReason).
const (
	StopMaxPackets = "max-packets"
	StopMaxBytes   = "max-bytes"
)

// Addressable copies, for Writer.stop.
var stopMaxPackets, stopMaxBytes = StopMaxPackets, StopMaxBytes

// flushInterval bounds how long a written packet may sit in memory before it
// reaches a capture file.
const flushInterval = 100 * time.Millisecond

// Interface is one capture point, one pcapng interface (link type Ethernet).
type Interface struct {
	Name        string // e.g. "pod:eth0", "host:veth-a", "uplink:bond0"
	Description string // e.g. "netns /run/netns/x, ifindex 2"
	Snaplen     int    // bytes kept per frame, 0 = unlimited (see commonSnaplen)
}

// Limits bound a capture file; 0 means unbounded.
type Limits struct {
	MaxPackets uint64
	// MaxBytes bounds the whole file: section header, interface descriptions,
	// packets and the statistics written by Close.
	MaxBytes int64
}

// InterfaceStats are one interface's counters, written by Close.
type InterfaceStats struct {
	Received uint64 // isb_ifrecv: packets the capture point took, drops included (libpcap's ps_recv)
	Dropped  uint64 // isb_ifdrop: packets the kernel dropped (ring full)
}

// Summary says what a pcapng file holds, for reports.
type Summary struct {
	Path    string `json:"path"`
	Packets uint64 `json:"packets"`
	Bytes   int64  `json:"bytes"`
	// PerInterface is packets written per interface (capture point).
	PerInterface map[string]uint64 `json:"per_interface"`
	StopReason   string            `json:"stop_reason,omitempty"`
	// EndedAt is when a bound ended the file: the capture time of the frame
	// that reached it (zero while none did). FramesNotWritten counts the
	// frames captured that the file had no room for from then on: those of
	// the rest of the run when the run went on (an incident's), else the
	// few in flight when it stopped. Both are the caller's account.
	EndedAt          time.Time `json:"ended_at,omitzero"`
	FramesNotWritten uint64    `json:"frames_not_written,omitzero"`
	// Error is the write error that ended the file early (disk full, ...).
	Error string `json:"error,omitempty"`
}

// Writer writes one pcapng capture. It is safe for concurrent use.
type Writer struct {
	mu     sync.Mutex
	block  []byte // the block being written
	out    blockOut
	file   *partialFile // nil for a stream
	async  *asyncFile   // the file's writer; nil for a stream
	stream stallable    // the stream's writer when it can stall; nil for a file
	flush  *time.Timer  // writes pending blocks of a file
	armed  bool         // flush is running: pending blocks will be written
	ifaces []Interface
	// declared is how many of ifaces have their description in the output:
	// one added while the capture runs is declared with its first packet
	// (declareUpTo), or by Close.
	declared int
	snaplen  int // what every description declares (commonSnaplen)
	lim      Limits
	start    time.Time

	packets  uint64
	perIface []uint64 // packets per interface
	bytes    int64    // blocks accepted: written or pending
	// stop is the stop reason (a bound was reached), "" while none: written
	// under mu, read without it by StopReason after every packet.
	stop   atomic.Pointer[string]
	err    error // the first failed write: the capture cannot go on
	closed bool
}

// Create starts a capture file at path, or streams to stdout when path is
// "-" (for `--pcap - | wireshark -k -i -`: see NewStream).
// A file is written as PATH.partial, mode 0600, renamed to PATH by Close;
// Create refuses to overwrite PATH or a PATH.partial left behind. Packets
// go to the file's writer goroutine within 100 ms of WritePacket (a slow
// disk delays the file, not the caller, up to asyncDepth chunks), in whole
// blocks only, so that the file is readable at any moment, also after a
// SIGKILL; the one exception is a frame above ~4 KB, which SIGKILL can cut
// during its write (blockOut).
func Create(path string, ifaces []Interface, lim Limits) (*Writer, error) {
	if path == "-" {
		return NewStream(os.Stdout, ifaces, lim)
	}
	pf, err := createPartial(path, true)
	if err != nil {
		return nil, err
	}
	w, err := newWriter(pf.File, true, ifaces, lim)
	if err == nil {
		err = pf.publish()
	}
	if err != nil {
		pf.discard()
		return nil, err
	}
	// The header is in the file (written directly); packets go through the
	// file's own writer goroutine.
	w.file, w.async = pf, newAsyncFile(pf.File, lim.MaxBytes)
	w.out.w = w.async
	w.armFlush()
	return w, nil
}

// NewStream writes a capture to s: the header at once, then packets within
// flushInterval of WritePacket, in Writes of whole blocks of at most
// PIPE_BUF bytes (atomic on a pipe), or of one larger block. Close does not
// close s.
func NewStream(s io.Writer, ifaces []Interface, lim Limits) (*Writer, error) {
	if cannotStall(s) {
		w, err := newWriter(s, false, ifaces, lim)
		if err == nil {
			w.armFlush()
		}
		return w, err
	}
	st := newStallable(s)
	w, err := newWriter(st, false, ifaces, lim)
	if err != nil {
		st.close()
		return nil, err
	}
	w.stream = st
	w.armFlush()
	return w, nil
}

// Abandon gives up a stream whose reader stopped reading: a write blocked in
// it, and every later one, fail with ErrStalled, so that Close returns. A
// caller that must end on time (a trace asked to stop) calls it once the
// reader had its chance to take the rest. It has no effect on a file, nor
// once the stream is closed; it may be called from any goroutine, also while
// a write holds the Writer.
func (w *Writer) Abandon() {
	if w.stream != nil {
		w.stream.giveUp()
	}
}

// armFlush makes the timer that writes pending blocks out flushInterval
// after the first of them (commitBlock starts it).
func (w *Writer) armFlush() {
	w.flush = time.AfterFunc(flushInterval, w.flushPending)
	w.flush.Stop()
}

// newWriter writes the section header and the interface descriptions.
func newWriter(dst io.Writer, file bool, ifaces []Interface, lim Limits) (*Writer, error) {
	if len(ifaces) == 0 {
		return nil, errors.New("pcapng: no interface to capture on")
	}
	w := &Writer{
		out:      blockOut{w: dst, file: file, pageSize: int64(os.Getpagesize())},
		ifaces:   append([]Interface(nil), ifaces...),
		declared: len(ifaces),
		snaplen:  commonSnaplen(ifaces),
		perIface: make([]uint64, len(ifaces)),
		lim:      lim,
		start:    time.Now(),
	}
	headers := [][]byte{appendSHB(nil, runtime.GOARCH, kernelName(), "pathtrace")}
	for _, ifc := range ifaces {
		headers = append(headers, appendIDB(nil, ifc.Name, ifc.Description, w.snaplen))
	}
	for _, h := range headers {
		if err := w.commitBlock(h, nil); errors.Is(err, ErrLimit) {
			return nil, fmt.Errorf("%w: the header alone exceeds the maximum of %d bytes", ErrLimit, lim.MaxBytes)
		} else if err != nil {
			return nil, err
		}
	}
	if err := w.out.flush(); err != nil {
		return nil, fmt.Errorf("write pcapng header: %w", err)
	}
	return w, nil
}

// HeaderSize is what the header of a capture of ifaces takes (the section
// header and the interface descriptions), in a file (file) or a stream: a
// MaxBytes below it cannot hold the header, which Create refuses. Known
// before anything is captured: a caller refuses such a bound first.
func HeaderSize(file bool, ifaces []Interface) (int64, error) {
	w, err := newWriter(io.Discard, file, ifaces, Limits{})
	if err != nil {
		return 0, err
	}
	return w.bytes, nil
}

// AddInterface adds one more interface (a capture point opened while the
// capture runs: a Pod that started), whose index is the number of
// interfaces before it. Its description is written with its first packet
// (pcapng allows one anywhere before the first packet that names it), not
// now: a caller that holds older packets back to order the file by time
// writes them first, and the description never takes the room they need
// under MaxBytes. Close declares an interface that had no packet, room
// permitting. Its snaplen is cut to what the file's interfaces declare (see
// commonSnaplen).
func (w *Writer) AddInterface(ifc Interface) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.closed:
		return errors.New("pcapng: AddInterface after Close")
	case w.err != nil:
		return w.err
	case w.stop.Load() != nil:
		return ErrLimit
	}
	if ifc.Snaplen <= 0 || w.snaplen > 0 && ifc.Snaplen > w.snaplen {
		ifc.Snaplen = w.snaplen
	}
	w.ifaces = append(w.ifaces, ifc)
	w.perIface = append(w.perIface, 0)
	return nil
}

// declareUpTo writes the descriptions of the interfaces up to iface not
// declared yet, in index order (a description's place in the file is its
// index). stop is recorded when one does not fit under MaxBytes.
func (w *Writer) declareUpTo(iface int, stop *string) error {
	for w.declared <= iface {
		ifc := w.ifaces[w.declared]
		w.block = appendIDB(w.block[:0], ifc.Name, ifc.Description, w.snaplen)
		if err := w.commitBlock(w.block, stop); err != nil {
			return err
		}
		w.declared++
	}
	return nil
}

// commonSnaplen is the snaplen every interface declares: the largest (0 =
// unlimited), because libpcap, hence tcpdump, refuses a file whose
// interfaces differ in snaplen. Frames are still cut to their own
// interface's snaplen.
func commonSnaplen(ifaces []Interface) int {
	snaplen := 0
	for i, ifc := range ifaces {
		if ifc.Snaplen <= 0 {
			return 0
		}
		if i == 0 || ifc.Snaplen > snaplen {
			snaplen = ifc.Snaplen
		}
	}
	return snaplen
}

// kernelName is the section's OS, e.g. "Linux 6.18.0".
func kernelName() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return runtime.GOOS
	}
	return unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:])
}

// WritePacket writes p as seen on interface iface (an index into the
// interfaces given to Create), with comment (none when empty). A VLAN tag the
// kernel delivered out of band is written back into the frame (with its
// TPID) and the lengths include it; the frame is then cut to the interface's
// snaplen, as libpcap does. It returns ErrLimit when a bound of Limits stops
// the capture (StopReason tells which); after the packet that reaches
// MaxPackets, StopReason is already set, so the caller can stop at once.
func (w *Writer) WritePacket(iface int, p *capture.Packet, comment string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.writePacket(iface, p, comment)
}

// Held is a Writer held for a run of packets (Writer.Hold).
type Held struct{ w *Writer }

// Hold holds the writer for the caller alone until Release: a caller that
// writes packets in runs takes the lock once per run instead of once per
// packet (its two atomic operations were about 5% of the CPU per packet).
// Meanwhile the writer's own timer waits to flush; hold it for a run, not
// for as long as the capture lasts.
func (w *Writer) Hold() Held {
	w.mu.Lock()
	return Held{w}
}

// WritePacket is Writer.WritePacket for the holder.
func (h Held) WritePacket(iface int, p *capture.Packet, comment string) error {
	return h.w.writePacket(iface, p, comment)
}

// Release lets the writer go.
func (h Held) Release() { h.w.mu.Unlock() }

// writePacket is WritePacket with w.mu held.
func (w *Writer) writePacket(iface int, p *capture.Packet, comment string) error {
	switch {
	case w.closed:
		return errors.New("pcapng: write after Close")
	case w.err != nil:
		return w.err
	case w.stop.Load() != nil:
		return ErrLimit
	case iface < 0 || iface >= len(w.ifaces):
		return fmt.Errorf("pcapng: no interface %d (have %d)", iface, len(w.ifaces))
	}
	if iface >= w.declared {
		if err := w.declareUpTo(iface, &stopMaxBytes); err != nil {
			return err
		}
	}
	// Encoded in place, straight into the pending output: a packet block is
	// most of what the capture writes, and a copy of it cost more than a
	// tenth of writing it.
	snaplen := w.ifaces[iface].Snaplen
	n := int64(epbLen(p, snaplen, comment))
	total, err := w.admit(n, &stopMaxBytes)
	if err != nil {
		return err
	}
	dst, inPlace, err := w.out.room(n)
	pending := false // blocks wait in memory
	switch {
	case err != nil:
	case !inPlace:
		w.block = appendEPB(w.block[:0], iface, p, snaplen, comment)
		err = w.out.write(w.block)
	default:
		pending, err = w.out.appended(appendEPB(dst, iface, p, snaplen, comment))
	}
	if err := w.committed(total, pending, err); err != nil {
		return err
	}
	w.packets++
	w.perIface[iface]++
	if w.lim.MaxPackets > 0 && w.packets >= w.lim.MaxPackets {
		w.stop.Store(&stopMaxPackets)
	}
	return nil
}

// commitBlock outputs one encoded block when it fits under MaxBytes;
// otherwise it drops it, records stop (when not nil) and returns ErrLimit.
func (w *Writer) commitBlock(block []byte, stop *string) error {
	total, err := w.admit(int64(len(block)), stop)
	if err != nil {
		return err
	}
	pending, err := w.out.put(block)
	return w.committed(total, pending, err)
}

// admit returns what a block of n bytes adds to the output, the filler
// before it included, when that fits under MaxBytes; otherwise it records
// stop (when not nil) and returns ErrLimit.
func (w *Writer) admit(n int64, stop *string) (int64, error) {
	total := n + w.out.fillerBefore(n)
	if w.lim.MaxBytes > 0 && w.bytes+total > w.lim.MaxBytes {
		if stop != nil {
			w.stop.Store(stop)
		}
		return 0, ErrLimit
	}
	return total, nil
}

// committed accounts for a block output, total bytes with its filler (err
// says how the output went; pending, whether blocks wait in memory).
func (w *Writer) committed(total int64, pending bool, err error) error {
	if err != nil {
		w.err = fmt.Errorf("write pcapng: %w", err)
		return w.err
	}
	w.bytes += total
	if pending && w.flush != nil && !w.armed {
		// Armed once for the oldest pending block, not re-armed for every
		// block (that cost more than encoding it).
		w.armed = true
		w.flush.Reset(flushInterval)
	}
	return nil
}

// flushPending runs flushInterval after a block was left pending. Blocks
// pending since a younger time (those then were written since, as a file
// write filled its pages) wait for their own due time: a write of the
// pages filled so far cut the file's writes off their flushBytes
// boundaries (see blockOut.flushFullPages), ten times a second at any
// packet rate.
func (w *Writer) flushPending() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.armed = false
	if since := w.out.pendingSince; !since.IsZero() && !w.closed {
		if wait := flushInterval - time.Since(since); wait > 0 {
			w.armed = true
			w.flush.Reset(wait)
			return
		}
	}
	if err := w.out.flush(); err != nil && w.err == nil {
		w.err = fmt.Errorf("write pcapng: %w", err)
	}
}

// Packets is the number of packets written.
func (w *Writer) Packets() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.packets
}

// PerInterface is the number of packets written per interface, in
// interface order.
func (w *Writer) PerInterface() []uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.perIface)
}

// recount sets the counters from the blocks in the file, after a failed
// write cut it short.
func (w *Writer) recount() error {
	f, err := os.Open(w.file.partial)
	if err != nil {
		return fmt.Errorf("pcapng: recounting after the write error: %w", err)
	}
	defer f.Close()
	perIface, size, err := countPackets(bufio.NewReaderSize(f, 1<<20), len(w.ifaces))
	if err != nil {
		return fmt.Errorf("pcapng: recounting after the write error: %w", err)
	}
	w.perIface, w.bytes, w.packets = perIface, size, 0
	for _, n := range perIface {
		w.packets += n
	}
	return nil
}

// Bytes is the size of the file so far (including what is about to be
// flushed).
func (w *Writer) Bytes() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.bytes
}

// StopReason is StopMaxPackets or StopMaxBytes once a bound stopped the
// capture, "" otherwise.
func (w *Writer) StopReason() string {
	if s := w.stop.Load(); s != nil {
		return *s
	}
	return ""
}

// Close writes the statistics of each interface (stats[i] for interface i,
// as far as stats goes) while they fit under MaxBytes, writes out what is
// pending and, for a file, syncs it and renames PATH.partial to PATH. A
// stream is not closed.
func (w *Writer) Close(stats []InterfaceStats) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return errors.New("pcapng: Close called twice")
	}
	w.closed = true
	if w.flush != nil {
		w.flush.Stop()
	}
	err := w.err
	if err == nil {
		err = w.writeStats(stats)
	}
	if ferr := w.out.flush(); ferr != nil && err == nil {
		err = fmt.Errorf("write pcapng: %w", ferr)
	}
	if w.async != nil {
		if aerr := w.async.Close(); aerr != nil {
			if err == nil {
				err = fmt.Errorf("write pcapng: %w", aerr)
			}
			// Blocks accepted after the failed write never reached the
			// file: count what it holds.
			err = errors.Join(err, w.recount())
		}
	}
	if w.file != nil {
		// Only whole blocks are in the file, even after a failed write.
		if ferr := w.file.finish(); ferr != nil {
			err = errors.Join(err, ferr)
		} else if err != nil {
			err = renamedError{err, w.file.partial, w.file.path}
		}
	}
	if w.stream != nil {
		w.stream.close()
	}
	return err
}

func (w *Writer) writeStats(stats []InterfaceStats) error {
	now := time.Now()
	for i, s := range stats[:min(len(stats), len(w.ifaces))] {
		// An interface that had no packet is declared for its statistics.
		if err := w.declareUpTo(i, nil); errors.Is(err, ErrLimit) {
			return nil
		} else if err != nil {
			return err
		}
		w.block = appendISB(w.block[:0], i, w.start, now, s.Received, s.Dropped)
		if err := w.commitBlock(w.block, nil); errors.Is(err, ErrLimit) {
			return nil // no room left: the statistics are optional
		} else if err != nil {
			return err
		}
	}
	return nil
}
