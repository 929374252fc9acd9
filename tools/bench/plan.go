package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

var (
	// unrelatedDst is where the unrelated traffic goes: the Pod's gateway on
	// the discard port. It is neither a Service nor a backend, so no capture
	// point may keep it; the gateway answers with rate-limited ICMP errors.
	unrelatedDst = netip.AddrPortFrom(lab.GatewayIP, 9)
	// bulkDst is the bulk sink the benchmark runs in the gateway's netns, on
	// its backend-side address: never a backend, so pathtrace only captures
	// the bulk flow when told to watch it (a learned backend is watched on
	// every port).
	bulkDst = netip.AddrPortFrom(lab.GatewayBackendIP, 5001)
)

// settle is how long a capture keeps running after the traffic stops before
// its CPU is read: longer than tcpdump's 1 s buffer timeout, so both tools
// have handed every packet to user space.
const settle = 1100 * time.Millisecond

// How many times the overhead runs alternate between nothing attached and
// pathtrace: throughput varies more from run to run than connect latency.
const (
	latencyRounds = 3
	pacedEvery    = time.Millisecond // paced connects: 1000 a second
	bulkRounds    = 5
)

type bench struct {
	cfg config
	lab *lab.Lab
	dir string // capture files, removed after each run
	// kept, when not nil, collects the capture files of the runs instead,
	// to remove at the end of a section: see captureRuns.
	kept *[]string
	udp  *udpSender
	sink *bulkSink
	seq  int

	commands  map[string][]string // the exact command lines of each tool, for the report
	loadStart string              // load average when the measurements started
	running   []int               // pids of the tools of the window that runs
}

// trafficFunc sends the traffic of one measured window.
type trafficFunc func(ctx context.Context) (sent uint64, elapsed time.Duration, err error)

// windowRun is one measured window: a capture tool (or none) running while
// some traffic flows.
type windowRun struct {
	Tool    string
	Rate    int // offered datagrams per second, 0 = as fast as the generator goes
	Round   int // capture and unrelated-traffic runs: 1, 2, ... (--rounds)
	Sent    uint64
	Elapsed time.Duration     // the generator's sending time
	Window  time.Duration     // sending time + settle: what CPU figures cover
	Wire    map[string]uint64 // RX+TX packets of veth-a and bond0 during the window
	SysBusy time.Duration     // busy time of all CPUs during the window
	RSS     []uint64          // VmRSS samples, one per second (long runs)
	Cap     *captureResult    // nil for toolNone
}

func (r windowRun) sentPPS() float64 { return float64(r.Sent) / r.Elapsed.Seconds() }

// toolArgvs are the command lines of tool (one per process), with their
// capture files in the benchmark's directory. pathtrace watches both lab
// Services plus extraSvcs.
func (b *bench) toolArgvs(tool string, extraSvcs ...string) [][]string {
	b.seq++
	var argvs [][]string
	switch tool {
	case toolPathtrace:
		argv := []string{b.cfg.pathtrace, "--host-netns", b.lab.NodeNetNS(),
			"--svc", lab.TCPVIP.String() + "/tcp", "--svc", lab.UDPVIP.String() + "/udp"}
		for _, s := range extraSvcs {
			argv = append(argv, "--svc", s)
		}
		argvs = [][]string{append(argv, "--duration", "1h", "--pcap", filepath.Join(b.dir, "pathtrace-"+strconv.Itoa(b.seq)+".pcapng"), "--output", "json")}
	case toolTcpdump:
		argvs = [][]string{b.tcpdumpArgv(b.lab.NodeNetNS(), lab.Uplink)}
	case toolDumpcap:
		// -q: no running count on stderr; its default 2 MiB buffer per
		// interface, as tcpdump keeps its default.
		file := filepath.Join(b.dir, fmt.Sprintf("dumpcap-%d.pcapng", b.seq))
		argvs = [][]string{{"ip", "netns", "exec", filepath.Base(b.lab.NodeNetNS()), b.cfg.dumpcap, "-q",
			"-i", lab.HostVeth, "-i", lab.Uplink, "-s", "96", "-w", file}}
	case toolTcpdump3, toolIdleTaps:
		// What pathtrace keeps, as a filter in the kernel: the two VIPs and
		// their backend; idle taps keep nothing (TEST-NET-1 is in no lab).
		filter := fmt.Sprintf("host %s or host %s or host %s", lab.TCPVIP.Addr(), lab.UDPVIP.Addr(), lab.BackendIP)
		for _, s := range extraSvcs {
			filter += " or " + svcFilter(s)
		}
		if tool == toolIdleTaps {
			filter = "host 192.0.2.1"
		}
		for _, point := range []struct{ netns, ifname string }{
			{b.lab.PodNetNS(), lab.PodIface}, {b.lab.NodeNetNS(), lab.HostVeth}, {b.lab.NodeNetNS(), lab.Uplink},
		} {
			argvs = append(argvs, append(b.tcpdumpArgv(point.netns, point.ifname), filter))
		}
	}
	key := tool
	if len(extraSvcs) > 0 {
		key += watchingBulk
	}
	if _, ok := b.commands[key]; !ok {
		for _, argv := range argvs {
			b.commands[key] = append(b.commands[key], shellJoin(argv))
		}
	}
	return argvs
}

