package session

import (
	"io"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// BenchmarkConsume is the user-space cost of one captured frame of a known
// flow, from the tap's ring to the pcapng encoder: copy into a batch,
// classification (the Repeat path), the time-ordered merge of two points and
// the packet block with its comment. The file write itself is left out
// (io.Discard).
func BenchmarkConsume(b *testing.B) {
	tr := testTracer(b, io.Discard)
	raw := udpFrame(b, client, vip)
	p := capture.Packet{Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw}
	b.ReportAllocs()
	b.ResetTimer()
	at := base
	for n := 0; n < b.N; n += maxBatch {
		bt := tr.newBatch(n / maxBatch % 2)
		for range maxBatch {
			at = at.Add(time.Microsecond)
			p.Time = at
			bt.add(&p)
		}
		bt.seal()
		if reason := tr.consume(bt); reason != "" {
			b.Fatal(reason)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/frame")
}
