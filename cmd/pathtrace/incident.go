package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/export"
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
                    Open vSwitch (when ovs-vsctl is installed), tc/tcx and XDP
                    programs, cgroup socket programs, BPF links, the nftables
                    ruleset, iptables-nft's nat and filter tables as
                    iptables-nft-save prints them (comments, DNAT targets),
                    iptables-legacy nat and filter tables (those that exist),
                    conntrack entries of the VIPs, sysctls, kernel and BPF
                    features
  MANIFEST.txt      every file, its size, and what could not be collected
                    (manifest.json: the same as JSON)

When done it prints SUMMARY.md and a "bundle: DIR/ and DIR.tar.gz" line on stdout.

--max-bytes bounds the directory, and the archive on its own; flows whose
reports do not fit are counted, not written. The capture file gets what the
snapshot and the reports leave: once full it ends, and the run goes on to
--duration, its verdicts covering the whole run (SUMMARY.md says how many
captured frames the file left out). The bundle is built in DIR.partial
and renamed to DIR once complete; a DIR, DIR.partial or DIR.tar.gz that exists
is refused. Ctrl-C ends the capture and writes the bundle; a second one skips
the snapshot parts not collected yet; a third stops pathtrace.

Only one incident runs at a time on a node; a second one is refused.
It takes the flags of the main command but --output, --pcap, --max-packets and
--version (the bundle always holds both reports and the capture), and
--flow-timeout and --report-every (for --duration 0, which an incident is not).

Exit codes: 0 bundle written, 1 runtime failure (not root, another incident running,
kernel feature missing), 2 bad usage (e.g. an --out that exists).

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
	fs.StringVar(&out, "out", "", "bundle `dir` to create (required), built as DIR.partial; DIR.tar.gz is written beside it")
	fs.StringVar(&maxBytes, "max-bytes", "256M", "bound on the whole bundle, `size` in bytes or with K, M, G suffix")
	// Only --help prints this (ContinueOnError: errors are one line each),
	// to stdout, so that it pages.
	help := bufio.NewWriter(os.Stdout) // its write error is told by helpWritten
	fs.SetOutput(help)
	fs.Usage = func() {
		fmt.Fprint(help, incidentUsage)
		fs.PrintDefaults()
	}
	if err := parseStrict(fs, args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return helpWritten("pathtrace incident", help)
		}
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v (see pathtrace incident --help)\n", err)
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "pathtrace incident: unexpected argument %q: Services are given with --svc, the bundle with --out (see pathtrace incident --help)\n", fs.Arg(0))
		return exitUsage
	}
	f.output = "table"
	if out != "" {
		out = filepath.Clean(out) // "--out /var/tmp/inc-42/" names /var/tmp/inc-42
	}
	opt, budget, err := incidentOptions(&f, out, maxBytes)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitFor(err)
	}
	limitMemory(opt.MaxFlows)
	if msg := capsProblem("pathtrace incident"); msg != "" {
		fmt.Fprintln(os.Stderr, msg)
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
	lowered := false // to fit the disk
	if avail, err := freeBytes(filepath.Dir(out)); err == nil {
		fit, err := fitDisk(budget, avail)
		if err != nil {
			fmt.Fprintf(os.Stderr, "pathtrace incident: --out %s: %v\n", out, err)
			return exitRuntime
		}
		if fit < budget {
			fmt.Fprintf(os.Stderr, "pathtrace incident: --max-bytes %s lowered to %d KiB: half of what %s has free, so that the bundle and its archive both fit\n", maxBytes, fit>>10, filepath.Dir(out))
			budget, opt.PcapLimits.MaxBytes, lowered = fit, captureBudget(fit), true
		}
	}
	// The bundle is built in DIR.partial and renamed to DIR once complete:
	// a bundle under its own name is always whole.
	building := incident.PartialDir(out)
	if err := os.Mkdir(building, 0o700); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		return exitRuntime
	}
	unhold, err := holdBuilding(building)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", err)
		os.Remove(building)
		return exitRuntime
	}
	defer unhold()

	ctx, bctx, captureOver, release := incidentStops()
	defer release()
	if isTerminal(os.Stderr) {
		opt.Progress = func(p session.Progress) { fmt.Fprintf(os.Stderr, "\r\033[K%s", progressLine(p)) }
	}
	opt.CaptureStart, opt.CaptureDone = hugeHeap, tightenHeap
	opt.CaptureBehind = moreProcsWhenBehind()
	res, err := session.Run(ctx, opt)
	if opt.Progress != nil {
		fmt.Fprint(os.Stderr, "\r\033[K")
	}
	if err != nil {
		if os.Remove(building) != nil { // not empty: the capture had started
			fmt.Fprintf(os.Stderr, "pathtrace incident: what was captured is left in %s\n", building)
		}
		var ue *discover.UsageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", ue)
			return exitUsage
		}
		if startInterrupted(ctx, err) {
			fmt.Fprintf(os.Stderr, "pathtrace incident: %s; no bundle was written\n", interruptedStart)
			return exitRuntime
		}
		fmt.Fprintf(os.Stderr, "pathtrace incident: %s\n", explainDenied(err))
		return exitRuntime
	}
	// The snapshot is taken after the capture: pathtrace's own observers are
	// gone, and conntrack still holds the traced flows. An interrupt now cuts
	// the snapshot short (what is not collected is noted) and the bundle is
	// finished; a second one stops pathtrace, leaving DIR.partial.
	captureOver()
	if err := writeBundle(bctx, out, opt, res, budget, lowered); err != nil {
		where := building
		if _, serr := os.Stat(building); serr != nil {
			where = out // published already: the archive failed
		}
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v (what was written is in %s); the run's report follows on stdout\n", err, where)
		// The verdicts are not lost with the bundle (a disk another
		// process filled, an --out gone read-only): they are printed.
		rw := report.NewWriter(os.Stdout, report.FormatTable)
		rw.Node(nodeJSON(res.Node, res.Attachments), func(w io.Writer) { writeNodeTable(w, res.Node, res.Attachments) })
		rw.Flows(res.Flows)
		rw.Summary(res.Summary, res.Drops, runOf(res, res.Pcap))
		return exitRuntime
	}
	return exitOK
}

