package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Tools whose capture is measured; toolNone is the run with nothing attached,
// toolTcpdump3 three tcpdump processes at pathtrace's three capture points,
// filtered in the kernel to the lab's VIPs and backend (the cost of filtered
// AF_PACKET capture there, without pathtrace's observers); toolIdleTaps the
// same three processes with a filter no lab packet matches (what merely
// having taps at those points costs); toolDumpcap Wireshark's capture engine
// writing one pcapng with an interface per point, at the two points it can
// reach from one netns (the host veth and the uplink): what the format
// pathtrace writes costs in the reference tool.
const (
	toolNone      = "none"
	toolTcpdump   = "tcpdump"
	toolTcpdump3  = "tcpdump at three points"
	toolIdleTaps  = "three idle taps"
	toolDumpcap   = "dumpcap at two points"
	toolPathtrace = "pathtrace"
)

// processKind is the kind of process a tool runs.
func processKind(tool string) string {
	if tool == toolTcpdump3 || tool == toolIdleTaps {
		return toolTcpdump
	}
	return tool
}

// procSet is the processes of one tool, measured together.
type procSet []*toolProc

// cpu is their CPU time so far.
func (s procSet) cpu() (time.Duration, error) {
	var sum time.Duration
	for _, p := range s {
		c, err := p.cpu()
		if err != nil {
			return 0, err
		}
		sum += c
	}
	return sum, nil
}

func (s procSet) faults() (uint64, error) {
	var sum uint64
	for _, p := range s {
		n, err := processFaults(p.pid())
		if err != nil {
			return 0, err
		}
		sum += n
	}
	return sum, nil
}

func (s procSet) kill() {
	for _, p := range s {
		p.kill()
	}
}

// finish stops every process and adds up what they reported (peak RSS too:
// the processes run side by side).
func (s procSet) finish() (*captureResult, error) {
	total := &captureResult{Captured: map[string]uint64{}, KernelDrops: map[string]uint64{}}
	for _, p := range s {
		r, err := p.finish()
		if err != nil {
			return nil, err
		}
		if len(s) == 1 {
			return r, nil
		}
		for k, v := range r.Captured {
			total.Captured[k] += v
		}
		for k, v := range r.KernelDrops {
			total.KernelDrops[k] += v
		}
		total.TotalCPU += r.TotalCPU
		total.PeakRSS += r.PeakRSS
	}
	return total, nil
}

// captureResult is what one capture process reported and cost.
type captureResult struct {
	Captured     map[string]uint64 // packets per capture point
	KernelDrops  map[string]uint64 // per capture point: accepted by the filter, lost (ring full)
	OtherLosses  uint64            // pathtrace: every other drop counter (ring buffer, flows over max, ...)
	LossCounters map[string]uint64 // pathtrace: those counters by name
	Flows        int               // pathtrace: flows in the report
	Events       uint64            // pathtrace: observations from its BPF observers (not the taps)
	WindowCPU    time.Duration     // utime+stime during the measured window
	WindowFaults uint64            // minor page faults during the measured window
	TotalCPU     time.Duration     // utime+stime over the whole life (rusage)
	PeakRSS      uint64            // bytes, rusage maxrss (VmHWM) over the whole life
	FileBytes    uint64            // size of the capture file it wrote
	CPUWait      *cpuWait          // pathtrace: its threads' wait for a CPU (nil: not reported)
}

// cpuWait is pathtrace's summary's cpu_wait: how long its threads were
// runnable but waiting for a CPU.
type cpuWait struct {
	TotalMs       float64 `json:"total_ms"`
	WorstSecondMs float64 `json:"worst_thread_second_ms"`
}

func (c *captureResult) totalCaptured() uint64 { return sum(c.Captured) }
func (c *captureResult) totalDrops() uint64    { return sum(c.KernelDrops) }

func sum(m map[string]uint64) uint64 {
	var n uint64
	for _, v := range m {
		n += v
	}
	return n
}

// toolProc is a running capture process. Its output is scanned line by line:
// readiness is a line on stdout (pathtrace's node object) or stderr
// (tcpdump's "listening on").
type toolProc struct {
	kind string
	argv []string
	cmd  *exec.Cmd
	stop syscall.Signal // what ends it cleanly and makes it print its counters

	ready chan struct{}
	done  chan struct{} // closed once the process is reaped and its output read

	mu      sync.Mutex
	summary []byte // pathtrace: its last {"type":"summary"} line
	stderr  bytes.Buffer
}

