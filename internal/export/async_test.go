package export

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAsyncFileDoesNotWaitForTheDisk: with the file's reader (here a pipe)
// stalled, Write returns at once up to the queue's depth; every chunk then
// arrives, in order, once the reader drains.
func TestAsyncFileDoesNotWaitForTheDisk(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	a := newAsyncFile(w, 0)
	var want bytes.Buffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range asyncDepth / 2 { // far beyond the pipe's 64 KiB buffer
			chunk := bytes.Repeat([]byte{byte(i)}, flushBytes)
			want.Write(chunk)
			if _, err := a.Write(chunk); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Write waited for the stalled reader")
	}
	got := make(chan []byte)
	go func() { b, _ := io.ReadAll(r); got <- b }()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	if b := <-got; !bytes.Equal(b, want.Bytes()) {
		t.Errorf("read %d bytes, want the %d written, in order", len(b), want.Len())
	}
}

// SmallFilesystem mounts a tmpfs of size (as mount's size= option) on a
// test directory, to fill up; it is unmounted when the test ends. Skips
// unless root. Exported for the package's external tests.
func SmallFilesystem(t *testing.T, size string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a small tmpfs")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
	return dir
}

// header is what asyncOnSmallFilesystem writes before the asyncFile takes
// over, as Create writes the pcapng header.
const header = 100

