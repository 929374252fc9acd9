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

// Tuple is what identifies a frame's flow and direction: its IPv4 addresses,
// L4 protocol and ports. It is comparable, a map key.
type Tuple struct {
	Src, Dst     [4]byte
	Sport, Dport uint16
	Proto        obs.Proto
}

// decoded is what decoding a frame found: the tuple, the TCP flags, and the
// in-band outer tag when there is one.
type decoded struct {
	tuple    Tuple
	tcpFlags uint8
	tpid     uint16 // in-band outer tag (0 = none)
	vlan     uint16
}

// Tuple decodes a frame's IPv4 TCP/UDP tuple without allocating; false for
// every frame Observation rejects.
func (p *Packet) Tuple() (Tuple, bool) {
	l, ok := p.decode()
	return l.tuple, ok
}

// decode reads Ethernet (with up to two in-band 802.1Q/802.1ad tags), IPv4
// and the TCP or UDP header. It fails for anything else: other ethertypes,
// other L4 protocols, non-first fragments (no ports) and headers cut by the
// snaplen.
func (p *Packet) decode() (l decoded, ok bool) {
	f := p.Data
	if len(f) < 14 {
		return l, false
	}
	etype := binary.BigEndian.Uint16(f[12:])
	l3 := 14
	for tags := 0; isVLANType(etype); tags++ {
		if tags == maxInbandTags || len(f) < l3+4 {
			return l, false
		}
		if tags == 0 {
			l.tpid, l.vlan = etype, binary.BigEndian.Uint16(f[l3:])&0x0fff
		}
		etype = binary.BigEndian.Uint16(f[l3+2:])
		l3 += 4
	}
	if etype != etherTypeIPv4 || len(f) < l3+20 {
		return l, false
	}
	ip := f[l3:]
	ihl := int(ip[0]&0x0f) * 4
	if ip[0]>>4 != 4 || ihl < 20 || len(ip) < ihl {
		return l, false
	}
	if binary.BigEndian.Uint16(ip[6:])&0x1fff != 0 {
		return l, false // a later fragment: no L4 header
	}
	l4 := ip[ihl:]
	switch l.tuple.Proto = obs.Proto(ip[9]); l.tuple.Proto {
	case obs.TCP:
		if len(l4) < 14 { // through the flags byte
			return l, false
		}
		l.tcpFlags = l4[13]
	case obs.UDP:
		if len(l4) < 8 {
			return l, false
		}
	default:
		return l, false
	}
	l.tuple.Src, l.tuple.Dst = [4]byte(ip[12:16]), [4]byte(ip[16:20])
	l.tuple.Sport, l.tuple.Dport = binary.BigEndian.Uint16(l4[0:]), binary.BigEndian.Uint16(l4[2:])
	return l, true
}

// Observation decodes the frame (see Tuple) into an observation. An
// out-of-band tag takes precedence over in-band ones (it is the outer one).
// Ifname and NetNS are the caller's to fill in; the observation may outlive
// Data.
func (p *Packet) Observation(point obs.Point) (obs.Observation, bool) {
	l, ok := p.decode()
	if !ok {
		return obs.Observation{}, false
	}
	o := obs.Observation{
		Time: p.Time, Point: point, Dir: p.Dir, Ifindex: p.Ifindex, Len: p.Len,
		Proto:    l.tuple.Proto,
		Src:      netip.AddrPortFrom(netip.AddrFrom4(l.tuple.Src), l.tuple.Sport),
		Dst:      netip.AddrPortFrom(netip.AddrFrom4(l.tuple.Dst), l.tuple.Dport),
		TCPFlags: l.tcpFlags,
		TPID:     l.tpid,
		VLAN:     l.vlan,
	}
	if p.VLANOutOfBand {
		o.VLAN, o.TPID = p.VLAN, p.TPID
	}
	o.DstMAC, o.SrcMAC = obs.MAC(p.Data[0:6]), obs.MAC(p.Data[6:12])
	return o, true
}