// incidentStops watches an incident's stop signals: the first ends the
// capture (capture is cancelled), the next, or the first once the capture
// is over (captureOver), cuts the snapshot short (bundle is cancelled), and
// one more stops pathtrace (endAtOnce). One channel counts them: a second
// signal while the capture stops (its observers detaching, seconds on a
// node of many Pods) is not lost, nor a third close behind it. release
// stops watching.
func incidentStops() (capture, bundle context.Context, captureOver, release func()) {
	capture, endCapture := context.WithCancel(context.Background())
	bundle, cutBundle := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 3) // all three may come before this reads one
	signal.Notify(sigs, stopSignals()...)
	done := make(chan struct{})
	go func() {
		select {
		case <-sigs:
			endCapture()
		case <-capture.Done():
		case <-done:
			return
		}
		select {
		case <-sigs:
			fmt.Fprintln(os.Stderr, "pathtrace incident: interrupted: finishing the bundle without the snapshot parts not collected yet (interrupt again to abandon it)")
			cutBundle(errSnapshotStop)
		case <-done:
			return
		}
		select {
		case s := <-sigs:
			endAtOnce(s)
		case <-done:
		}
	}()
	return capture, bundle, endCapture, func() {
		signal.Stop(sigs)
		close(done)
		endCapture()
		cutBundle(nil)
	}
}

// holdBuilding locks dir, the bundle being built (DIR.partial), until
// release or pathtrace's end, even by SIGKILL (a flock): an incident given
// the same --out then tells one being built now, which removing would
// destroy, from one a killed run left (buildingInUse). Held by the
// directory's inode, it goes with the rename to DIR.
func holdBuilding(dir string) (release func(), err error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("lock %s: %w", dir, err)
	}
	return func() { unix.Close(fd) }, nil
}

// buildingInUse tells whether dir, a DIR.partial that exists, is held by
// the incident building it now (holdBuilding).
func buildingInUse(dir string) bool {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	return errors.Is(unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB), unix.EWOULDBLOCK)
}

// errSnapshotStop is why the bundle's snapshot was cut short (the stop
// signal after the one that ended the capture, or the first once it
// ended), which its manifest's notes say of the parts not collected.
var errSnapshotStop = errors.New("interrupted by a stop signal")