// svcFilter is the capture filter that keeps what pathtrace's --svc s
// (address:port/protocol) watches.
func svcFilter(s string) string {
	addrPort, proto, _ := strings.Cut(s, "/")
	ap := netip.MustParseAddrPort(addrPort)
	return fmt.Sprintf("(host %s and %s port %d)", ap.Addr(), proto, ap.Port())
}

// tcpdumpArgv captures ifname in netns to a file of its own. -Z root:
// Debian's tcpdump otherwise writes its file as user tcpdump, which cannot
// create files in the benchmark's private directory.
func (b *bench) tcpdumpArgv(netns, ifname string) []string {
	file := filepath.Join(b.dir, fmt.Sprintf("tcpdump-%d-%s.pcap", b.seq, ifname))
	return []string{"ip", "netns", "exec", filepath.Base(netns), b.cfg.tcpdump, "-i", ifname, "-w", file, "-s", "96", "-n", "-Z", "root"}
}

// captureFile is the file argv writes.
func captureFile(argv []string) string {
	if f := argValue(argv, "--pcap"); f != "" {
		return f
	}
	return argValue(argv, "-w")
}

// argValue is the argument after flag in argv, "" when none.
func argValue(argv []string, flag string) string {
	for i, a := range argv[:len(argv)-1] {
		if a == flag {
			return argv[i+1]
		}
	}
	return ""
}

// window runs traffic with tool capturing (argvs: one per process; nil for
// none) and measures the window from the first datagram to settle after the
// last.
func (b *bench) window(ctx context.Context, tool string, argvs [][]string, rate int, traffic trafficFunc, sampleRSS bool) (windowRun, error) {
	run := windowRun{Tool: tool, Rate: rate}
	var procs procSet
	defer procs.kill()
	for _, argv := range argvs {
		if b.kept != nil {
			*b.kept = append(*b.kept, captureFile(argv))
		} else {
			defer os.Remove(captureFile(argv))
		}
		p, err := startTool(ctx, processKind(tool), argv)
		if err != nil {
			return run, err
		}
		procs = append(procs, p)
	}
	b.running = b.running[:0]
	for _, p := range procs {
		b.running = append(b.running, p.pid())
	}
	if err := sleepCtx(ctx, 300*time.Millisecond); err != nil { // let start-up work finish
		return run, err
	}
	c0, err := procs.cpu()
	if err != nil {
		return run, err
	}
	f0, err := procs.faults()
	if err != nil {
		return run, err
	}
	s0, err := systemBusy()
	if err != nil {
		return run, err
	}
	l0, err := linkPackets(b.lab.NodeNetNS(), lab.HostVeth, lab.Uplink)
	if err != nil {
		return run, err
	}
	t0 := time.Now()
	rssCtx, stopRSS := context.WithCancel(ctx)
	defer stopRSS()
	var rss <-chan []uint64
	if sampleRSS && len(procs) == 1 {
		rss = sampleRSSEverySecond(rssCtx, procs[0].pid())
	}
	run.Sent, run.Elapsed, err = traffic(ctx)
	if err != nil {
		return run, err
	}
	if err := sleepCtx(ctx, settle); err != nil {
		return run, err
	}
	if rss != nil {
		stopRSS()
		run.RSS = <-rss
	}
	c1, err := procs.cpu()
	if err != nil {
		return run, err
	}
	f1, err := procs.faults()
	if err != nil {
		return run, err
	}
	s1, err := systemBusy()
	if err != nil {
		return run, err
	}
	l1, err := linkPackets(b.lab.NodeNetNS(), lab.HostVeth, lab.Uplink)
	if err != nil {
		return run, err
	}
	run.Window, run.SysBusy = time.Since(t0), s1-s0
	run.Wire = map[string]uint64{}
	for k := range l1 {
		run.Wire[k] = l1[k] - l0[k]
	}
	if len(procs) > 0 {
		if run.Cap, err = procs.finish(); err != nil {
			return run, err
		}
		run.Cap.WindowCPU, run.Cap.WindowFaults = c1-c0, f1-f0
		for _, argv := range argvs {
			if st, err := os.Stat(captureFile(argv)); err == nil {
				run.Cap.FileBytes += uint64(st.Size())
			}
		}
	}
	return run, nil
}

