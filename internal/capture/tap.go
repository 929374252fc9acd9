package capture

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Defaults and bounds of a tap.
const (
	DefaultSnaplen   = 96      // as `tcpdump -s 96`
	DefaultRingBytes = 4 << 20 // 4 MiB per tap
	MinRingBytes     = 16 << 10
	MaxRingBytes     = 256 << 20
	// Blocks: four in the default ring, each retired when full or after
	// retireTimeoutMs, so a tap wakes its reader at most ten times a second
	// below 10 MB/s of frames, and a few dozen at the lab's highest rates.
	// Each wake costs more than a hundred frames do (the Go scheduler, and
	// caches gone cold while the process slept): against 256 KiB blocks,
	// which woke it twice as often at 20k datagrams a second, pathtrace took
	// 16-19% less CPU at 10k and 20k in alternating lab runs (13 of 14 pairs).
	maxBlockBytes   = 1 << 20
	frameBytes      = 2048 // only checked by the kernel for V3; packets are packed
	retireTimeoutMs = 100  // a partly filled block is handed over after this long

	// DrainTimeout bounds how long Run goes on after its context ends: the
	// kernel hands over the block it was filling within the retire timeout.
	DrainTimeout = retireTimeoutMs*time.Millisecond + 50*time.Millisecond
)

// ErrClosed is returned by Run and SetFilter on a closed tap.
var ErrClosed = errors.New("capture: tap closed")

// Config says where a tap captures and how much it may keep.
type Config struct {
	NetNS  string // netns file (/run/netns/NAME, /proc/PID/ns/net); "" = the caller's netns
	Ifname string
	Role   string // free label used in errors: "pod", "host", "uplink"

	// Snaplen is the number of bytes kept per frame (default DefaultSnaplen):
	// the filter's return value. A custom Filter or Program brings its own,
	// e.g. FilterFor(addrs, Snaplen); Snaplen then only sizes the ring check.
	Snaplen int
	// RingBytes is the ring memory (default DefaultRingBytes, between
	// MinRingBytes and MaxRingBytes). It is cut into blocks of at most
	// 1 MiB (at least 4), each handed to Run when full or after 100 ms.
	RingBytes int
	// Filter is the classic BPF socket filter. nil (and no Program) means
	// FilterFor(nil, Snaplen): accept nothing until SetFilter names the
	// addresses. A tap never copies unfiltered traffic to user space.
	Filter []bpf.RawInstruction
	// Program, when set, is an eBPF socket filter (BPF_PROG_TYPE_SOCKET_FILTER)
	// attached with SO_ATTACH_BPF instead of a classic Filter; its return
	// value is the number of bytes kept. The socket takes its own reference:
	// the caller may close Program after Open. Filter and Program exclude
	// each other.
	Program *ebpf.Program
	// Behind, when set, is called from Run after each block it reads while
	// the blocks the kernel handed over and Run has not read yet are a
	// quarter of the ring or more: the reader is behind, and the ring
	// overflows if that goes on. A caller may give the reader more CPU
	// then, and take it back once the calls have stopped for a while.
	Behind func()
}

// Stats are a tap's counters since Open. Nothing a tap loses goes uncounted:
// KernelPackets = Packets + KernelDrops + packets still in the ring, and
// DecodeErrors counts ring entries Run had to skip.
type Stats struct {
	Packets       uint64 // delivered to Run's callback
	KernelPackets uint64 // accepted by the filter (PACKET_STATISTICS tp_packets, drops included)
	KernelDrops   uint64 // accepted but lost: the ring was full (tp_drops)
	QueueFreezes  uint64 // times the ring was full (tp_freeze_q_cnt)
	DecodeErrors  uint64 // ring entries whose header pointed outside their block
	// LinkDowns counts the times the interface went down while Run ran,
	// LinkDown how long it was down in all (an ongoing one up to now, or to
	// Close), FirstDown when it first went down: nothing crosses a down
	// interface, so nothing was captured there meanwhile, and nothing was
	// lost.
	LinkDowns uint64
	LinkDown  time.Duration
	FirstDown time.Time
}

