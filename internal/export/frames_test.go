package export_test

import (
	"net"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// Test frames are encoded with gopacket, independently of the writer.

var (
	podMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0a}
	gwMAC  = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x0b}
	t0     = time.Date(2025, 3, 1, 12, 0, 0, 123456789, time.UTC)
)

const (
	tpid8021Q  = 0x8100
	tpid8021AD = 0x88a8
)

// testIfaces are three capture points; the uplink keeps 96 bytes per frame.
var testIfaces = []export.Interface{
	{Name: "pod:eth0", Description: "netns /run/netns/pttest-pod, ifindex 2", Snaplen: 262144},
	{Name: "host:veth-a", Description: "netns /proc/1/ns/net, ifindex 7", Snaplen: 262144},
	{Name: "uplink:bond0", Description: "netns /proc/1/ns/net, ifindex 3", Snaplen: 96},
}

// tcpFrame is an untagged Ethernet/IPv4/TCP frame carrying payload bytes.
func tcpFrame(payload int) []byte {
	ip := &layers.IPv4{Version: 4, IHL: 5, TTL: 64, Protocol: layers.IPProtocolTCP,
		SrcIP: net.IPv4(10, 244, 8, 23).To4(), DstIP: net.IPv4(10, 120, 0, 80).To4()}
	tcp := &layers.TCP{SrcPort: 40000, DstPort: 80, Seq: 1, PSH: true, ACK: true, Window: 512}
	if err := tcp.SetNetworkLayerForChecksum(ip); err != nil {
		panic(err)
	}
	data := make([]byte, payload)
	for i := range data {
		data[i] = byte(i)
	}
	buf := gopacket.NewSerializeBuffer()
	opts := gopacket.SerializeOptions{FixLengths: true, ComputeChecksums: true}
	eth := &layers.Ethernet{SrcMAC: podMAC, DstMAC: gwMAC, EthernetType: layers.EthernetTypeIPv4}
	if err := gopacket.SerializeLayers(buf, opts, eth, ip, tcp, gopacket.Payload(data)); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// packet is a captured frame; a non-zero tpid carries VLAN vid out of band
// (with priority 3), as the kernel delivers it on a tagged uplink.
func packet(frame []byte, dir obs.Dir, tpid, vid uint16) *capture.Packet {
	p := &capture.Packet{Time: t0, Dir: dir, Len: len(frame), CapLen: len(frame), Data: frame}
	if tpid != 0 {
		p.VLANOutOfBand, p.TPID, p.VLAN, p.TCI = true, tpid, vid, 3<<13|vid
	}
	return p
}
