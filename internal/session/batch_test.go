package session

import (
	"io"
	"testing"
	"time"

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