// incidentOptions validates the flags; the pcapng gets what the snapshot and
// the reports leave of the budget.
func incidentOptions(f *traceFlags, out, maxBytes string) (session.Options, int64, error) {
	if out == "" {
		return session.Options{}, 0, usagef("--out is required: the bundle directory to create, e.g. --out /var/tmp/incident-1")
	}
	out = filepath.Clean(out)
	for _, p := range []string{out, incident.PartialDir(out), tarballOf(out)} {
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		switch {
		case p != incident.PartialDir(out):
		case buildingInUse(p):
			return session.Options{}, 0, usagef("--out %s: %s is being built by an incident running now: give a new directory", out, p)
		default:
			return session.Options{}, 0, usagef("--out %s: %s exists, left by an interrupted incident: remove it, or give a new directory", out, p)
		}
		return session.Options{}, 0, usagef("--out %s: %s exists: give a new directory, pathtrace never mixes two incidents", out, p)
	}
	if st, err := os.Stat(filepath.Dir(out)); err != nil || !st.IsDir() {
		return session.Options{}, 0, usagef("--out %s: no directory %s to create it in", out, filepath.Dir(out))
	}
	if err := canWriteIn(filepath.Dir(out)); err != nil {
		return session.Options{}, 0, usagef("--out %s: cannot create it in %s: %v; give --out in a writable directory", out, filepath.Dir(out), err)
	}
	// Its longest name: the archive's, written beside DIR.partial.
	if err := partialFits(out, ".tar.gz.partial"); err != nil {
		return session.Options{}, 0, usagef("--out %s: %v", out, err)
	}
	budget, err := parseSize(maxBytes)
	if err != nil {
		return session.Options{}, 0, usagef("--max-bytes %q: %v", maxBytes, err)
	}
	if budget < 1<<20 {
		return session.Options{}, 0, usagef("--max-bytes %q: give a size of at least 1M, e.g. 256M", maxBytes)
	}
	if f.duration < 0 {
		return session.Options{}, 0, usagef("--duration %s: an incident is time-bounded; give a positive duration, e.g. --duration 60s", f.duration)
	}
	if f.duration == 0 {
		return session.Options{}, 0, usagef("--duration 0: an incident is time-bounded; give its duration, e.g. --duration 60s (to trace until stopped, run pathtrace --duration 0 without incident)")
	}
	opt, err := f.validate()
	if err != nil {
		return opt, 0, err
	}
	opt.Pcap = filepath.Join(incident.PartialDir(out), captureFile)
	opt.PcapLimits.MaxBytes = captureBudget(budget)
	// A full capture file must not cut the verdicts short: the run goes on
	// to --duration, and SUMMARY.md says what the file left out.
	opt.PcapBoundEndsFileOnly = true
	return opt, budget, nil
}

// captureFile is the bundle's pcapng.
const captureFile = "capture.pcapng"

// captureBudget is the pcapng's part of a bundle's budget: what the snapshot
// and the reports' reserve leave.
func captureBudget(budget int64) int64 {
	_, rest := incident.SplitBudget(budget)
	return rest - reportReserve(rest)
}

// fitDisk lowers budget to what the filesystem of dir has free, avail bytes:
// the bundle directory and its archive, each up to budget, must both fit.
// Without that, on a disk with less free than --max-bytes, the capture took
// it all and the snapshot and the reports (the verdicts) failed on ENOSPC.
func fitDisk(budget, avail int64) (int64, error) {
	fits := avail / 2
	if fits >= budget {
		return budget, nil
	}
	if fits < 1<<20 {
		return 0, fmt.Errorf("only %d KiB free where the bundle goes: it and its archive need at least 2 MiB; free some space or give --out on another filesystem", avail>>10)
	}
	return fits, nil
}

