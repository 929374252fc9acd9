package hugeheap

import (
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// A process's maps around its heap: the binary, the heap's arena (mapped in
// part, reserved after), the next arena, then the kernel's mmap area.
const testMaps = `00400000-00989000 r-xp 00000000 fd:01 1234 /usr/bin/pathtrace
00989000-00f3d000 r--p 00589000 fd:01 1234 /usr/bin/pathtrace
01047000-0308b000 rw-p 00000000 00:00 0
1d0c2000-1d0e3000 rw-p 00000000 00:00 0 [heap]
1c2c5c000000-1c2c5e800000 ---p 00000000 00:00 0
1c2c5e800000-1c2c5fc00000 rw-p 00000000 00:00 0
1c2c5fc00000-1c2c60400000 rw-p 00000000 00:00 0
1c2c60400000-1c2c64000000 ---p 00000000 00:00 0
1c2c64000000-1c2c64400000 rw-p 00000000 00:00 0 [anon: Go: heap]
7f7178000000-7f7178021000 rw-p 00000000 00:00 0
7f7178021000-7f717c000000 ---p 00000000 00:00 0
7fff1000-7fff2000 rw-p 00000000 00:00 0 [stack]
`

func TestHeapMappings(t *testing.T) {
	for _, tc := range []struct {
		name string
		addr uintptr
		want []span
	}{
		{"in the arena's first mapping", 0x1c2c5e800010, []span{
			{lo: 0x1c2c5e800000, hi: 0x1c2c5fc00000, writable: true},
			{lo: 0x1c2c5fc00000, hi: 0x1c2c60400000, writable: true},
			{lo: 0x1c2c64000000, hi: 0x1c2c64400000, writable: true},
		}},
		{"in the next arena, named by the runtime", 0x1c2c64000000, []span{
			{lo: 0x1c2c5e800000, hi: 0x1c2c5fc00000, writable: true},
			{lo: 0x1c2c5fc00000, hi: 0x1c2c60400000, writable: true},
			{lo: 0x1c2c64000000, hi: 0x1c2c64400000, writable: true},
		}},
		{"in another run of anonymous mappings", 0x7f7178000100, []span{
			{lo: 0x7f7178000000, hi: 0x7f7178021000, writable: true},
		}},
	} {
		got, err := heapMappings(strings.NewReader(testMaps), tc.addr)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: got %+v, want %+v", tc.name, got, tc.want)
		}
	}
	for _, addr := range []uintptr{0x1d0c2010 /* [heap]: brk, not Go's */, 0x00400100 /* the binary */, 0x7fff1800 /* [stack] */, 0x5000} {
		if got, err := heapMappings(strings.NewReader(testMaps), addr); err == nil {
			t.Errorf("%#x: got %+v, want an error (not in an anonymous mapping)", addr, got)
		}
	}
}

// TestCollapseTheHeap checks on this process that the heap's memory in use
// is in huge pages after Collapse: the mapping that holds a heap object
// written to has huge pages, and is not marked for khugepaged.
func TestCollapseTheHeap(t *testing.T) {
	needCollapse(t)
	obj := make([]byte, 3*hugePage) // lies over at least one whole 2 MiB range
	for i := range obj {
		obj[i] = 1
	}
	n, err := Collapse()
	if err != nil {
		t.Fatal(err)
	}
	entry := smapsEntry(t, uintptr(unsafe.Pointer(&obj[0])))
	runtime.KeepAlive(obj)
	if n == 0 || entry["AnonHugePages:"] == "0" {
		t.Errorf("Collapse collapsed %d ranges; the heap's mapping holds AnonHugePages %s kB, want some", n, entry["AnonHugePages:"])
	}
	if strings.Contains(" "+entry["VmFlags:"]+" ", " hg ") {
		t.Errorf("the heap's mapping is marked MADV_HUGEPAGE (VmFlags %s): khugepaged would fill what the runtime gives back", entry["VmFlags:"])
	}
}

// TestCollapseWithinBudget: a heap that a big discovery spread over many
// 2 MiB ranges, a few pages resident in each, is collapsed only as far as
// the budget allows, from its lowest address (the runtime's page allocator
// reuses the lowest free pages first).
func TestCollapseWithinBudget(t *testing.T) {
	needCollapse(t)
	const ranges, budget = 16, 4 * hugePage
	mem := hugeRanges(t, ranges)
	for i := range ranges {
		mem[i*hugePage] = 1 // a page here and there
	}
	n := collapseSpans([]span{spanOf(mem)}, budget)
	resident := residentBytes(t, mem)
	if n == 0 || resident > budget+ranges*os.Getpagesize() {
		t.Errorf("collapsed %d ranges: %d KiB resident, want at most the budget %d KiB and the %d pages written", n, resident>>10, budget>>10, ranges)
	}
	if first := residentBytes(t, mem[:hugePage]); first != hugePage {
		t.Errorf("the lowest range has %d KiB resident, want it collapsed whole", first>>10)
	}
}

