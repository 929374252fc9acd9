package export

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// smallCache shrinks the budget and window for a test.
func smallCache(t *testing.T, budget, window int64) {
	oldBudget, oldWindow := cacheBudget, cacheWindow
	cacheBudget, cacheWindow = budget, window
	t.Cleanup(func() { cacheBudget, cacheWindow = oldBudget, oldWindow })
}

// fakeCache records the ranges a cacheDropper asks for.
type fakeCache struct {
	calls []string
	fail  string // "drop" or "writeback": that call fails
}

func (f *fakeCache) dropper() *cacheDropper {
	return &cacheDropper{
		startWriteback: func(off, n int64) error { return f.call("writeback", off, n) },
		drop:           func(off, n int64) error { return f.call("drop", off, n) },
	}
}

func (f *fakeCache) call(what string, off, n int64) error {
	f.calls = append(f.calls, fmt.Sprintf("%s %d+%d", what, off, n))
	if what == f.fail {
		return errors.New("refused")
	}
	return nil
}

// TestCacheDropperRanges: nothing happens below the budget; past it, whole
// windows are written back as they fill, and each pass drops what earlier
// passes wrote back, retrying the window before once.
func TestCacheDropperRanges(t *testing.T) {
	smallCache(t, 100, 10)
	var f fakeCache
	d := f.dropper()
	steps := []struct {
		size int64
		want []string
	}{
		{50, nil},
		{99, nil},
		{105, []string{"writeback 0+100"}},
		{107, []string{"drop 0+100"}},
		{109, nil}, // nothing new to drop, no whole window since
		{123, []string{"writeback 100+20"}},
		{125, []string{"drop 90+30"}},
		{131, []string{"writeback 120+10"}},
		{131, []string{"drop 110+20"}},
		{131, nil},
	}
	for _, s := range steps {
		f.calls = nil
		if !d.pass(s.size) {
			t.Fatalf("size %d: pass failed", s.size)
		}
		if fmt.Sprint(f.calls) != fmt.Sprint(s.want) {
			t.Errorf("size %d: calls %v, want %v", s.size, f.calls, s.want)
		}
	}
}

// TestCacheDropperStopsWhenRefused: a filesystem that refuses either call
// fails the pass; the dropper then takes the writer's sizes without
// calling anything more (offer never blocks, close returns).
func TestCacheDropperStopsWhenRefused(t *testing.T) {
	smallCache(t, 10, 10)
	for _, fail := range []string{"writeback", "drop"} {
		t.Run(fail, func(t *testing.T) {
			f := fakeCache{fail: fail}
			d := f.dropper()
			size := int64(10)
			for ; size < 100 && d.pass(size); size += 10 {
			}
			if size == 100 {
				t.Fatalf("calls %v: no pass failed", f.calls)
			}
			if last := f.calls[len(f.calls)-1]; last[:len(fail)] != fail {
				t.Errorf("calls %v: the failed pass did not end with the refused %s", f.calls, fail)
			}
		})
	}
	f := fakeCache{fail: "writeback"}
	d := f.dropper()
	d.sizes, d.done = make(chan int64, 1), make(chan struct{})
	go d.run()
	for size := int64(10); size <= 10000; size += 10 {
		d.offer(size)
	}
	d.close()
	if len(f.calls) != 1 {
		t.Errorf("calls %v after a refusal, want the refused writeback only", f.calls)
	}
}

