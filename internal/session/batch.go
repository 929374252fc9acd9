package session

import (
	"slices"
	"sync"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// A batch is what a producer hands the consumer at once: the frames of (at
// most) one ring block of one tap, or observations from the probe. Batches
// are reused: at tens of thousands of frames a second, fresh ones would keep
// the garbage collector busy.
type batch struct {
	tap    int     // index in tracer.taps; -1 for the probe's observations
	frames []frame // in capture (time) order
	// data holds the frames' bytes: a ring slot is reused once its block is
	// handed back to the kernel, so every frame is copied, once. Each
	// frame's Data points into it from add on (rebase when it grows).
	data []byte
	obs  []obs.Observation
	next int // with --pcap: the first frame not written yet
	// seq numbers a tap's batch as it is handed to the consumer
	// (tracer.handed); 0 for any other.
	seq uint64
	// ended marks the last batch of a tap whose capture ended (no frame,
	// never reused): the consumer has taken every frame of the tap once
	// it takes this one (tracer.tapEnded).
	ended bool
}

// frame is one captured frame and what the consumer made of it. It is 128
// bytes, two cache lines: the merge holds thousands of them (maxHeld) and
// goes through them again to write them, out of the CPU's caches by then, so
// every line counts.
type frame struct {
	pkt   capture.Packet // Data points into the batch's data
	h     flow.Handle    // the flow counter it went to, when known
	known bool
	// kindSlot is a hash of the frame's kind (classKey), for
	// pcapOut.byKind; 0 for a frame without one.
	kindSlot uint8
}

// A batch is handed over when it reaches maxBatch frames or maxBatchBytes of
// frame data, or at the end of a ring block. A tap whose last batch held at
// most smallBatch frames (a quiet Pod's, most of a node's) takes a small
// one, with room for that many (2 KiB, where a full one takes 32 KiB):
// with --pcap every batch is held 200 ms for the merge, so a node of many
// Pods holds one or two per tap, live heap for the collector.
const (
	maxBatch      = 256
	smallBatch    = 16
	maxBatchBytes = 256 << 10
)

// add copies p into the batch: straight into the next frame, where a frame
// value appended was built and then copied again (a frame is 128 bytes).
func (b *batch) add(p *capture.Packet) {
	n := len(b.frames)
	if n < cap(b.frames) {
		b.frames = b.frames[:n+1] // putBatch cleared it
	} else {
		b.frames = append(b.frames, frame{})
	}
	if cap(b.data)-len(b.data) < len(p.Data) {
		b.data = slices.Grow(b.data, len(p.Data))
		b.rebase(n)
	}
	off := len(b.data)
	b.data = append(b.data, p.Data...)
	f := &b.frames[n]
	f.pkt = *p
	f.pkt.Data = b.data[off:len(b.data):len(b.data)]
}

// rebase points the first n frames at their bytes in data, moved by its
// growth; they are stored there one after the other.
func (b *batch) rebase(n int) {
	off := 0
	for i := range b.frames[:n] {
		f := &b.frames[i]
		end := off + len(f.pkt.Data)
		f.pkt.Data = b.data[off:end:end]
		off = end
	}
}

func (b *batch) full() bool { return len(b.frames) >= maxBatch || len(b.data) >= maxBatchBytes }

// maxObs is the largest batch of observations kept for reuse (the probe's
// batches are smaller).
const maxObs = 512

// freeBatches is how many consumed frame batches are kept for reuse, of each
// size: more than are in flight (the channel, one filling per tap) plus what
// the pcapng merge holds (maxHeld frames) in the steady state. freeObsBatches
// is the same for the probe's observations, which come one batch per
// ring-buffer read: a few suffice. Kept apart, a batch never holds both
// kinds of arrays, and a small one is never taken for a full one.
const (
	freeBatches    = 32
	freeObsBatches = 4
)

// batchPool keeps consumed batches for reuse, last in first out: the batch
// reused next is the one written out last, whose memory is still in the
// CPU's caches (a queue hands back the coldest, and every frame stored into
// it missed the cache). Not a sync.Pool: it drops its content at every
// garbage collection, and the allocations that follow bring the next one
// sooner.
type batchPool struct {
	mu    sync.Mutex
	items []*batch
}

func newBatchPool(n int) *batchPool { return &batchPool{items: make([]*batch, 0, n)} }

func (bp *batchPool) get() *batch {
	bp.mu.Lock()
	defer bp.mu.Unlock()
	n := len(bp.items)
	if n == 0 {
		return nil
	}
	b := bp.items[n-1]
	bp.items[n-1] = nil
	bp.items = bp.items[:n-1]
	return b
}

// put keeps b unless the pool is full.
func (bp *batchPool) put(b *batch) {
	bp.mu.Lock()
	defer bp.mu.Unlock()
	if len(bp.items) < cap(bp.items) {
		bp.items = append(bp.items, b)
	}
}

func (bp *batchPool) len() int {
	bp.mu.Lock()
	defer bp.mu.Unlock()
	return len(bp.items)
}

// newBatch returns an empty batch for tap (-1: observations), small or full
// (smallBatch), a reused one when there is one.
func (tr *tracer) newBatch(tap int, small bool) *batch {
	free := tr.free
	switch {
	case tap < 0:
		free = tr.freeObs
	case small:
		free = tr.freeSmall
	}
	b := free.get()
	if b == nil {
		b = &batch{}
	}
	if tap >= 0 && b.frames == nil {
		n := maxBatch
		if small {
			n = smallBatch
		}
		b.frames = make([]frame, 0, n)
		// Room for n frames of snaplen bytes from the start: grown by
		// append, a new batch's data went through a dozen sizes, each
		// copied and its frames rebased (most of the CPU of the first
		// 200 ms of a capture, while the merge fills with new batches).
		b.data = make([]byte, 0, min(n*tr.opt.Snaplen, maxBatchBytes))
	}
	b.tap = tap
	return b
}

// putBatch gives a consumed batch back for reuse.
func (tr *tracer) putBatch(b *batch) {
	if cap(b.data) > 2*maxBatchBytes || cap(b.obs) > maxObs {
		return // grown by unusually large frames: let it go
	}
	clear(b.frames) // drop the references to flows
	clear(b.obs)
	b.frames, b.data, b.obs, b.next, b.seq = b.frames[:0], b.data[:0], b.obs[:0], 0, 0
	switch {
	case b.tap < 0:
		tr.freeObs.put(b)
	case cap(b.frames) <= smallBatch:
		tr.freeSmall.put(b)
	default:
		tr.free.put(b)
	}
}
