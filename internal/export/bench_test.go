package export_test

import (
	"io"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// BenchmarkWritePacket writes uplink frames as captured with the default
// snaplen (96 bytes, an out-of-band VLAN tag) with a verdict comment: the
// per-packet cost of --pcap.
func BenchmarkWritePacket(b *testing.B) {
	frame := tcpFrame(1400)[:96]
	comment := "flow 3 request to backend (after translation); rewritten_at=socket by=connect4 lab_sock4_connect (id 5)"
	for _, dst := range []string{"file", "stream"} {
		b.Run(dst, func(b *testing.B) {
			var w *export.Writer
			var err error
			if dst == "file" {
				w, err = export.Create(filepath.Join(b.TempDir(), "bench.pcapng"), testIfaces, export.Limits{})
			} else {
				w, err = export.NewStream(io.Discard, testIfaces, export.Limits{})
			}
			if err != nil {
				b.Fatal(err)
			}
			p := packet(frame, obs.DirOut, tpid8021Q, 200)
			p.Len = 1454
			b.ReportAllocs()
			b.ResetTimer()
			cpu := processCPU()
			for range b.N {
				if err := w.WritePacket(2, p, comment); err != nil {
					b.Fatal(err)
				}
			}
			bytes := w.Bytes()
			// Closed within the measure: the file's writer goroutine
			// finishes its writes, whose CPU (most of it the kernel's)
			// counts in cpu-ns/op, where ns/op is the caller's time.
			if err := w.Close(nil); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(bytes)/float64(b.N), "file-B/op")
		})
	}
}

// processCPU is the process's user and system CPU time so far, in
// nanoseconds.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}