// TestCacheDropperDropsFromThePageCache runs the real calls on a file in
// the test's temporary directory: once written back (here: synced before
// each pass, so no page is still under writeback), every window but the
// newest leaves the page cache, and the file reads back whole.
func TestCacheDropperDropsFromThePageCache(t *testing.T) {
	dir := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	if !blockBacked(int64(st.Type)) {
		t.Skipf("%s is not on a block-backed filesystem (type %#x): its pages cannot be dropped", dir, st.Type)
	}
	page := int64(os.Getpagesize())
	window := 16 * page
	smallCache(t, 2*window, window)
	f, err := os.Create(filepath.Join(dir, "capture"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := newCacheDropper(int(f.Fd()))
	var want []byte
	const windows = 8
	for i := range windows {
		chunk := bytes.Repeat([]byte{byte(i + 1)}, int(window))
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
		want = append(want, chunk...)
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		if !d.pass(int64(len(want))) {
			t.Fatal("the filesystem refused sync_file_range or fadvise")
		}
	}
	d.close()
	resident, err := residentPages(f, int64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	dropped := d.dropped / page
	if dropped != (windows-1)*window/page {
		t.Fatalf("dropped up to page %d, want %d", dropped, (windows-1)*window/page)
	}
	for p, in := range resident {
		if int64(p) < dropped && in {
			t.Errorf("page %d of %d still cached, dropped up to %d", p, len(resident), dropped)
			break
		}
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("the file does not read back as written")
	}
}

// residentPages tells, per page of f's first size bytes, whether it is in
// the page cache (mincore on a shared read-only mapping).
func residentPages(f *os.File, size int64) ([]bool, error) {
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	defer unix.Munmap(m)
	vec := make([]byte, (size+int64(os.Getpagesize())-1)/int64(os.Getpagesize()))
	// x/sys/unix has no wrapper for mincore(2).
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return nil, fmt.Errorf("mincore: %w", errno)
	}
	in := make([]bool, len(vec))
	for i, v := range vec {
		in[i] = v&1 != 0
	}
	return in, nil
}

// TestCacheDropperCallsDirectly: the direct calls pass each argument where
// the kernel reads it (an offset, a length or a flag it refuses is
// refused), and a call that takes longer than directStall sends the next
// ones through the runtime.
func TestCacheDropperCallsDirectly(t *testing.T) {
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		t.Skipf("the calls go through the runtime on %s", runtime.GOARCH)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "capture"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(make([]byte, 2*os.Getpagesize())); err != nil {
		t.Fatal(err)
	}
	fd := int(f.Fd())
	d := newCacheDropper(fd)
	defer d.close()
	if d.viaRuntime {
		t.Fatal("the calls go through the runtime from the start")
	}
	const syncFileRange, fadvise = unix.SYS_SYNC_FILE_RANGE, unix.SYS_FADVISE64
	for _, c := range []struct {
		what      string
		trap      uintptr
		off, n    int64
		flag      int
		wantErrno unix.Errno // 0: none
		refused   string
	}{
		{"sync_file_range", syncFileRange, 0, 4096, unix.SYNC_FILE_RANGE_WRITE, 0, ""},
		{"sync_file_range", syncFileRange, 0, 4096, 1 << 8, unix.EINVAL, "an unknown flag"},
		{"sync_file_range", syncFileRange, -4096, 4096, unix.SYNC_FILE_RANGE_WRITE, unix.EINVAL, "a negative offset"},
		{"sync_file_range", syncFileRange, 0, -4096, unix.SYNC_FILE_RANGE_WRITE, unix.EINVAL, "a negative length"},
		{"fadvise", fadvise, 0, 4096, unix.FADV_DONTNEED, 0, ""},
		{"fadvise", fadvise, 0, 4096, 99, unix.EINVAL, "an unknown advice"},
		{"fadvise", fadvise, 0, -4096, unix.FADV_DONTNEED, unix.EINVAL, "a negative length"},
	} {
		err := d.call(c.trap, fd, c.off, c.n, c.flag)
		switch {
		case c.wantErrno == 0 && err != nil:
			t.Errorf("%s(%d, %d, %d): %v", c.what, c.off, c.n, c.flag, err)
		case c.wantErrno != 0 && !errors.Is(err, c.wantErrno):
			t.Errorf("%s with %s: %v, want %v", c.what, c.refused, err, c.wantErrno)
		}
	}
	if d.viaRuntime {
		t.Fatal("calls of a few microseconds sent the next ones through the runtime")
	}
	defer func(s time.Duration) { directStall = s }(directStall)
	directStall = -1 // every call stalls
	if err := d.startWriteback(0, 4096); err != nil {
		t.Fatal(err)
	}
	if !d.viaRuntime {
		t.Fatal("a call longer than directStall: the next ones still go directly")
	}
	if err := d.drop(0, 4096); err != nil {
		t.Fatalf("through the runtime: %v", err)
	}
}
