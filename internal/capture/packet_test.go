package capture

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/pathtrace/pathtrace/internal/obs"
)

func TestObservation(t *testing.T) {
	when := time.Unix(1700000000, 123456789)
	tests := []struct {
		name      string
		pkt       Packet
		wantProto obs.Proto
		wantSrc   string
		wantDst   string
		wantFlags uint8
		wantVLAN  uint16
		wantTPID  uint16
	}{
		{
			name:      "untagged tcp syn",
			pkt:       Packet{Data: tcpFrame(t, "10.244.8.23", "10.120.0.80", 40000, 80)},
			wantProto: obs.TCP, wantSrc: "10.244.8.23:40000", wantDst: "10.120.0.80:80", wantFlags: 0x02,
		},
		{
			name:      "802.1Q udp",
			pkt:       Packet{Data: udpFrame(t, "10.244.8.23", "10.120.0.10", 5000, 53, tag{tpid: etherTypeDot1Q, vid: 200})},
			wantProto: obs.UDP, wantSrc: "10.244.8.23:5000", wantDst: "10.120.0.10:53", wantVLAN: 200, wantTPID: etherTypeDot1Q,
		},
		{
			name: "QinQ reports the outer tag",
			pkt: Packet{Data: udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2,
				tag{tpid: etherTypeDot1AD, vid: 100, pcp: 3}, tag{tpid: etherTypeDot1Q, vid: 200})},
			wantProto: obs.UDP, wantSrc: "10.0.0.1:1", wantDst: "10.0.0.2:2", wantVLAN: 100, wantTPID: etherTypeDot1AD,
		},
		{
			name: "out-of-band tag wins over in-band",
			pkt: Packet{VLANOutOfBand: true, VLAN: 300, TPID: etherTypeDot1AD,
				Data: udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, tag{tpid: etherTypeDot1Q, vid: 200})},
			wantProto: obs.UDP, wantSrc: "10.0.0.1:1", wantDst: "10.0.0.2:2", wantVLAN: 300, wantTPID: etherTypeDot1AD,
		},
		{
			name:      "ip options",
			pkt:       Packet{Data: withIPOptions(t, tcpFrame(t, "10.0.0.1", "10.0.0.2", 1234, 80))},
			wantProto: obs.TCP, wantSrc: "10.0.0.1:1234", wantDst: "10.0.0.2:80", wantFlags: 0x02,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.pkt
			p.Time, p.Ifindex, p.Dir, p.Len, p.CapLen = when, 7, obs.DirOut, len(p.Data)+10, len(p.Data)
			o, ok := p.Observation(obs.PointUplink)
			if !ok {
				t.Fatalf("Observation: not decoded")
			}
			if o.Proto != tc.wantProto || o.Src.String() != tc.wantSrc || o.Dst.String() != tc.wantDst {
				t.Errorf("got %v %v -> %v, want %v %s -> %s", o.Proto, o.Src, o.Dst, tc.wantProto, tc.wantSrc, tc.wantDst)
			}
			if o.TCPFlags != tc.wantFlags || o.VLAN != tc.wantVLAN || o.TPID != tc.wantTPID {
				t.Errorf("flags %#x vlan %d tpid %#x, want %#x %d %#x", o.TCPFlags, o.VLAN, o.TPID, tc.wantFlags, tc.wantVLAN, tc.wantTPID)
			}
			if !o.Time.Equal(when) || o.Point != obs.PointUplink || o.Dir != obs.DirOut || o.Ifindex != 7 || o.Len != p.Len {
				t.Errorf("metadata: %+v", o)
			}
			tu, control, ok := p.Tuple()
			if want := tupleOf(o); !ok || tu != want {
				t.Errorf("Tuple %x (%v), want %x: the fields of the observation, packed", tu, ok, want)
			}
			if want := o.Proto == obs.TCP && o.TCPFlags&0x07 != 0; control != want {
				t.Errorf("Tuple says control %v for TCP flags %#x (proto %v)", control, o.TCPFlags, o.Proto)
			}
			if o.SrcMAC.String() != macA.String() || o.DstMAC.String() != macB.String() {
				t.Errorf("MACs %v -> %v, want %v -> %v", o.SrcMAC, o.DstMAC, macA, macB)
			}
			clear(p.Data)
			if o.SrcMAC.String() != macA.String() {
				t.Errorf("SrcMAC aliases the frame")
			}
		})
	}
}

// tupleOf packs an observation's fields as Tuple documents it.
func tupleOf(o obs.Observation) Tuple {
	src, dst := o.Src.Addr().As4(), o.Dst.Addr().As4()
	return Tuple{
		Addrs: uint64(binary.BigEndian.Uint32(src[:]))<<32 | uint64(binary.BigEndian.Uint32(dst[:])),
		Rest:  uint64(o.Src.Port())<<48 | uint64(o.Dst.Port())<<32 | uint64(o.Proto)<<24,
	}
}

