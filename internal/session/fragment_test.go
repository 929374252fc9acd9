package session

import (
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// fragFrame is one IPv4 fragment of a UDP datagram client -> vip: the first
// (offset 0, with the UDP header) or a later one (payload only).
func fragFrame(t *testing.T, id uint16, offset uint16, more bool) []byte {
	t.Helper()
	eth := &layers.Ethernet{SrcMAC: net.HardwareAddr{2, 0, 0, 0, 0, 1}, DstMAC: net.HardwareAddr{2, 0, 0, 0, 0, 2}, EthernetType: layers.EthernetTypeIPv4}
	ip := &layers.IPv4{Version: 4, TTL: 64, Protocol: layers.IPProtocolUDP, Id: id, FragOffset: offset,
		SrcIP: client.Addr().AsSlice(), DstIP: vip.Addr().AsSlice()}
	if more {
		ip.Flags = layers.IPv4MoreFragments
	}
	ls := []gopacket.SerializableLayer{eth, ip}
	if offset == 0 {
		udp := &layers.UDP{SrcPort: layers.UDPPort(client.Port()), DstPort: layers.UDPPort(vip.Port()), Length: 3008}
		ls = append(ls, udp)
	}
	ls = append(ls, gopacket.Payload(make([]byte, 64)))
	buf := gopacket.NewSerializeBuffer()
	if err := gopacket.SerializeLayers(buf, gopacket.SerializeOptions{}, ls...); err != nil {
		t.Fatal(err)
	}
	f := buf.Bytes()
	// SerializeOptions without FixLengths: set the IP header's own fields.
	f[14] = 0x45
	f[16], f[17] = byte((len(f)-14)>>8), byte(len(f)-14)
	return f
}

// TestLaterFragmentsFollowTheirDatagram: the fragments after the first of a
// UDP datagram to a VIP carry no ports, but belong to the flow of their first
// fragment (same addresses, protocol and IP ID): they are counted in it and
// their pcapng comment names it. A later fragment whose first was not seen
// is counted as without ports (the summary's without_ports), as the report
// says.
func TestLaterFragmentsFollowTheirDatagram(t *testing.T) {
	tr := testTracer(t, io.Discard)
	tr.pcap = nil
	tr.eng = flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}}})
	classify := func(at time.Duration, f []byte) (flow.Handle, bool) {
		var h flow.Handle
		ok := tr.classify(0, &capture.Packet{Time: base.Add(at), Dir: obs.DirOut, Len: len(f), CapLen: len(f), Data: f}, &h, new(uint8))
		return h, ok
	}
	if _, ok := classify(0, fragFrame(t, 77, 0, true)); !ok {
		t.Fatal("the first fragment found no flow")
	}
	h, ok := classify(time.Microsecond, fragFrame(t, 77, 185, true))
	if !ok {
		t.Fatal("a later fragment of the datagram found no flow")
	}
	if c, _ := tr.eng.CommentOf(&h); !strings.HasPrefix(c, "flow 1 ") {
		t.Errorf("later fragment's comment %q, want flow 1's", c)
	}
	if _, ok := classify(2*time.Microsecond, fragFrame(t, 77, 370, false)); !ok {
		t.Fatal("the last fragment of the datagram found no flow")
	}
	if _, ok := classify(3*time.Microsecond, fragFrame(t, 99, 185, false)); ok {
		t.Error("a later fragment of an unseen datagram was put in a flow")
	}
	flows := tr.eng.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	var n uint64
	for _, p := range flows[0].Points {
		n += p.Packets
	}
	if n != 3 {
		t.Errorf("flow counts %d packets, want the datagram's 3 fragments: %+v", n, flows[0].Points)
	}
	if got := tr.eng.Summary().WithoutPorts; got != 1 {
		t.Errorf("without_ports %d, want 1 (the fragment whose first was not seen)", got)
	}
}
