// Package report writes pathtrace's results: a table for a person, or JSON
// lines for tools ({"type":"node"} first, one {"type":"flow"} per flow, a
// {"type":"summary"} last), and a one-line progress for stderr.
package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// Output formats.
const (
	FormatTable = "table"
	FormatJSON  = "json"
)

// Writer writes the blocks of a report in order: Node, Flows, Summary.
type Writer struct {
	w      *errWriter
	format string
	// byPlace remembers the distinct rewriters per verdict from Flows, and
	// their flows, for the table's summary.
	byPlace map[flow.Place][]*rewriter
	// backends counts the flows per backend and how each was answered,
	// for the table's summary.
	backends backendCounts
	// rows counts the table rows Finished wrote since its last header.
	rows int
	// finished: Finished wrote flows (the flows left at the end follow
	// them, without the note that none was seen).
	finished bool
	// widths: the columns of the rows Finished writes, widened as wider
	// cells come (fixedWidths.fit).
	widths fixedWidths
}

// NewWriter returns a writer to w: JSON lines for FormatJSON, tables for
// anything else (the command line validates the flag).
func NewWriter(w io.Writer, format string) *Writer {
	return &Writer{w: &errWriter{w: w}, format: format, byPlace: make(map[flow.Place][]*rewriter)}
}

// Err is the first error writing the report met (stdout on a full disk,
// closed), nil when every byte went out. The tables are written with many
// small writes whose errors are not returned one by one: a caller checks Err
// once at the end, so that a lost report is never a silent success.
func (w *Writer) Err() error { return w.w.err }

// errWriter remembers the first write error; it writes nothing after it.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	e.err = err
	return n, err
}

// Node writes the node block: v as {"type":"node",...} (v must marshal to a
// JSON object without a "type" key), or whatever table writes.
func (w *Writer) Node(v any, table func(io.Writer)) error {
	if w.format != FormatJSON {
		table(w.w)
		_, err := fmt.Fprintln(w.w)
		return err
	}
	return w.object("node", v)
}

// Flows writes one row or one JSON line per flow.
func (w *Writer) Flows(flows []flow.Flow) error {
	w.noteRewriters(flows)
	if w.format != FormatJSON {
		if w.finished {
			if len(flows) == 0 {
				return nil
			}
			_, err := fmt.Fprintln(w.w, "Flows still open at the end:")
			if err != nil {
				return err
			}
			w.fitWidths(flows)
			return writeFlowRows(w.w, flows, true, w.widths, 0)
		}
		return writeFlowTable(w.w, flows)
	}
	for _, f := range flows {
		if err := w.object("flow", f); err != nil {
			return err
		}
	}
	return nil
}

// maxRewritersListed bounds the rewriters the summary table lists per
// verdict; the last line then says there were more.
const maxRewritersListed = 32

// moreRewriters is the summary table's last rewriter line of a verdict
// that had more than maxRewritersListed.
const moreRewriters = "... and others (the flows' rows and JSON name each)"

// Finished writes flows that ended while the run goes on (a run until
// stopped reports each flow as it ends): a JSON line each, as Flows
// writes them, or table rows under a header repeated every screenful,
// with their notes. Each call's output is written at once (no buffer):
// a reader of a pipe sees the flows as they end.
func (w *Writer) Finished(flows []flow.Flow) error {
	if len(flows) == 0 {
		return nil
	}
	w.finished = true
	if w.format == FormatJSON {
		return w.Flows(flows)
	}
	w.noteRewriters(flows)
	// A column that had to widen starts a new header: the rows below it
	// line up again. Flows that end together (a busy node's second) get
	// the header again every screenful among them too.
	header := w.fitWidths(flows) || w.rows == 0 || w.rows+len(flows) > finishedScreen
	if header {
		w.rows = (len(flows)-1)%finishedScreen + 1
	} else {
		w.rows += len(flows)
	}
	return writeFlowRows(w.w, flows, header, w.widths, finishedScreen)
}

// fitWidths widens the columns of Finished's rows for flows and tells
// whether one grew.
func (w *Writer) fitWidths(flows []flow.Flow) bool {
	if w.widths == nil {
		w.widths = slices.Clone(fixedWidths(minFixedWidths))
		w.widths.fit([][]string{flowHeader})
	}
	rows := make([][]string, len(flows))
	for i, f := range flows {
		rows[i] = flowCells(f)
	}
	return w.widths.fit(rows)
}

// finishedScreen is how many rows Finished writes under one header.
const finishedScreen = 40