// Tap is an AF_PACKET TPACKET_V3 capture on one interface, both directions.
type Tap struct {
	cfg     Config
	fd      int
	ifindex int
	// poller is a duplicate of fd in Go's network poller: Run waits for
	// retired blocks there, parking its goroutine instead of an OS thread
	// in poll(2) (fewer wake-ups and context switches at high rates).
	poller    *os.File
	ring      []byte
	blockSize int
	blockNr   int

	closing   chan struct{} // closed by Close: Run returns
	closeOnce sync.Once
	closeErr  error
	runMu     sync.Mutex // held by Run while it reads the ring; Close waits for it

	mu     sync.Mutex // fd and the kernel counters below
	closed bool
	kernel Stats // KernelPackets, KernelDrops, QueueFreezes

	packets      atomic.Uint64
	decodeErrors atomic.Uint64
	link         linkState
}

// Open creates the capture socket inside cfg.NetNS and binds it to cfg.Ifname.
// The socket is created with protocol 0, so it receives nothing until bind:
// the filter and the ring are in place before the first frame arrives, and
// there is nothing unfiltered to drain and no counter baseline to take.
func Open(cfg Config) (*Tap, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	blockSize, blockNr := ringGeometry(cfg.RingBytes)
	if cfg.Snaplen > blockSize-blockDescLen-128 {
		return nil, fmt.Errorf("capture %s: snaplen %d does not fit a %d-byte ring block", cfg.name(), cfg.Snaplen, blockSize)
	}
	t := &Tap{cfg: cfg, fd: -1, blockSize: blockSize, blockNr: blockNr, closing: make(chan struct{})}
	err := nsutil.Do(cfg.NetNS, t.open)
	if err == nil {
		err = t.openPoller()
	}
	if err != nil {
		t.release()
		return nil, fmt.Errorf("capture %s: %w", cfg.name(), err)
	}
	return t, nil
}

func (c *Config) setDefaults() error {
	if c.Ifname == "" {
		return errors.New("capture: no interface name")
	}
	if c.Snaplen == 0 {
		c.Snaplen = DefaultSnaplen
	}
	if c.RingBytes == 0 {
		c.RingBytes = DefaultRingBytes
	}
	if c.Snaplen < 0 || c.Snaplen > 65535 {
		return fmt.Errorf("capture %s: snaplen %d, want 1..65535", c.name(), c.Snaplen)
	}
	if c.RingBytes < MinRingBytes || c.RingBytes > MaxRingBytes {
		return fmt.Errorf("capture %s: ring of %d bytes, want %d..%d", c.name(), c.RingBytes, MinRingBytes, MaxRingBytes)
	}
	if c.Program != nil {
		if c.Filter != nil {
			return fmt.Errorf("capture %s: both a classic Filter and an eBPF Program given", c.name())
		}
		return nil
	}
	if c.Filter == nil {
		f, err := FilterFor(nil, c.Snaplen)
		if err != nil {
			return err
		}
		c.Filter = f
	}
	return nil
}

func (c *Config) name() string {
	if c.Role == "" {
		return c.Ifname
	}
	return c.Role + "/" + c.Ifname
}

// ringGeometry cuts ringBytes into at least four page-aligned blocks of at
// most maxBlockBytes; the ring never exceeds ringBytes.
func ringGeometry(ringBytes int) (blockSize, blockNr int) {
	page := os.Getpagesize()
	blockSize = min(maxBlockBytes, ringBytes/4) / page * page
	return blockSize, ringBytes / blockSize
}

// MinRingFor is the smallest ring whose blocks hold a frame of snaplen
// bytes (Open refuses a smaller one).
func MinRingFor(snaplen int) int {
	page := os.Getpagesize()
	block := (snaplen + blockDescLen + 128 + page - 1) / page * page
	return max(MinRingBytes, 4*block)
}

