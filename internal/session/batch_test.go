package session

import (
	"io"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestSmallBatches: a quiet tap's batch has room for a few frames, not a
// full batch's 256, grows when more come, and each size is reused for the
// same kind of request only: the batches a node of many quiet Pods holds
// in the pcapng merge take a few KiB each.
func TestSmallBatches(t *testing.T) {
	tr := testTracer(t, io.Discard)
	raw := udpFrame(t, client, vip)
	add := func(b *batch, n int) {
		for i := range n {
			b.add(&capture.Packet{Time: base.Add(time.Duration(i) * time.Microsecond), Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw})
		}
	}
	small := tr.newBatch(0, true)
	if cap(small.frames) != smallBatch {
		t.Fatalf("a small batch has room for %d frames, want %d", cap(small.frames), smallBatch)
	}
	add(small, 3)
	tr.putBatch(small)
	grown := tr.newBatch(1, true)
	if grown != small {
		t.Fatal("the small batch given back was not reused for a small one")
	}
	add(grown, smallBatch+1) // a burst on a quiet tap
	tr.putBatch(grown)
	if tr.freeSmall.len() != 0 || tr.free.len() != 1 {
		t.Fatalf("a grown batch kept among the small ones (%d small, %d full)", tr.freeSmall.len(), tr.free.len())
	}
	if b := tr.newBatch(0, true); b == grown || cap(b.frames) != smallBatch {
		t.Errorf("a small request got a batch with room for %d frames", cap(b.frames))
	}
	if b := tr.newBatch(0, false); b != grown {
		t.Error("a full request did not reuse the grown batch")
	}
	if b := tr.newBatch(2, false); cap(b.frames) != maxBatch {
		t.Errorf("a full batch has room for %d frames, want %d", cap(b.frames), maxBatch)
	}
}

// TestBatchFramesKeepTheirBytes: each frame's Data holds its own bytes in
// the batch's data from add on, also after the data grew (moved) under
// later frames, and after the batch was reused; the source (a ring slot) is not
// referenced.
func TestBatchFramesKeepTheirBytes(t *testing.T) {
	tr := testTracer(t, io.Discard)
	frameOf := func(i int) []byte {
		f := make([]byte, 40+i%70) // sizes that make the data grow at odd places
		for j := range f {
			f[j] = byte(i*7 + j)
		}
		return f
	}
	for round := range 2 { // a fresh batch, then the same one reused
		b := tr.newBatch(0, round == 0)
		slot := make([]byte, 200)
		for i := range maxBatch {
			src := frameOf(i)
			copy(slot, src)
			b.add(&capture.Packet{Time: base.Add(time.Duration(i)), Len: len(src), CapLen: len(src), Data: slot[:len(src)]})
			clear(slot) // the ring slot is reused
		}
		for i := range b.frames {
			if got, want := b.frames[i].pkt.Data, frameOf(i); string(got) != string(want) || cap(got) != len(want) {
				t.Fatalf("round %d: frame %d holds %x (cap %d), want %x", round, i, got, cap(got), want)
			}
			// In the batch's data, not an array it outgrew (kept alive
			// until the batch is given back).
			if at := uintptr(unsafe.Pointer(unsafe.SliceData(b.frames[i].pkt.Data))) - uintptr(unsafe.Pointer(unsafe.SliceData(b.data))); at >= uintptr(len(b.data)) {
				t.Fatalf("round %d: frame %d points outside the batch's data", round, i)
			}
		}
		tr.putBatch(b)
	}
}

// TestNewBatchHasRoomForItsFrames: a new batch, small or full, takes its
// frames of up to snaplen bytes without growing its data (each growth
// copies the bytes and rebases every frame: most of the CPU of a capture's
// first 200 ms, while the merge fills with new batches).
func TestNewBatchHasRoomForItsFrames(t *testing.T) {
	tr := testTracer(t, io.Discard)
	tr.opt.Snaplen = 96
	frame := make([]byte, tr.opt.Snaplen)
	for _, small := range []bool{true, false} {
		b := tr.newBatch(0, small)
		n := cap(b.frames)
		b.add(&capture.Packet{Len: len(frame), CapLen: len(frame), Data: frame})
		data := unsafe.SliceData(b.data)
		for range n - 1 {
			b.add(&capture.Packet{Len: len(frame), CapLen: len(frame), Data: frame})
		}
		if unsafe.SliceData(b.data) != data {
			t.Errorf("small %v: the data of a new batch grew before its %d frames of %d bytes were in", small, n, len(frame))
		}
	}
}

// A frame is two cache lines: the merge goes through thousands of them.
func TestFrameSize(t *testing.T) {
	if n := unsafe.Sizeof(frame{}); n > 128 {
		t.Errorf("a frame takes %d bytes, more than two cache lines", n)
	}
}

// One catch-up with the observers covers every batch the taps handed over
// before it began; a batch handed over after it needs another, and so does
// one no tap numbered. (No probe: each catch-up finds nothing to wait for.)
func TestOneCatchUpCoversTheBatchesHandedBefore(t *testing.T) {
	tr := &tracer{}
	hand := func() *batch { return &batch{tap: 0, seq: tr.handed.Add(1)} }
	check := func(name string, b *batch, want uint64) {
		t.Helper()
		tr.catchUpBefore(b)
		if tr.caughtUp != want {
			t.Errorf("%s (seq %d): caught up to batch %d, want %d", name, b.seq, tr.caughtUp, want)
		}
	}
	b1, b2, b3 := hand(), hand(), hand()
	check("the first of three queued: one catch-up for the three", b1, 3)
	check("the second: none", b2, 3)
	b4 := hand() // while the consumer works on the second
	check("the third: none", b3, 3)
	check("one handed after the catch-up began: another", b4, 4)
	hand()
	check("an unnumbered batch: one, for the batches handed so far too", &batch{tap: 0}, 5)
}

// TestHandOverSaysConsumerBehind: a tap whose batch waits on the consumer's
// full queue for behindWait says the capture is behind
// (Options.CaptureBehind), and again every behindWait until the batch is
// queued; a batch with room, or taken within behindWait, says nothing.
func TestHandOverSaysConsumerBehind(t *testing.T) {
	defer func(d time.Duration) { behindWait = d }(behindWait)
	var behind atomic.Int32
	tr := &tracer{opt: Options{CaptureBehind: func() { behind.Add(1) }}}
	items := make(chan *batch, 1)
	tr.handOver(items, &batch{})
	if n := behind.Load(); n != 0 {
		t.Fatalf("a batch the queue had room for: CaptureBehind called %d times", n)
	}
	handOver := func() chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			tr.handOver(items, &batch{})
		}()
		return done
	}
	stillWaiting := func(done chan struct{}) {
		select {
		case <-done:
			t.Fatal("a batch was queued past a full queue")
		default:
		}
	}

	// Taken long before behindWait: a pause of the consumer.
	behindWait = time.Hour
	done := handOver()
	time.Sleep(10 * time.Millisecond) // it waits on the full queue
	stillWaiting(done)
	<-items
	<-done
	if n := behind.Load(); n != 0 {
		t.Fatalf("a batch taken within behindWait: CaptureBehind called %d times", n)
	}

	// Waiting longer: it says so, again while it waits for room.
	behindWait = time.Millisecond
	done = handOver()
	deadline := time.After(5 * time.Second)
	for behind.Load() < 2 {
		select {
		case <-done:
			t.Fatal("a batch was queued past a full queue")
		case <-deadline:
			<-items // let it go
			t.Fatalf("a batch waits for a full queue: CaptureBehind called %d times, want it again and again", behind.Load())
		case <-time.After(time.Millisecond):
		}
	}
	stillWaiting(done)
	<-items
	<-done
	said := behind.Load()
	<-items
	time.Sleep(10 * time.Millisecond)
	if n := behind.Load(); n != said {
		t.Fatalf("CaptureBehind called %d times after the batch was queued (%d before)", n-said, said)
	}
	// Without a callback, the wait is all.
	tr.opt.CaptureBehind = nil
	items <- &batch{}
	go func() { <-items; <-items }()
	tr.handOver(items, &batch{})
}
