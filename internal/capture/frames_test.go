package capture

import (
	"net"
	"testing"
	"unsafe"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"golang.org/x/sys/unix"
)

// Test frames are encoded with gopacket, an encoder independent of the
// decoder under test.

var (
	macA = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	macB = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
)

type tag struct {
	tpid uint16
	vid  uint16
	pcp  uint8
}

// buildFrame serializes Ethernet, the in-band tags (outer first) and payload
// layers whose first one has ethernet type inner.
func buildFrame(t testing.TB, tags []tag, inner layers.EthernetType, payload ...gopacket.SerializableLayer) []byte {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: inner}
	ls := []gopacket.SerializableLayer{eth}
	if len(tags) > 0 {
		eth.EthernetType = layers.EthernetType(tags[0].tpid)
	}
	for i, tg := range tags {
		next := inner
		if i+1 < len(tags) {
			next = layers.EthernetType(tags[i+1].tpid)
		}
		ls = append(ls, &layers.Dot1Q{VLANIdentifier: tg.vid, Priority: tg.pcp, Type: next})
	}
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	if err := gopacket.SerializeLayers(buf, opts, append(ls, payload...)...); err != nil {
		t.Fatalf("serialize: %v", err)
	}
	return buf.Bytes()
}

func ipv4(src, dst string, proto layers.IPProtocol) *layers.IPv4 {
	return &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: proto,
		SrcIP: net.ParseIP(src).To4(), DstIP: net.ParseIP(dst).To4()}
}

func udpFrame(t testing.TB, src, dst string, sport, dport uint16, tags ...tag) []byte {
	ip := ipv4(src, dst, layers.IPProtocolUDP)
	udp := &layers.UDP{SrcPort: layers.UDPPort(sport), DstPort: layers.UDPPort(dport)}
	_ = udp.SetNetworkLayerForChecksum(ip)
	return buildFrame(t, tags, layers.EthernetTypeIPv4, ip, udp, gopacket.Payload("hello"))
}

func tcpFrame(t testing.TB, src, dst string, sport, dport uint16, tags ...tag) []byte {
	ip := ipv4(src, dst, layers.IPProtocolTCP)
	tcp := &layers.TCP{SrcPort: layers.TCPPort(sport), DstPort: layers.TCPPort(dport), SYN: true, Window: 1000}
	_ = tcp.SetNetworkLayerForChecksum(ip)
	return buildFrame(t, tags, layers.EthernetTypeIPv4, ip, tcp)
}

// fakePkt is one packet of a fake TPACKET_V3 block.
type fakePkt struct {
	frame     []byte
	wireLen   int // tp_len; 0 = len(frame)
	sec, nsec uint32
	status    uint32
	tci       uint32
	tpid      uint16
	ifindex   int32
	pktType   uint8
	mac       uint16 // tp_mac; 0 = where the kernel puts an Ethernet frame
}

// fakeBlock lays packets out as the kernel does (prb_fill_curr_block), using
// the x/sys/unix structs rather than the parser's offsets, so a wrong offset
// in the parser shows.
func fakeBlock(size int, pkts ...fakePkt) []byte {
	b := make([]byte, size)
	desc := (*unix.TpacketBlockDesc)(unsafe.Pointer(&b[0]))
	desc.Version = unix.TPACKET_V3
	bh := (*unix.TpacketHdrV1)(unsafe.Pointer(&desc.Hdr[0]))
	bh.Block_status = unix.TP_STATUS_USER
	bh.Num_pkts = uint32(len(pkts))
	off := int(unsafe.Sizeof(*desc))
	bh.Offset_to_first_pkt = uint32(off)
	hdrLen := tpacketAlign(unix.SizeofTpacket3Hdr)
	for i, p := range pkts {
		h := (*unix.Tpacket3Hdr)(unsafe.Pointer(&b[off]))
		mac := p.mac
		if mac == 0 { // tpacket_rcv: netoff = TPACKET_ALIGN(tp_hdrlen + max(maclen, 16)), macoff = netoff - maclen
			mac = uint16(tpacketAlign(hdrLen+unix.SizeofSockaddrLinklayer+16) - 14)
		}
		h.Sec, h.Nsec, h.Status, h.Mac = p.sec, p.nsec, p.status, mac
		h.Snaplen = uint32(len(p.frame))
		h.Len = uint32(p.wireLen)
		if p.wireLen == 0 {
			h.Len = h.Snaplen
		}
		h.Hv1.Vlan_tci, h.Hv1.Vlan_tpid = p.tci, p.tpid
		sll := (*unix.RawSockaddrLinklayer)(unsafe.Pointer(&b[off+hdrLen]))
		sll.Family, sll.Ifindex, sll.Pkttype = unix.AF_PACKET, p.ifindex, p.pktType
		copy(b[off+int(mac):], p.frame)
		total := (int(mac) + len(p.frame) + 7) &^ 7
		if i < len(pkts)-1 {
			h.Next_offset = uint32(total)
		}
		off += total
	}
	return b
}

func tpacketAlign(n int) int {
	return (n + unix.TPACKET_ALIGNMENT - 1) &^ (unix.TPACKET_ALIGNMENT - 1)
}
