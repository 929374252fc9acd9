package capture

import (
	"bytes"
	"encoding/binary"
	"reflect"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
	"golang.org/x/sys/unix"
)

func collect(block []byte) (pkts []*Packet, delivered, malformed int) {
	var p Packet
	delivered, malformed = walkBlock(block, &p, func(p *Packet) { pkts = append(pkts, p.Clone()) })
	return pkts, delivered, malformed
}

func TestWalkBlock(t *testing.T) {
	out := tcpFrame(t, "10.244.8.23", "10.120.0.80", 40000, 80)
	in := udpFrame(t, "10.244.20.31", "10.244.8.23", 5353, 5000)
	inband := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, tag{tpid: etherTypeDot1Q, vid: 42, pcp: 1})
	block := fakeBlock(4096,
		fakePkt{frame: out, wireLen: 1514, sec: 1700000000, nsec: 999999999, ifindex: 3,
			pktType: unix.PACKET_OUTGOING, status: unix.TP_STATUS_USER | unix.TP_STATUS_CSUMNOTREADY},
		fakePkt{frame: in, sec: 1700000001, nsec: 5, ifindex: 3, pktType: unix.PACKET_HOST,
			status: unix.TP_STATUS_USER | unix.TP_STATUS_VLAN_VALID | unix.TP_STATUS_VLAN_TPID_VALID,
			tci:    3<<13 | 200, tpid: etherTypeDot1AD},
		fakePkt{frame: in, ifindex: 3, pktType: unix.PACKET_OTHERHOST,
			status: unix.TP_STATUS_USER | unix.TP_STATUS_VLAN_VALID, tci: 10},
		fakePkt{frame: inband, ifindex: 3, pktType: unix.PACKET_BROADCAST, status: unix.TP_STATUS_USER},
	)
	pkts, delivered, malformed := collect(block)
	if delivered != 4 || malformed != 0 || len(pkts) != 4 {
		t.Fatalf("delivered %d malformed %d, want 4 0", delivered, malformed)
	}

	p := pkts[0]
	if !p.Time.Equal(time.Unix(1700000000, 999999999)) || p.Ifindex != 3 || p.PktType != unix.PACKET_OUTGOING ||
		p.Dir != obs.DirOut || !p.CsumNotReady || p.Len != 1514 || p.CapLen != len(out) || !bytes.Equal(p.Data, out) {
		t.Errorf("outgoing packet: %+v", p)
	}
	if p.VLANOutOfBand || p.TPID != 0 || p.VLAN != 0 {
		t.Errorf("untagged packet has a tag: %+v", p)
	}

	p = pkts[1]
	if p.Dir != obs.DirIn || p.CsumNotReady || !p.VLANOutOfBand || p.TPID != etherTypeDot1AD || p.VLAN != 200 ||
		p.TCI != 3<<13|200 || !bytes.Equal(p.Data, in) || !p.Time.Equal(time.Unix(1700000001, 5)) {
		t.Errorf("out-of-band 802.1ad packet: %+v", p)
	}

	p = pkts[2]
	if p.Dir != obs.DirIn || !p.VLANOutOfBand || p.TPID != etherTypeDot1Q || p.VLAN != 10 {
		t.Errorf("tag without TPID: %+v", p)
	}

	p = pkts[3]
	if p.VLANOutOfBand || p.TPID != etherTypeDot1Q || p.VLAN != 42 || p.TCI != 1<<13|42 {
		t.Errorf("in-band tag: %+v", p)
	}
}

func TestWalkBlockDataIsBounded(t *testing.T) {
	frame := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)
	block := fakeBlock(4096, fakePkt{frame: frame}, fakePkt{frame: frame})
	var p Packet
	walkBlock(block, &p, func(p *Packet) {
		if cap(p.Data) != len(p.Data) {
			t.Errorf("Data has capacity %d beyond its %d bytes: appending would write into the ring", cap(p.Data), len(p.Data))
		}
	})
}