// open runs inside the target netns.
func (t *Tap) open() error {
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	t.fd = fd
	ifr, err := unix.NewIfreq(t.cfg.Ifname)
	if err != nil {
		return fmt.Errorf("interface name: %w", err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFINDEX, ifr); err != nil {
		return fmt.Errorf("interface %q: %w", t.cfg.Ifname, err)
	}
	t.ifindex = int(ifr.Uint32())
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_VERSION, unix.TPACKET_V3); err != nil {
		return fmt.Errorf("PACKET_VERSION TPACKET_V3: %w", err)
	}
	if t.cfg.Program != nil {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ATTACH_BPF, t.cfg.Program.FD()); err != nil {
			return fmt.Errorf("SO_ATTACH_BPF (program fd %d): %w", t.cfg.Program.FD(), err)
		}
	} else if err := attachFilter(fd, t.cfg.Filter); err != nil {
		return err
	}
	req := unix.TpacketReq3{
		Block_size:     uint32(t.blockSize),
		Block_nr:       uint32(t.blockNr),
		Frame_size:     frameBytes,
		Frame_nr:       uint32(t.blockSize / frameBytes * t.blockNr),
		Retire_blk_tov: retireTimeoutMs,
	}
	if err := unix.SetsockoptTpacketReq3(fd, unix.SOL_PACKET, unix.PACKET_RX_RING, &req); err != nil {
		return fmt.Errorf("PACKET_RX_RING (%d blocks of %d bytes): %w", t.blockNr, t.blockSize, err)
	}
	ring, err := unix.Mmap(fd, 0, t.blockSize*t.blockNr, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap ring: %w", err)
	}
	t.ring = ring
	sll := unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: t.ifindex}
	if err := unix.Bind(fd, &sll); err != nil {
		return fmt.Errorf("bind to ifindex %d: %w", t.ifindex, err)
	}
	return nil
}

// openPoller registers a duplicate of the socket with Go's poller.
// O_NONBLOCK is shared by both descriptors, which only matters to the
// poller: the ring is read from memory.
func (t *Tap) openPoller() error {
	dup, err := unix.Dup(t.fd)
	if err != nil {
		return fmt.Errorf("dup: %w", err)
	}
	unix.CloseOnExec(dup)
	if err := unix.SetNonblock(dup, true); err != nil {
		unix.Close(dup)
		return fmt.Errorf("non-blocking socket: %w", err)
	}
	t.poller = os.NewFile(uintptr(dup), t.cfg.name())
	return nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func attachFilter(fd int, prog []bpf.RawInstruction) error {
	if len(prog) == 0 {
		return errors.New("empty socket filter")
	}
	fprog := unix.SockFprog{
		Len:    uint16(len(prog)),
		Filter: (*unix.SockFilter)(unsafe.Pointer(&prog[0])), // same layout as struct sock_filter
	}
	if err := unix.SetsockoptSockFprog(fd, unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &fprog); err != nil {
		return fmt.Errorf("SO_ATTACH_FILTER (%d instructions): %w", len(prog), err)
	}
	return nil
}

// release frees what open acquired; used on failure and by Close.
func (t *Tap) release() error {
	var errs []error
	if t.poller != nil {
		errs = append(errs, t.poller.Close())
		t.poller = nil
	}
	if t.ring != nil {
		errs = append(errs, unix.Munmap(t.ring))
		t.ring = nil
	}
	if t.fd >= 0 {
		errs = append(errs, unix.Close(t.fd))
		t.fd = -1
	}
	return errors.Join(errs...)
}

// Ifindex is the index of the captured interface in its netns.
func (t *Tap) Ifindex() int { return t.ifindex }

// SetFilter replaces the socket filter atomically (SO_ATTACH_FILTER swaps the
// program in place): no frame is seen by neither or by both. On a tap opened
// with an eBPF Program it replaces that program.
func (t *Tap) SetFilter(prog []bpf.RawInstruction) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return ErrClosed
	}
	if err := attachFilter(t.fd, prog); err != nil {
		return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
	}
	return nil
}

