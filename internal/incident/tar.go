package incident

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// OmittedFile names the archive member that lists what Tar left out.
const OmittedFile = "OMITTED.txt"

// OmittedError is returned by Tar when the archive was written without some
// files, because with them it would have exceeded its byte bound. The bundle
// directory still holds them.
type OmittedError struct {
	Archive  string
	MaxBytes int64
	Files    []File // name and size of each file left out
}

func (e *OmittedError) Error() string {
	names := make([]string, len(e.Files))
	for i, f := range e.Files {
		names[i] = fmt.Sprintf("%s (%d bytes)", f.Name, f.Bytes)
	}
	return fmt.Sprintf("%s was written without %s: with them it would exceed %d bytes (they are still in the bundle directory; %s in the archive lists them)",
		e.Archive, strings.Join(names, ", "), e.MaxBytes, OmittedFile)
}

// firstFiles go first into an archive and are never left out: they say what
// the rest is.
var firstFiles = []string{SummaryFile, ManifestText, ManifestJSON}

// Tar writes out, a .tar.gz of dir (members under dir's base name, mode 0600,
// written to out.partial and renamed when complete, never over an existing
// out). maxBytes > 0 bounds the
// archive: when everything would not fit, the largest files are left out, an
// OMITTED.txt member lists them and the result is an *OmittedError. When not
// even the summary and manifest fit, nothing is written.
func Tar(dir, out string, maxBytes int64) error {
	files, err := bundleFiles(dir, out)
	if err != nil {
		return err
	}
	keep, omitted := planArchive(files, maxBytes)
	if keep == nil {
		return fmt.Errorf("incident archive: not written: even %s alone would exceed %d bytes", strings.Join(firstFiles, ", "), maxBytes)
	}
	partial := out + ".partial"
	if err := writeArchive(dir, partial, keep, omitted, maxBytes); err != nil {
		os.Remove(partial)
		return err
	}
	if err := renameNoReplace(partial, out); err != nil {
		os.Remove(partial)
		return fmt.Errorf("incident archive: %w", err)
	}
	if len(omitted) > 0 {
		return &OmittedError{Archive: out, MaxBytes: maxBytes, Files: omitted}
	}
	return nil
}

// bundleFiles lists dir's regular files (paths relative to dir), the first
// files first, then by name. The archive itself must not be among them.
func bundleFiles(dir, out string) ([]File, error) {
	absDir, err1 := filepath.Abs(dir)
	absOut, err2 := filepath.Abs(out)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("incident archive: %w", err)
	}
	if strings.HasPrefix(absOut, absDir+string(filepath.Separator)) {
		return nil, fmt.Errorf("incident archive: %s is inside the bundle directory %s", out, dir)
	}
	var files []File
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil // directories are walked, links and devices skipped
		}
		st, err := d.Info()
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return err
		}
		files = append(files, File{Name: filepath.ToSlash(rel), Bytes: st.Size()})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("incident archive: %w", err)
	}
	slices.SortStableFunc(files, func(a, b File) int {
		ra, rb := firstRank(a.Name), firstRank(b.Name)
		if ra != rb {
			return ra - rb
		}
		return strings.Compare(a.Name, b.Name)
	})
	return files, nil
}

func firstRank(name string) int {
	if i := slices.Index(firstFiles, name); i >= 0 {
		return i
	}
	return len(firstFiles)
}

// archiveCost bounds what a file adds to a .tar.gz: a 512-byte header, the
// data padded to 512, and deflate's worst case on incompressible data (a
// stored block costs 5 bytes per 64 KiB; 1 per 4 KiB is generous).
func archiveCost(size int64) int64 {
	padded := 512 + (size+511)/512*512
	return padded + padded/4096 + 1
}

// archiveFixed is the archive's own cost: tar's end blocks, gzip header and
// trailer, with room to spare.
const archiveFixed = 1024 + 1024

// omittedListCost is reserved for OMITTED.txt when files are left out.
const omittedListCost = 8 << 10

