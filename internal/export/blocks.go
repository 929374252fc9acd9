package export

import (
	"encoding/binary"
	"fmt"
	"io"
	"time"
)

// blockOut writes whole pcapng blocks so that the output never ends inside a
// block, whenever the writing process dies.
//
// To a stream (file false, a pipe to Wireshark) whole blocks are batched up
// to pipeBuf bytes per Write (or flushInterval, whichever first): a pipe
// write of at most PIPE_BUF bytes is atomic, so a reader never gets part of
// a block, whenever the writer dies. A block longer than that goes alone.
// One write per packet cost five times the CPU of the file at 100k
// packets a second.
//
// To the capture file it owns (file true), no block crosses a page
// boundary of the file, because the kernel copies a regular-file write page
// (folio) by page and gives up between two pages when a fatal signal is
// pending (mm/filemap.c generic_perform_write): SIGKILL during the write of
// a block that crosses a boundary leaves its first part at the end of the
// file; one within a page is all or nothing. So blocks are batched in memory
// up to the end of the current page, and a block that would cross it starts
// the next page, the rest of the current one taken by a filler block (a
// block type for local use, which readers skip). The cost is the filler:
// on average half a block per page. Since no block crosses a page boundary,
// a write of many pages cut at any boundary still ends between blocks: pages
// are batched up to flushBytes per write (or flushInterval, whichever first).
//
// A block longer than a page less a filler's size (frames above ~4 KB: a
// snaplen that large and jumbo or GSO frames) cannot avoid crossing; it is
// written alone, with one write, and SIGKILL during those few microseconds
// can still cut it. That is the residual risk.
type blockOut struct {
	w        io.Writer
	file     bool
	pageSize int64
	off      int64  // bytes written to w
	pending  []byte // whole blocks not written yet
	// pendingSince is when the oldest of them was added (zero while none
	// is pending): the writer's flush timer writes them once they are
	// flushInterval old, not sooner.
	pendingSince time.Time
}

// pipeBuf is Linux's PIPE_BUF: the largest pipe write that is atomic.
const pipeBuf = 4096

// fillerType is a pcapng block type for local use (0x80000000 and up), which
// readers skip: "PT" pad.
const fillerType = 0x80005054

// minBlock is the smallest pcapng block: type, length, length.
const minBlock = 12

// flushBytes is how much a file write carries at most when batching whole
// pages: one write(2) per 256 KiB instead of per page. Large writes are
// cheaper per byte (fewer calls into the filesystem), and each write that
// blocks for a while costs the Go scheduler a hand-off of its processor.
// 1 MiB writes took about 5% less CPU per packet at 100k packets a second,
// but the buffers in flight raised the long run's peak RSS by 3 MiB (to
// 63 MiB, against the 64 MiB bound) and its garbage collections. A power
// of two, a multiple of the page size (flushFullPages aligns writes to it).
const flushBytes = 256 << 10

// fillerBefore returns the size of the filler that must precede a block of n
// bytes at the current position, 0 for none.
//
// Invariant: the free rest of the current page is 0 or at least minBlock, so
// that a filler always fits.
func (o *blockOut) fillerBefore(n int64) int64 {
	if !o.file {
		return 0
	}
	used := o.used()
	free := o.pageSize - used
	if n <= o.pageSize-minBlock || n == o.pageSize {
		if n == free || n <= free-minBlock {
			return 0
		}
		return free // start on the next page
	}
	// A block that crosses a boundary wherever it starts: it must not leave
	// less than a filler's room on its last page.
	if end := (used + n) % o.pageSize; end != 0 && o.pageSize-end < minBlock {
		return minBlock
	}
	return 0
}

// put writes (or queues) the filler fillerBefore asked for, then the block,
// and reports whether blocks are left pending (the caller flushes them
// within flushInterval).
func (o *blockOut) put(block []byte) (pending bool, err error) {
	dst, inPlace, err := o.room(int64(len(block)))
	if err != nil {
		return false, err
	}
	if !inPlace {
		return false, o.write(block)
	}
	return o.appended(append(dst, block...))
}