// withIPOptions inserts a 4-byte NOP option into the IPv4 header (IHL 6).
func withIPOptions(t *testing.T, frame []byte) []byte {
	t.Helper()
	p := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default)
	ip := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
	ip.Options = []layers.IPv4Option{{OptionType: 1}, {OptionType: 1}, {OptionType: 1}, {OptionType: 0}}
	ip.IHL = 6
	tcp := p.Layer(layers.LayerTypeTCP).(*layers.TCP)
	_ = tcp.SetNetworkLayerForChecksum(ip)
	buf := gopacket.NewSerializeBuffer()
	err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet), ip, tcp)
	if err != nil {
		t.Fatal(err)
	}
	if got := buf.Bytes()[14] & 0x0f; got != 6 {
		t.Fatalf("IHL %d, want 6", got)
	}
	return buf.Bytes()
}

func TestObservationRejects(t *testing.T) {
	frag := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)
	binary.BigEndian.PutUint16(frag[14+6:], 185) // fragment offset 185*8
	icmp := buildFrame(t, nil, layers.EthernetTypeIPv4, ipv4("10.0.0.1", "10.0.0.2", layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(8, 0)})
	ip6 := &layers.IPv6{Version: 6, NextHeader: layers.IPProtocolNoNextHeader, HopLimit: 1,
		SrcIP: netip.MustParseAddr("fd00::1").AsSlice(), DstIP: netip.MustParseAddr("fd00::2").AsSlice()}
	dot1q := tag{tpid: etherTypeDot1Q, vid: 1}
	tests := map[string][]byte{
		"later fragment":       frag,
		"icmp":                 icmp,
		"ipv6":                 buildFrame(t, nil, layers.EthernetTypeIPv6, ip6),
		"tcp cut before flags": tcpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)[:14+20+13],
		"udp cut in header":    udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)[:14+20+6],
		"ip cut":               udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2)[:14+19],
		"tag cut":              udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, dot1q)[:17],
		"three tags":           udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, dot1q, dot1q, dot1q),
		"runt":                 {0xff, 0xff},
		"not version 4":        func() []byte { f := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2); f[14] = 0x65; return f }(),
		"ihl below 5":          func() []byte { f := udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2); f[14] = 0x44; return f }(),
	}
	for name, frame := range tests {
		p := Packet{Data: frame}
		if o, ok := p.Observation(obs.PointPod); ok {
			t.Errorf("%s: decoded as %+v", name, o)
		}
		if tu, _, ok := p.Tuple(); ok {
			t.Errorf("%s: Tuple %x", name, tu)
		}
	}
}

func TestAppendFrame(t *testing.T) {
	plain := udpFrame(t, "10.244.8.23", "10.120.0.10", 5000, 53)
	p := Packet{Data: plain, VLANOutOfBand: true, TPID: etherTypeDot1AD, TCI: 5<<13 | 200, VLAN: 200}
	tagged := p.AppendFrame(nil)
	if len(tagged) != len(plain)+4 {
		t.Fatalf("tagged frame has %d bytes, want %d", len(tagged), len(plain)+4)
	}
	want := udpFrame(t, "10.244.8.23", "10.120.0.10", 5000, 53, tag{tpid: etherTypeDot1AD, vid: 200, pcp: 5})
	if !bytes.Equal(tagged[:len(want)], want) {
		t.Errorf("tagged frame\n%x\nwant\n%x", tagged, want)
	}
	dec := gopacket.NewPacket(tagged, layers.LayerTypeEthernet, gopacket.Default)
	if d, ok := dec.Layer(layers.LayerTypeDot1Q).(*layers.Dot1Q); !ok || d.VLANIdentifier != 200 || d.Priority != 5 {
		t.Errorf("gopacket decodes tag %+v", dec.Layer(layers.LayerTypeDot1Q))
	}
	if dec.Layer(layers.LayerTypeUDP) == nil {
		t.Errorf("inner UDP lost: %v", dec)
	}

	p.TPID = 0 // kernel reported no TPID
	if got := binary.BigEndian.Uint16(p.AppendFrame(nil)[12:]); got != etherTypeDot1Q {
		t.Errorf("default TPID %#x, want 0x8100", got)
	}
	if p.TagLen() != 4 {
		t.Errorf("TagLen %d with an out-of-band tag, want 4", p.TagLen())
	}
	untagged := Packet{Data: plain}
	if got := untagged.AppendFrame([]byte{7}); got[0] != 7 || !bytes.Equal(got[1:], plain) || untagged.TagLen() != 0 {
		t.Errorf("frame without out-of-band tag was changed")
	}
}