// planArchive picks the files that fit in maxBytes: the first files, then the
// others smallest first. keep is nil when not even the first files fit.
func planArchive(files []File, maxBytes int64) (keep, omitted []File) {
	total := int64(archiveFixed)
	for _, f := range files {
		total += archiveCost(f.Bytes)
	}
	if maxBytes <= 0 || total <= maxBytes {
		return files, nil
	}
	budget := maxBytes - archiveFixed - omittedListCost
	inKeep := map[string]bool{}
	var rest []File
	for _, f := range files {
		if firstRank(f.Name) < len(firstFiles) {
			budget -= archiveCost(f.Bytes)
			inKeep[f.Name] = true
		} else {
			rest = append(rest, f)
		}
	}
	if budget < 0 {
		return nil, files
	}
	slices.SortStableFunc(rest, func(a, b File) int { return int(min(max(a.Bytes-b.Bytes, -1), 1)) })
	for _, f := range rest {
		if c := archiveCost(f.Bytes); c <= budget {
			budget -= c
			inKeep[f.Name] = true
		}
	}
	for _, f := range files { // back in archive order
		if inKeep[f.Name] {
			keep = append(keep, f)
		} else {
			omitted = append(omitted, f)
		}
	}
	return keep, omitted
}

func writeArchive(dir, path string, keep, omitted []File, maxBytes int64) error {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	defer out.Close()
	lw := &limitedWriter{w: out, left: maxBytes}
	var w io.Writer = out
	if maxBytes > 0 {
		w = lw
	}
	gz := gzip.NewWriter(w)
	tw := tar.NewWriter(gz)
	base := filepath.Base(filepath.Clean(dir))
	for _, f := range keep {
		if err := addFile(tw, dir, base, f); err != nil {
			return err
		}
	}
	if len(omitted) > 0 {
		if err := addOmittedList(tw, base, omitted, maxBytes); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	if err := gz.Close(); err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	if err := out.Sync(); err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	return out.Close()
}

func addFile(tw *tar.Writer, dir, base string, f File) error {
	src, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Name)))
	if err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	// The size planned is what is written, even if the file grew since.
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: base + "/" + f.Name, Size: f.Bytes, Mode: 0o600, ModTime: st.ModTime()}
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("incident archive %s: %w", f.Name, err)
	}
	if _, err := io.CopyN(tw, src, f.Bytes); err != nil {
		return fmt.Errorf("incident archive %s: %w", f.Name, err)
	}
	return nil
}

func addOmittedList(tw *tar.Writer, base string, omitted []File, maxBytes int64) error {
	var b strings.Builder
	fmt.Fprintf(&b, "This archive is bounded to %d bytes. These files of the bundle were left out to stay within it;\nthey are still in the bundle directory on the node:\n\n", maxBytes)
	for _, f := range omitted {
		fmt.Fprintf(&b, "%s\t%d bytes\n", f.Name, f.Bytes)
	}
	text := b.String()
	if len(text) > omittedListCost-2048 {
		text = text[:omittedListCost-2048] + "\n[list cut]\n"
	}
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: base + "/" + OmittedFile, Size: int64(len(text)), Mode: 0o600}
	if err := tw.WriteHeader(hdr); err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	if _, err := io.WriteString(tw, text); err != nil {
		return fmt.Errorf("incident archive: %w", err)
	}
	return nil
}

// limitedWriter fails a write that would go past its bound: the plan's
// estimate is a guard, this is the guarantee.
type limitedWriter struct {
	w    io.Writer
	left int64
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		return 0, errors.New("incident archive: would exceed its byte bound")
	}
	n, err := l.w.Write(p)
	l.left -= int64(n)
	return n, err
}

// renameNoReplace renames old to new, failing when new exists (a file or a
// directory): an incident never replaces an earlier one's files.
func renameNoReplace(old, new string) error {
	err := unix.Renameat2(unix.AT_FDCWD, old, unix.AT_FDCWD, new, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// No RENAME_NOREPLACE on this filesystem.
		if _, serr := os.Lstat(new); serr == nil {
			return &os.LinkError{Op: "rename", Old: old, New: new, Err: os.ErrExist}
		}
		return os.Rename(old, new)
	}
	if err != nil {
		return &os.LinkError{Op: "rename", Old: old, New: new, Err: err}
	}
	return nil
}

// Publish renames a bundle built in dir+".partial" to dir, never over an
// existing dir: a bundle appears under its name only once complete, and one
// left as DIR.partial (pathtrace killed while writing it) says what it is.
func Publish(dir string) error {
	if err := renameNoReplace(PartialDir(dir), dir); err != nil {
		return fmt.Errorf("incident bundle: %w", err)
	}
	return nil
}

// PartialDir is where the bundle for dir is built.
func PartialDir(dir string) string { return strings.TrimSuffix(dir, "/") + ".partial" }
