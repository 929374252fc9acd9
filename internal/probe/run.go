package probe

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
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// readerPoll is how often the ring buffer is read when no observer woke the
// reader: the latest an event reaches the engine, as a quiet tap's frames
// do (its ring block retires after 100 ms). A tap's frames have the events
// before them read at once anyway (CatchUp), and each poll wakes the
// process: every 50 ms, pathtrace took 7% more CPU in alternating lab runs
// at 20k datagrams a second (more in 6 of 6 pairs). After a poll that found
// more than busyBytes, the next one comes after busyPoll: a burst of new
// flows (about 9 MB/s of events at 12,000 connections a second) would
// otherwise fill the 512 KiB ring in about 60 ms, before the next poll,
// whenever its wakeup came late (the observers wake the reader once the
// ring holds 128 KiB).
const (
	readerPoll = 100 * time.Millisecond
	busyPoll   = 10 * time.Millisecond
	busyBytes  = 32 << 10
)

// idleWait is how long the reader sleeps after a poll that found nothing,
// unless an observer wakes it first (every submit to a sleeping reader
// does): only a bound in case a wakeup were lost. An idle pathtrace then
// wakes about once a second, not twenty times. A variable for tests.
var idleWait = time.Second

// maxEmit bounds the observations RunBatches hands over at once.
const maxEmit = 256

// Run is RunBatches with one call per observation.
func (p *Probe) Run(ctx context.Context, emit func(obs.Observation)) error {
	return p.RunBatches(ctx, func(batch []obs.Observation) {
		for _, o := range batch {
			emit(o)
		}
	})
}

// RunBatches reads the observers' ring buffer and the conntrack
// subscriptions and calls emit with batches of observations (at most
// maxEmit; the slice is reused once emit returns: emit copies what it keeps),
// one call at a time, until ctx is done or the Probe is closed. A batch is handed over as soon as the ring buffer has
// nothing more to read. It can be called once per Probe, Run included.
func (p *Probe) RunBatches(ctx context.Context, emit func([]obs.Observation)) error {
	if !p.running.CompareAndSwap(false, true) {
		return errors.New("probe: Run called twice")
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return errors.New("probe closed")
	}
	p.runWG.Add(1)
	events := p.maps["events"]
	p.mu.Unlock()
	defer p.runWG.Done()

	// This goroutine alone uses the reader, and closes it: closing it from
	// another one while this one asks AvailableBytes dereferences the ring
	// the close released.
	rd, err := ringbuf.NewReader(events)
	if err != nil {
		return fmt.Errorf("open ring buffer: %w", err)
	}
	defer rd.Close()
	epoch, err := monotonicEpoch()
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	stopping := func() bool {
		select {
		case <-ctx.Done():
			return true
		case <-p.closing:
			return true
		default:
			return false
		}
	}
	wg.Add(1)

	var emitMu sync.Mutex
	serial := func(batch []obs.Observation) {
		emitMu.Lock()
		defer emitMu.Unlock()
		emit(batch)
	}
	go func() {
		defer wg.Done()
		var ctBatch []obs.Observation
		for {
			select {
			case o := <-p.ctObs:
				batch := append(ctBatch[:0], o)
			more: // take what else is queued, without waiting
				for len(batch) < maxEmit {
					select {
					case o := <-p.ctObs:
						batch = append(batch, o)
					default:
						break more
					}
				}
				p.counters.ctEvents.Add(uint64(len(batch)))
				serial(batch)
				ctBatch = batch
			case <-ctx.Done():
				return
			case <-p.closing:
				return
			}
		}
	}()

	// The observers submit without waking the reader (a full ring does wake
	// it, and so does the first event after a poll that found nothing: see
	// sleepFlag): every readerPoll (busyPoll after a busy poll), read
	// everything there is. The wait parks this goroutine in Go's network
	// poller on a duplicate of the ring's fd, as the taps wait. The reader's
	// own wait is epoll_wait(2) on a thread: a blocking syscall, which wakes
	// the runtime's monitor thread, takes the processor away and hands it to
	// another thread, and leaves the monitor polling every 20 us for a while
	// (with 3,000 connections back to back: 7% more CPU per connection, a
	// third more context switches). The reads themselves never block (a
	// deadline in the past): when stopping, a last read takes whatever was
	// submitted before the stop, nothing is dropped.
	park, err := newRingPark(events)
	if err != nil {
		return err
	}
	defer park.Close()
	positions, err := mapRingPositions(events)
	if err != nil {
		return err
	}
	defer positions.close()
	p.catchUp.start(positions, park)
	defer p.catchUp.stop() // before the positions are unmapped
	// A stop ends the wait at once: a sleeping reader waits up to idleWait.
	stopWait := make(chan struct{})
	defer close(stopWait)
	go func() {
		select {
		case <-ctx.Done():
		case <-p.closing:
		case <-stopWait:
			return
		}
		park.interrupt()
	}()
	sleeper, err := mapSleepFlag(p.maps["reader_asleep"])
	if err != nil {
		return err
	}
	defer sleeper.close()
	var rec ringbuf.Record
	var batch []obs.Observation
	flush := func() {
		if len(batch) > 0 {
			serial(batch)
			batch = batch[:0]
		}
	}
	// A read that failed leaves asks unanswered: answered after the last
	// flush (deferred calls run last first).
	var asks []chan struct{}
	defer func() { answer(asks) }()
	defer flush()
	for {
		stop := stopping() // before the read: what came before the stop is read
		asks = p.catchUp.take()
		p.catchUp.reading.Store(true)
		rd.SetDeadline(time.Now())
		readBytes := 0
		// An empty ring is not read at all: ReadInto would ask epoll first,
		// a syscall that wakes the runtime's monitor too.
		for rd.AvailableBytes() > 0 {
			err := rd.ReadInto(&rec)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break // read dry
			}
			if errors.Is(err, ringbuf.ErrClosed) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("read ring buffer: %w", err)
			}
			readBytes += len(rec.RawSample)
			o, err := decodeEvent(rec.RawSample, epoch)
			if err != nil {
				p.counters.decodeErrors.Add(1)
				continue
			}
			p.name(&o)
			p.counters.events.Add(1)
			if batch = append(batch, o); len(batch) == maxEmit {
				flush()
			}
		}
		flush()
		p.catchUp.reading.Store(false)
		answer(asks)
		asks = nil
		if stop {
			return nil
		}
		next := readerPoll
		switch {
		case readBytes > busyBytes:
			next = busyPoll
		case readBytes == 0 && sleeper.sleep(rd):
			next = idleWait
		}
		err := park.wait(next, func() bool { return p.catchUp.asked() || rd.AvailableBytes() > busyBytes })
		sleeper.wake()
		if err != nil {
			return fmt.Errorf("wait for the ring buffer: %w", err)
		}
	}
}

