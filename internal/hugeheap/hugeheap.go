// Package hugeheap moves the Go heap's memory in use to transparent huge
// pages as the capture starts: a new flow's memory then lies in a 2 MiB page
// already resident, not in a 4 KiB page faulted in every few flows. On a VM
// a page fault costs microseconds (11 us on the lab's); in the lab, 1500
// connections to a watched VIP cost pathtrace about 1900 faults without this
// and a few tens with it, and a third to a half less CPU each.
//
// The Go runtime no longer advises its heap for huge pages itself (Go
// 1.21.1): khugepaged would fill huge pages the runtime had given back in
// part, and the heap's resident memory would creep up to what the runtime
// mapped. So the heap is collapsed once, not advised (Collapse).
package hugeheap

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// span is one mapping of /proc/self/maps.
type span struct {
	lo, hi   uintptr
	writable bool // rw-p: mapped for use; ---p is reserved address space
}

// heapMappings returns the writable anonymous mappings of the address-
// contiguous run of anonymous mappings that holds addr, read from maps
// (/proc/self/maps). The runtime reserves its heap arenas (64 MiB each,
// PROT_NONE) next to each other and maps parts of them read-write as the
// heap grows, so that run is the heap: its mapped parts, its reserved
// rest, the arenas reserved after it.
func heapMappings(maps io.Reader, addr uintptr) ([]span, error) {
	var spans []span
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		// "lo-hi perms offset dev inode [path]": anonymous with no path, or
		// a name given with PR_SET_VMA_ANON_NAME ("[anon: Go: heap]", as
		// the runtime names its own where the kernel lets it).
		f := strings.Fields(sc.Text())
		if len(f) < 5 {
			continue
		}
		if len(f) > 5 && !strings.HasPrefix(f[5], "[anon:") {
			spans = append(spans, span{}) // a file, the stack, the vdso: ends a run
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			return nil, fmt.Errorf("maps: bad range %q", f[0])
		}
		l, err1 := strconv.ParseUint(lo, 16, 64)
		h, err2 := strconv.ParseUint(hi, 16, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("maps: %w", err)
		}
		spans = append(spans, span{lo: uintptr(l), hi: uintptr(h), writable: f[1] == "rw-p"})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	at := -1
	for i, s := range spans {
		if s.lo <= addr && addr < s.hi {
			at = i
			break
		}
	}
	if at < 0 {
		return nil, fmt.Errorf("maps: no anonymous mapping holds %#x", addr)
	}
	first, last := at, at
	for first > 0 && spans[first-1].hi != 0 && spans[first-1].hi == spans[first].lo {
		first--
	}
	for last+1 < len(spans) && spans[last+1].hi != 0 && spans[last+1].lo == spans[last].hi {
		last++
	}
	var heap []span
	for _, s := range spans[first : last+1] {
		if s.writable {
			heap = append(heap, s)
		}
	}
	return heap, nil
}

// hugePage is the size of an x86-64 transparent huge page (a PMD's).
const hugePage = 2 << 20

// collapseBudget bounds the memory Collapse makes resident that was not:
// with a small ruleset the heap's ranges with a page resident add about
// that much when collapsed whole; after the discovery of a node of 5,000 kube-proxy
// Services in iptables-nft, whose garbage left pages in twice as many
// ranges, collapsing them all added 33 MB and took the peak RSS from 47
// to 69 MiB.
const collapseBudget = 16 << 20

// probe is a heap object whose address tells where the heap is (set by
// Collapse: a package variable's initial new() may be laid out in the
// binary's data, not on the heap).
var probe *[64]byte

// Collapse moves the heap's memory in use to huge pages (MADV_COLLAPSE,
// Linux >= 6.1), every 2 MiB of its mappings of which a page is resident,
// from the lowest up, as long as they add at most collapseBudget to the
// resident memory: the heap's first allocations, those of the observers'
// loading above all, left pages here and there in most of them, and each of
// those ranges is then resident whole. It returns how many it collapsed. The heap is not
// marked MADV_HUGEPAGE: where the node's THP setting is "madvise",
// khugepaged leaves it alone, its later growth and what the runtime gives
// back stay in 4 KiB pages, and its resident memory follows the runtime's
// account again once those ranges are given back. Nothing is done under
// GODEBUG=disablethp=1 or THP "never". A range that fails (one the heap
// never touched, a kernel without MADV_COLLAPSE) stays as it was.
func Collapse() (int, error) {
	if disabled() {
		return 0, nil
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0, err
	}
	probe = new([64]byte)
	heap, err := heapMappings(bytes.NewReader(maps), uintptr(unsafe.Pointer(probe)))
	if err != nil {
		return 0, err
	}
	return collapseSpans(heap, collapseBudget), nil
}

// collapseSpans collapses the 2 MiB ranges of spans, lowest address first
// (the runtime's page allocator reuses the lowest free pages first, so the
// next allocations land there), as long as what their collapse makes
// resident that was not fits in budget bytes. It returns how many.
func collapseSpans(spans []span, budget int) int {
	n := 0
	page := os.Getpagesize()
	vec := make([]byte, hugePage/page)
	for _, s := range spans {
		// One huge page at a time, by address (the heap's memory is not a
		// Go object to slice): a range that fails leaves the others
		// collapsed.
		for a := (s.lo + hugePage - 1) &^ (hugePage - 1); a+hugePage <= s.hi; a += hugePage {
			if _, _, errno := unix.Syscall(unix.SYS_MINCORE, a, hugePage, uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
				continue
			}
			added := hugePage
			for _, v := range vec {
				added -= int(v&1) * page
			}
			if added == hugePage {
				continue // nothing of it in use: left to the runtime
			}
			if added > budget {
				return n
			}
			if _, _, errno := unix.Syscall(unix.SYS_MADVISE, a, hugePage, unix.MADV_COLLAPSE); errno == 0 {
				n++
				budget -= added
			}
		}
	}
	return n
}

// thpSetting is where the kernel says when it uses transparent huge pages.
var thpSetting = "/sys/kernel/mm/transparent_hugepage/enabled"

// disabled reports whether the user turned the heap's huge pages off
// (GODEBUG=disablethp=1, the runtime's own switch), or the node's
// administrator all of them (THP "never").
func disabled() bool {
	for _, kv := range strings.Split(os.Getenv("GODEBUG"), ",") {
		if kv == "disablethp=1" {
			return true
		}
	}
	setting, err := os.ReadFile(thpSetting)
	return err == nil && bytes.Contains(setting, []byte("[never]"))
}
