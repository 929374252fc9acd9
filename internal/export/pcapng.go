package export

import (
	"encoding/binary"
	"fmt"
	"io"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// The pcapng blocks pathtrace writes (draft-ietf-opsawg-pcapng), little
// endian, encoded by hand: the file is written for every captured packet,
// without allocating, and the binary carries no packet-decoding library.

// Block types.
const (
	blockSectionHeader   = 0x0a0d0d0a
	blockInterface       = 1
	blockInterfaceStats  = 5
	blockEnhancedPacket  = 6
	byteOrderMagic       = 0x1a2b3c4d
	linkTypeEthernet     = 1
	tsResolutionNanosecs = 9 // if_tsresol: 10^-9 s
)

// Option codes.
const (
	optEnd       = 0
	optComment   = 1
	shbHardware  = 2
	shbOS        = 3
	shbUserAppl  = 4
	ifName       = 2
	ifDesc       = 3
	ifTsresol    = 9
	epbFlags     = 2
	isbStartTime = 2
	isbEndTime   = 3
	isbIfRecv    = 4
	isbIfDrop    = 5
)

// Direction bits of epb_flags.
const (
	epbInbound  = 1
	epbOutbound = 2
)

var le = binary.LittleEndian

// beginBlock appends a block header with its length still 0; endBlock
// appends the trailing length and fills in the leading one.
func beginBlock(b []byte, typ uint32) ([]byte, int) {
	start := len(b)
	b = le.AppendUint32(b, typ)
	return le.AppendUint32(b, 0), start
}

func endBlock(b []byte, start int) []byte {
	total := uint32(len(b) - start + 4)
	le.PutUint32(b[start+4:], total)
	return le.AppendUint32(b, total)
}

func pad4(b []byte) []byte {
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// appendOption appends one option; a value longer than an option can hold
// (64 KiB) is cut.
func appendOption(b []byte, code uint16, value []byte) []byte {
	value = value[:min(len(value), 0xffff)]
	b = le.AppendUint16(b, code)
	b = le.AppendUint16(b, uint16(len(value)))
	return pad4(append(b, value...))
}

func appendStringOption(b []byte, code uint16, value string) []byte {
	if value == "" {
		return b
	}
	value = value[:min(len(value), 0xffff)]
	b = le.AppendUint16(b, code)
	b = le.AppendUint16(b, uint16(len(value)))
	return pad4(append(b, value...))
}

func appendEndOfOptions(b []byte) []byte { return le.AppendUint32(b, optEnd) }

// appendSHB appends a section header block of unknown section length.
func appendSHB(b []byte, hardware, os, app string) []byte {
	b, start := beginBlock(b, blockSectionHeader)
	b = le.AppendUint32(b, byteOrderMagic)
	b = le.AppendUint16(b, 1) // version 1.0
	b = le.AppendUint16(b, 0)
	b = le.AppendUint64(b, ^uint64(0)) // section length: not given
	b = appendStringOption(b, shbHardware, hardware)
	b = appendStringOption(b, shbOS, os)
	b = appendStringOption(b, shbUserAppl, app)
	return endBlock(appendEndOfOptions(b), start)
}

// appendIDB appends an Ethernet interface description with nanosecond
// timestamps.
func appendIDB(b []byte, name, description string, snaplen int) []byte {
	b, start := beginBlock(b, blockInterface)
	b = le.AppendUint16(b, linkTypeEthernet)
	b = le.AppendUint16(b, 0)
	b = le.AppendUint32(b, uint32(snaplen))
	b = appendStringOption(b, ifName, name)
	b = appendStringOption(b, ifDesc, description)
	b = appendOption(b, ifTsresol, []byte{tsResolutionNanosecs})
	return endBlock(appendEndOfOptions(b), start)
}

// appendTimestamp appends a nanosecond timestamp as pcapng's high and low
// 32-bit halves.
func appendTimestamp(b []byte, t time.Time) []byte {
	ts := uint64(t.UnixNano())
	b = le.AppendUint32(b, uint32(ts>>32))
	return le.AppendUint32(b, uint32(ts))
}

// appendISB appends the statistics of interface iface over [start, end].
func appendISB(b []byte, iface int, start, end time.Time, received, dropped uint64) []byte {
	b, blk := beginBlock(b, blockInterfaceStats)
	b = le.AppendUint32(b, uint32(iface))
	b = appendTimestamp(b, end)
	b = appendOption(b, isbStartTime, appendTimestamp(nil, start))
	b = appendOption(b, isbEndTime, appendTimestamp(nil, end))
	b = appendOption(b, isbIfRecv, le.AppendUint64(nil, received))
	b = appendOption(b, isbIfDrop, le.AppendUint64(nil, dropped))
	return endBlock(appendEndOfOptions(b), blk)
}

// appendEPB appends an enhanced packet block of p on interface iface, its
// frame (with an out-of-band VLAN tag written back) cut to snaplen (0 =
// whole), with its direction flag and comment. One copy of the frame, no
// allocation once b has grown.
func appendEPB(b []byte, iface int, p *capture.Packet, snaplen int, comment string) []byte {
	b, start := beginBlock(b, blockEnhancedPacket)
	b = le.AppendUint32(b, uint32(iface))
	b = appendTimestamp(b, p.Time)
	lengths := len(b)
	b = le.AppendUint64(b, 0) // captured and original length, filled in below
	data := len(b)
	b = p.AppendFrame(b)
	capLen := len(b) - data
	if snaplen > 0 && capLen > snaplen {
		b, capLen = b[:data+snaplen], snaplen
	}
	le.PutUint32(b[lengths:], uint32(capLen))
	le.PutUint32(b[lengths+4:], uint32(max(p.Len+p.TagLen(), capLen)))
	b = pad4(b)
	b = le.AppendUint16(b, epbFlags)
	b = le.AppendUint16(b, 4)
	b = le.AppendUint32(b, direction(p.Dir))
	b = appendStringOption(b, optComment, comment)
	return endBlock(appendEndOfOptions(b), start)
}

// epbLen is the length of the block appendEPB appends for the same
// arguments.
func epbLen(p *capture.Packet, snaplen int, comment string) int {
	capLen := len(p.Data) + p.TagLen()
	if snaplen > 0 && capLen > snaplen {
		capLen = snaplen
	}
	n := 28 + (capLen+3)&^3 + 8 + 4 + 4 // header, frame, flags option, end of options, trailer
	if comment != "" {
		n += 4 + (min(len(comment), 0xffff)+3)&^3
	}
	return n
}

func direction(d obs.Dir) uint32 {
	switch d {
	case obs.DirIn:
		return epbInbound
	case obs.DirOut:
		return epbOutbound
	}
	return 0
}

// countPackets walks the blocks of a pcapng file written by this package and
// counts its packet blocks per interface (of ifaces) and its bytes.
func countPackets(r io.Reader, ifaces int) (perIface []uint64, size int64, err error) {
	perIface = make([]uint64, ifaces)
	var head [12]byte
	for {
		if _, err := io.ReadFull(r, head[:]); err == io.EOF {
			return perIface, size, nil
		} else if err != nil {
			return nil, 0, fmt.Errorf("block at byte %d: %w", size, err)
		}
		typ, n := le.Uint32(head[0:]), int64(le.Uint32(head[4:]))
		if n < 12 || n%4 != 0 {
			return nil, 0, fmt.Errorf("block at byte %d: length %d", size, n)
		}
		if typ == blockEnhancedPacket {
			if i := le.Uint32(head[8:]); int(i) < ifaces {
				perIface[i]++
			}
		}
		if _, err := io.CopyN(io.Discard, r, n-12); err != nil {
			return nil, 0, fmt.Errorf("block at byte %d: %w", size, err)
		}
		size += n
	}
}