// rewriter is a program or rule the summary table lists under its verdict,
// with the flows it rewrote: a row's BY is shortened, and several rules
// (kube-proxy's endpoint chains, its PREROUTING and OUTPUT paths) shorten
// alike; the flow ids tell which row went by which.
type rewriter struct {
	by  string
	ids []int // the first maxRewriterIDs
	n   int
}

// maxRewriterIDs bounds the flow ids listed with a rewriter.
const maxRewriterIDs = 10

func (r *rewriter) add(id int) {
	if len(r.ids) < maxRewriterIDs {
		r.ids = append(r.ids, id)
	}
	r.n++
}

// flows names r's flows: "(flow 3)", "(flows 1, 3, 5)", "(flows 1-10, 12)",
// "(flows 1, 3-11, ... 25 in all)".
func (r *rewriter) flows() string {
	switch {
	case r.n == 1:
		return fmt.Sprintf("(flow %d)", r.ids[0])
	case r.n > len(r.ids):
		return fmt.Sprintf("(flows %s, ... %d in all)", idRanges(r.ids), r.n)
	}
	return "(flows " + idRanges(r.ids) + ")"
}

func (w *Writer) noteRewriters(flows []flow.Flow) {
	for _, f := range flows {
		w.backends.add(f)
		if f.By == "" {
			continue
		}
		list := w.byPlace[f.RewrittenAt]
		if i := slices.IndexFunc(list, func(r *rewriter) bool { return r.by == f.By }); i >= 0 {
			list[i].add(f.ID)
			continue
		}
		if w.finished && len(list) >= maxRewritersListed {
			// A run until stopped meets ever new rules (kube-proxy names
			// its chains after the endpoints): the list stays bounded.
			if last := list[maxRewritersListed-1]; last.by != moreRewriters {
				list[maxRewritersListed-1] = &rewriter{by: moreRewriters}
			}
			list[maxRewritersListed-1].add(f.ID)
			continue
		}
		r := &rewriter{by: f.By}
		r.add(f.ID)
		w.byPlace[f.RewrittenAt] = append(list, r)
	}
}

// Omitted says, after Flows, that the flows left are not written here and
// why (a size bound): a line, or {"type":"omitted","flows":N,"first_id":ID,
// "reason":...}. The summary written next still counts them, and its table
// names their rewriters.
func (w *Writer) Omitted(left []flow.Flow, why string) error {
	if len(left) == 0 {
		return nil
	}
	w.noteRewriters(left)
	if w.format != FormatJSON {
		_, err := fmt.Fprintf(w.w, "%d more flows (from id %d on) are not written here: %s.\n\n", len(left), left[0].ID, why)
		return err
	}
	return w.object("omitted", struct {
		Flows   int    `json:"flows"`
		FirstID int    `json:"first_id"`
		Reason  string `json:"reason"`
	}{len(left), left[0].ID, why})
}

// Run is what the caller adds to the summary about the run itself.
type Run struct {
	Stop    string            `json:"stop_reason,omitempty"` // why it ended: duration, interrupted, max-packets, reader-gone, ...
	Packets map[string]uint64 `json:"packets,omitempty"`     // frames captured per capture point
	Pcap    *export.Summary   `json:"pcap,omitempty"`        // the pcapng file, when one was written
	// Summarized counts packets the tc and netfilter observers left out of
	// their reports because the flow direction was already reported at that
	// point often enough (the taps still captured them): not a loss.
	Summarized uint64 `json:"observer_events_summarized"`
	// CaptureEnded: capture points whose capture ended early (interface
	// down or deleted), with when and why; what they would have seen later
	// is missing.
	CaptureEnded map[string]string `json:"capture_ended,omitempty"`
	// CaptureGaps: capture points whose interface went down while the run
	// went on (a link that flapped), with how often and how long: nothing
	// crossed it meanwhile, so nothing was captured there, and nothing lost.
	CaptureGaps map[string]string `json:"capture_gaps,omitempty"`
	// ObserversEnded: the observers' event reader ended early, when and
	// why; later flows lack their socket, tc and netfilter evidence.
	ObserversEnded string `json:"observers_ended,omitempty"`
	// NATRulesReread: the NAT rules and IPVS services were read again
	// while the run went on (flows reached backends no rule read before
	// named), when, and what changed.
	NATRulesReread string `json:"nat_rules_reread,omitempty"`
	// TCProgramsChanged: the tc programs of the host veths and uplinks
	// that appeared and went while the run went on (an agent that
	// restarted or upgraded), where and when.
	TCProgramsChanged []string `json:"tc_programs_changed,omitempty"`
	// PodsStarted: the Pods that started during the run (every Pod of the
	// node traced), followed from when they were found: who, when, their
	// taps, and what could not be attached.
	PodsStarted []string `json:"pods_started,omitempty"`
	// ObserversAdded: the tcx observers attached during the run, on host
	// veths that got a tc program (a Pod that started, a CNI agent that
	// started), when, and what failed.
	ObserversAdded []string `json:"observers_added,omitempty"`
	// CPUWait: how long pathtrace's threads were runnable but waiting for
	// a CPU during the capture (nil: the kernel does not say).
	CPUWait *CPUWait `json:"cpu_wait,omitempty"`
}

