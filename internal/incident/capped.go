package incident

import (
	"bytes"
	"fmt"
)

// topicWriter collects one snapshot file in memory, keeping at most limit
// bytes. Writes past the limit succeed but are only counted, so a command
// writing into it runs to completion and the marker can say how much was left
// out.
type topicWriter struct {
	buf     bytes.Buffer
	limit   int
	dropped int64
	notes   []string
}

func newTopicWriter(limit int) *topicWriter {
	return &topicWriter{limit: limit}
}

func (w *topicWriter) Write(p []byte) (int, error) {
	room := w.limit - w.buf.Len()
	if len(p) <= room {
		return w.buf.Write(p)
	}
	if room > 0 {
		w.buf.Write(p[:room])
	}
	w.dropped += int64(len(p) - max(room, 0))
	return len(p), nil
}

// notef records a note for the manifest (something not read, or read by a
// fallback); the file itself says the same in its own words.
func (w *topicWriter) notef(format string, args ...any) {
	w.notes = append(w.notes, fmt.Sprintf(format, args...))
}

// truncatedMarker ends a file cut at its cap, on a line of its own.
const truncatedMarker = "[pathtrace: truncated here: %d more bytes not kept (cap %d bytes)]\n"

// finish returns the file's bytes, at most limit. A cut file ends at a line
// boundary followed by the marker.
func (w *topicWriter) finish() ([]byte, bool) {
	b := w.buf.Bytes()
	if w.dropped == 0 {
		return b, false
	}
	// Make room for the marker (sized with the largest count it can show) and
	// the newline that may have to precede it.
	room := w.limit - 1 - len(fmt.Sprintf(truncatedMarker, w.dropped+int64(len(b)), w.limit))
	keep := min(max(room, 0), len(b))
	if nl := bytes.LastIndexByte(b[:keep], '\n'); nl >= 0 {
		keep = nl + 1
	}
	dropped := w.dropped + int64(len(b)-keep)
	out := b[:keep:keep]
	if keep > 0 && out[keep-1] != '\n' {
		out = append(out, '\n')
	}
	return append(out, fmt.Sprintf(truncatedMarker, dropped, w.limit)...), true
}