// sampleRSSEverySecond records VmRSS of pid each second until ctx ends,
// then sends the samples.
func sampleRSSEverySecond(ctx context.Context, pid int) <-chan []uint64 {
	out := make(chan []uint64, 1)
	go func() {
		var samples []uint64
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				out <- samples
				return
			case <-tick.C:
				if rss, err := vmRSS(pid); err == nil {
					samples = append(samples, rss)
				}
			}
		}
	}()
	return out
}

// vmRSS is the resident set of pid in bytes, from /proc/PID/status.
func vmRSS(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

func (b *bench) udpTraffic(dst netip.AddrPort, rate int, d time.Duration) trafficFunc {
	return func(ctx context.Context) (uint64, time.Duration, error) {
		return b.udp.send(ctx, dst, rate, d)
	}
}

func idle(d time.Duration) trafficFunc {
	return func(ctx context.Context) (uint64, time.Duration, error) {
		return 0, d, sleepCtx(ctx, d)
	}
}

// churnTraffic sends one datagram from a new socket (a new source port, a
// new flow) rate times a second, as a busy DNS client does.
func (b *bench) churnTraffic(dst netip.AddrPort, rate int, d time.Duration) trafficFunc {
	return func(ctx context.Context) (sent uint64, elapsed time.Duration, err error) {
		sa := &unix.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
		payload := make([]byte, udpPayload)
		start := time.Now()
		err = nsutil.Do(b.lab.PodNetNS(), func() error {
			for {
				elapsed = time.Since(start)
				if elapsed >= d || ctx.Err() != nil {
					return ctx.Err()
				}
				if int64(elapsed.Seconds()*float64(rate)) <= int64(sent) {
					time.Sleep(50 * time.Microsecond)
					continue
				}
				fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return fmt.Errorf("socket: %w", err)
				}
				err = unix.Sendto(fd, payload, 0, sa)
				unix.Close(fd)
				if err != nil {
					return fmt.Errorf("sendto %s: %w", dst, err)
				}
				sent++
			}
		})
		return sent, elapsed, err
	}
}

// results is everything one benchmark run measured.
type results struct {
	Capture   []windowRun                // per rate: none, tcpdump, pathtrace[, dumpcap]
	Unrelated []windowRun                // per round: unrelatedTools with unrelated traffic
	Idle      windowRun                  // pathtrace with no traffic at all
	Long      windowRun                  // pathtrace, one new flow per datagram
	Latency   map[string][]time.Duration // back to back, by tool
	Paced     map[string][]time.Duration // one every pacedEvery, by tool
	// LatencyCPU and LatencyFaults are pathtrace's process CPU and minor
	// page faults over its latency runs, LatencyElapsed how long their
	// connections took.
	LatencyCPU, LatencyElapsed time.Duration
	LatencyFaults              uint64
	Observers                  *observerCost
	Bulk                       []bulkRun
}

type bulkRun struct {
	Tool   string // toolNone, toolPathtrace, or toolPathtrace + " (watching the bulk flow)"
	Round  int
	Bps    float64
	Window time.Duration
	Cap    *captureResult
}