// Run hands each captured frame to fn until ctx is done or the tap is closed,
// then returns nil. When ctx ends, Run first delivers the frames the kernel
// accepted before: it waits for the block the kernel was filling (at most
// DrainTimeout); Close ends it at once. Run returns an error only when
// capturing failed (for example the interface went down or away: ENETDOWN).
// fn runs on Run's goroutine; the *Packet and its Data point into the ring
// and are valid only during the call: copy (Packet.Clone) what must outlive
// it. A slow fn makes the ring fill up; what the kernel then drops is counted
// in Stats. Only one Run may be active at a time.
func (t *Tap) Run(ctx context.Context, fn func(*Packet)) error {
	return t.RunBlocks(ctx, fn, nil)
}

// RunBlocks is Run that also calls blockDone after the packets of each ring
// block (a batch: up to a block of frames, or what arrived within the
// block's retire timeout), so a caller can hand its work on in batches.
func (t *Tap) RunBlocks(ctx context.Context, fn func(*Packet), blockDone func()) error {
	if fn == nil {
		return errors.New("capture: Run needs a callback")
	}
	if t.isClosed() {
		return ErrClosed
	}
	if !t.runMu.TryLock() {
		return fmt.Errorf("capture %s: Run is already running", t.cfg.name())
	}
	defer t.runMu.Unlock()
	conn, err := t.poller.SyscallConn()
	if err != nil {
		return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
	}
	// Cancellation wakes the wait; Close does the same. A deadline an
	// earlier Run left behind is cleared.
	if err := t.poller.SetReadDeadline(time.Time{}); err != nil {
		return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
	}
	woken := make(chan struct{})
	stopWaker := context.AfterFunc(ctx, func() {
		defer close(woken)
		t.poller.SetReadDeadline(time.Now())
	})
	defer func() {
		if !stopWaker() {
			<-woken // it ran: let it finish before a next Run clears the deadline
		}
	}()
	var p Packet
	var drainUntil time.Time // set when ctx ends
	for next := 0; ; {
		select {
		case <-t.closing:
			return nil
		default:
		}
		if drainUntil.IsZero() && ctx.Err() != nil {
			// The packets accepted before the end are delivered: the kernel
			// hands over the block it was filling within the retire timeout.
			<-woken // the waker's deadline is set: replace it
			drainUntil = time.Now().Add(DrainTimeout)
			if err := t.poller.SetReadDeadline(drainUntil); err != nil {
				return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
			}
		}
		block := t.ring[next*t.blockSize : (next+1)*t.blockSize]
		status := (*uint32)(unsafe.Pointer(&block[blockStatusOff]))
		retired := func() bool { return atomic.LoadUint32(status)&unix.TP_STATUS_USER != 0 }
		if !retired() {
			if !drainUntil.IsZero() && (!time.Now().Before(drainUntil) || blockEmpty(block)) {
				return nil
			}
			if t.link.isDown() {
				if err := t.waitLinkBack(ctx, retired, drainUntil); err != nil {
					return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
				}
				continue
			}
			if err := t.wait(conn, retired); err != nil {
				if errors.Is(err, unix.ENETDOWN) && t.StillBound() {
					// The interface went down, not away: the kernel hooks the
					// socket again when it comes back up (a bond or a NIC
					// that flaps); until then nothing crosses it.
					t.link.down(time.Now())
					continue
				}
				return fmt.Errorf("capture %s: %w", t.cfg.name(), err)
			}
			continue
		}
		delivered, malformed := walkBlock(block, &p, fn)
		t.packets.Add(uint64(delivered))
		t.decodeErrors.Add(uint64(malformed))
		atomic.StoreUint32(status, unix.TP_STATUS_KERNEL) // hand the block back
		if blockDone != nil {
			blockDone()
		}
		next = (next + 1) % t.blockNr
		if t.cfg.Behind != nil && t.backlogged(next) {
			t.cfg.Behind()
		}
	}
}

// backlogged tells whether the backlogBlocks blocks from next on are all
// handed over and not read yet. The kernel retires blocks in ring order and
// never passes one it has not been given back, so the last of them tells.
func (t *Tap) backlogged(next int) bool {
	last := (next + backlogBlocks(t.blockNr) - 1) % t.blockNr
	status := (*uint32)(unsafe.Pointer(&t.ring[last*t.blockSize+blockStatusOff]))
	return atomic.LoadUint32(status)&unix.TP_STATUS_USER != 0
}

