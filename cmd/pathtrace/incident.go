package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/incident"
	"github.com/pathtrace/pathtrace/internal/probe"
	"github.com/pathtrace/pathtrace/internal/report"
	"github.com/pathtrace/pathtrace/internal/session"
)

const incidentUsage = `pathtrace incident runs one bounded trace and packs everything an incident
ticket needs into one directory (and a .tar.gz of it):

  SUMMARY.md        the verdicts in plain words
  report.txt/.json  the full report (node, flows, summary)
  capture.pcapng    every captured frame, one interface per capture point
  *.txt             a read-only snapshot of the node: links, addresses, routes and
                    neighbours of the node and the Pods, bridge ports, VLANs and FDB,
                    tc/tcx programs, cgroup socket programs, the nftables ruleset,
                    iptables-legacy NAT (only if that table exists), conntrack
                    entries of the VIPs, sysctls, kernel and BPF features
  MANIFEST.txt      every file, its size, and what could not be collected

Only one incident runs at a time on a node; a second one is refused.

Usage:
  pathtrace incident --svc IP[:PORT][/tcp|udp] --out DIR [flags]

Example:
  sudo pathtrace incident --svc 10.120.0.80 --duration 30s --out /var/tmp/inc-42

Flags:
`

func runIncident(args []string) int {
	var f traceFlags
	var out, maxBytes string
	fs := pflag.NewFlagSet("pathtrace incident", pflag.ContinueOnError)
	fs.SortFlags = false
	addSelectionFlags(fs, &f)
	fs.StringVar(&out, "out", "", "bundle `dir` to create (required); DIR.tar.gz is written beside it")
	fs.StringVar(&maxBytes, "max-bytes", "256M", "bound on the whole bundle, `size` in bytes or with K, M, G suffix")
	fs.Usage = func() {
		fmt.Fprint(os.Stderr, incidentUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return exitOK
		}
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v (see pathtrace incident --help)\n", err)
		return exitUsage
	}
	f.output = "table"
	opt, budget, err := incidentOptions(&f, out, maxBytes)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitUsage
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "pathtrace incident: needs root (CAP_BPF, CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_ADMIN for setns): run it with sudo")
		return exitRuntime
	}
	if err := setNice(f.nice); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v; capturing at the priority it has\n", err)
	}
	release, err := incident.Lock(incident.DefaultRunDir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitRuntime
	}
	defer release()
	if err := os.Mkdir(out, 0o700); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitRuntime
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if isTerminal(os.Stderr) {
		opt.Progress = func(p session.Progress) { fmt.Fprintf(os.Stderr, "\r\033[K%s", progressLine(p)) }
	}
	var atts []probe.Attachment
	opt.Ready = func(_ *discover.NodeInfo, a []probe.Attachment) { atts = a }
	res, err := session.Run(ctx, opt)
	if opt.Progress != nil {
		fmt.Fprint(os.Stderr, "\r\033[K")
	}
	if err != nil {
		os.Remove(out) // empty unless the capture had started
		var ue *discover.UsageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", ue)
			return exitUsage
		}
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitRuntime
	}
	// The snapshot is taken after the capture: pathtrace's own observers are
	// gone, and conntrack still holds the traced flows.
	if err := writeBundle(context.Background(), out, opt, res, atts, budget); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitRuntime
	}
	return exitOK
}

// incidentOptions validates the flags; the pcapng gets what the snapshot and
// the reports leave of the budget.
func incidentOptions(f *traceFlags, out, maxBytes string) (session.Options, int64, error) {
	if out == "" {
		return session.Options{}, 0, usagef("--out is required: the bundle directory to create, e.g. --out /var/tmp/incident-1")
	}
	if _, err := os.Stat(out); err == nil {
		return session.Options{}, 0, usagef("--out %s exists: give a new directory, pathtrace never mixes two incidents", out)
	}
	if st, err := os.Stat(filepath.Dir(out)); err != nil || !st.IsDir() {
		return session.Options{}, 0, usagef("--out %s: no directory %s to create it in", out, filepath.Dir(out))
	}
	budget, err := parseSize(maxBytes)
	if err != nil || budget < 1<<20 {
		return session.Options{}, 0, usagef("--max-bytes %q: give a size of at least 1M, e.g. 256M", maxBytes)
	}
	opt, err := f.validate()
	if err != nil {
		return opt, 0, err
	}
	_, rest := incident.SplitBudget(budget)
	opt.Pcap = filepath.Join(out, "capture.pcapng")
	opt.PcapLimits.MaxBytes = rest - reportReserve
	return opt, budget, nil
}

// reportReserve is the part of the budget kept for the reports and SUMMARY.md.
const reportReserve = 512 << 10

func writeBundle(ctx context.Context, dir string, opt session.Options, res *session.Result, atts []probe.Attachment, budget int64) error {
	run := report.Run{Stop: res.StopReason, Packets: res.Packets, Pcap: res.Pcap, Summarized: res.Summarized, CaptureEnded: res.CaptureEnded, ObserversEnded: res.ObserversEnded}
	for _, format := range []string{"txt", "json"} {
		name := filepath.Join(dir, "report."+format)
		f, err := os.OpenFile(name, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return err
		}
		rw := report.NewWriter(f, map[string]string{"txt": report.FormatTable, "json": report.FormatJSON}[format])
		rw.Node(nodeJSON(res.Node, atts), func(w io.Writer) { writeNodeTable(w, res.Node, atts) })
		rw.Flows(res.Flows)
		rw.Summary(res.Summary, res.Drops, run)
		if err := f.Close(); err != nil {
			return err
		}
	}
	snapBudget, _ := incident.SplitBudget(budget)
	var vips []netip.Addr
	for _, s := range opt.Services {
		vips = append(vips, s.Addr)
	}
	m, err := incident.Snapshot(ctx, res.Node, vips, dir, incident.Options{Features: features(atts), MaxBytes: snapBudget})
	if err != nil {
		return err
	}
	if err := incident.WriteSummary(dir, res.Flows, res.Summary.WithDrops(res.Drops), res.Node, res.StopReason,
		incident.Ended{Captures: res.CaptureEnded, Observers: res.ObserversEnded}); err != nil {
		return err
	}
	for _, f := range []struct{ name, holds string }{
		{"SUMMARY.md", "the verdicts in plain words"},
		{"report.txt", "the full report as tables"},
		{"report.json", "the full report as JSON lines (node, flows, summary)"},
		{"capture.pcapng", "every captured frame, one interface per capture point, with flow comments"},
	} {
		if err := m.Add(dir, f.name, f.holds); err != nil {
			return err
		}
	}
	if err := m.Write(dir); err != nil {
		return err
	}
	tarball := strings.TrimSuffix(dir, "/") + ".tar.gz"
	var omitted *incident.OmittedError
	if err := incident.Tar(dir, tarball, budget); err != nil && !errors.As(err, &omitted) {
		return err
	} else if omitted != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", omitted)
	}
	summary, err := os.ReadFile(filepath.Join(dir, "SUMMARY.md"))
	if err != nil {
		return err
	}
	fmt.Printf("%s\nbundle: %s/ and %s\n", summary, dir, tarball)
	return nil
}

// features lists what the observers found in the kernel, for the snapshot.
func features(atts []probe.Attachment) []string {
	var out []string
	for _, a := range atts {
		state := "attached"
		if a.Err != nil {
			state = "unavailable: " + a.Err.Error()
		}
		out = append(out, fmt.Sprintf("%s (%s): %s", a.Observer, a.Where, state))
	}
	return out
}
