package incident

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
)

// Manifest files: a table for people and the same as JSON for tools. They
// describe every other file of the bundle, not themselves.
const (
	ManifestText = "MANIFEST.txt"
	ManifestJSON = "manifest.json"
)

// Manifest lists a bundle's files and what could not be collected.
type Manifest struct {
	Files []File   `json:"files"`
	Notes []string `json:"notes"`
}

// File is one file of the bundle.
type File struct {
	Name      string `json:"name"` // relative to the bundle directory
	Bytes     int64  `json:"bytes"`
	Holds     string `json:"holds"`
	Truncated bool   `json:"truncated,omitempty"` // cut at its cap, with a marker line
}

// Notef adds a note: something not collected, cut, or read by a fallback.
func (m *Manifest) Notef(format string, args ...any) {
	m.Notes = append(m.Notes, fmt.Sprintf(format, args...))
}

// Add records a file the caller wrote into the bundle (the pcapng, the
// report, SUMMARY.md), with its current size; adding a name again updates it.
func (m *Manifest) Add(dir, name, holds string) error {
	st, err := os.Stat(filepath.Join(dir, name))
	if err != nil {
		return fmt.Errorf("incident manifest: %w", err)
	}
	f := File{Name: name, Bytes: st.Size(), Holds: holds}
	for i := range m.Files {
		if m.Files[i].Name == name {
			m.Files[i] = f
			return nil
		}
	}
	m.Files = append(m.Files, f)
	return nil
}

// Write writes MANIFEST.txt and manifest.json into dir.
func (m Manifest) Write(dir string) error {
	if m.Files == nil {
		m.Files = []File{}
	}
	if m.Notes == nil {
		m.Notes = []string{}
	}
	var b strings.Builder
	b.WriteString("pathtrace incident bundle: what each file holds\n\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FILE\tBYTES\tHOLDS")
	for _, f := range m.Files {
		holds := f.Holds
		if f.Truncated {
			holds += " (cut at its cap, see its last line)"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", f.Name, f.Bytes, holds)
	}
	tw.Flush()
	b.WriteString("\nNotes (what could not be collected, or was cut):\n")
	if len(m.Notes) == 0 {
		b.WriteString("  none\n")
	}
	for _, n := range m.Notes {
		fmt.Fprintf(&b, "  - %s\n", n)
	}
	if err := os.WriteFile(filepath.Join(dir, ManifestText), []byte(b.String()), 0o600); err != nil {
		return fmt.Errorf("incident manifest: %w", err)
	}
	js, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("incident manifest: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ManifestJSON), append(js, '\n'), 0o600); err != nil {
		return fmt.Errorf("incident manifest: %w", err)
	}
	return nil
}

// ReadManifest reads the manifest.json of a bundle directory.
func ReadManifest(dir string) (Manifest, error) {
	var m Manifest
	b, err := os.ReadFile(filepath.Join(dir, ManifestJSON))
	if err != nil {
		return m, fmt.Errorf("incident manifest: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("incident manifest %s: %w", filepath.Join(dir, ManifestJSON), err)
	}
	return m, nil
}

// manifestNotes returns the notes of dir's manifest, none when it has none.
func manifestNotes(dir string) ([]string, error) {
	m, err := ReadManifest(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	return m.Notes, err
}