// freeBytes is what an unprivileged write could still use of dir's filesystem.
func freeBytes(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// reportReserve is the part of the budget kept from the pcapng for the
// reports, SUMMARY.md, the manifest and the archive's headers: an eighth,
// between 512 KiB and 8 MiB (the JSON report of 4096 flows is about 3 MiB).
// The reports get what the pcapng left; flows that do not fit are counted,
// not written (fitReports).
func reportReserve(rest int64) int64 { return min(max(rest/8, 512<<10), 8<<20) }

// tarballOf is the archive written beside the bundle directory.
func tarballOf(dir string) string { return strings.TrimSuffix(dir, "/") + ".tar.gz" }

// writeBundle writes the bundle for out in DIR.partial, renames it to out,
// then archives it. Within budget (lowered: to fit the disk): the snapshot
// has its share, the pcapng what the reserve left; the reports get what
// remains, and the flows that do not fit are counted in them, not written.
func writeBundle(ctx context.Context, out string, opt session.Options, res *session.Result, budget int64, lowered bool) error {
	dir := incident.PartialDir(out)
	snapBudget, _ := incident.SplitBudget(budget)
	var vips []netip.Addr
	for _, s := range opt.Services {
		vips = append(vips, s.Addr)
	}
	m, err := incident.Snapshot(ctx, res.Node, vips, dir, incident.Options{Features: features(res.Attachments), MaxBytes: snapBudget})
	if err != nil {
		return err
	}
	summary := func() error {
		return incident.WriteSummary(dir, res.Flows, res.Summary.WithDrops(res.Drops), res.Node, res.StopReason,
			incident.Ended{Captures: res.CaptureEnded, Gaps: res.CaptureGaps, Observers: res.ObserversEnded, NATRules: res.NATRulesReread, TCPrograms: res.TCProgramsChanged, PodsStarted: res.PodsStarted, ObserversAdded: res.ObserversAdded,
				File: fileEnded(res, opt.PcapLimits.MaxBytes, budget, lowered), CPUWait: cpuWaitOf(res.CPUWait)},
			incident.Taken{Version: version(), Command: commandLine(os.Args)})
	}
	if err := summary(); err != nil {
		return err
	}
	used, err := dirBytes(dir)
	if err != nil {
		return err
	}
	// Kept for what is written after the reports: the manifest (twice what
	// it is now: the reports' lines and a note join it) and the archive's
	// headers and its compression's worst case, so the archive fits too.
	manifest, err := dirBytes(dir, incident.ManifestText, incident.ManifestJSON)
	if err != nil {
		return err
	}
	after := 16<<10 + 2*manifest + 64<<10 + budget/1024
	run := runOf(res, bundlePcap(res.Pcap))
	written, err := fitReports(dir, budget-used-after, res, run)
	if err != nil {
		return err
	}
	if left := len(res.Flows) - written; left > 0 {
		m.Notef("report.txt, report.json: %d of %d flows not written (from id %d on): they did not fit in --max-bytes %d with the capture; SUMMARY.md counts them all",
			left, len(res.Flows), res.Flows[written].ID, budget)
		if err := m.Write(dir); err != nil { // WriteSummary reads its notes
			return err
		}
		if err := summary(); err != nil {
			return err
		}
	}
	for _, f := range []struct{ name, holds string }{
		{"SUMMARY.md", "the verdicts in plain words"},
		{"report.txt", "the full report as tables"},
		{"report.json", "the full report as JSON lines (node, flows, summary)"},
		{captureFile, "every captured frame, one interface per capture point, with flow comments"},
	} {
		if err := m.Add(dir, f.name, f.holds); err != nil {
			return err
		}
	}
	if err := m.Write(dir); err != nil {
		return err
	}
	if err := incident.Publish(out); err != nil {
		return err
	}
	tarball := tarballOf(out)
	var omitted *incident.OmittedError
	if err := incident.Tar(out, tarball, budget); err != nil && !errors.As(err, &omitted) {
		return err
	} else if omitted != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: %v\n", omitted)
	}
	text, err := os.ReadFile(filepath.Join(out, incident.SummaryFile))
	if err != nil {
		return err
	}
	// The bundle is whole: a reader that went away (`| head`) loses only
	// this copy of SUMMARY.md, so the run still succeeds, and says where
	// the bundle is.
	if _, err := fmt.Printf("%s\nbundle: %s/ and %s\n", text, out, tarball); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace incident: SUMMARY.md could not be printed: %v; bundle: %s/ and %s\n", outputLost(err), out, tarball)
	}
	return nil
}

// bundlePcap is the capture file's summary as the bundle's reports give it:
// named within the bundle, which is built as DIR.partial, renamed and
// archived, so that the name stays right wherever the bundle is unpacked.
func bundlePcap(p *export.Summary) *export.Summary {
	inBundle := *p
	inBundle.Path = captureFile
	inBundle.Error = strings.ReplaceAll(p.Error, p.Path, captureFile) // a write error names it too
	return &inBundle
}

