// Command pathtrace follows every flow to a Kubernetes Service VIP on a node and
// says where the VIP was rewritten to a backend: socket, tc, netfilter or nowhere.
package main

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/pathtrace/pathtrace/internal/hugeheap"
	"github.com/pathtrace/pathtrace/internal/lab"
)

// Exit codes are part of the command-line contract.
const (
	exitOK      = 0
	exitRuntime = 1
	exitUsage   = 2
)

// memoryLimit is the Go runtime's soft limit: on a busy node pathtrace
// collects garbage sooner rather than grow. With the binary's pages, the
// event ring and three 4 MiB capture rings (about 24 MiB, bounded on their
// own) it keeps the process under 64 MiB at the default --max-flows with one
// Pod; two Pods or more have five rings (8 MiB more: 70 MiB with 51 Pods
// in churn). The heap's memory in use as the capture starts is moved to
// huge pages, resident whole (hugeHeap): 40 MiB, not the 42 it was
// before, leaves room for that (a 10-minute churn run peaked at 60.9 MiB,
// 61.3 without huge pages). At 4096 flows (2.4 KiB each on the heap,
// flow.TestFlowMemory) the collector still has room to allocate between
// cycles, half a minute or more in churn (the steady state allocates
// little). A larger --max-flows raises it (memoryLimitFor).
const memoryLimit = 40 << 20

// defaultMaxFlows is --max-flows' default, the bound memoryLimit is made for.
const defaultMaxFlows = 4096

// flowBytes is the soft limit's share of each flow beyond defaultMaxFlows:
// a followed flow keeps at most 2.5 KiB on the heap (flow.TestFlowMemory;
// 3.25 when the run below was made) and the tables sized by --max-flows
// add a little; the process grew by 3.3 KiB per flow in the lab at
// --max-flows 100000 under churn. The rest is the collector's room: held
// to 42 MiB (the limit then), that run's live heap passed the limit within
// a minute and the collector then ran without pause, 0.7 of a core
// against 0.17.
const flowBytes = 4 << 10

// memoryLimitFor is the soft limit of a run that follows up to maxFlows
// flows: what the user asked for with --max-flows is memory, not a
// collector that never stops.
func memoryLimitFor(maxFlows int) int64 {
	extra := int64(max(0, maxFlows-defaultMaxFlows))
	if extra > (math.MaxInt64-memoryLimit)/flowBytes {
		return math.MaxInt64 // no limit: the product would wrap to a small one
	}
	return memoryLimit + extra*flowBytes
}

// limitMemory sets the soft limit for maxFlows, unless GOMEMLIMIT did.
func limitMemory(maxFlows int) {
	if os.Getenv("GOMEMLIMIT") == "" { // the user's setting wins
		debug.SetMemoryLimit(memoryLimitFor(maxFlows))
	}
}

// tightenHeap keeps the heap tight once the capture is over: the report of
// thousands of flows is built and printed once, CPU no longer matters,
// memory still does. This process runs one session, so the setting is its
// to make (session.Options.CaptureDone).
func tightenHeap() { debug.SetGCPercent(10) }

// hugeHeap is the session's CaptureStart: the heap's memory in use moved to
// transparent huge pages (hugeheap), so that the flows to come find their
// memory resident instead of faulting it in, once the observers' loading
// gave its garbage back (which then does not raise the peak RSS). Where
// the kernel cannot, the heap stays in 4 KiB pages: faster or not, the
// capture is the same.
func hugeHeap() { _, _ = hugeheap.Collapse() }

// captureProcs is how many threads run pathtrace's Go code at once, given
// the CPUs the runtime would use: at most half of them, and at most 2 (one
// consumer owns the flow engine; the taps and the file writer feed it). On a
// 2-core node that is 1: the capture then never takes a core from the traced
// workload, and its goroutines hand work to each other without waking
// threads (measured in the lab: 0.28-0.33 us of CPU per captured packet
// instead of 0.35-0.42), until its rings back up (behindProcs).
func captureProcs(cpus int) int {
	return max(1, min(2, cpus/2))
}