// profileDir, when set (--cpuprofile), is where each pathtrace run writes
// its CPU profile, numbered by profiles.
var (
	profileDir string
	profiles   atomic.Int64
)

// startTool starts argv and waits until it is capturing.
func startTool(ctx context.Context, kind string, argv []string) (*toolProc, error) {
	p := &toolProc{kind: kind, argv: argv, ready: make(chan struct{}), done: make(chan struct{})}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	if kind == toolPathtrace && profileDir != "" {
		prof := filepath.Join(profileDir, fmt.Sprintf("pathtrace-%d.prof", profiles.Add(1)))
		p.cmd.Env = append(os.Environ(), "PATHTRACE_CPUPROFILE="+prof)
	}
	// The capture dies with the benchmark, even if the benchmark is SIGKILLed.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	var readyOut, readyErr func(string) bool
	switch kind {
	case toolPathtrace:
		p.stop = syscall.SIGTERM
		readyOut = func(line string) bool { return strings.HasPrefix(line, `{"type":"node"`) }
	case toolTcpdump:
		p.stop = syscall.SIGINT
		readyErr = func(line string) bool { return strings.Contains(line, "listening on") }
	case toolDumpcap:
		p.stop = syscall.SIGINT
		readyErr = func(line string) bool { return strings.HasPrefix(line, "Capturing on") }
	default:
		return nil, fmt.Errorf("unknown tool %q", kind)
	}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", kind, err)
	}
	var readers sync.WaitGroup
	var readyOnce sync.Once
	markReady := func() { readyOnce.Do(func() { close(p.ready) }) }
	readers.Add(2)
	go func() { defer readers.Done(); p.scan(stdout, readyOut, markReady, true) }()
	go func() { defer readers.Done(); p.scan(stderr, readyErr, markReady, false) }()
	go func() {
		readers.Wait()
		p.cmd.Wait()
		close(p.done)
	}()

	select {
	case <-p.ready:
		return p, nil
	case <-p.done:
		return nil, fmt.Errorf("%s exited before capturing: %s", kind, p.stderrTail())
	case <-ctx.Done():
		p.kill()
		return nil, ctx.Err()
	case <-time.After(30 * time.Second):
		p.kill()
		return nil, fmt.Errorf("%s not capturing after 30s: %s", kind, p.stderrTail())
	}
}

// scan reads one output stream. Of stdout it keeps only pathtrace's summary
// line (a run with thousands of flows prints megabytes of flow lines).
func (p *toolProc) scan(r io.Reader, ready func(string) bool, markReady func(), isStdout bool) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		line := sc.Text()
		if ready != nil && ready(line) {
			markReady()
		}
		p.mu.Lock()
		switch {
		case !isStdout:
			p.stderr.WriteString(line + "\n")
		case strings.HasPrefix(line, `{"type":"summary"`):
			p.summary = []byte(line)
		}
		p.mu.Unlock()
	}
	io.Copy(io.Discard, r)
}

func (p *toolProc) pid() int { return p.cmd.Process.Pid }

// cpu is the process's CPU time so far.
func (p *toolProc) cpu() (time.Duration, error) {
	select {
	case <-p.done:
		return 0, fmt.Errorf("%s exited during the run (%s): %s", p.kind, p.cmd.ProcessState, p.stderrTail())
	default:
	}
	return processCPU(p.pid())
}

// kill ends the process at once; a no-op once it has exited.
func (p *toolProc) kill() {
	select {
	case <-p.done:
	default:
		p.cmd.Process.Kill()
		<-p.done
	}
}

// finish stops the process cleanly and collects what it reported.
func (p *toolProc) finish() (*captureResult, error) {
	p.cmd.Process.Signal(p.stop)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.kill()
		return nil, fmt.Errorf("%s did not exit within 30s of %s", p.kind, p.stop)
	}
	st := p.cmd.ProcessState
	ru, ok := st.SysUsage().(*syscall.Rusage)
	if !ok {
		return nil, errors.New("no rusage")
	}
	res := &captureResult{
		TotalCPU: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()),
		PeakRSS:  uint64(ru.Maxrss) << 10, // KiB on Linux
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var err error
	switch p.kind {
	case toolPathtrace:
		if !st.Success() {
			return nil, fmt.Errorf("pathtrace: %s: %s", st, p.stderrTailLocked())
		}
		err = parsePathtraceSummary(p.summary, res)
	case toolTcpdump:
		err = parseTcpdumpStats(p.stderr.String(), argValue(p.argv, "-i"), res)
	case toolDumpcap:
		err = parseDumpcapStats(p.stderr.String(), res)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w (stderr: %s)", p.kind, err, p.stderrTailLocked())
	}
	return res, nil
}