// fileEnded says that the capture file filled its share of budget while
// the run went on, with when and what it left out; nil when it holds the
// whole run.
func fileEnded(res *session.Result, share, budget int64, lowered bool) *incident.FileEnded {
	p := res.Pcap
	if p.StopReason == "" {
		return nil
	}
	return &incident.FileEnded{Share: share, Budget: budget, LoweredToFitDisk: lowered,
		After: p.EndedAt.Sub(res.Began), Run: res.Stopped.Sub(res.Began),
		Written: p.Packets, Captured: p.Packets + p.FramesNotWritten}
}

// fitReports writes report.txt and report.json into dir within room bytes
// together: every flow when they fit, else as many flows as fit, in id
// order, each report then saying how many more there are. It returns how
// many flows were written.
func fitReports(dir string, room int64, res *session.Result, run report.Run) (int, error) {
	render := func(k int) (txt, js []byte) {
		var bt, bj bytes.Buffer
		for _, r := range []struct {
			w      *bytes.Buffer
			format string
		}{{&bt, report.FormatTable}, {&bj, report.FormatJSON}} {
			rw := report.NewWriter(r.w, r.format)
			rw.Node(nodeJSON(res.Node, res.Attachments), func(w io.Writer) { writeNodeTable(w, res.Node, res.Attachments) })
			rw.Flows(res.Flows[:k])
			rw.Omitted(res.Flows[k:], "they did not fit in the incident's --max-bytes with the capture (SUMMARY.md counts them all)")
			rw.Summary(res.Summary, res.Drops, run)
		}
		return bt.Bytes(), bj.Bytes()
	}
	fits := func(k int) bool {
		txt, js := render(k)
		return int64(len(txt)+len(js)) <= room
	}
	k := len(res.Flows)
	txt, js := render(k)
	if int64(len(txt)+len(js)) > room {
		// The largest k that fits: sizes grow with k.
		k = sort.Search(len(res.Flows), func(i int) bool { return !fits(i + 1) })
		txt, js = render(k)
	}
	if int64(len(txt)+len(js)) > room {
		// Not even the node block fits: cut each report to its half.
		txt, js = cutAt(txt, room/2), cutAt(js, room/2)
	}
	for name, body := range map[string][]byte{"report.txt": txt, "report.json": js} {
		if err := os.WriteFile(filepath.Join(dir, name), body, 0o600); err != nil {
			return 0, err
		}
	}
	return k, nil
}

// cutAt keeps at most n bytes of b, at a line boundary, ending with a line
// that says it was cut.
func cutAt(b []byte, n int64) []byte {
	marker := fmt.Sprintf("[pathtrace: cut here: %d bytes do not fit in the incident's --max-bytes]\n", len(b))
	keep := max(n-int64(len(marker)), 0)
	if keep >= int64(len(b)) {
		return b
	}
	b = b[:keep]
	if nl := bytes.LastIndexByte(b, '\n'); nl >= 0 {
		b = b[:nl+1]
	} else {
		b = b[:0]
	}
	if int64(len(b)+len(marker)) > n {
		return b
	}
	return append(b, marker...)
}

// dirBytes sums the sizes of dir's regular files, or only of those named.
func dirBytes(dir string, names ...string) (int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, e := range entries {
		if len(names) > 0 && !slices.Contains(names, e.Name()) {
			continue
		}
		info, err := e.Info()
		if err != nil {
			return 0, err
		}
		if info.Mode().IsRegular() {
			n += info.Size()
		}
	}
	return n, nil
}

// features lists what the observers found in the kernel, for the snapshot.
func features(atts []probe.Attachment) []string {
	var out []string
	for _, a := range atts {
		state := "attached"
		if a.Err != nil {
			state = "not attached: " + a.Err.Error() // as the report's OBSERVERS table says
		}
		out = append(out, fmt.Sprintf("%s (%s): %s", a.Observer, a.Where, state))
	}
	return out
}

// commandLine renders args as a shell would take them back.
func commandLine(args []string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		if i == 0 {
			a = filepath.Base(a) // before quoting: a path with a space keeps no stray quote
		}
		quoted[i] = a
		if a == "" || strings.ContainsAny(a, " \t\n'\"\\$`|&;<>()*?[]{}~#") {
			quoted[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(quoted, " ")
}
