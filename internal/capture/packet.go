// Package capture taps interfaces with bounded AF_PACKET TPACKET_V3 rings and
// an in-kernel socket filter (classic BPF, or an eBPF program given by the
// caller), and turns captured frames into
// observations. It reads what only the tpacket header tells: the direction
// (sll_pkttype), VLAN tags the kernel carries out of band (with their TPID),
// and whether the L4 checksum is still to be filled in (CHECKSUM_PARTIAL).
//
// An RX tap sees a frame before tc ingress, a TX tap after tc egress
// (net/core/dev.c), which is what makes taps usable as brackets around tc.
package capture

import (
	"encoding/binary"
	"net/netip"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
	"golang.org/x/sys/unix"
)

// maxInbandTags is how many stacked in-band VLAN tags are decoded (QinQ), the
// same as FilterFor accepts.
const maxInbandTags = 2

// Packet is one captured frame and what its tpacket header said about it.
type Packet struct {
	Time    time.Time // kernel receive/transmit time, nanosecond resolution, wall clock
	Ifindex int
	PktType uint8   // sll_pkttype: unix.PACKET_HOST, PACKET_OUTGOING, ...
	Dir     obs.Dir // DirOut for PACKET_OUTGOING, DirIn otherwise

	Len    int // length of the frame (without an out-of-band tag)
	CapLen int // bytes captured, len(Data)

	// The outer VLAN tag: from the tpacket header when the kernel carried it
	// out of band (VLANOutOfBand), else from the first in-band 802.1Q/802.1ad
	// header. TPID is 0 when the frame is untagged.
	VLAN          uint16 // VLAN ID (the low 12 bits of TCI)
	TCI           uint16 // the whole tag control information (priority, DEI, ID)
	TPID          uint16
	VLANOutOfBand bool

	// CsumNotReady: the L4 checksum is incomplete (CHECKSUM_PARTIAL, common on
	// veths); it is not a bad checksum.
	CsumNotReady bool

	// Data is the frame as captured, at most the snaplen. In a callback of
	// Tap.Run it points into the ring and is valid only during the call.
	Data []byte
}

func dirOf(pktType uint8) obs.Dir {
	if pktType == unix.PACKET_OUTGOING {
		return obs.DirOut
	}
	return obs.DirIn
}

func isVLANType(t uint16) bool { return t == etherTypeDot1Q || t == etherTypeDot1AD }

// inbandTag returns the outer in-band VLAN tag of an Ethernet frame.
func inbandTag(frame []byte) (tpid, tci uint16, ok bool) {
	if len(frame) < 16 {
		return 0, 0, false
	}
	tpid = binary.BigEndian.Uint16(frame[12:])
	if !isVLANType(tpid) {
		return 0, 0, false
	}
	return tpid, binary.BigEndian.Uint16(frame[14:]), true
}

// Clone returns a copy of p whose Data the caller owns (in a Run callback,
// Data points into the ring).
func (p *Packet) Clone() *Packet {
	c := *p
	c.Data = append([]byte(nil), p.Data...)
	return &c
}

// AppendFrame appends the frame to dst with an out-of-band VLAN tag written
// back in after the MAC addresses (TPID as reported, 0x8100 when the kernel
// did not report one), as libpcap does for Ethernet captures; the wire
// length is then Len+4. Without an out-of-band tag it appends Data as is.
func (p *Packet) AppendFrame(dst []byte) []byte {
	if !p.VLANOutOfBand || len(p.Data) < 12 {
		return append(dst, p.Data...)
	}
	tpid := p.TPID
	if tpid == 0 {
		tpid = etherTypeDot1Q
	}
	dst = append(dst, p.Data[:12]...)
	dst = binary.BigEndian.AppendUint16(dst, tpid)
	dst = binary.BigEndian.AppendUint16(dst, p.TCI)
	return append(dst, p.Data[12:]...)
}

// TagLen is how many bytes AppendFrame adds to Data: 4 for a tag written
// back, else 0.
func (p *Packet) TagLen() int {
	if p.VLANOutOfBand && len(p.Data) >= 12 {
		return 4
	}
	return 0
}

