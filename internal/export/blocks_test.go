package export

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// recorder records each Write, like write(2) calls on the capture file.
type recorder struct {
	writes    [][]byte
	failAfter int // fail the write that would exceed this many bytes (0: never)
	size      int64
	truncated int64
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.failAfter > 0 && r.size+int64(len(p)) > int64(r.failAfter) {
		n := r.failAfter - int(r.size)
		r.size += int64(n)
		return n, errors.New("no space left on device")
	}
	r.writes = append(r.writes, bytes.Clone(p))
	r.size += int64(len(p))
	return len(p), nil
}

func (r *recorder) Truncate(n int64) error {
	r.size, r.truncated = n, n
	return nil
}

// block is a fake pcapng block of n bytes (type 6, as a packet).
func block(n int, seq byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 6)
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	b = append(b, bytes.Repeat([]byte{seq}, n-12)...)
	return binary.LittleEndian.AppendUint32(b, uint32(n))
}

// TestPageContainedWrites: whatever the block sizes, no block crosses a page
// boundary of the file (except a single block too large for a page, written
// alone), so a write cut at any page boundary ends between blocks; the blocks
// come out in order, and fillers are the only additions.
func TestPageContainedWrites(t *testing.T) {
	const page = 4096
	rng := rand.New(rand.NewPCG(4, 2))
	for round := range 50 {
		rec := &recorder{}
		o := blockOut{w: rec, file: true, pageSize: page}
		var want [][]byte
		maxSize := []int{200, 1600, 5000, 9000}[round%4]
		for i := range 500 {
			n := 12 + 4*rng.IntN(maxSize/4)
			if i%97 == 0 {
				n = page - 4*rng.IntN(3) // page-sized and the sizes that leave no room for a filler
			}
			b := block(n, byte(i))
			before := o.off + int64(len(o.pending))
			cost := o.fillerBefore(int64(n)) + int64(n)
			if _, err := o.put(b); err != nil {
				t.Fatal(err)
			}
			if after := o.off + int64(len(o.pending)); after-before != cost {
				t.Fatalf("round %d block %d (%d bytes): grew by %d, fillerBefore promised %d", round, i, n, after-before, cost)
			}
			if free := page - o.used(); o.used() != 0 && free < minBlock {
				t.Fatalf("round %d block %d: %d bytes left on the page, too few for a filler", round, i, free)
			}
			want = append(want, b)
			if rng.IntN(10) == 0 {
				o.flush() // the flush timer
			}
		}
		if err := o.flush(); err != nil {
			t.Fatal(err)
		}
		var off int64
		for _, w := range rec.writes {
			for rest, at := w, off; len(rest) > 0; {
				n := int64(binary.LittleEndian.Uint32(rest[4:]))
				oneLargeBlock := n == int64(len(w)) && n > page-minBlock && n != page
				if at/page != (at+n-1)/page && !oneLargeBlock {
					t.Fatalf("round %d: a block of %d bytes at %d crosses a page boundary", round, n, at)
				}
				rest, at = rest[n:], at+n
			}
			if len(w) > flushBytes+page {
				t.Fatalf("round %d: a write of %d bytes, more than a batch", round, len(w))
			}
			off += int64(len(w))
		}
		var got [][]byte
		for rest := bytes.Join(rec.writes, nil); len(rest) > 0; {
			n := binary.LittleEndian.Uint32(rest[4:])
			if n < minBlock || binary.LittleEndian.Uint32(rest[n-4:]) != n {
				t.Fatalf("round %d: bad block of %d bytes", round, n)
			}
			if binary.LittleEndian.Uint32(rest) != fillerType {
				got = append(got, rest[:n])
			}
			rest = rest[n:]
		}
		if len(got) != len(want) || !bytes.Equal(bytes.Join(got, nil), bytes.Join(want, nil)) {
			t.Fatalf("round %d: %d blocks came out, want the %d put in, in order", round, len(got), len(want))
		}
	}
}

// TestWritesAlignedToFlushBytes: once packets stream in, each write starts
// and ends where the file reaches a multiple of flushBytes, whatever the
// header before them and a flush by the timer: the page cache then takes a
// write as one large folio instead of a folio of every order.
func TestWritesAlignedToFlushBytes(t *testing.T) {
	const page = 4096
	rec := &recorder{}
	o := blockOut{w: rec, file: true, pageSize: page}
	o.put(block(612, 0)) // the section header and interfaces
	if err := o.flush(); err != nil {
		t.Fatal(err)
	}
	timer := -1
	for i := range 20000 {
		o.put(block(252, byte(i)))
		if i == 7000 {
			o.flush() // the flush timer, mid-page
			timer = len(rec.writes) - 1
		}
	}
	o.flush()
	var off int64
	for i, w := range rec.writes {
		end := off + int64(len(w))
		if i > 0 && i != timer && i < len(rec.writes)-1 && end%flushBytes != 0 {
			t.Errorf("write %d covers [%d, %d): does not end on a multiple of %d", i, off, end, flushBytes)
		}
		if len(w) > flushBytes {
			t.Errorf("write %d of %d bytes, more than %d", i, len(w), flushBytes)
		}
		off = end
	}
	if len(rec.writes) < 15 {
		t.Errorf("%d writes of %d bytes: the blocks were not flushed as they filled", len(rec.writes), off)
	}
}