// residentBytes is how much of mem is resident (mincore).
func residentBytes(t *testing.T, mem []byte) int {
	page := os.Getpagesize()
	vec := make([]byte, len(mem)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		t.Fatal(errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n * page
}

// kernelCollapses tells whether this kernel collapses a range of anonymous
// memory this test maps and writes to.
func kernelCollapses(t *testing.T) bool {
	mem, err := unix.Mmap(-1, 0, 2*hugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	start := (uintptr(unsafe.Pointer(&mem[0])) + hugePage - 1) &^ (hugePage - 1)
	off := start - uintptr(unsafe.Pointer(&mem[0]))
	mem[off] = 1
	return unix.Madvise(mem[off:off+hugePage], unix.MADV_COLLAPSE) == nil
}

func TestDisabled(t *testing.T) {
	t.Setenv("GODEBUG", "madvdontneed=1,disablethp=1")
	if !disabled() {
		t.Error("GODEBUG=...,disablethp=1: not disabled")
	}
	t.Setenv("GODEBUG", "disablethp=0")
	dir := t.TempDir()
	defer func(setting string) { thpSetting = setting }(thpSetting)
	for setting, want := range map[string]bool{
		"always [madvise] never\n": false,
		"[always] madvise never\n": false,
		"always madvise [never]\n": true,
	} {
		thpSetting = dir + "/enabled"
		if err := os.WriteFile(thpSetting, []byte(setting), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := disabled(); got != want {
			t.Errorf("THP %q: disabled = %v, want %v", setting, got, want)
		}
	}
	thpSetting = dir + "/absent" // a kernel without THP: Collapse tries, and fails
	if disabled() {
		t.Error("no THP setting: disabled")
	}
}

// smapsEntry is the fields ("Rss:", "VmFlags:", ...) of the smaps entry
// holding addr, each with its first value (VmFlags: all of them).
func smapsEntry(t *testing.T, addr uintptr) map[string]string {
	t.Helper()
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	var entry map[string]string
	for _, line := range strings.Split(string(smaps), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok && len(f) >= 5 {
			if entry != nil {
				return entry
			}
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			if err1 == nil && err2 == nil && uintptr(l) <= addr && addr < uintptr(h) {
				entry = map[string]string{}
			}
			continue
		}
		if entry != nil && len(f) > 1 {
			if f[0] == "VmFlags:" {
				entry[f[0]] = strings.Join(f[1:], " ")
			} else {
				entry[f[0]] = f[1]
			}
		}
	}
	if entry == nil {
		t.Fatalf("no smaps entry holds %#x", addr)
	}
	return entry
}

// TestCollapseLeavesUnusedRanges: a 2 MiB range of the heap with no page
// resident (its page table kept from an earlier use) is not collapsed,
// which would make 2 MiB resident that nothing uses.
func TestCollapseLeavesUnusedRanges(t *testing.T) {
	needCollapse(t)
	const ranges = 4
	mem := hugeRanges(t, ranges)
	for i := range ranges {
		r := mem[i*hugePage : (i+1)*hugePage]
		r[0] = 1
		if i%2 == 1 { // used, then given back: its page table stays
			if err := unix.Madvise(r[:os.Getpagesize()], unix.MADV_DONTNEED); err != nil {
				t.Fatal(err)
			}
		}
	}
	collapseSpans([]span{spanOf(mem)}, ranges*hugePage)
	for i := range ranges {
		got := residentBytes(t, mem[i*hugePage:(i+1)*hugePage])
		if want := [2]int{hugePage, 0}[i%2]; got != want {
			t.Errorf("range %d: %d KiB resident, want %d KiB", i, got>>10, want>>10)
		}
	}
}

// needCollapse skips a test where Collapse does nothing: THP off, or a
// kernel without MADV_COLLAPSE.
func needCollapse(t *testing.T) {
	t.Helper()
	t.Setenv("GODEBUG", "")
	if disabled() {
		t.Skip("transparent huge pages are off on this node")
	}
	if !kernelCollapses(t) {
		t.Skip("this kernel has no MADV_COLLAPSE (Linux >= 6.1)")
	}
}

// hugeRanges maps n 2 MiB ranges of anonymous memory, aligned on a huge
// page, nothing touched; unmapped when the test ends.
func hugeRanges(t *testing.T, n int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, (n+1)*hugePage, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	base := uintptr(unsafe.Pointer(&mem[0]))
	off := ((base + hugePage - 1) &^ (hugePage - 1)) - base
	return mem[off : off+uintptr(n)*hugePage]
}

// spanOf is the heap span that mem is.
func spanOf(mem []byte) span {
	lo := uintptr(unsafe.Pointer(&mem[0]))
	return span{lo: lo, hi: lo + uintptr(len(mem)), writable: true}
}