// behindProcs is how many threads run pathtrace's Go code once a capture
// ring backed up (session.Options.CaptureBehind), given the CPUs the
// runtime would use: 2 where there are two. With one, the capture stops
// whole while that thread is held: preempted on saturated CPUs, or in a
// write(2) of the file, which takes 3-27 ms there instead of 0.05 (all
// write(2)s go without the runtime's hand-off: see export's writeDirect),
// and its rings overflow. In the lab at 100k-260k datagrams/s, frames were
// lost in 11 of 15 runs with one thread, 1 of 15 with two (where tcpdump
// lost some too), whose CPU per captured packet is 10-14% more.
func behindProcs(cpus int) int { return min(2, cpus) }

// availableProcs is GOMAXPROCS as the runtime chose it (the CPUs it may
// use, a container's CPU limit included), before main lowers it.
var availableProcs = runtime.GOMAXPROCS(0)

// moreProcsWhenBehind is the session's CaptureBehind: the capture gets
// behindProcs threads while it is behind, and its captureProcs back once
// it has kept up for calmAfter (a node's traffic burst must not cost a
// run until stopped the dearer threads for the rest of its life), unless
// GOMAXPROCS was set by the user (nil then). A node whose traffic never
// backs a ring up keeps the cheaper one thread.
func moreProcsWhenBehind() func() {
	if os.Getenv("GOMAXPROCS") != "" {
		return nil
	}
	g := &procsGovernor{low: captureProcs(availableProcs), high: behindProcs(availableProcs), calm: calmAfter}
	return g.behind
}

// calmAfter is how long a capture that fell behind keeps its behindProcs
// after the last sign of it: long enough that a burst's threads stay for
// its next seconds, short next to a run until stopped.
const calmAfter = 30 * time.Second

// procsGovernor sets GOMAXPROCS to high from the first behind call, and to
// low again once behind has not been called for calm.
type procsGovernor struct {
	low, high int
	calm      time.Duration
	mu        sync.Mutex
	last      time.Time // the latest behind call
	raised    bool
}

// behind is called again and again while the capture is behind (from the
// taps' goroutines, after each block read: a lock and a clock read).
func (g *procsGovernor) behind() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.last = time.Now()
	if g.raised || g.high <= runtime.GOMAXPROCS(0) {
		return
	}
	g.raised = true
	runtime.GOMAXPROCS(g.high)
	go g.lowerWhenCalm()
}

func (g *procsGovernor) lowerWhenCalm() {
	for {
		g.mu.Lock()
		wait := g.calm - time.Since(g.last)
		if wait <= 0 {
			runtime.GOMAXPROCS(g.low)
			g.raised = false
			g.mu.Unlock()
			return
		}
		g.mu.Unlock()
		time.Sleep(wait)
	}
}

func main() {
	// The lab re-executes this binary for its servers and client processes.
	lab.RunWorkerIfRequested()
	if os.Getenv("GOMAXPROCS") == "" { // the user's setting wins
		runtime.GOMAXPROCS(captureProcs(availableProcs))
	}
	limitMemory(defaultMaxFlows) // a run's --max-flows may raise it
	// A write to stdout whose reader went away (`| head -1`) fails with
	// EPIPE instead of killing pathtrace (exit 141, nothing said): each
	// command says what it lost. Caught, not ignored: the programs the lab
	// and the snapshot run get SIGPIPE's default back.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)

	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "incident":
			os.Exit(runIncident(os.Args[2:]))
		case "lab":
			os.Exit(runLab(os.Args[2:]))
		case "help": // "pathtrace help [incident|lab]", as many tools take it
			os.Exit(runHelp(os.Args[2:]))
		}
	}
	os.Exit(runTrace(os.Args[1:]))
}