// asyncOnSmallFilesystem is an asyncFile on a file of a 256 KiB filesystem,
// after a header written directly.
func asyncOnSmallFilesystem(t *testing.T) (*os.File, *asyncFile) {
	t.Helper()
	f, err := os.Create(filepath.Join(SmallFilesystem(t, "256k"), "full"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if _, err := f.Write(make([]byte, header)); err != nil {
		t.Fatal(err)
	}
	return f, newAsyncFile(f, 0)
}

// TestAsyncFileDiskFull: on a full filesystem the error reaches the caller
// (at a later Write or at Close) and the file holds whole chunks only,
// after what was written before the asyncFile took over (the pcapng
// header, which Create writes directly).
func TestAsyncFileDiskFull(t *testing.T) {
	f, a := asyncOnSmallFilesystem(t)
	chunk := bytes.Repeat([]byte{7}, 48<<10)
	var werr error
	for range 64 {
		if _, werr = a.Write(chunk); werr != nil {
			break
		}
	}
	cerr := a.Close()
	for _, err := range []error{werr, cerr} {
		if err != nil && !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("error %v, want ENOSPC", err)
		}
	}
	if cerr == nil {
		t.Fatal("Close reported no error although the disk filled up")
	}
	if !strings.Contains(cerr.Error(), f.Name()) {
		t.Errorf("error %q does not name the file %s", cerr, f.Name())
	}
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if (st.Size()-header)%int64(len(chunk)) != 0 {
		t.Errorf("file of %d bytes: a chunk was cut (a %d-byte header, then chunks of %d bytes)", st.Size(), header, len(chunk))
	}
}

// TestAsyncFileDiskFullKeepsWholePages: a handed-off chunk (blockOut's
// batches, whose page boundaries lie between blocks) cut short by a full
// disk keeps the whole pages it wrote; a copied chunk (Write: one large
// block) is cut off entirely, as TestAsyncFileDiskFull checks.
func TestAsyncFileDiskFullKeepsWholePages(t *testing.T) {
	f, a := asyncOnSmallFilesystem(t)
	// One chunk larger than the filesystem: nothing before it to keep.
	if _, err := a.handOff(bytes.Repeat([]byte{7}, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Close: %v, want ENOSPC", err)
	}
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	page := int64(os.Getpagesize())
	if st.Size()%page != 0 || st.Size() < 128<<10 {
		t.Errorf("file of %d bytes after the disk filled; want the whole pages written (a multiple of %d, most of 256 KiB)", st.Size(), page)
	}
}

// TestAsyncFileReservesAhead: blocks are reserved past the data while the
// file is written (never past the limit), and Close gives them back.
func TestAsyncFileReservesAhead(t *testing.T) {
	dir := t.TempDir()
	probe, err := os.Create(filepath.Join(dir, "probe"))
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	if err := syscall.Fallocate(int(probe.Fd()), 1 /* FALLOC_FL_KEEP_SIZE */, 0, 4096); err != nil {
		t.Skipf("the filesystem of %s cannot reserve blocks: %v", dir, err)
	}
	for _, limit := range []int64{0, 600 << 10} {
		f, err := os.Create(filepath.Join(dir, fmt.Sprint("reserve-", limit)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		a := newAsyncFile(f, limit)
		chunk := bytes.Repeat([]byte{7}, 256<<10)
		if _, err := a.Write(chunk); err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		for deadline := time.Now().Add(5 * time.Second); ; {
			if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
				t.Fatal(err)
			}
			if st.Size == int64(len(chunk)) || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Millisecond)
		}
		allocated := st.Blocks * 512
		want := int64(len(chunk)) + reserveAhead
		if limit > 0 {
			want = limit
		}
		if allocated < want-4096 || allocated > want+4096 {
			t.Errorf("limit %d: %d bytes allocated while writing %d, want about %d", limit, allocated, st.Size, want)
		}
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != int64(len(chunk)) || st.Blocks*512 > st.Size+4096 {
			t.Errorf("limit %d: after Close %d bytes, %d allocated; want nothing allocated past the end", limit, st.Size, st.Blocks*512)
		}
	}
}

// TestWriteDirect: writeDirect writes everything, returns the errno of a
// failed write, and is used for local filesystems only.
func TestWriteDirect(t *testing.T) {
	path := filepath.Join(t.TempDir(), "direct")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := bytes.Repeat([]byte("pathtrace"), 100_000) // several pages
	if n, err := writeDirect(int(f.Fd()), want); n != len(want) || err != nil {
		t.Fatalf("writeDirect: %d, %v; want %d, nil", n, err, len(want))
	}
	if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("file holds %d bytes (%v), want the %d written", len(got), err, len(want))
	}
	ro, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if n, err := writeDirect(int(ro.Fd()), want); n != 0 || !errors.Is(err, syscall.EBADF) {
		t.Errorf("writeDirect to a read-only fd: %d, %v; want 0, EBADF", n, err)
	}

	for _, c := range []struct {
		name  string
		magic int64
		local bool
	}{
		{"ext4", unix.EXT4_SUPER_MAGIC, true},
		{"xfs", unix.XFS_SUPER_MAGIC, true},
		{"tmpfs", unix.TMPFS_MAGIC, true},
		{"overlayfs", unix.OVERLAYFS_SUPER_MAGIC, true},
		{"nfs", unix.NFS_SUPER_MAGIC, false},
		{"fuse", unix.FUSE_SUPER_MAGIC, false},
		{"cifs", unix.CIFS_SUPER_MAGIC, false},
		{"pipefs", unix.PIPEFS_MAGIC, false},
	} {
		if got := localFilesystem(c.magic); got != c.local {
			t.Errorf("localFilesystem(%s) = %v, want %v", c.name, got, c.local)
		}
	}
}

// TestAsyncFileLeavesDirectWritesAfterAStall: a file on a local filesystem
// is written directly until one write takes longer than directStall, then
// through the runtime; what it holds is the same.
func TestAsyncFileLeavesDirectWritesAfterAStall(t *testing.T) {
	dir := t.TempDir()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil || !localFilesystem(int64(st.Type)) {
		t.Skipf("the test's temporary directory is not on a local filesystem (type %#x, %v)", st.Type, err)
	}
	f, err := os.Create(filepath.Join(dir, "stall"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	a := newAsyncFile(f, 0)
	if !a.direct {
		t.Fatal("a file on a local filesystem is not written directly")
	}
	defer func(d time.Duration) { directStall = d }(directStall)
	directStall = -1 // every write stalls
	var want bytes.Buffer
	for i := range 3 {
		chunk := bytes.Repeat([]byte{byte('a' + i)}, 10_000)
		want.Write(chunk)
		if _, err := a.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if a.direct {
		t.Error("still written directly after a write that stalled")
	}
	if got, err := os.ReadFile(f.Name()); err != nil || !bytes.Equal(got, want.Bytes()) {
		t.Errorf("file holds %d bytes (%v), want the %d written", len(got), err, want.Len())
	}
}