// run measures every wanted section, in the order of the report.
func (b *bench) run(ctx context.Context) (*results, error) {
	res := &results{Latency: map[string][]time.Duration{}, Paced: map[string][]time.Duration{}}
	for _, s := range []struct {
		name string
		run  func(context.Context, *results) error
	}{
		{"capture", b.captureRuns},
		{"unrelated", b.unrelatedRuns},
		{"long", b.longRun},
		{"latency", b.latencyRuns},
		{"observers", b.observerRuns},
		{"bulk", b.bulkRuns},
	} {
		if b.cfg.only != nil && !b.cfg.only[s.name] {
			continue
		}
		if err := s.run(ctx, res); err != nil {
			return nil, err
		}
	}
	return res, nil
}

func progress(format string, a ...any) { fmt.Fprintf(os.Stderr, "bench: "+format+"\n", a...) }

// captureRuns keeps every capture file until all its runs are done, as a
// user keeps theirs: each run writes into pages new to the page cache, as
// a capture does on a node. Deleting each file at once let the next run
// write into the pages just freed, still mapped and warm, which hid what
// fresh pages cost (on this VM, which hands free memory back to its host:
// more than half of pathtrace's CPU at 100k pps before its file dropped
// its own pages from the cache as it went).
func (b *bench) captureRuns(ctx context.Context, res *results) error {
	b.kept = new([]string)
	defer func() {
		for _, f := range *b.kept {
			os.Remove(f)
		}
		b.kept = nil
	}()
	tools := []string{toolNone, toolTcpdump, toolPathtrace}
	if b.cfg.dumpcap != "" {
		tools = append(tools, toolDumpcap)
	}
	for round := 1; round <= b.cfg.rounds; round++ {
		for _, rate := range b.cfg.rates {
			for _, tool := range tools {
				progress("capture, round %d: %s at %s", round, tool, rateName(rate))
				r, err := b.window(ctx, tool, b.argvsOrNil(tool), rate, b.udpTraffic(lab.UDPVIP, rate, b.cfg.window), false)
				if err != nil {
					return fmt.Errorf("capture %s at %s: %w", tool, rateName(rate), err)
				}
				r.Round = round
				res.Capture = append(res.Capture, r)
			}
		}
	}
	return nil
}

// unrelatedTools are the runs of the unrelated-traffic measurement, in
// round order.
var unrelatedTools = []string{toolNone, toolPathtrace, toolTcpdump3}

// unrelatedRuns alternate, in --rounds rounds, unrelated traffic with
// nothing attached, with pathtrace and with tcpdump at three points: the
// machine's speed drifts more between minutes than pathtrace's filters
// cost, so each run is compared with the nothing-attached run of its round.
// A pathtrace run without any traffic, once, is the process's baseline.
func (b *bench) unrelatedRuns(ctx context.Context, res *results) error {
	for round := 1; round <= b.cfg.rounds; round++ {
		for _, tool := range unrelatedTools {
			progress("unrelated traffic, round %d: %s", round, tool)
			r, err := b.window(ctx, tool, b.argvsOrNil(tool), 0, b.udpTraffic(unrelatedDst, 0, b.cfg.window), false)
			if err != nil {
				return fmt.Errorf("unrelated traffic, %s: %w", tool, err)
			}
			r.Round = round
			res.Unrelated = append(res.Unrelated, r)
		}
	}
	progress("unrelated traffic: pathtrace with no traffic at all")
	r, err := b.window(ctx, toolPathtrace, b.argvsOrNil(toolPathtrace), 0, idle(b.cfg.window), false)
	if err != nil {
		return fmt.Errorf("pathtrace with no traffic: %w", err)
	}
	res.Idle = r
	return nil
}

func (b *bench) longRun(ctx context.Context, res *results) error {
	progress("long run: pathtrace, %s with a new flow per datagram", b.cfg.long)
	long, err := b.window(ctx, toolPathtrace, b.toolArgvs(toolPathtrace), b.cfg.churnRate,
		b.churnTraffic(lab.UDPVIP, b.cfg.churnRate, b.cfg.long), true)
	if err != nil {
		return fmt.Errorf("long run: %w", err)
	}
	res.Long = long
	return nil
}

// latencyTools are the runs of the connect() measurement, in round order.
var latencyTools = []string{toolNone, toolTcpdump, toolIdleTaps, toolTcpdump3, toolPathtrace}

