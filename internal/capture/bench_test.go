package capture

import (
	"testing"

	"github.com/pathtrace/pathtrace/internal/obs"
	"golang.org/x/sys/unix"
)

// BenchmarkParseBlock walks a full default-size block of 96-byte snaps, as a
// busy uplink fills it; ns/pkt is the figure to watch.
func BenchmarkParseBlock(b *testing.B) {
	frame := tcpFrame(b, "10.244.8.23", "10.120.0.80", 40000, 80)
	frame = append(frame, make([]byte, DefaultSnaplen-len(frame))...)
	per := (82 + len(frame) + 7) &^ 7
	pkts := make([]fakePkt, (maxBlockBytes-blockDescLen)/per)
	for i := range pkts {
		pkts[i] = fakePkt{frame: frame, wireLen: 1514, pktType: unix.PACKET_OUTGOING,
			status: unix.TP_STATUS_USER | unix.TP_STATUS_VLAN_VALID | unix.TP_STATUS_VLAN_TPID_VALID, tci: 200, tpid: etherTypeDot1Q}
	}
	block := fakeBlock(maxBlockBytes, pkts...)
	var p Packet
	seen := 0
	fn := func(*Packet) { seen++ }
	b.SetBytes(int64(len(block)))
	b.ReportAllocs()
	for b.Loop() {
		if d, _ := walkBlock(block, &p, fn); d != len(pkts) {
			b.Fatalf("delivered %d of %d", d, len(pkts))
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(seen), "ns/pkt")
}

func BenchmarkObservation(b *testing.B) {
	p := Packet{Data: tcpFrame(b, "10.244.8.23", "10.120.0.80", 40000, 80, tag{tpid: etherTypeDot1Q, vid: 200}), Dir: obs.DirOut}
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := p.Observation(obs.PointUplink); !ok {
			b.Fatal("not decoded")
		}
	}
}
