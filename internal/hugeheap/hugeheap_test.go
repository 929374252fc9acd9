package hugeheap

import (
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"
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

// TestAdviseMarksTheHeap checks on this process that the mapping holding a
// fresh heap object is marked for huge pages ("hg" in its smaps VmFlags).
func TestAdviseMarksTheHeap(t *testing.T) {
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil {
		t.Skip("this kernel has no transparent huge pages")
	}
	t.Setenv("GODEBUG", "")
	if err := Advise(); err != nil {
		t.Fatal(err)
	}
	obj := new([1 << 10]byte)
	flags := vmFlags(t, uintptr(unsafe.Pointer(obj)))
	runtime.KeepAlive(obj)
	if !strings.Contains(" "+flags+" ", " hg ") {
		t.Errorf("the heap's mapping has VmFlags %q after Advise, want hg among them", flags)
	}
}

func TestAdviseHonorsDisableTHP(t *testing.T) {
	t.Setenv("GODEBUG", "madvdontneed=1,disablethp=1")
	if !disabled() {
		t.Error("GODEBUG=...,disablethp=1: not disabled")
	}
	t.Setenv("GODEBUG", "disablethp=0")
	if disabled() {
		t.Error("GODEBUG=disablethp=0: disabled")
	}
}

// vmFlags is the VmFlags line of the smaps entry holding addr.
func vmFlags(t *testing.T, addr uintptr) string {
	t.Helper()
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	in := false
	for _, line := range strings.Split(string(smaps), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok && len(f) >= 5 {
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uintptr(l) <= addr && addr < uintptr(h)
			continue
		}
		if in && f[0] == "VmFlags:" {
			return strings.Join(f[1:], " ")
		}
	}
	t.Fatalf("no smaps entry holds %#x", addr)
	return ""
}