// runHelp prints the help of the main command, or of the subcommand named.
func runHelp(args []string) int {
	// "help --help" asks for help too: the main command's.
	var topics []string
	for _, a := range args {
		if a != "-h" && a != "--help" {
			topics = append(topics, a)
		}
	}
	args = topics
	if len(args) > 1 {
		fmt.Fprintln(os.Stderr, "pathtrace: help takes at most one topic (incident or lab)")
		return 2
	}
	if len(args) == 0 {
		return runTrace([]string{"--help"})
	}
	switch args[0] {
	case "incident":
		return runIncident([]string{"--help"})
	case "lab":
		return runLab([]string{"--help"})
	}
	fmt.Fprintf(os.Stderr, "pathtrace: no help topic %q: try pathtrace help, pathtrace help incident or pathtrace help lab\n", args[0])
	return 2
}

// usageError is a bad-input error: one line saying what is wrong and how to fix it.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return usageError{fmt.Sprintf(format, a...)} }

// parseStrict parses args into fs, refusing a flag given twice unless it is
// repeatable (--svc): the last one silently won, so --pod-ip A --pod-ip B
// traced B alone, and --duration 10s ... --duration 1h ran for an hour. It
// refuses an empty value too, which read as the flag left out: a script's
// --pod-ip "$IP" or --host-netns "$NS" whose variable was empty traced every
// Pod, or pathtrace's own netns, and --pcap "$FILE" wrote no capture.
func parseStrict(fs *pflag.FlagSet, args []string) error {
	seen := map[string]bool{}
	return fs.ParseAll(args, func(f *pflag.Flag, v string) error {
		if _, repeatable := f.Value.(pflag.SliceValue); !repeatable && seen[f.Name] {
			return fmt.Errorf("--%s given twice (%s, then %s): give it once", f.Name, f.Value, v)
		}
		if v == "" {
			return fmt.Errorf("--%s is empty (a variable not set?): give it a value", f.Name)
		}
		seen[f.Name] = true
		return fs.Set(f.Name, v)
	})
}

// outputLost says why stdout took no more: a report or a status is lost,
// which the command says on stderr (a help or a version: helpWritten).
func outputLost(err error) error {
	if errors.Is(err, syscall.EPIPE) {
		return fmt.Errorf("its reader went away (%w)", err)
	}
	return err
}

// helpWritten ends a help or a version written to stdout through w: a
// reader that stopped early (`| head -1`) got what it wanted, exit 0 and
// nothing said; any other write error (a full disk) is said, exit 1: the
// help was not printed.
func helpWritten(cmd string, w *bufio.Writer) int {
	if err := w.Flush(); err != nil && !errors.Is(err, syscall.EPIPE) {
		fmt.Fprintf(os.Stderr, "%s: its output could not be written: %v\n", cmd, err)
		return exitRuntime
	}
	return exitOK
}

// stopSignals end a trace early, its report and capture file complete:
// Ctrl-C, SIGTERM, and SIGHUP (the terminal went away: an ssh session that
// dropped), as tcpdump does, unless SIGHUP is ignored (nohup): asking for
// it would undo that.
func stopSignals() []os.Signal {
	sigs := []os.Signal{os.Interrupt, syscall.SIGTERM}
	if !signal.Ignored(syscall.SIGHUP) {
		sigs = append(sigs, syscall.SIGHUP)
	}
	return sigs
}

// endAtOnce ends pathtrace on a stop signal s that came while it stopped:
// at once, without the report, killed by s (the kernel detaches what it
// attached). Killed, not exited 128+s: bash goes on with a script whose
// command exited after a Ctrl-C, taking it as handled. The stop signals stay
// notified until then: giving them their default action back as the stop
// began dropped one that came close behind the first, still queued for the
// channel that reset took away.
func endAtOnce(s os.Signal) {
	sig := s.(syscall.Signal)
	signal.Reset(s)
	// To this thread: delivered before the call returns.
	runtime.LockOSThread()
	_ = syscall.Tgkill(syscall.Getpid(), syscall.Gettid(), sig)
	// Still here: s was ignored when pathtrace started (SIGINT in a
	// script's background job), and is again.
	os.Exit(128 + int(sig))
}