// backlogBlocks is the backlog at which a tap is behind: a quarter of its
// blocks (at least one). At the lab's highest rates a 4 MiB ring's quarter
// is 20 ms of frames, where the ring holds 80.
func backlogBlocks(blockNr int) int { return max(1, blockNr/4) }

// wait parks until retired() or the socket reports an error (the
// interface went down or away), or the poller's deadline passes (Run's
// context ended, or Close).
func (t *Tap) wait(conn syscall.RawConn, retired func() bool) error {
	var sockErr error
	err := conn.Read(func(fd uintptr) bool {
		if retired() {
			return true
		}
		// The socket turns readable when a block retires, or on an error.
		// Check for an error before every park, not only after a wake-up:
		// Read forgets a wake-up that came before it was called (the
		// runtime resets the readiness, expecting this function to look),
		// so an interface deleted while Run was busy would leave it parked
		// for good.
		soErr, err := sockError(fd)
		switch {
		case err != nil:
			sockErr = fmt.Errorf("SO_ERROR: %w", err)
		case soErr != 0:
			sockErr = fmt.Errorf("socket error: %w", unix.Errno(soErr))
		}
		return sockErr != nil
	})
	switch {
	case sockErr != nil:
		return sockErr
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil // the caller checks why
	case err != nil:
		return fmt.Errorf("wait for the ring: %w", err)
	}
	return nil
}

// sockError reads SO_ERROR with a raw system call: it never blocks, and a
// tap checks it before every park, hundreds of times a second. Through the
// runtime's syscall entry, each check after an idle moment would wake the
// Go runtime's monitor thread, which then polls for a while: about a tenth
// of pathtrace's CPU at high packet rates.
func sockError(fd uintptr) (int, error) {
	var v int32
	n := uint32(unsafe.Sizeof(v))
	_, _, errno := unix.RawSyscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_SOCKET, unix.SO_ERROR,
		uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&n)), 0)
	if errno != 0 {
		return 0, errno
	}
	return int(v), nil
}

func (t *Tap) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// Stats returns the counters. Reading PACKET_STATISTICS resets the kernel's
// counters, so the tap accumulates them; Stats stays valid after Close.
func (t *Tap) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.pullKernelStats()
	}
	s := t.kernel
	s.Packets = t.packets.Load()
	s.DecodeErrors = t.decodeErrors.Load()
	s.LinkDowns, s.LinkDown, s.FirstDown = t.link.stats(time.Now())
	return s
}

// pullKernelStats adds the kernel counters to t.kernel; t.mu is held. The
// getsockopt cannot fail on an open AF_PACKET socket with a V3 ring.
func (t *Tap) pullKernelStats() {
	st, err := unix.GetsockoptTpacketStatsV3(t.fd, unix.SOL_PACKET, unix.PACKET_STATISTICS)
	if err != nil {
		return
	}
	t.kernel.KernelPackets += uint64(st.Packets)
	t.kernel.KernelDrops += uint64(st.Drops)
	t.kernel.QueueFreezes += uint64(st.Freeze_q_cnt)
}

// Close stops Run (it returns once fn returns), takes the
// last kernel counters, unmaps the ring and closes the socket. It is
// idempotent: later calls return the first call's result.
func (t *Tap) Close() error {
	t.closeOnce.Do(func() {
		close(t.closing)
		if t.poller != nil {
			t.poller.SetReadDeadline(time.Now()) // wakes a waiting Run
		}
		t.runMu.Lock()
		defer t.runMu.Unlock()
		t.mu.Lock()
		defer t.mu.Unlock()
		t.pullKernelStats()
		t.closed = true
		// An interface still down ends its gap here: Stats would count the
		// time after, when nothing is captured at all, to the run's end.
		t.link.up(time.Now())
		if err := t.release(); err != nil {
			t.closeErr = fmt.Errorf("capture %s: close: %w", t.cfg.name(), err)
		}
	})
	return t.closeErr
}