// sleepFlag is the observers' reader_asleep flag, mapped into this process
// (the map is BPF_F_MMAPABLE): set and cleared with atomic exchanges, full
// barriers, as the protocol in observe.h needs.
type sleepFlag struct {
	mem  []byte
	flag *uint64
}

func mapSleepFlag(m *ebpf.Map) (*sleepFlag, error) {
	mem, err := unix.Mmap(m.FD(), 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map reader_asleep: %w", err)
	}
	return &sleepFlag{mem: mem, flag: (*uint64)(unsafe.Pointer(&mem[0]))}, nil
}

// sleep announces that the reader sleeps until the next submit, then looks
// at the ring once more: false (and awake again) when something arrived
// meanwhile.
func (s *sleepFlag) sleep(rd *ringbuf.Reader) bool {
	atomic.SwapUint64(s.flag, 1)
	if rd.AvailableBytes() > 0 {
		s.wake()
		return false
	}
	return true
}

// wake clears the flag (a submit that woke the reader already did).
func (s *sleepFlag) wake() { atomic.SwapUint64(s.flag, 0) }

func (s *sleepFlag) close() {
	s.wake()
	unix.Munmap(s.mem)
}

// ringPark waits for the observers' ring buffer in Go's network poller.
type ringPark struct {
	f           *os.File
	conn        syscall.RawConn
	interrupted atomic.Bool
}

// newRingPark registers a duplicate of the ring buffer's fd with the poller
// (the ring's own fd stays the reader's).
func newRingPark(events *ebpf.Map) (*ringPark, error) {
	fd, err := unix.FcntlInt(uintptr(events.FD()), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate the ring buffer fd: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ring buffer fd: %w", err)
	}
	f := os.NewFile(uintptr(fd), "events")
	conn, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ring buffer fd: %w", err)
	}
	return &ringPark{f: f, conn: conn}, nil
}

// wait parks until the observers wake the reader (the ring filling up),
// ready() holds, or d passes.
func (r *ringPark) wait(d time.Duration, ready func() bool) error {
	if err := r.f.SetReadDeadline(time.Now().Add(d)); err != nil {
		return err
	}
	if r.interrupted.Load() { // before the deadline above replaced its own
		return nil
	}
	woken := false
	err := r.conn.Read(func(uintptr) bool {
		if woken || ready() {
			return true
		}
		woken = true // the next call comes after a wakeup: read then
		return false
	})
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	return err
}

// poke ends the current wait (a wait begun later looks at its ready
// first).
func (r *ringPark) poke() { r.f.SetReadDeadline(time.Now()) }

// interrupt ends the current wait and every later one at once.
func (r *ringPark) interrupt() {
	r.interrupted.Store(true)
	r.f.SetReadDeadline(time.Now())
}

func (r *ringPark) Close() error { return r.f.Close() }

// name adds what the record does not carry: the interface name of a tc
// observation, the priority of a netfilter one, the names of a drop's
// reason and function.
func (p *Probe) name(o *obs.Observation) {
	if o.Drop != nil {
		p.drops.name(o.Drop)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch o.Point {
	case obs.PointTCHead, obs.PointTCTail:
		o.Ifname = p.ifnames[ifaceKey{o.NetNS, o.Ifindex}]
	case obs.PointNFBefore, obs.PointNFAfter:
		o.Prio = p.nfPrios[nfKey{o.NetNS, o.Hook, o.Point}]
	}
}

// monotonicEpoch returns the wall-clock time at which CLOCK_MONOTONIC (the
// clock of bpf_ktime_get_ns) was zero, measured around one time.Now call.
func monotonicEpoch() (time.Time, error) {
	var before, after unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &before); err != nil {
		return time.Time{}, fmt.Errorf("read monotonic clock: %w", err)
	}
	now := time.Now().Round(0) // wall clock only
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &after); err != nil {
		return time.Time{}, fmt.Errorf("read monotonic clock: %w", err)
	}
	mid := (before.Nano() + after.Nano()) / 2
	return now.Add(-time.Duration(mid)), nil
}