// latencyRuns alternate runs without and with pathtrace, so that a drift of
// the machine shows up on both sides.
func (b *bench) latencyRuns(ctx context.Context, res *results) error {
	for round := range latencyRounds {
		for _, tool := range latencyTools {
			progress("connect latency, round %d: %s", round+1, tool)
			lat, paced, r, err := b.latencyRun(ctx, tool)
			if err != nil {
				return fmt.Errorf("connect latency with %s: %w", tool, err)
			}
			res.Latency[tool] = append(res.Latency[tool], lat...)
			res.Paced[tool] = append(res.Paced[tool], paced...)
			if tool == toolPathtrace {
				res.LatencyCPU += r.Cap.WindowCPU
				res.LatencyFaults += r.Cap.WindowFaults
				res.LatencyElapsed += r.Elapsed
			}
		}
	}
	return nil
}

func (b *bench) bulkRuns(ctx context.Context, res *results) error {
	for round := range bulkRounds {
		for _, variant := range bulkVariants {
			progress("TCP throughput, round %d: %s", round+1, variant)
			br, err := b.bulkRun(ctx, variant)
			if err != nil {
				return fmt.Errorf("TCP throughput with %s: %w", variant, err)
			}
			br.Round = round
			res.Bulk = append(res.Bulk, br)
		}
	}
	return nil
}

func (b *bench) argvsOrNil(tool string) [][]string {
	if tool == toolNone {
		return nil
	}
	return b.toolArgvs(tool)
}

// latencyRun times the configured number of connects to the TCP VIP with
// tool running (or nothing): back to back (the client as busy as it can be,
// competing with the capture for the CPUs), then paced, one every
// pacedEvery (what each connection pays in the kernel path, the machine
// otherwise mostly idle).
func (b *bench) latencyRun(ctx context.Context, tool string) (lat, paced []time.Duration, r windowRun, err error) {
	r, err = b.window(ctx, tool, b.argvsOrNil(tool), 0, func(ctx context.Context) (uint64, time.Duration, error) {
		start := time.Now()
		var err error
		if lat, err = connectLatencies(ctx, b.lab.PodNetNS(), lab.TCPVIP, b.cfg.connects, 0); err != nil {
			return 0, 0, err
		}
		paced, err = connectLatencies(ctx, b.lab.PodNetNS(), lab.TCPVIP, b.cfg.connects, pacedEvery)
		return uint64(len(lat) + len(paced)), time.Since(start), err
	}, false)
	return lat, paced, r, err
}

// Bulk variants: nothing, pathtrace, pathtrace also watching the bulk flow
// (every segment then passes its filters and is written to the capture
// file), tcpdump at pathtrace's three capture points (the cost of the taps
// alone), and those tcpdumps also keeping the bulk flow (the cost of
// capturing every segment at three points, without pathtrace's observers).
const (
	watchingBulk     = " (watching the bulk flow)"
	bulkWatched      = toolPathtrace + watchingBulk
	bulkWatchedTaps3 = toolTcpdump3 + watchingBulk
)

var bulkVariants = []string{toolNone, toolPathtrace, bulkWatched, toolTcpdump3, bulkWatchedTaps3}

// bulkRun measures one bulk TCP transfer from the Pod to the sink with
// variant running.
func (b *bench) bulkRun(ctx context.Context, variant string) (bulkRun, error) {
	tool, argvs := variant, b.argvsOrNil(variant)
	switch variant {
	case bulkWatched:
		tool, argvs = toolPathtrace, b.toolArgvs(toolPathtrace, bulkDst.String()+"/tcp")
	case bulkWatchedTaps3:
		tool, argvs = toolTcpdump3, b.toolArgvs(toolTcpdump3, bulkDst.String()+"/tcp")
	}
	var bps float64
	r, err := b.window(ctx, tool, argvs, 0, func(ctx context.Context) (uint64, time.Duration, error) {
		start := time.Now()
		var err error
		bps, err = bulkThroughput(ctx, b.lab.PodNetNS(), b.sink, bulkDst, b.cfg.window)
		return 0, time.Since(start), err
	}, false)
	return bulkRun{Tool: variant, Bps: bps, Window: r.Window, Cap: r.Cap}, err
}

// runName is a capture run's offered rate, and its round when there are
// several.
func (b *bench) runName(rate, round int) string {
	if b.cfg.rounds <= 1 {
		return rateName(rate)
	}
	return fmt.Sprintf("%s #%d", rateName(rate), round)
}

func rateName(rate int) string {
	if rate == 0 {
		return "max"
	}
	return fmt.Sprintf("%d pps", rate)
}