// linkPoll is how often a tap whose interface is down looks whether it is
// back up or was deleted: the kernel reports neither on the socket (an
// interface deleted while down raises no second error). In the first
// linkPollFirstFor of a down it looks every linkPollFirst: the block the
// kernel was filling when it went down retires on its timeout, and its
// frames must reach the merge within its hold (200 ms) or the file has
// them out of time order (a look every 250 ms took up to 1.6 ms old frames
// there after the merge had written later ones).
const (
	linkPoll         = 250 * time.Millisecond
	linkPollFirst    = 20 * time.Millisecond
	linkPollFirstFor = 3 * retireTimeoutMs * time.Millisecond
)

// waitLinkBack waits while the interface is down: it returns nil when a
// block retired (the block the kernel was filling when the interface went
// down retires on its timeout), when the interface is up again, when Close
// or ctx ends the run, or, once draining (drainUntil set), at drainUntil;
// an error once the interface was deleted.
func (t *Tap) waitLinkBack(ctx context.Context, retired func() bool, drainUntil time.Time) error {
	poll := time.NewTimer(linkPoll)
	defer poll.Stop()
	var ended <-chan struct{}
	if drainUntil.IsZero() {
		ended = ctx.Done() // then Run starts draining
	}
	for {
		if retired() {
			return nil
		}
		if !t.StillBound() {
			return fmt.Errorf("socket error: %w (the interface was deleted while down)", unix.ENETDOWN)
		}
		if t.linkUp() {
			t.link.up(time.Now())
			return nil
		}
		if !drainUntil.IsZero() && !time.Now().Before(drainUntil) {
			return nil
		}
		every := linkPoll
		if t.link.downFor(time.Now()) < linkPollFirstFor {
			every = linkPollFirst
		}
		poll.Reset(every)
		select {
		case <-t.closing:
			return nil
		case <-ended:
			return nil
		case <-poll.C:
		}
	}
}

// StillBound tells whether the socket is still bound to its interface: the
// kernel unbinds it (ifindex -1) when the interface is deleted.
func (t *Tap) StillBound() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	sa, err := unix.Getsockname(t.fd)
	ll, ok := sa.(*unix.SockaddrLinklayer)
	return err == nil && ok && ll.Ifindex == t.ifindex
}

// linkUp tells whether the interface is administratively up, when the
// kernel hooks the socket again. The socket lives in the interface's netns,
// where the ioctls resolve its index.
func (t *Tap) linkUp() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return false
	}
	ifr, err := unix.NewIfreq("")
	if err != nil {
		return false
	}
	ifr.SetUint32(uint32(t.ifindex))
	if unix.IoctlIfreq(t.fd, unix.SIOCGIFNAME, ifr) != nil || unix.IoctlIfreq(t.fd, unix.SIOCGIFFLAGS, ifr) != nil {
		return false
	}
	return ifr.Uint16()&unix.IFF_UP != 0
}

// linkState is when a tap's interface went down and for how long, read by
// Stats while Run writes it.
type linkState struct {
	mu        sync.Mutex
	downs     uint64
	since     time.Time // when the ongoing one began; zero while up
	first     time.Time
	downTotal time.Duration
}

func (l *linkState) down(at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.since.IsZero() {
		return
	}
	l.downs++
	l.since = at
	if l.first.IsZero() {
		l.first = at
	}
}

func (l *linkState) up(at time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.since.IsZero() {
		return
	}
	l.downTotal += at.Sub(l.since)
	l.since = time.Time{}
}

// downFor is how long the ongoing down has lasted at now (0 while up).
func (l *linkState) downFor(now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.since.IsZero() {
		return 0
	}
	return now.Sub(l.since)
}

func (l *linkState) isDown() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !l.since.IsZero()
}

func (l *linkState) stats(now time.Time) (downs uint64, total time.Duration, first time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	total = l.downTotal
	if !l.since.IsZero() {
		total += now.Sub(l.since)
	}
	return l.downs, total, l.first
}