// Tuple is what identifies a frame's flow and direction, packed in two
// words: Addrs holds the IPv4 source (high half) and destination, Rest the
// source port (bits 48-63), destination port (32-47), L4 protocol (24-31)
// and whether the packet is the first fragment of a fragmented datagram
// (bit 23); the low 23 bits of Rest are zero, free for the caller's own
// fields. It is comparable, a map key that hashes as 16 bytes of memory.
type Tuple struct{ Addrs, Rest uint64 }

// firstFragment is Tuple.Rest's bit for the first fragment of a datagram
// (more fragments follow; later ones have no ports and no Tuple).
const firstFragment = 1 << 23

// FirstFragment tells whether the packet is the first fragment of a
// fragmented datagram: its later fragments carry no ports (Fragment).
func (t Tuple) FirstFragment() bool { return t.Rest&firstFragment != 0 }

// Tuple decodes a frame's IPv4 TCP/UDP tuple without allocating; false for
// every frame Observation rejects. control says the frame is a TCP SYN, FIN
// or RST: one that may begin or end a connection, and so its flow. It
// reads the fields straight from the frame: at every captured packet, a
// decoded struct handed back through memory cost more than the decoding.
func (p *Packet) Tuple() (t Tuple, control, ok bool) {
	// Most frames are untagged IPv4 without options, through the TCP
	// flags: read at fixed offsets, without the general walk of layers.
	if f := p.Data; len(f) >= 14+20+14 && f[12] == 0x08 && f[13] == 0x00 && f[14] == 0x45 {
		proto := obs.Proto(f[14+9])
		frag := binary.BigEndian.Uint16(f[14+6:])
		if frag&0x1fff == 0 && (proto == obs.TCP || proto == obs.UDP) {
			t = Tuple{
				Addrs: binary.BigEndian.Uint64(f[14+12:]),
				Rest:  uint64(binary.BigEndian.Uint32(f[34:]))<<32 | uint64(proto)<<24,
			}
			if frag&0x2000 != 0 { // more fragments: the first of a datagram
				t.Rest |= firstFragment
			}
			return t, proto == obs.TCP && f[34+13]&tcpControl != 0, true
		}
	}
	return p.tupleOfLayers()
}

// tupleOfLayers is Tuple for any frame layers decodes.
func (p *Packet) tupleOfLayers() (t Tuple, control, ok bool) {
	l3, l4, proto, _, _, ok := p.layers()
	if !ok {
		return Tuple{}, false, false
	}
	f := p.Data
	t = Tuple{
		Addrs: binary.BigEndian.Uint64(f[l3+12:]),
		Rest:  uint64(binary.BigEndian.Uint32(f[l4:]))<<32 | uint64(proto)<<24,
	}
	if f[l3+6]&0x20 != 0 { // more fragments (layers refuses later ones)
		t.Rest |= firstFragment
	}
	return t, proto == obs.TCP && f[l4+13]&tcpControl != 0, true
}

// tcpControl are the TCP flags FIN, SYN and RST.
const tcpControl = 0x07

// layers finds the IPv4 header (at l3) and the TCP or UDP header (at l4) of
// an Ethernet frame with up to two in-band 802.1Q/802.1ad tags, and the
// outer in-band tag (tpid 0: none). It fails for anything else: other
// ethertypes, other L4 protocols, non-first fragments (no ports) and
// headers cut by the snaplen. Offsets, not a struct: they come back in
// registers.
func (p *Packet) layers() (l3, l4 int, proto obs.Proto, tpid, vlan uint16, ok bool) {
	f := p.Data
	if len(f) < 14 {
		return 0, 0, 0, 0, 0, false
	}
	etype := binary.BigEndian.Uint16(f[12:])
	l3 = 14
	for tags := 0; isVLANType(etype); tags++ {
		if tags == maxInbandTags || len(f) < l3+4 {
			return 0, 0, 0, 0, 0, false
		}
		if tags == 0 {
			tpid, vlan = etype, binary.BigEndian.Uint16(f[l3:])&0x0fff
		}
		etype = binary.BigEndian.Uint16(f[l3+2:])
		l3 += 4
	}
	if etype != etherTypeIPv4 || len(f) < l3+20 {
		return 0, 0, 0, 0, 0, false
	}
	ip := f[l3:]
	ihl := int(ip[0]&0x0f) * 4
	if ip[0]>>4 != 4 || ihl < 20 || len(ip) < ihl {
		return 0, 0, 0, 0, 0, false
	}
	if binary.BigEndian.Uint16(ip[6:])&0x1fff != 0 {
		return 0, 0, 0, 0, 0, false // a later fragment: no L4 header
	}
	l4 = l3 + ihl
	switch proto = obs.Proto(ip[9]); proto {
	case obs.TCP:
		if len(f) < l4+14 { // through the flags byte
			return 0, 0, 0, 0, 0, false
		}
	case obs.UDP:
		if len(f) < l4+8 {
			return 0, 0, 0, 0, 0, false
		}
	default:
		return 0, 0, 0, 0, 0, false
	}
	return l3, l4, proto, tpid, vlan, true
}

