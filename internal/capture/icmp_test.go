package capture

import (
	"testing"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// icmpFrame is an ICMPv4 message of type typ and code from src to dst that
// quotes quote (see quoteOf), behind tags.
func icmpFrame(t testing.TB, src, dst string, typ, code uint8, quote []byte, tags ...tag) []byte {
	t.Helper()
	return buildFrame(t, tags, layers.EthernetTypeIPv4, ipv4(src, dst, layers.IPProtocolICMPv4),
		&layers.ICMPv4{TypeCode: layers.CreateICMPv4TypeCode(typ, code)}, gopacket.Payload(quote))
}

// quoteOf is what an ICMP error quotes of an untagged Ethernet frame: its IP
// header and the next n bytes (RFC 792 asks for 8).
func quoteOf(frame []byte, n int) []byte {
	ihl := int(frame[14]&0x0f) * 4
	return append([]byte(nil), frame[14:14+ihl+n]...)
}

// withOuterIPOptions gives an ICMP frame's (untagged) IPv4 header 4 bytes of
// options (IHL 6).
func withOuterIPOptions(t *testing.T, frame []byte) []byte {
	t.Helper()
	p := gopacket.NewPacket(frame, layers.LayerTypeEthernet, gopacket.Default)
	ip := p.Layer(layers.LayerTypeIPv4).(*layers.IPv4)
	ip.Options = []layers.IPv4Option{{OptionType: 1}, {OptionType: 1}, {OptionType: 1}, {OptionType: 0}}
	ip.IHL = 6
	buf := gopacket.NewSerializeBuffer()
	err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true},
		p.Layer(layers.LayerTypeEthernet).(*layers.Ethernet), ip, gopacket.Payload(ip.Payload))
	if err != nil {
		t.Fatal(err)
	}
	if got := buf.Bytes()[14] & 0x0f; got != 6 {
		t.Fatalf("IHL %d, want 6", got)
	}
	return buf.Bytes()
}

func TestICMPError(t *testing.T) {
	const gw, client = "10.244.8.1", "10.244.8.23"
	udpReq := udpFrame(t, client, "10.120.0.10", 41911, 53)
	tcpReq := tcpFrame(t, client, "10.120.0.80", 40000, 80)
	qinq := []tag{{tpid: etherTypeDot1AD, vid: 100}, {tpid: etherTypeDot1Q, vid: 200}}
	for _, tc := range []struct {
		name               string
		frame              []byte
		kind, quoted, from string
	}{
		{"net unreachable about UDP", icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8)),
			"ICMP destination unreachable (code 0: net unreachable)", "udp 10.244.8.23:41911 -> 10.120.0.10:53", gw},
		{"the whole datagram quoted, 802.1Q", icmpFrame(t, gw, client, 3, 1, quoteOf(udpReq, 13), tag{tpid: etherTypeDot1Q, vid: 200}),
			"ICMP destination unreachable (code 1: host unreachable)", "udp 10.244.8.23:41911 -> 10.120.0.10:53", gw},
		{"port unreachable from the destination, QinQ", icmpFrame(t, "10.120.0.10", client, 3, 3, quoteOf(udpReq, 8), qinq...),
			"ICMP destination unreachable (code 3: port unreachable)", "udp 10.244.8.23:41911 -> 10.120.0.10:53", "10.120.0.10"},
		{"time exceeded about TCP, 8 bytes quoted", icmpFrame(t, gw, client, 11, 0, quoteOf(tcpReq, 8)),
			"ICMP time exceeded (code 0: TTL exceeded in transit)", "tcp 10.244.8.23:40000 -> 10.120.0.80:80", gw},
		{"parameter problem, an unnamed code", icmpFrame(t, gw, client, 12, 1, quoteOf(tcpReq, 8)),
			"ICMP parameter problem (code 1)", "tcp 10.244.8.23:40000 -> 10.120.0.80:80", gw},
		{"quoted IP options", icmpFrame(t, gw, client, 3, 0, quoteOf(withIPOptions(t, tcpReq), 8)),
			"ICMP destination unreachable (code 0: net unreachable)", "tcp 10.244.8.23:40000 -> 10.120.0.80:80", gw},
		{"outer IP options", withOuterIPOptions(t, icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8))),
			"ICMP destination unreachable (code 0: net unreachable)", "udp 10.244.8.23:41911 -> 10.120.0.10:53", gw},
		{"quote cut before the ports", icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 2)),
			"ICMP destination unreachable (code 0: net unreachable)", "udp 10.244.8.23 -> 10.120.0.10", gw},
		{"quoted later fragment", icmpFrame(t, gw, client, 3, 0, func() []byte {
			q := quoteOf(udpReq, 8)
			q[6], q[7] = 0, 0x10
			return q
		}()), "ICMP destination unreachable (code 0: net unreachable)", "udp 10.244.8.23 -> 10.120.0.10", gw},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := Packet{Data: tc.frame}
			e, ok := p.ICMPError()
			if !ok {
				t.Fatal("not decoded")
			}
			if got := e.Kind(); got != tc.kind {
				t.Errorf("Kind %q, want %q", got, tc.kind)
			}
			if got := e.QuotedString(); got != tc.quoted {
				t.Errorf("quoted %q, want %q", got, tc.quoted)
			}
			if e.From.String() != tc.from || e.To.String() != client {
				t.Errorf("message %v -> %v, want %s -> %s", e.From, e.To, tc.from, client)
			}
			if o := e.Observation(); o.Proto != e.Proto || o.Src != e.Src || o.Dst != e.Dst {
				t.Errorf("Observation %+v, want the quoted packet %v", o, e)
			}
			// Never a packet of the quoted flow.
			if o, ok := p.Observation(obs.PointPod); ok {
				t.Errorf("Observation decoded the error as %v %v -> %v", o.Proto, o.Src, o.Dst)
			}
			if tu, _, ok := p.Tuple(); ok {
				t.Errorf("Tuple decoded the error: %x", tu)
			}
		})
	}
}

func TestICMPErrorRejects(t *testing.T) {
	const gw, client = "10.244.8.1", "10.244.8.23"
	udpReq := udpFrame(t, client, "10.120.0.10", 41911, 53)
	dot1q := tag{tpid: etherTypeDot1Q, vid: 200}
	fragment := icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8))
	fragment[14+6], fragment[14+7] = 0, 0x10
	quoted6 := quoteOf(udpReq, 8)
	quoted6[0] = 0x65
	longIHL := icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8))
	longIHL[14] = 0x4f // 60 bytes of header in a 56-byte packet
	for name, frame := range map[string][]byte{
		"echo reply":                  icmpFrame(t, gw, client, 0, 0, quoteOf(udpReq, 8)),
		"redirect":                    icmpFrame(t, gw, client, 5, 0, quoteOf(udpReq, 8)),
		"quote cut in the addresses":  icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8)[:19]),
		"frame cut in the quote":      icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8))[:14+20+8+16],
		"later fragment of the error": fragment,
		"IHL beyond the frame":        longIHL,
		"quote not IPv4":              icmpFrame(t, gw, client, 3, 0, quoted6),
		"three tags":                  icmpFrame(t, gw, client, 3, 0, quoteOf(udpReq, 8), dot1q, dot1q, dot1q),
		"udp":                         udpReq,
		"runt":                        {1, 2, 3},
	} {
		p := Packet{Data: frame}
		if e, ok := p.ICMPError(); ok {
			t.Errorf("%s: decoded as %+v", name, e)
		}
	}
}
