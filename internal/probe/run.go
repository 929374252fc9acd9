package probe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// readerPoll is how often the ring buffer is read when no observer woke the
// reader: the latest an event reaches the engine. After a poll that found
// more than busyBytes, the next one comes after busyPoll: a burst of new
// flows (about 9 MB/s of events at 12,000 connections a second) would
// otherwise fill the 512 KiB ring in about 60 ms, before the next poll,
// whenever its wakeup came late.
const (
	readerPoll = 50 * time.Millisecond
	busyPoll   = 10 * time.Millisecond
	busyBytes  = 32 << 10
)

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
	// it): poll every readerPoll and read everything there is. The deadline
	// error comes once the ring is read dry: when stopping, that is the end
	// (whatever was submitted before the stop is read, not dropped).
	var rec ringbuf.Record
	var batch []obs.Observation
	readBytes := 0 // since the last poll
	flush := func() {
		if len(batch) > 0 {
			serial(batch)
			batch = batch[:0]
		}
	}
	defer flush()
	rd.SetDeadline(time.Now().Add(readerPoll))
	for {
		if len(batch) == maxEmit || len(batch) > 0 && rd.AvailableBytes() == 0 {
			flush()
		}
		if err := rd.ReadInto(&rec); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if stopping() {
					return nil
				}
				next := readerPoll
				if readBytes > busyBytes {
					next = busyPoll
				}
				readBytes = 0
				rd.SetDeadline(time.Now().Add(next))
				continue
			}
			if errors.Is(err, ringbuf.ErrClosed) {
				return nil
			}
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
		batch = append(batch, o)
	}
}

// name adds what the record does not carry: the interface name of a tc
// observation and the priority of a netfilter one.
func (p *Probe) name(o *obs.Observation) {
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