// room readies the output for a block of n bytes (the filler fillerBefore
// asks for, and a flush when the block would not fit) and returns the
// pending blocks to append it to, so that it is encoded in place; not
// inPlace when the block must go alone, in one write of its own.
func (o *blockOut) room(n int64) (dst []byte, inPlace bool, err error) {
	if !o.file {
		if int64(len(o.pending))+n > pipeBuf {
			if err := o.flush(); err != nil {
				return nil, false, err
			}
		}
		return o.pending, n <= pipeBuf, nil
	}
	if f := o.fillerBefore(n); f > 0 {
		if len(o.pending) == 0 {
			o.pendingSince = time.Now()
		}
		o.pending = appendFiller(o.pending, f)
		if err := o.flushFullPages(); err != nil {
			return nil, false, err
		}
	}
	if o.used()+n > o.pageSize {
		// Crosses a boundary whatever we do: alone, in one write.
		return nil, false, o.flush()
	}
	return o.pending, true, nil
}

// appended takes back what room returned with the block appended, and
// reports whether blocks are left pending.
func (o *blockOut) appended(pending []byte) (bool, error) {
	if len(o.pending) == 0 {
		o.pendingSince = time.Now()
	}
	o.pending = pending
	if !o.file {
		return true, nil
	}
	if err := o.flushFullPages(); err != nil {
		return false, err
	}
	return len(o.pending) > 0, nil
}

// flushFullPages writes the pending blocks once they end where the file
// reaches a multiple of flushBytes (or, past a boundary that a block larger
// than a page stepped over, once they amount to flushBytes and end a page).
// Writes then start and end on flushBytes boundaries of the file: the page
// cache takes each one as a single large folio, where a write that starts
// elsewhere is cut into folios of every order down to one page, each
// looked up, allocated and accounted for apart (ext4's write_begin was half
// of the kernel's time per write).
func (o *blockOut) flushFullPages() error {
	if o.used() != 0 {
		return nil
	}
	if at := o.off + int64(len(o.pending)); at&(flushBytes-1) == 0 && len(o.pending) > 0 || len(o.pending) >= flushBytes {
		return o.flush()
	}
	return nil
}

// used is how much of the current page the written and pending blocks fill.
// A page is a power of two: the mask, not a division (three per packet).
func (o *blockOut) used() int64 {
	at := o.off + int64(len(o.pending))
	if o.pageSize&(o.pageSize-1) == 0 {
		return at & (o.pageSize - 1)
	}
	return at % o.pageSize
}

// appendFiller appends a skippable block of n bytes (n >= minBlock, a
// multiple of 4).
func appendFiller(b []byte, n int64) []byte {
	b = binary.LittleEndian.AppendUint32(b, fillerType)
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	b = append(b, make([]byte, n-minBlock)...)
	return binary.LittleEndian.AppendUint32(b, uint32(n))
}

// handOffer is a writer that takes ownership of a buffer instead of copying
// it (asyncFile).
type handOffer interface {
	handOff(p []byte) (next []byte, err error)
}

func (o *blockOut) flush() error {
	if len(o.pending) == 0 {
		return nil
	}
	o.pendingSince = time.Time{}
	if h, ok := o.w.(handOffer); ok {
		n := len(o.pending)
		next, err := h.handOff(o.pending)
		if cap(next) == 0 {
			next = make([]byte, 0, flushBytes+o.pageSize)
		}
		o.pending = next
		if err == nil {
			o.off += int64(n)
		}
		return err
	}
	err := o.write(o.pending)
	o.pending = o.pending[:0]
	return err
}

// write writes whole blocks with one Write; after a failed write (a full
// disk) it cuts the file back to the last whole block.
func (o *blockOut) write(b []byte) error {
	n, err := o.w.Write(b)
	if err == nil {
		o.off += int64(n)
		return nil
	}
	if t, ok := o.w.(interface{ Truncate(int64) error }); ok && o.file && n > 0 {
		if terr := t.Truncate(o.off); terr != nil {
			return fmt.Errorf("%w (and cutting the partial block off failed: %v)", err, terr)
		}
	}
	return err
}
