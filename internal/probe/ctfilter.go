package probe

import (
	"encoding/binary"
	"net/netip"

	"golang.org/x/net/bpf"
)

// A conntrack event is a netlink message: the 16-byte nlmsghdr, the 4-byte
// nfgenmsg (family first), then attributes, the first of which is the
// original tuple (ctnetlink_conntrack_event): CTA_TUPLE_ORIG, nesting
// CTA_TUPLE_IP, nesting CTA_IP_V4_SRC then CTA_IP_V4_DST. Attribute headers
// are host-order (little-endian) length and type; addresses network order.
const (
	ctFamilyOff  = 16 // nfgenmsg.nfgen_family
	ctOrigOff    = 20 // CTA_TUPLE_ORIG header
	ctIPOff      = 24 // CTA_TUPLE_IP header
	ctSrcOff     = 28 // CTA_IP_V4_SRC header, then the address
	ctDstOff     = 36 // CTA_IP_V4_DST header
	ctDstAddrOff = 40 // the original destination address
	ctMinLen     = ctDstAddrOff + 4

	// maxCTFilterAddrs bounds the addresses one filter compares (two
	// instructions each, within the kernel's 4096); beyond, every event
	// goes to user space, which filters them as well.
	maxCTFilterAddrs = 2000
)

// Attribute types as a classic BPF half-word load sees them (big-endian),
// flag bits (NLA_F_NESTED, NLA_F_NET_BYTEORDER) masked off by nlaTypeMask.
func nlaHalf(v uint16) uint32 {
	var b [2]byte
	binary.LittleEndian.PutUint16(b[:], v)
	return uint32(binary.BigEndian.Uint16(b[:]))
}

var nlaTypeMask = nlaHalf(0x3fff)

// conntrackFilter is a classic BPF socket filter for a ctnetlink event
// socket: it drops events of other families than IPv4 and IPv4 events whose
// original destination is none of addrs, in the kernel, so a busy node's
// conntrack churn never reaches pathtrace. A message whose attributes are
// not laid out as expected passes, for user space to decide. Nil (no filter)
// for more than maxCTFilterAddrs addresses.
func conntrackFilter(addrs []netip.Addr) []bpf.RawInstruction {
	var v4 []uint32
	for _, a := range addrs {
		if a = a.Unmap(); a.Is4() {
			b := a.As4()
			v4 = append(v4, binary.BigEndian.Uint32(b[:]))
		}
	}
	if len(v4) > maxCTFilterAddrs {
		return nil
	}
	pass, drop := bpf.RetConstant{Val: 0xffffffff}, bpf.RetConstant{Val: 0}
	// Every test jumps over the return that follows it when it holds:
	// no jump is longer than one instruction (classic BPF's are 8-bit).
	prog := []bpf.Instruction{
		bpf.LoadExtension{Num: bpf.ExtLen},
		bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: ctMinLen, SkipTrue: 1},
		pass, // too short to be laid out as expected
		bpf.LoadAbsolute{Off: ctFamilyOff, Size: 1},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: 2 /* AF_INET */, SkipTrue: 1},
		drop, // IPv6: pathtrace traces IPv4 Services
	}
	for _, c := range []struct {
		off, mask, want uint32
	}{
		{ctOrigOff + 2, nlaTypeMask, nlaHalf(1)}, // CTA_TUPLE_ORIG
		{ctIPOff + 2, nlaTypeMask, nlaHalf(1)},   // CTA_TUPLE_IP
		{ctSrcOff, 0xffff, nlaHalf(8)},           // length of CTA_IP_V4_SRC
		{ctSrcOff + 2, nlaTypeMask, nlaHalf(1)},  // CTA_IP_V4_SRC
		{ctDstOff, 0xffff, nlaHalf(8)},           // length of CTA_IP_V4_DST
		{ctDstOff + 2, nlaTypeMask, nlaHalf(2)},  // CTA_IP_V4_DST
	} {
		prog = append(prog,
			bpf.LoadAbsolute{Off: c.off, Size: 2},
			bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: c.mask},
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: c.want, SkipTrue: 1},
			pass, // another layout: user space decides
		)
	}
	prog = append(prog, bpf.LoadAbsolute{Off: ctDstAddrOff, Size: 4})
	for _, a := range v4 {
		prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: a, SkipFalse: 1}, pass)
	}
	prog = append(prog, drop)
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil // cannot happen with these instructions; no filter is safe
	}
	return raw
}