func (p *toolProc) stderrTail() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stderrTailLocked()
}

func (p *toolProc) stderrTailLocked() string {
	s := strings.TrimSpace(p.stderr.String())
	if len(s) > 600 {
		s = "..." + s[len(s)-600:]
	}
	return s
}

// pathtraceSummary is the part of pathtrace's JSON summary line read here.
type pathtraceSummary struct {
	Type         string            `json:"type"`
	Flows        int               `json:"flows"`
	Drops        map[string]uint64 `json:"drops"`
	Packets      map[string]uint64 `json:"packets"`
	Observations map[string]uint64 `json:"observations"`
	CPUWait      *cpuWait          `json:"cpu_wait"`
}

// parsePathtraceSummary fills res from the summary line: packets per capture
// point ("role:ifname"), "<point> kernel_drops" per point, every other drop
// counter, and the observations of points that are not taps (named by role).
func parsePathtraceSummary(line []byte, res *captureResult) error {
	if len(line) == 0 {
		return errors.New("no summary line in the JSON report")
	}
	var s pathtraceSummary
	if err := json.Unmarshal(line, &s); err != nil {
		return fmt.Errorf("summary line: %w", err)
	}
	if s.Packets == nil {
		return errors.New("summary line has no per-point packet counts")
	}
	res.Captured = s.Packets
	res.Flows = s.Flows
	res.CPUWait = s.CPUWait
	res.KernelDrops, res.LossCounters = map[string]uint64{}, map[string]uint64{}
	taps := map[string]bool{}
	for point := range s.Packets {
		res.KernelDrops[point] = 0
		role, _, _ := strings.Cut(point, ":")
		taps[role] = true
	}
	for point, n := range s.Observations {
		if !taps[point] {
			res.Events += n
		}
	}
	for k, v := range s.Drops {
		if point, ok := strings.CutSuffix(k, " kernel_drops"); ok {
			res.KernelDrops[point] = v
		} else {
			res.OtherLosses += v
			res.LossCounters[k] = v
		}
	}
	return nil
}

// tcpdump says "packet" for one (its PLURAL_SUFFIX): "1 packet dropped by
// kernel".
var tcpdumpStat = regexp.MustCompile(`(?m)^(\d+) packets? (captured|dropped by kernel)$`)

// parseTcpdumpStats reads the counters tcpdump prints on stderr when it ends.
func parseTcpdumpStats(stderr, iface string, res *captureResult) error {
	found := map[string]uint64{}
	for _, m := range tcpdumpStat.FindAllStringSubmatch(stderr, -1) {
		n, err := strconv.ParseUint(m[1], 10, 64)
		if err != nil {
			return err
		}
		found[m[2]] = n
	}
	captured, ok1 := found["captured"]
	dropped, ok2 := found["dropped by kernel"]
	if !ok1 || !ok2 {
		return errors.New("no \"packets captured\"/\"dropped by kernel\" lines")
	}
	res.Captured = map[string]uint64{iface: captured}
	res.KernelDrops = map[string]uint64{iface: dropped}
	return nil
}

var dumpcapStat = regexp.MustCompile(`(?m)^Packets received/dropped on interface '([^']+)': (\d+)/\d+ \(pcap:(\d+)/dumpcap:(\d+)/flushed:(\d+)/ps_ifdrop:(\d+)\)`)

// parseDumpcapStats reads the per-interface counters dumpcap prints on stderr
// when it ends: received (written to the file), and the drops by where they
// happened: in the kernel (pcap, ps_ifdrop) or in dumpcap's own queue
// between its capture threads and its writer (dumpcap, flushed).
func parseDumpcapStats(stderr string, res *captureResult) error {
	ms := dumpcapStat.FindAllStringSubmatch(stderr, -1)
	if len(ms) == 0 {
		return errors.New("no \"Packets received/dropped on interface\" lines")
	}
	res.Captured, res.KernelDrops, res.LossCounters = map[string]uint64{}, map[string]uint64{}, map[string]uint64{}
	for _, m := range ms {
		var n [5]uint64
		for i := range n {
			v, err := strconv.ParseUint(m[i+2], 10, 64)
			if err != nil {
				return err
			}
			n[i] = v
		}
		iface := m[1]
		res.Captured[iface] = n[0]
		res.KernelDrops[iface] = n[1] + n[4]
		res.OtherLosses += n[2] + n[3]
		res.LossCounters["dumpcap queue"] += n[2] + n[3]
	}
	return nil
}