// Observation decodes the frame (see Tuple) into an observation. An
// out-of-band tag takes precedence over in-band ones (it is the outer one).
// Ifname and NetNS are the caller's to fill in; the observation may outlive
// Data.
func (p *Packet) Observation(point obs.Point) (o obs.Observation, ok bool) {
	l3, l4, proto, tpid, vlan, ok := p.layers()
	if !ok {
		return obs.Observation{}, false
	}
	// Field by field into the result: a composite literal was built on
	// the stack and copied out with wide loads over its narrow stores, a
	// store-forwarding stall that was a quarter of the decoding.
	f := p.Data
	o.Time, o.Point, o.Dir, o.Ifindex, o.Len = p.Time, point, p.Dir, p.Ifindex, p.Len
	o.Proto = proto
	o.Src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(f[l3+12:l3+16])), binary.BigEndian.Uint16(f[l4:]))
	o.Dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(f[l3+16:l3+20])), binary.BigEndian.Uint16(f[l4+2:]))
	o.TPID, o.VLAN = tpid, vlan
	if proto == obs.TCP {
		o.TCPFlags = f[l4+13]
	}
	if p.VLANOutOfBand {
		o.VLAN, o.TPID = p.VLAN, p.TPID
	}
	o.DstMAC, o.SrcMAC = obs.MAC(p.Data[0:6]), obs.MAC(p.Data[6:12])
	return o, true
}

// FragKey identifies the IPv4 datagram a fragment belongs to (source,
// destination, protocol and identification, RFC 791), packed like Tuple:
// Addrs the source (high half) and destination, Rest the identification
// (bits 32-47) and protocol (24-31); the low 24 bits are the caller's.
type FragKey struct{ Addrs, Rest uint64 }

// Fragment reports whether the frame is an IPv4 fragment, the key of its
// datagram and whether it is the first fragment (offset 0, which alone
// carries the TCP/UDP header and so the ports; Tuple decodes it).
func (p *Packet) Fragment() (k FragKey, first, ok bool) {
	l3, ok := ipv4Offset(p.Data)
	if !ok {
		return FragKey{}, false, false
	}
	ip := p.Data[l3:]
	frag := binary.BigEndian.Uint16(ip[6:])
	if frag&0x3fff == 0 { // neither more fragments nor an offset
		return FragKey{}, false, false
	}
	return FragKey{
		Addrs: binary.BigEndian.Uint64(ip[12:]),
		Rest:  uint64(binary.BigEndian.Uint16(ip[4:]))<<32 | uint64(ip[9])<<24,
	}, frag&0x1fff == 0, true
}

// Addrs4 returns the datagram's source and destination.
func (k FragKey) Addrs4() (src, dst netip.Addr) {
	return netip.AddrFrom4([4]byte{byte(k.Addrs >> 56), byte(k.Addrs >> 48), byte(k.Addrs >> 40), byte(k.Addrs >> 32)}),
		netip.AddrFrom4([4]byte{byte(k.Addrs >> 24), byte(k.Addrs >> 16), byte(k.Addrs >> 8), byte(k.Addrs)})
}

// Proto is the datagram's protocol.
func (k FragKey) Proto() obs.Proto { return obs.Proto(k.Rest >> 24) }