// FuzzObservation checks that decoding never panics and agrees with the
// filter: a frame that decodes is accepted exactly when an address is listed
// (for an ICMP error, an address of the packet it quotes).
func FuzzObservation(f *testing.F) {
	f.Add(tcpFrame(f, "10.244.8.23", "10.120.0.80", 40000, 80))
	f.Add(udpFrame(f, "10.120.0.80", "10.0.0.1", 1, 2, tag{tpid: etherTypeDot1Q, vid: 200}))
	f.Add(udpFrame(f, "10.0.0.1", "10.0.0.2", 1, 2, tag{tpid: etherTypeDot1AD, vid: 1}, tag{tpid: etherTypeDot1Q, vid: 2}))
	f.Add(icmpFrame(f, "10.244.8.1", "10.244.8.23", 3, 0, quoteOf(udpFrame(f, "10.244.8.23", "10.120.0.80", 1, 80), 8)))
	f.Add(icmpFrame(f, "10.244.8.1", "10.244.8.23", 11, 0, quoteOf(tcpFrame(f, "10.244.8.23", "10.0.0.1", 1, 80), 8), tag{tpid: etherTypeDot1Q, vid: 2}))
	listed := netip.MustParseAddr("10.120.0.80")
	prog := mustFilter(f, 96, listed.String())
	f.Fuzz(func(t *testing.T, frame []byte) {
		p := Packet{Data: frame, Len: len(frame), CapLen: len(frame)}
		if e, ok := p.ICMPError(); ok {
			// An error is judged by its quote, as the filter does.
			want := 0
			if e.Src.Addr() == listed || e.Dst.Addr() == listed {
				want = 96
			}
			if got := runFilter(t, prog, frame); got != want {
				t.Fatalf("filter returned %d for an ICMP error about %s, want %d", got, e.QuotedString(), want)
			}
			if _, ok := p.Observation(obs.PointHost); ok {
				t.Fatalf("an ICMP error decoded as an observation")
			}
			return
		}
		o, ok := p.Observation(obs.PointHost)
		if !ok {
			return
		}
		if o.Proto != obs.TCP && o.Proto != obs.UDP || !o.Src.Addr().Is4() || !o.Dst.Addr().Is4() {
			t.Fatalf("decoded nonsense: %+v", o)
		}
		want := 0
		if o.Src.Addr() == listed || o.Dst.Addr() == listed {
			want = 96
		}
		if got := runFilter(t, prog, frame); got != want {
			t.Fatalf("filter returned %d for a frame decoded as %v -> %v, want %d", got, o.Src, o.Dst, want)
		}
	})
}

func TestClone(t *testing.T) {
	p := Packet{Data: []byte{1, 2, 3}, VLAN: 5}
	c := p.Clone()
	p.Data[0] = 9
	if c.Data[0] != 1 || c.VLAN != 5 {
		t.Errorf("clone shares data or lost fields: %+v", c)
	}
}

// Tuple reads the common frame (untagged IPv4 without options) at fixed
// offsets: it must agree with the general decoding (tupleOfLayers) on
// every frame, whatever byte is changed and wherever the frame is cut.
func TestTupleFastPathAgrees(t *testing.T) {
	frames := [][]byte{
		tcpFrame(t, "10.244.8.23", "10.120.0.80", 40000, 80),
		udpFrame(t, "10.120.0.80", "10.0.0.1", 1, 2),
		udpFrame(t, "10.0.0.1", "10.0.0.2", 1, 2, tag{tpid: etherTypeDot1Q, vid: 200}),
	}
	check := func(f []byte) {
		t.Helper()
		p := Packet{Data: f, Len: len(f), CapLen: len(f)}
		t1, c1, ok1 := p.Tuple()
		t2, c2, ok2 := p.tupleOfLayers()
		if t1 != t2 || c1 != c2 || ok1 != ok2 {
			t.Fatalf("frame %x: Tuple %v %v %v, layers %v %v %v", f, t1, c1, ok1, t2, c2, ok2)
		}
	}
	fast := 0
	for _, orig := range frames {
		for cut := 0; cut <= len(orig); cut++ {
			check(orig[:cut])
		}
		for i := range min(len(orig), 64) {
			for _, v := range []byte{0, 1, 0x02, 0x06, 0x07, 0x08, 0x11, 0x20, 0x3f, 0x40, 0x45, 0x46, 0x81, 0xff} {
				f := bytes.Clone(orig)
				f[i] = v
				check(f)
				if p := (Packet{Data: f}); len(f) >= 48 && f[12] == 8 && f[13] == 0 && f[14] == 0x45 {
					if _, _, ok := p.Tuple(); ok {
						fast++
					}
				}
			}
		}
	}
	if fast == 0 {
		t.Fatal("no frame took the fast path")
	}
}
