package probe

import (
	"encoding/binary"
	"net/netip"
)

// ctEntry is what pathtrace reads of a conntrack event: the original and
// reply tuples, the entry's status bits and mark.
type ctEntry struct {
	proto        uint8
	orig, reply  ctTuple
	status, mark uint32
}

// ctTuple is one direction of a conntrack entry.
type ctTuple struct {
	src, dst netip.AddrPort
}

// ctnetlink's message and attribute types (linux/netfilter/nfnetlink.h,
// nfnetlink_conntrack.h).
const (
	nfnlSubsysCTNetlink = 1
	ipctnlMsgCTNew      = 0 // NEW and UPDATE events, the groups subscribed to

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaStatus     = 3
	ctaMark       = 8

	ctaTupleIP    = 1
	ctaTupleProto = 2

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3

	nlaTypeBits = 0x3fff // the type without NLA_F_NESTED and NLA_F_NET_BYTEORDER
	nlmsgHdrLen = 16
	nfgenHdrLen = 4
)

// nextCTMessage splits the first netlink message off b (what one read of
// the subscription's socket returned): its type and payload, and the rest.
// ok is false when b holds no whole message.
func nextCTMessage(b []byte) (typ uint16, payload, rest []byte, ok bool) {
	if len(b) < nlmsgHdrLen {
		return 0, nil, nil, false
	}
	n := int(binary.LittleEndian.Uint32(b))
	if n < nlmsgHdrLen || n > len(b) {
		return 0, nil, nil, false
	}
	typ = binary.LittleEndian.Uint16(b[4:])
	payload = b[nlmsgHdrLen:n]
	if n = align4(n); n < len(b) {
		rest = b[n:]
	}
	return typ, payload, rest, true
}

// decodeCTEvent reads the entry of a ctnetlink event message of type typ
// (nextCTMessage) in place, without allocating: at hundreds of events a
// second (every state change of every watched TCP connection is one), a
// decoder that allocates per attribute kept the garbage collector busy.
// ok is false for a message that is no conntrack entry event or has no
// original tuple; attributes pathtrace does not read are skipped.
func decodeCTEvent(typ uint16, payload []byte) (e ctEntry, ok bool) {
	if typ != nfnlSubsysCTNetlink<<8|ipctnlMsgCTNew || len(payload) < nfgenHdrLen {
		return e, false
	}
	var haveOrig bool
	for a := payload[nfgenHdrLen:]; ; {
		typ, data, rest, ok := nextAttr(a)
		if !ok {
			break
		}
		a = rest
		switch typ {
		case ctaTupleOrig:
			e.orig, e.proto, haveOrig = decodeCTTuple(data)
		case ctaTupleReply:
			e.reply, _, _ = decodeCTTuple(data)
		case ctaStatus:
			if len(data) == 4 {
				e.status = binary.BigEndian.Uint32(data)
			}
		case ctaMark:
			if len(data) == 4 {
				e.mark = binary.BigEndian.Uint32(data)
			}
		}
	}
	return e, haveOrig
}

// decodeCTTuple reads a CTA_TUPLE_ORIG or CTA_TUPLE_REPLY attribute's
// payload: addresses and ports (0 for a protocol without ports), the
// protocol number. ok is false without addresses.
func decodeCTTuple(b []byte) (t ctTuple, proto uint8, ok bool) {
	var src, dst netip.Addr
	var sport, dport uint16
	for {
		typ, data, rest, more := nextAttr(b)
		if !more {
			break
		}
		b = rest
		switch typ {
		case ctaTupleIP:
			for {
				typ, ip, rest, more := nextAttr(data)
				if !more {
					break
				}
				data = rest
				switch {
				case (typ == ctaIPv4Src || typ == ctaIPv4Dst) && len(ip) == 4,
					(typ == ctaIPv6Src || typ == ctaIPv6Dst) && len(ip) == 16:
					a, _ := netip.AddrFromSlice(ip)
					if typ == ctaIPv4Src || typ == ctaIPv6Src {
						src = a
					} else {
						dst = a
					}
				}
			}
		case ctaTupleProto:
			for {
				typ, v, rest, more := nextAttr(data)
				if !more {
					break
				}
				data = rest
				switch {
				case typ == ctaProtoNum && len(v) == 1:
					proto = v[0]
				case typ == ctaProtoSrcPort && len(v) == 2:
					sport = binary.BigEndian.Uint16(v)
				case typ == ctaProtoDstPort && len(v) == 2:
					dport = binary.BigEndian.Uint16(v)
				}
			}
		}
	}
	if !src.IsValid() || !dst.IsValid() {
		return ctTuple{}, proto, false
	}
	return ctTuple{src: netip.AddrPortFrom(src, sport), dst: netip.AddrPortFrom(dst, dport)}, proto, true
}

// nextAttr splits the first netlink attribute off b: its type (flags masked
// off), payload, and the attributes after it. more is false when b holds
// no whole attribute.
func nextAttr(b []byte) (typ uint16, data, rest []byte, more bool) {
	if len(b) < 4 {
		return 0, nil, nil, false
	}
	n := int(binary.LittleEndian.Uint16(b))
	if n < 4 || n > len(b) {
		return 0, nil, nil, false
	}
	typ = binary.LittleEndian.Uint16(b[2:]) & nlaTypeBits
	data = b[4:n]
	if n = align4(n); n < len(b) {
		rest = b[n:]
	}
	return typ, data, rest, true
}

func align4(n int) int { return (n + 3) &^ 3 }