func TestWalkBlockMalformed(t *testing.T) {
	frame := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)
	three := func() []byte {
		return fakeBlock(4096, fakePkt{frame: frame}, fakePkt{frame: frame}, fakePkt{frame: frame})
	}
	firstOff := blockDescLen
	secondOff := func(b []byte) int { return firstOff + int(binary.NativeEndian.Uint32(b[firstOff:])) }
	tests := []struct {
		name          string
		corrupt       func(b []byte) []byte
		wantDelivered int
		wantMalformed int
	}{
		{"intact", func(b []byte) []byte { return b }, 3, 0},
		{"more packets announced than chained", func(b []byte) []byte {
			binary.NativeEndian.PutUint32(b[blockNumPktsOff:], 5)
			return b
		}, 3, 2},
		{"next offset past the block", func(b []byte) []byte {
			binary.NativeEndian.PutUint32(b[secondOff(b):], 1<<20)
			return b
		}, 2, 1},
		{"first packet outside", func(b []byte) []byte {
			binary.NativeEndian.PutUint32(b[blockFirstPktOff:], 4090)
			return b
		}, 0, 3},
		{"first packet inside the descriptor", func(b []byte) []byte {
			binary.NativeEndian.PutUint32(b[blockFirstPktOff:], 8)
			return b
		}, 0, 3},
		{"snaplen past the block", func(b []byte) []byte {
			binary.NativeEndian.PutUint32(b[secondOff(b)+pktSnaplenOff:], 5000)
			return b
		}, 1, 2},
		{"mac offset inside the header", func(b []byte) []byte {
			binary.NativeEndian.PutUint16(b[firstOff+pktMacOff:], 10)
			return b
		}, 0, 3},
		{"block cut short", func(b []byte) []byte { return b[:secondOff(b)+pktMinHdrLen-1] }, 1, 2},
		{"shorter than a descriptor", func(b []byte) []byte { return b[:20] }, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, d, m := collect(tc.corrupt(three()))
			if d != tc.wantDelivered || m != tc.wantMalformed {
				t.Errorf("delivered %d malformed %d, want %d %d", d, m, tc.wantDelivered, tc.wantMalformed)
			}
		})
	}
}

func TestWalkBlockEmpty(t *testing.T) {
	if _, d, m := collect(fakeBlock(4096)); d != 0 || m != 0 {
		t.Errorf("empty block: delivered %d malformed %d", d, m)
	}
}

// FuzzWalkBlock: any block content is walked without a panic, and every
// packet the descriptor announces is either delivered or counted.
func FuzzWalkBlock(f *testing.F) {
	frame := udpFrame(f, "10.0.0.1", "10.0.0.2", 1, 2)
	f.Add(fakeBlock(1024, fakePkt{frame: frame}, fakePkt{frame: frame, status: unix.TP_STATUS_VLAN_VALID}))
	f.Fuzz(func(t *testing.T, block []byte) {
		var p Packet
		d, m := walkBlock(block, &p, func(p *Packet) { _, _ = p.Observation(obs.PointUplink) })
		if len(block) >= blockDescLen {
			if n := int(binary.NativeEndian.Uint32(block[blockNumPktsOff:])); d+m != n {
				t.Fatalf("delivered %d + malformed %d != announced %d", d, m, n)
			}
		}
	})
}

// parsePacket sets every field of the packet it fills in (walkBlock reuses
// one for the whole block): parsed into a packet whose every field holds
// something, each packet comes out as parsed into a zero one.
func TestParsePacketSetsEveryField(t *testing.T) {
	out := tcpFrame(t, "10.244.8.23", "10.120.0.80", 40000, 80)
	inband := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, tag{tpid: etherTypeDot1Q, vid: 42, pcp: 1})
	pkts := []fakePkt{
		{frame: out, sec: 1700000000, nsec: 7, ifindex: 3, pktType: unix.PACKET_OUTGOING, status: unix.TP_STATUS_USER},
		{frame: out, ifindex: 4, pktType: unix.PACKET_HOST, status: unix.TP_STATUS_USER | unix.TP_STATUS_VLAN_VALID, tci: 10},
		{frame: inband, pktType: unix.PACKET_HOST, status: unix.TP_STATUS_USER},
		{frame: out[:10], pktType: unix.PACKET_HOST, status: unix.TP_STATUS_USER},
	}
	for i, fp := range pkts {
		block := fakeBlock(4096, fp)
		off := int(binary.NativeEndian.Uint32(block[blockFirstPktOff:]))
		var want Packet
		if !parsePacket(block, off, &want) {
			t.Fatalf("packet %d not parsed", i)
		}
		var dirty Packet
		v := reflect.ValueOf(&dirty).Elem()
		for j := range v.NumField() {
			switch f := v.Field(j); f.Kind() {
			case reflect.Bool:
				f.SetBool(true)
			case reflect.Int:
				f.SetInt(-99)
			case reflect.Uint8, reflect.Uint16:
				f.SetUint(0xfe)
			case reflect.Slice:
				f.SetBytes([]byte{1, 2, 3})
			case reflect.Struct: // Time
				f.Set(reflect.ValueOf(time.Unix(5, 5).UTC()))
			default:
				t.Fatalf("field %s of kind %s: teach the test to fill it", v.Type().Field(j).Name, f.Kind())
			}
		}
		if !parsePacket(block, off, &dirty) {
			t.Fatalf("packet %d not parsed into a used packet", i)
		}
		if !reflect.DeepEqual(dirty, want) {
			t.Errorf("packet %d parsed into a used packet:\n%+v\nwant\n%+v", i, dirty, want)
		}
	}
}
