package probe

import (
	"encoding/binary"
	"net/netip"
	"syscall"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
)

// nla is a netlink attribute as the kernel writes it: host-order length and
// type, the payload, padding to 4 bytes.
func nla(typ uint16, payload ...[]byte) []byte {
	var p []byte
	for _, b := range payload {
		p = append(p, b...)
	}
	b := binary.LittleEndian.AppendUint16(nil, uint16(4+len(p)))
	b = binary.LittleEndian.AppendUint16(b, typ)
	b = append(b, p...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

const nlaNested = 0x8000

// ctTupleAttr is a CTA_TUPLE_ORIG or CTA_TUPLE_REPLY attribute of type typ.
func ctTupleAttr(typ uint16, proto uint8, src, dst netip.AddrPort) []byte {
	ipSrc, ipDst := uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	if src.Addr().Is6() {
		ipSrc, ipDst = ctaIPv6Src, ctaIPv6Dst
	}
	be16 := func(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }
	return nla(typ|nlaNested,
		nla(ctaTupleIP|nlaNested, nla(ipSrc, src.Addr().AsSlice()), nla(ipDst, dst.Addr().AsSlice())),
		nla(ctaTupleProto|nlaNested, nla(ctaProtoNum, []byte{proto}),
			nla(ctaProtoSrcPort|0x4000 /* NLA_F_NET_BYTEORDER */, be16(src.Port())), nla(ctaProtoDstPort, be16(dst.Port()))),
		nla(3 /* CTA_TUPLE_ZONE */, be16(0)))
}

// ctMessage is a whole ctnetlink event message of type typ with attrs.
func ctMessage(typ uint16, family uint8, attrs ...[]byte) []byte {
	body := []byte{family, 0, 0, 0} // nfgenmsg
	for _, a := range attrs {
		body = append(body, a...)
	}
	m := binary.LittleEndian.AppendUint32(nil, uint32(16+len(body)))
	m = binary.LittleEndian.AppendUint16(m, typ)
	m = binary.LittleEndian.AppendUint16(m, 0x0600) // NLM_F_CREATE|NLM_F_EXCL: a NEW event
	m = append(m, make([]byte, 8)...)               // sequence, pid
	return append(m, body...)
}

// dnatEvent is a NEW event of a DNATed TCP connection, with the attributes
// pathtrace skips (protocol info, timeout, ...) between those it reads.
func dnatEvent(family uint8, client, vip, backend netip.AddrPort) []byte {
	be32 := func(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
	return ctMessage(nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew, family,
		ctTupleAttr(ctaTupleOrig, 6, client, vip),
		ctTupleAttr(ctaTupleReply, 6, backend, client),
		nla(ctaStatus, be32(0x08|0x20)),
		nla(4|nlaNested /* CTA_PROTOINFO */, nla(1|nlaNested, nla(1, []byte{3}))),
		nla(7 /* CTA_TIMEOUT */, be32(120)),
		nla(ctaMark, be32(9)),
		nla(12 /* CTA_ID */, be32(77)),
	)
}

func TestDecodeCTEvent(t *testing.T) {
	ap := netip.MustParseAddrPort
	for _, c := range []struct {
		name                 string
		family               uint8
		client, vip, backend netip.AddrPort
	}{
		{"IPv4", 2, ap("10.244.8.23:40000"), ap("10.120.0.80:80"), ap("10.244.20.31:3000")},
		{"IPv6", 10, ap("[fd00::23]:40000"), ap("[fd00:80::1]:80"), ap("[fd00:20::31]:3000")},
	} {
		msg := dnatEvent(c.family, c.client, c.vip, c.backend)
		typ, payload, rest, ok := nextCTMessage(msg)
		if !ok || rest != nil {
			t.Fatalf("%s: nextCTMessage: ok %v, %d bytes left", c.name, ok, len(rest))
		}
		got, ok := decodeCTEvent(typ, payload)
		want := ctEntry{proto: 6, orig: ctTuple{c.client, c.vip}, reply: ctTuple{c.backend, c.client}, status: 0x28, mark: 9}
		if !ok || got != want {
			t.Errorf("%s: decodeCTEvent = %+v, %v; want %+v", c.name, got, ok, want)
		}

		// What ti-mo/conntrack, which pathtrace decoded events with
		// before, reads of the same message.
		raw, err := syscall.ParseNetlinkMessage(msg)
		if err != nil {
			t.Fatal(err)
		}
		var ev conntrack.Event
		if err := ev.Unmarshal(netlink.Message{Header: netlink.Header{Type: netlink.HeaderType(raw[0].Header.Type), Flags: netlink.HeaderFlags(raw[0].Header.Flags)}, Data: raw[0].Data}); err != nil {
			t.Fatalf("%s: conntrack.Event.Unmarshal: %v", c.name, err)
		}
		f := ev.Flow
		ref := ctEntry{
			proto:  f.TupleOrig.Proto.Protocol,
			orig:   ctTuple{netip.AddrPortFrom(f.TupleOrig.IP.SourceAddress, f.TupleOrig.Proto.SourcePort), netip.AddrPortFrom(f.TupleOrig.IP.DestinationAddress, f.TupleOrig.Proto.DestinationPort)},
			reply:  ctTuple{netip.AddrPortFrom(f.TupleReply.IP.SourceAddress, f.TupleReply.Proto.SourcePort), netip.AddrPortFrom(f.TupleReply.IP.DestinationAddress, f.TupleReply.Proto.DestinationPort)},
			status: uint32(f.Status),
			mark:   f.Mark,
		}
		if got != ref {
			t.Errorf("%s: decodeCTEvent = %+v, conntrack.Event.Unmarshal %+v", c.name, got, ref)
		}
	}
}

func TestDecodeCTEventRefuses(t *testing.T) {
	ap := netip.MustParseAddrPort
	client, vip := ap("10.244.8.23:40000"), ap("10.120.0.80:80")
	orig := ctTupleAttr(ctaTupleOrig, 17, client, vip)
	for _, c := range []struct {
		name string
		msg  []byte
	}{
		{"an expectation event", ctMessage(2<<8 /* NFNL_SUBSYS_CTNETLINK_EXP */, 2, orig)},
		{"a destroy event (not subscribed to)", ctMessage(nfnlSubsysCTNetlink<<8|2, 2, orig)},
		{"no original tuple", ctMessage(nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew, 2, ctTupleAttr(ctaTupleReply, 17, vip, client))},
		{"an original tuple without addresses", ctMessage(nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew, 2, nla(ctaTupleOrig|nlaNested, nla(ctaTupleIP|nlaNested)))},
		{"an attribute longer than the message", func() []byte {
			m := ctMessage(nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew, 2, orig)
			binary.LittleEndian.PutUint16(m[20:], uint16(len(m)))
			return m
		}()},
	} {
		typ, payload, _, ok := nextCTMessage(c.msg)
		if !ok {
			t.Fatalf("%s: nextCTMessage refuses the message", c.name)
		}
		if e, ok := decodeCTEvent(typ, payload); ok {
			t.Errorf("%s: decoded as %+v", c.name, e)
		}
	}
}

func TestNextCTMessage(t *testing.T) {
	ap := netip.MustParseAddrPort
	a := dnatEvent(2, ap("10.244.8.23:40000"), ap("10.120.0.80:80"), ap("10.244.20.31:3000"))
	b := dnatEvent(2, ap("10.244.8.23:40001"), ap("10.120.0.80:80"), ap("10.244.20.31:3000"))
	buf := append(append([]byte(nil), a...), b...)
	var clients []netip.AddrPort
	for len(buf) > 0 {
		typ, payload, rest, ok := nextCTMessage(buf)
		if !ok {
			t.Fatalf("%d bytes left that are no message", len(buf))
		}
		buf = rest
		e, _ := decodeCTEvent(typ, payload)
		clients = append(clients, e.orig.src)
	}
	if len(clients) != 2 || clients[0].Port() != 40000 || clients[1].Port() != 40001 {
		t.Errorf("two messages in one read: clients %v", clients)
	}
	for _, short := range [][]byte{a[:15], a[:len(a)-1]} {
		if _, _, _, ok := nextCTMessage(short); ok {
			t.Errorf("a cut message (%d of %d bytes) taken for whole", len(short), len(a))
		}
	}
}

func TestDecodeCTEventAllocatesNothing(t *testing.T) {
	ap := netip.MustParseAddrPort
	msg := dnatEvent(2, ap("10.244.8.23:40000"), ap("10.120.0.80:80"), ap("10.244.20.31:3000"))
	if n := testing.AllocsPerRun(100, func() {
		typ, payload, _, _ := nextCTMessage(msg)
		decodeCTEvent(typ, payload)
	}); n != 0 {
		t.Errorf("%v allocations per event, want none", n)
	}
}