// CPUWait is the kernel's run_delay of pathtrace's threads over the
// capture: all of them, and the longest of one thread within one second.
type CPUWait struct {
	TotalMs       float64 `json:"total_ms"`
	WorstSecondMs float64 `json:"worst_thread_second_ms"`
}

// NewCPUWait is a CPUWait in milliseconds.
func NewCPUWait(total, worst time.Duration) *CPUWait {
	return &CPUWait{TotalMs: ms(total), WorstSecondMs: ms(worst)}
}

func ms(d time.Duration) float64 { return float64(d.Round(10*time.Microsecond)) / 1e6 }

// Summary writes the per-verdict counts, every drop counter (the engine's and
// the caller's drops, e.g. kernel drops per capture point and ring buffer
// losses; zero ones included) and what the caller says of the run.
func (w *Writer) Summary(s flow.Summary, drops map[string]uint64, run Run) error {
	s = s.WithDrops(drops)
	if w.format != FormatJSON {
		return writeSummaryTable(w.w, s, w.byPlace, w.backends, run)
	}
	return w.object("summary", struct {
		flow.Summary
		Run
	}{s, run})
}

// Interval writes how a run until stopped goes, every so often: the
// summary so far (every flow, reported or open, and every drop counter)
// and the CPU wait so far (c; nil: unknown) as
// {"type":"interval","at":...,...}, or one line for a table, which says the
// CPU wait once a capture ring lost frames. Never a "summary": that stays
// the run's last line.
func (w *Writer) Interval(at time.Time, s flow.Summary, drops, packets map[string]uint64, c *CPUWait) error {
	s = s.WithDrops(drops)
	if w.format == FormatJSON {
		return w.object("interval", struct {
			At time.Time `json:"at"`
			flow.Summary
			Packets map[string]uint64 `json:"packets,omitempty"`
			CPUWait *CPUWait          `json:"cpu_wait,omitempty"`
		}{at, s, packets, c})
	}
	var lost uint64
	for _, n := range s.Drops {
		lost += n
	}
	var verdicts []string
	for _, p := range flow.Places() {
		if n := s.RewrittenAt[p]; n > 0 {
			verdicts = append(verdicts, fmt.Sprintf("%s %d", p, n))
		}
	}
	var wait string
	if c != nil && len(lossyRings(s.Drops)) > 0 {
		wait = fmt.Sprintf(" (capture rings among them; a thread of pathtrace's waited up to %s in one second for a CPU)", msString(c.WorstSecondMs))
	}
	_, err := fmt.Fprintf(w.w, "%s so far: %d flows (%s), %d open; drops %d%s\n", at.Format("15:04:05"), s.Flows, strings.Join(verdicts, ", "), s.Flows-s.Retired, lost, wait)
	return err
}

// WriteTable writes flows and their summary (drops included) as tables.
func WriteTable(w io.Writer, flows []flow.Flow, s flow.Summary) error {
	rw := NewWriter(w, FormatTable)
	if err := rw.Flows(flows); err != nil {
		return err
	}
	return rw.Summary(s, nil, Run{})
}

// object writes v as a JSON object with "type" first.
func (w *Writer) object(typ string, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode %s: %w", typ, err)
	}
	body = bytes.TrimSpace(body)
	if len(body) < 2 || body[0] != '{' {
		return fmt.Errorf("encode %s: %T is not a JSON object", typ, v)
	}
	out := fmt.Appendf(nil, `{"type":%q`, typ)
	if rest := bytes.TrimSpace(body[1:]); rest[0] != '}' {
		out = append(out, ',')
	}
	out = append(out, body[1:]...)
	out = append(out, '\n')
	if _, err := w.w.Write(out); err != nil {
		return fmt.Errorf("write %s: %w", typ, err)
	}
	return nil
}
