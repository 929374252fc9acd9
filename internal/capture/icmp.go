package capture

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// ICMPv4 error message types: each quotes the packet it is about (RFC 792),
// that packet's IP header and at least the first 8 bytes after it. The taps'
// filters keep them when the quoted packet belongs to a watched flow.
const (
	ICMPDestUnreachable = 3
	ICMPTimeExceeded    = 11
	ICMPParamProblem    = 12
)

const ipProtoICMP = 1

// isICMPError tells whether an ICMPv4 type is one of the error messages above.
func isICMPError(typ uint8) bool {
	return typ == ICMPDestUnreachable || typ == ICMPTimeExceeded || typ == ICMPParamProblem
}

// ICMPError is an ICMPv4 error message and the packet it quotes. It is never
// a packet of the quoted flow: Tuple and Observation reject every ICMP
// frame.
type ICMPError struct {
	Type, Code uint8
	// From and To are the message's own addresses: who reports the error
	// (a router, or the quoted packet's destination) and to whom.
	From, To netip.Addr
	// The quoted packet: its protocol and addresses, with its TCP or UDP
	// ports when the quote holds them (0 otherwise, or for a later
	// fragment).
	Proto    obs.Proto
	Src, Dst netip.AddrPort
}

// ICMPError decodes an ICMPv4 error message (destination unreachable, time
// exceeded, parameter problem) in an Ethernet frame with up to two in-band
// 802.1Q/802.1ad tags, and the addresses of the packet it quotes; false for
// any other frame, for a later fragment of the message, and for a quote cut
// before its addresses (by the sender or the snaplen).
func (p *Packet) ICMPError() (ICMPError, bool) {
	f := p.Data
	l3, ok := ipv4Offset(f)
	if !ok {
		return ICMPError{}, false
	}
	ip := f[l3:]
	ihl := int(ip[0]&0x0f) * 4
	if ihl < 20 || len(ip) < ihl || ip[9] != ipProtoICMP || binary.BigEndian.Uint16(ip[6:])&0x1fff != 0 {
		return ICMPError{}, false
	}
	msg := ip[ihl:]
	if len(msg) < 8+20 || !isICMPError(msg[0]) {
		return ICMPError{}, false
	}
	q := msg[8:] // the quoted IPv4 header
	qihl := int(q[0]&0x0f) * 4
	if q[0]>>4 != 4 || qihl < 20 {
		return ICMPError{}, false
	}
	e := ICMPError{
		Type: msg[0], Code: msg[1],
		From:  netip.AddrFrom4([4]byte(ip[12:16])),
		To:    netip.AddrFrom4([4]byte(ip[16:20])),
		Proto: obs.Proto(q[9]),
	}
	var sport, dport uint16
	if l4 := q[min(qihl, len(q)):]; (e.Proto == obs.TCP || e.Proto == obs.UDP) && len(l4) >= 4 &&
		binary.BigEndian.Uint16(q[6:])&0x1fff == 0 {
		sport, dport = binary.BigEndian.Uint16(l4), binary.BigEndian.Uint16(l4[2:])
	}
	e.Src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(q[12:16])), sport)
	e.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(q[16:20])), dport)
	return e, true
}

// ipv4Offset finds the IPv4 header of an Ethernet frame behind up to two
// in-band tags, as layers does, and checks that its fixed part is there.
func ipv4Offset(f []byte) (int, bool) {
	if len(f) < 14 {
		return 0, false
	}
	etype := binary.BigEndian.Uint16(f[12:])
	l3 := 14
	for tags := 0; isVLANType(etype); tags++ {
		if tags == maxInbandTags || len(f) < l3+4 {
			return 0, false
		}
		etype = binary.BigEndian.Uint16(f[l3+2:])
		l3 += 4
	}
	if etype != etherTypeIPv4 || len(f) < l3+20 || f[l3]>>4 != 4 {
		return 0, false
	}
	return l3, true
}

// Observation is the quoted packet as an observation (protocol, addresses
// and ports only): what finds its flow (flow.Engine.Classify), never what
// is added to the flow.
func (e ICMPError) Observation() obs.Observation {
	return obs.Observation{Proto: e.Proto, Src: e.Src, Dst: e.Dst}
}

// Kind names the message, e.g. "ICMP destination unreachable (code 0: net
// unreachable)".
func (e ICMPError) Kind() string {
	var name string
	switch e.Type {
	case ICMPDestUnreachable:
		name = "destination unreachable"
	case ICMPTimeExceeded:
		name = "time exceeded"
	case ICMPParamProblem:
		name = "parameter problem"
	default:
		name = fmt.Sprintf("type %d", e.Type)
	}
	if c := icmpCodeName(e.Type, e.Code); c != "" {
		return fmt.Sprintf("ICMP %s (code %d: %s)", name, e.Code, c)
	}
	return fmt.Sprintf("ICMP %s (code %d)", name, e.Code)
}

// QuotedString renders the quoted packet, e.g. "udp 10.244.8.23:41911 ->
// 10.120.0.10:53" (ports left out when the quote has none).
func (e ICMPError) QuotedString() string {
	proto := e.Proto.String()
	if proto == "proto?" {
		proto = fmt.Sprintf("proto %d", uint8(e.Proto))
	}
	if e.Src.Port() == 0 && e.Dst.Port() == 0 {
		return fmt.Sprintf("%s %v -> %v", proto, e.Src.Addr(), e.Dst.Addr())
	}
	return fmt.Sprintf("%s %v -> %v", proto, e.Src, e.Dst)
}

// icmpCodeName names the common codes (RFC 792, RFC 1812).
func icmpCodeName(typ, code uint8) string {
	switch typ {
	case ICMPDestUnreachable:
		switch code {
		case 0:
			return "net unreachable"
		case 1:
			return "host unreachable"
		case 2:
			return "protocol unreachable"
		case 3:
			return "port unreachable"
		case 4:
			return "fragmentation needed"
		case 9, 10, 13:
			return "administratively prohibited"
		}
	case ICMPTimeExceeded:
		switch code {
		case 0:
			return "TTL exceeded in transit"
		case 1:
			return "fragment reassembly time exceeded"
		}
	}
	return ""
}