// TestFailedWriteLeavesWholeBlocks: a write cut short (disk full) is cut
// back to the last whole block.
func TestFailedWriteLeavesWholeBlocks(t *testing.T) {
	rec := &recorder{failAfter: 100}
	o := blockOut{w: rec, file: true, pageSize: 4096}
	o.put(block(64, 1))
	if err := o.flush(); err != nil {
		t.Fatal(err)
	}
	o.put(block(64, 2))
	if err := o.flush(); err == nil {
		t.Fatal("the failing write reported no error")
	}
	if rec.size != 64 || rec.truncated != 64 || o.off != 64 {
		t.Errorf("after the failed write: file %d bytes (truncated to %d), offset %d; want 64", rec.size, rec.truncated, o.off)
	}
}

// appendEPB encodes a packet block field by field at the offsets its
// length (epbLen) leaves, whatever the frame, tag, snaplen and comment:
// each block is decoded here on its own and every field checked.
func TestEPBEncoding(t *testing.T) {
	comments := []string{"", "x", "ab", "abc", "abcd", "flow 3 request to VIP (before translation)", string(bytes.Repeat([]byte("c"), 0x10003))}
	for frameLen := 0; frameLen <= 70; frameLen++ {
		frame := make([]byte, frameLen)
		for i := range frame {
			frame[i] = byte(i + 1)
		}
		for _, oob := range []bool{false, true} {
			for _, snaplen := range []int{0, 1, 14, 60, 61, 62, 63, 64} {
				for _, comment := range comments {
					p := &capture.Packet{Time: time.Unix(1, 2), Len: frameLen + 1000, Data: frame, VLANOutOfBand: oob, TCI: 200, Dir: obs.DirIn}
					// Appended after the blocks the buffer holds (whole
					// blocks: a multiple of 4 bytes).
					prefix := []byte{0xee, 0xee, 0xee, 0xee}
					b := appendEPB(prefix[:4:4], 3, p, snaplen, comment)
					if !bytes.Equal(b[:4], prefix) {
						t.Fatalf("appendEPB changed the bytes before the block")
					}
					if err := checkEPB(b[4:], p, snaplen, comment); err != nil {
						t.Fatalf("frame %d, tag %v, snaplen %d, comment of %d: %v", frameLen, oob, snaplen, len(comment), err)
					}
				}
			}
		}
	}
}

// checkEPB decodes a packet block of interface 3 and compares it with
// what it was made of.
func checkEPB(blk []byte, p *capture.Packet, snaplen int, comment string) error {
	if len(blk) < 32 || len(blk)%4 != 0 {
		return fmt.Errorf("block of %d bytes", len(blk))
	}
	n := int(le.Uint32(blk[4:]))
	if typ := le.Uint32(blk); typ != blockEnhancedPacket || n != len(blk) || int(le.Uint32(blk[n-4:])) != n {
		return fmt.Errorf("type %d, lengths %d and %d, block of %d bytes", typ, n, le.Uint32(blk[n-4:]), len(blk))
	}
	if n != epbLen(p, snaplen, comment) {
		return fmt.Errorf("%d bytes, epbLen says %d", n, epbLen(p, snaplen, comment))
	}
	ts := uint64(le.Uint32(blk[12:]))<<32 | uint64(le.Uint32(blk[16:]))
	if iface := le.Uint32(blk[8:]); iface != 3 || ts != uint64(p.Time.UnixNano()) {
		return fmt.Errorf("interface %d, time %d", iface, ts)
	}
	want := p.AppendFrame(nil)
	if snaplen > 0 && len(want) > snaplen {
		want = want[:snaplen]
	}
	capLen, origLen := int(le.Uint32(blk[20:])), int(le.Uint32(blk[24:]))
	if capLen != len(want) || origLen != p.Len+p.TagLen() {
		return fmt.Errorf("captured %d, original %d; want %d, %d", capLen, origLen, len(want), p.Len+p.TagLen())
	}
	if !bytes.Equal(blk[28:28+capLen], want) {
		return fmt.Errorf("frame %x, want %x", blk[28:28+capLen], want)
	}
	off := 28 + capLen
	for ; off%4 != 0; off++ {
		if blk[off] != 0 {
			return fmt.Errorf("padding byte %d is %#x", off, blk[off])
		}
	}
	opts := map[uint16][]byte{}
	for {
		if off+4 > n-4 {
			return fmt.Errorf("options run past the block (at %d of %d)", off, n)
		}
		code, l := le.Uint16(blk[off:]), int(le.Uint16(blk[off+2:]))
		off += 4
		if code == optEnd {
			if l != 0 || off != n-4 {
				return fmt.Errorf("end of options of length %d at %d, block of %d", l, off, n)
			}
			break
		}
		end := off + (l+3)&^3
		if end > n-4 {
			return fmt.Errorf("option %d of %d bytes runs past the block", code, l)
		}
		for _, c := range blk[off+l : end] {
			if c != 0 {
				return fmt.Errorf("option %d padding %x", code, blk[off+l:end])
			}
		}
		opts[code] = blk[off : off+l]
		off = end
	}
	if f := opts[epbFlags]; len(f) != 4 || le.Uint32(f) != epbInbound {
		return fmt.Errorf("flags option %x", f)
	}
	wantComment := comment[:min(len(comment), 0xffff)]
	if c, ok := opts[optComment]; string(c) != wantComment || ok != (comment != "") {
		return fmt.Errorf("comment of %d bytes, want %d", len(c), len(wantComment))
	}
	if len(opts) != 1+min(1, len(comment)) {
		return fmt.Errorf("%d options", len(opts))
	}
	return nil
}
