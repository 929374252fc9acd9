package capture

import (
	"encoding/binary"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Layout of a TPACKET_V3 block (include/uapi/linux/if_packet.h), host byte
// order. A block starts with struct tpacket_block_desc; packets follow, each
// a struct tpacket3_hdr, then a struct sockaddr_ll at TPACKET_ALIGN(48), then
// the frame at tp_mac, all offsets relative to the packet's header.
const (
	blockDescLen     = 48 // tpacket_block_desc with tpacket_hdr_v1
	blockStatusOff   = 8  // hdr.bh1.block_status
	blockNumPktsOff  = 12 // hdr.bh1.num_pkts
	blockFirstPktOff = 16 // hdr.bh1.offset_to_first_pkt

	pktNextOff     = 0  // tp_next_offset (0 on the last packet)
	pktSecOff      = 4  // tp_sec
	pktNsecOff     = 8  // tp_nsec (V3 timestamps are nanoseconds)
	pktSnaplenOff  = 12 // tp_snaplen
	pktLenOff      = 16 // tp_len
	pktStatusOff   = 20 // tp_status
	pktMacOff      = 24 // tp_mac (u16)
	pktVlanTCIOff  = 32 // hv1.tp_vlan_tci (u32)
	pktVlanTPIDOff = 36 // hv1.tp_vlan_tpid (u16)

	sllOff        = 48 // TPACKET_ALIGN(sizeof(struct tpacket3_hdr))
	sllIfindexOff = sllOff + 4
	sllPktTypeOff = sllOff + 10
	pktMinHdrLen  = sllOff + 20 // through struct sockaddr_ll
	vlanIDMask    = 0x0fff
)

// walkBlock calls fn for each packet of a retired TPACKET_V3 block (the block
// as mapped, block descriptor first). p is filled in again for each packet and
// p.Data points into block. It stops at the first packet whose header or frame
// would fall outside the block, and reports that packet and every later one
// the block descriptor announced as malformed, so no loss goes uncounted.
func walkBlock(block []byte, p *Packet, fn func(*Packet)) (delivered, malformed int) {
	if len(block) < blockDescLen {
		return 0, 0
	}
	n := int(binary.NativeEndian.Uint32(block[blockNumPktsOff:]))
	off := int(binary.NativeEndian.Uint32(block[blockFirstPktOff:]))
	for i := range n {
		if !parsePacket(block, off, p) {
			return delivered, n - i
		}
		fn(p)
		delivered++
		next := int(binary.NativeEndian.Uint32(block[off+pktNextOff:]))
		if i < n-1 && next <= 0 {
			return delivered, n - i - 1
		}
		off += next
	}
	return delivered, 0
}

// parsePacket decodes the packet whose tpacket3_hdr is at block[off:] into p,
// or reports false if any part of it lies outside block.
func parsePacket(block []byte, off int, p *Packet) bool {
	if off < blockDescLen || off > len(block)-pktMinHdrLen {
		return false
	}
	h := block[off:]
	snaplen := int(binary.NativeEndian.Uint32(h[pktSnaplenOff:]))
	mac := int(binary.NativeEndian.Uint16(h[pktMacOff:]))
	if mac < pktMinHdrLen || snaplen > len(h)-mac {
		return false
	}
	status := binary.NativeEndian.Uint32(h[pktStatusOff:])
	// Field by field, every one of them: a composite literal was built on
	// the stack and copied into p with wide loads over its narrow stores,
	// a store-forwarding stall that was half of the time per packet.
	pktType := h[sllPktTypeOff]
	p.Time = time.Unix(int64(binary.NativeEndian.Uint32(h[pktSecOff:])),
		int64(binary.NativeEndian.Uint32(h[pktNsecOff:])))
	p.Ifindex = int(int32(binary.NativeEndian.Uint32(h[sllIfindexOff:])))
	p.PktType = pktType
	p.Dir = dirOf(pktType)
	p.Len = int(binary.NativeEndian.Uint32(h[pktLenOff:]))
	p.CapLen = snaplen
	p.CsumNotReady = status&unix.TP_STATUS_CSUMNOTREADY != 0
	p.Data = h[mac : mac+snaplen : mac+snaplen]
	p.VLANOutOfBand, p.TCI, p.TPID = false, 0, 0
	if status&unix.TP_STATUS_VLAN_VALID != 0 {
		p.VLANOutOfBand = true
		p.TCI = uint16(binary.NativeEndian.Uint32(h[pktVlanTCIOff:]))
		p.TPID = etherTypeDot1Q // kernels before 3.14 report no TPID
		if status&unix.TP_STATUS_VLAN_TPID_VALID != 0 {
			p.TPID = binary.NativeEndian.Uint16(h[pktVlanTPIDOff:])
		}
	} else if tpid, tci, ok := inbandTag(p.Data); ok {
		p.TPID, p.TCI = tpid, tci
	}
	p.VLAN = p.TCI & vlanIDMask
	return true
}

// blockEmpty reports whether a block the kernel still owns holds no packet
// yet (the kernel counts them in as it writes).
func blockEmpty(block []byte) bool {
	return atomic.LoadUint32((*uint32)(unsafe.Pointer(&block[blockNumPktsOff]))) == 0
}
