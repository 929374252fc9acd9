package main

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// Targets of the issue.
const (
	rssLimit          = 64 << 20
	maxLatencyRatio   = 1.05
	minThroughputRate = 0.98
)

// markdown renders the results with the machine, the exact commands and a
// verdict for every target.
func (b *bench) markdown(res *results, started time.Time) string {
	var w strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&w, format, a...) }

	p("# pathtrace capture benchmark\n\n")
	p("Written by `make bench` on %s (the benchmark took %s). Numbers from one run on this machine; rerun to compare.\n\n",
		started.UTC().Format("2006-01-02 15:04 MST"), time.Since(started).Round(time.Second))
	p("| | |\n|---|---|\n")
	p("| kernel | %s |\n", kernelRelease())
	p("| CPU | %s, **%d cores** (shared by the traffic generator, the lab's backend, the forwarding softirqs and the capture) |\n", cpuModel(), runtime.NumCPU())
	p("| load average | %s at the start, %s at the end (other work on the machine shows in the system CPU columns) |\n", b.loadStart, loadAverage())
	p("| Go | %s |\n", runtime.Version())
	p("| pathtrace | %s, built from the working tree at commit %s |\n", orDash(firstLine(b.cfg.pathtrace, "--version")), orDash(firstLine("git", "rev-parse", "--short", "HEAD")))
	p("| tcpdump | %s |\n", orDash(strings.Join(strings.Fields(firstLines(2, b.cfg.tcpdump, "--version")), " ")))
	if b.cfg.dumpcap != "" {
		p("| dumpcap | %s |\n", orDash(firstLine(b.cfg.dumpcap, "--version")))
	}
	p("| lab | `%s`, mode `tc`: the UDP VIP %s is rewritten to %s by a tcx program on `%s`; `%s` carries VLAN %d |\n\n",
		b.lab.Name(), lab.UDPVIP, lab.UDPBackend, lab.HostVeth, lab.Uplink, lab.VLAN)

	p("## Commands\n\n")
	p("```\nmake bench\n# runs: go test -run '^$' -bench . -benchmem ./...\n#       go build -o bin/pathtrace ./cmd/pathtrace\n#       go run ./tools/bench --pathtrace bin/pathtrace --out BENCH.md\n```\n\n")
	p("Capture commands measured (each started fresh per run, stopped with SIGTERM / SIGINT, on which each prints its counters; capture files in a temporary directory, kept until the last capture run of section 1 is done, as a user keeps theirs, and deleted after each run in the other sections):\n\n```\n")
	for _, k := range slices.Sorted(maps.Keys(b.commands)) {
		p("# %s\n%s\n", k, strings.Join(b.commands[k], "\n"))
	}
	p("```\n\n")
	p("pathtrace runs at its default `--nice -5` (its threads drain the rings ahead of the other processes of its scheduling group when the CPUs are saturated); tcpdump at nice 0, as it starts. The scheduler weighs a nice value only against the processes of the same group, %s.\n\n", niceScope())
	p("Traffic, all inside the lab's namespaces: a Go generator thread inside the Pod's netns sends %d-byte UDP datagrams (%d-byte frames, cut by snaplen 96) from one unconnected socket with `sendmmsg` (batches of %d) to %s, paced or as fast as one thread goes; the backend echoes each one, so every point carries requests and replies. ", udpPayload, udpPayload+42, udpBatch, lab.UDPVIP)
	p("Each run: the tool starts, 0.3 s pause, %s of traffic, %s settle (longer than tcpdump's 1 s buffer timeout), then CPU, link counters and the tool's own counters are read. ", b.cfg.window, settle)
	p("*Process CPU* is the run time of the tool's threads (`/proc/PID/task/*/schedstat`, ns) over that window; *system CPU* is the busy time of all CPUs from `/proc/stat` (10 ms steps) over the same window, which also holds the softirq work (socket filters, AF_PACKET copies, tcx observers) that no process is charged for; *wire* packets are RX+TX counters of `%s`; *peak RSS* is the process's `ru_maxrss` (VmHWM) over its whole life. \"s/M\" = CPU seconds per million packets (= µs per packet).\n\n", lab.Uplink)

	b.captureSection(p, res)
	b.unrelatedSection(p, res)
	b.longSection(p, res)
	b.overheadSection(p, res)
	b.observerSection(p, res)
	b.targetsSection(p, res)
	b.limitsSection(p, res)
	return w.String()
}

type printer func(format string, a ...any)

// nonZero lists the counters of m that are not 0, by name: "a 3, b 5".
func nonZero(m map[string]uint64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if n := m[k]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", k, n))
		}
	}
	return strings.Join(parts, ", ")
}

func (b *bench) captureSection(p printer, res *results) {
	p("## 1. Capture of matching traffic\n\n")
	p("pathtrace captures at three points (`pod:eth0`, `host:%s`, `uplink:%s`), tcpdump at one (`%s`).", lab.HostVeth, lab.Uplink, lab.Uplink)
	if b.cfg.dumpcap != "" {
		p(" For reference, %s: Wireshark's capture engine writing one pcapng file with an interface per point, as pathtrace does, at `%s` and `%s` (it captures in one netns; the Pod's `eth0` is in another), without comments.", toolDumpcap, lab.HostVeth, lab.Uplink)
	}
	p("\n\n")
	p("| offered | tool | sent pps | wire pkts %s | captured, all points | captured on %s | kernel drops | other losses | BPF observer events | file bytes per captured packet | process CPU | CPU s/M captured | CPU s/M wire | system CPU s/M wire | peak RSS |\n", lab.Uplink, lab.Uplink)
	p("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res.Capture {
		wire := r.Wire[lab.Uplink]
		row := fmt.Sprintf("| %s | %s | %s | %s |", b.runName(r.Rate, r.Round), r.Tool, count(r.sentPPS()), count(float64(wire)))
		if r.Cap == nil {
			row += " – | – | – | – | – | – | – | – | – |"
		} else {
			c := r.Cap
			events := "–"
			if r.Tool == toolPathtrace {
				events = count(float64(c.Events))
			}
			row += fmt.Sprintf(" %s | %s | %d | %d | %s | %s | %.2f s (%.0f%%) | %s | %s |", count(float64(c.totalCaptured())), count(float64(uplinkCount(c.Captured))),
				c.totalDrops(), c.OtherLosses, events, bytesPer(c.FileBytes, c.totalCaptured()), c.WindowCPU.Seconds(), 100*c.WindowCPU.Seconds()/r.Window.Seconds(),
				perMillion(c.WindowCPU, c.totalCaptured()), perMillion(c.WindowCPU, wire))
		}
		row += fmt.Sprintf(" %s |", perMillion(r.SysBusy, wire))
		if r.Cap != nil {
			row += " " + mib(r.Cap.PeakRSS) + " |"
		} else {
			row += " – |"
		}
		p("%s\n", row)
	}
	// Which rings overflowed tells a stall of the whole process (every
	// point at once) from one point's reader falling behind.
	var drops, losses, waits []string
	for _, r := range res.Capture {
		if r.Cap == nil {
			continue
		}
		if w := r.Cap.CPUWait; w != nil {
			waits = append(waits, fmt.Sprintf("%s %.0f / %.0f ms", b.runName(r.Rate, r.Round), w.WorstSecondMs, w.TotalMs))
		}
		if r.Cap.totalDrops() > 0 {
			drops = append(drops, fmt.Sprintf("%s at %s: %s", r.Tool, b.runName(r.Rate, r.Round), nonZero(r.Cap.KernelDrops)))
		}
		if r.Cap.OtherLosses > 0 {
			losses = append(losses, fmt.Sprintf("%s at %s: %s", r.Tool, b.runName(r.Rate, r.Round), nonZero(r.Cap.LossCounters)))
		}
	}
	if len(drops) > 0 {
		p("\nKernel drops by capture point: %s.\n", strings.Join(drops, "; "))
	}
	if len(losses) > 0 {
		p("\nOther losses by counter: %s.\n", strings.Join(losses, "; "))
	}
	if len(waits) > 0 {
		// Whether the CPUs held pathtrace back in the runs that lost frames.
		p("\npathtrace's threads' wait for a CPU while runnable, from its report's `cpu_wait` (the most one thread waited within one second / all threads over the run): %s.\n", strings.Join(waits, "; "))
	}
	p("\nRatios, pathtrace ÷ tcpdump at the same offered rate in the same round (system CPU overhead = system CPU per wire packet minus that of the run with nothing attached):\n\n")
	p("| offered | kernel drops tcpdump / pathtrace | captured ÷ wire packets on %s, tcpdump / pathtrace | process CPU per captured packet | process CPU per wire packet | system CPU overhead per wire packet (tcpdump / pathtrace, s/M) | peak RSS |\n", lab.Uplink)
	p("|---|---:|---:|---:|---:|---:|---:|\n")
	for _, g := range groupByRate(res.Capture) {
		td, pt := g.tcpdump.Cap, g.pathtrace.Cap
		tdWire, ptWire := g.tcpdump.Wire[lab.Uplink], g.pathtrace.Wire[lab.Uplink]
		p("| %s | %d / %d | %s / %s | %s | %s | %s / %s | %s |\n", b.runName(g.rate, g.round), td.totalDrops(), pt.totalDrops()+pt.OtherLosses,
			ratio(float64(uplinkCount(td.Captured)), float64(tdWire)), ratio(float64(uplinkCount(pt.Captured)), float64(ptWire)),
			ratio(cpuPer(pt.WindowCPU, pt.totalCaptured()), cpuPer(td.WindowCPU, td.totalCaptured())),
			ratio(cpuPer(pt.WindowCPU, ptWire), cpuPer(td.WindowCPU, tdWire)),
			overhead(g.tcpdump, g.none), overhead(g.pathtrace, g.none),
			ratio(float64(pt.PeakRSS), float64(td.PeakRSS)))
	}
	p("\n")
	if b.cfg.dumpcap == "" {
		return
	}
	p("Reference, pathtrace ÷ %s (pcapng at several points in both):\n\n", toolDumpcap)
	p("| offered | drops dumpcap in the kernel / in its queue | drops pathtrace | file bytes per captured packet, dumpcap / pathtrace | process CPU per captured packet | peak RSS |\n")
	p("|---|---:|---:|---:|---:|---:|\n")
	for _, g := range groupByRate(res.Capture) {
		dc, pt := g.dumpcap.Cap, g.pathtrace.Cap
		if dc == nil {
			continue
		}
		p("| %s | %d / %d | %d | %s / %s | %s | %s |\n", b.runName(g.rate, g.round), dc.totalDrops(), dc.OtherLosses, pt.totalDrops()+pt.OtherLosses,
			bytesPer(dc.FileBytes, dc.totalCaptured()), bytesPer(pt.FileBytes, pt.totalCaptured()),
			ratio(cpuPer(pt.WindowCPU, pt.totalCaptured()), cpuPer(dc.WindowCPU, dc.totalCaptured())),
			ratio(float64(pt.PeakRSS), float64(dc.PeakRSS)))
	}
	p("\n")
}

func (b *bench) unrelatedSection(p printer, res *results) {
	p("## 2. Unrelated traffic\n\n")
	p("UDP from the Pod to %s (the gateway's discard port: neither a Service nor a backend), as fast as the generator goes, with pathtrace watching both lab Services. The in-kernel filters must reject all of it. For reference, the same with %s (`tcpdump -w` on `%s`, `%s` and `%s`, each filtered in the kernel to the VIPs and the backend as pathtrace is: the cost of filtered AF_PACKET capture at those points, without pathtrace's observers). %d alternating rounds, each run compared with the nothing-attached run of its round (the machine's speed drifts from minute to minute by more than what is measured here).\n\n",
		unrelatedDst, toolTcpdump3, lab.PodIface, lab.HostVeth, lab.Uplink, b.cfg.rounds)
	p("| round | run | sent pps | wire pkts %s | captured | process CPU | CPU s/M wire | system CPU s/M wire |\n|---|---|---:|---:|---:|---:|---:|---:|\n", lab.Uplink)
	row := func(round, name string, r windowRun) {
		wire := r.Wire[lab.Uplink]
		captured, cpu, cpuWire := "–", "–", "–"
		if c := r.Cap; c != nil {
			captured = fmt.Sprint(c.totalCaptured())
			cpu = fmt.Sprintf("%.2f s (%.1f%%)", c.WindowCPU.Seconds(), 100*c.WindowCPU.Seconds()/r.Window.Seconds())
			cpuWire = perMillion(c.WindowCPU, wire)
		}
		p("| %s | %s | %s | %s | %s | %s | %s | %s |\n", round, name, count(r.sentPPS()), count(float64(wire)), captured, cpu, cpuWire, perMillion(r.SysBusy, wire))
	}
	names := map[string]string{toolNone: "nothing attached", toolPathtrace: "pathtrace", toolTcpdump3: toolTcpdump3}
	for _, r := range res.Unrelated {
		row(fmt.Sprint(r.Round), names[r.Tool], r)
	}
	row("–", "pathtrace, no traffic at all", res.Idle)
	p("\nPer round against the nothing-attached run, median (range): the sender's rate %s with pathtrace, %s with %s; system CPU per unrelated packet %s with pathtrace, %s with %s.\n\n",
		ratioRange(sentRatios(res.Unrelated, toolPathtrace)), ratioRange(sentRatios(res.Unrelated, toolTcpdump3)), toolTcpdump3,
		diffRange(sysOverheads(res.Unrelated, toolPathtrace), "µs"), diffRange(sysOverheads(res.Unrelated, toolTcpdump3), "µs"), toolTcpdump3)
	p("The idle pathtrace used %.2f s of CPU over its whole life, %.2f s of it in the window: the rest is start-up (discovery, loading and attaching its BPF programs) and the final report.\n\n",
		res.Idle.Cap.TotalCPU.Seconds(), res.Idle.Cap.WindowCPU.Seconds())
}

func (b *bench) longSection(p printer, res *results) {
	r := res.Long
	c := r.Cap
	p("## 3. Memory over a longer run\n\n")
	p("pathtrace for %s while the Pod sends one datagram from a new socket (a new flow) %d times a second to %s, as a busy DNS client does: %d flows offered, %d in the report, %d packets captured, %d kernel drops, %d other losses (flows over `--max-flows` included).\n\n",
		r.Elapsed.Round(time.Second), r.Rate, lab.UDPVIP, r.Sent, c.Flows, c.totalCaptured(), c.totalDrops(), c.OtherLosses)
	var samples []string
	for i, s := range r.RSS {
		samples = append(samples, fmt.Sprintf("%ds %s", i+1, mib(s)))
	}
	p("VmRSS each second: %s. Peak RSS over the whole life (report included): **%s**. Process CPU: %.2f s (%s per flow).\n\n",
		strings.Join(samples, ", "), mib(c.PeakRSS), c.WindowCPU.Seconds(), perFlow(c.WindowCPU, r.Sent))
}

func (b *bench) overheadSection(p printer, res *results) {
	p("## 4. Overhead on the traced system\n\n")
	p("`connect()` to the TCP VIP %s from the Pod (blocking, new socket each, closed with RST), %d samples per side and pacing in %d alternating rounds; pathtrace watches the VIP, so every connection is a traced flow; %s (filtered to the VIPs and the backend) shows what AF_PACKET capture at pathtrace's points costs by itself, and %s (the same three tcpdumps with a filter no packet matches) what merely having a tap at each of those points costs. *Back to back*: the client connects as fast as it can, so on this 2-core machine the capture's own CPU competes with the client and the backend. *Paced*: one connection every %s, the machine otherwise mostly idle, so the added latency is what each connection pays in the kernel path (observers, taps).\n\n",
		lab.TCPVIP, len(res.Latency[toolNone])/latencyRounds, latencyRounds, toolTcpdump3, toolIdleTaps, pacedEvery)
	for _, pacing := range []struct {
		name string
		lat  map[string][]time.Duration
	}{{"back to back", res.Latency}, {"paced", res.Paced}} {
		base, td, td3, with := pacing.lat[toolNone], pacing.lat[toolTcpdump], pacing.lat[toolTcpdump3], pacing.lat[toolPathtrace]
		idle := pacing.lat[toolIdleTaps]
		p("| %s | median | p90 | p99 |\n|---|---:|---:|---:|\n", pacing.name)
		p("| nothing attached | %s | %s | %s |\n", us(percentile(base, 50)), us(percentile(base, 90)), us(percentile(base, 99)))
		p("| tcpdump on `%s` running (for reference) | %s | %s | %s |\n", lab.Uplink, us(percentile(td, 50)), us(percentile(td, 90)), us(percentile(td, 99)))
		p("| %s running (tcpdump at the three points, a filter no packet matches) | %s | %s | %s |\n", toolIdleTaps, us(percentile(idle, 50)), us(percentile(idle, 90)), us(percentile(idle, 99)))
		p("| %s running (for reference) | %s | %s | %s |\n", toolTcpdump3, us(percentile(td3, 50)), us(percentile(td3, 90)), us(percentile(td3, 99)))
		p("| pathtrace running | %s | %s | %s |\n", us(percentile(with, 50)), us(percentile(with, 90)), us(percentile(with, 99)))
		p("| ratio tcpdump / nothing | %s | %s | %s |\n", latRatio(td, base, 50), latRatio(td, base, 90), latRatio(td, base, 99))
		p("| ratio %s / nothing | %s | %s | %s |\n", toolIdleTaps, latRatio(idle, base, 50), latRatio(idle, base, 90), latRatio(idle, base, 99))
		p("| ratio %s / nothing | %s | %s | %s |\n", toolTcpdump3, latRatio(td3, base, 50), latRatio(td3, base, 90), latRatio(td3, base, 99))
		p("| ratio pathtrace / nothing (target ≤ %.2f×) | %s | %s | %s |\n\n", maxLatencyRatio, latRatio(with, base, 50), latRatio(with, base, 90), latRatio(with, base, 99))
	}
	conns := uint64(len(res.Latency[toolPathtrace]) + len(res.Paced[toolPathtrace]))
	p("pathtrace's own process used %s of CPU per traced connection (both pacings), %.0f%% of a core while the connections ran, and took %.2f minor page faults per connection (a new flow's memory; on a VM each fault costs microseconds).\n\n",
		perFlow(res.LatencyCPU, conns), 100*res.LatencyCPU.Seconds()/res.LatencyElapsed.Seconds(), float64(res.LatencyFaults)/float64(max(conns, 1)))

	p("UDP datagrams per second one sending thread reaches with the capture running (the runs at the maximum rate above; the median of the rounds): ")
	perTool := map[string][]float64{}
	var tools []string
	for _, r := range res.Capture {
		if r.Rate == 0 {
			if _, ok := perTool[r.Tool]; !ok {
				tools = append(tools, r.Tool)
			}
			perTool[r.Tool] = append(perTool[r.Tool], r.sentPPS())
		}
	}
	var maxRates []string
	noneMax := median(perTool[toolNone])
	for _, tool := range tools {
		m := median(perTool[tool])
		maxRates = append(maxRates, fmt.Sprintf("%s %s (%s)", tool, count(m), ratio(m, noneMax)))
	}
	p("to the VIP %s; to unrelated destinations nothing attached %s, pathtrace %s (per round: %s).\n\n", strings.Join(maxRates, ", "),
		count(median(sentRates(res.Unrelated, toolNone))), count(median(sentRates(res.Unrelated, toolPathtrace))), ratioRange(sentRatios(res.Unrelated, toolPathtrace)))

	p("TCP throughput of one bulk connection from the Pod to a sink in the gateway's netns on its backend-side address (%s, not a backend: through `%s`, the bridge, `%s` with its VLAN programs and the gateway's routing), %s per run, %d alternating rounds. \"Watching the bulk flow\" adds `--svc %s/tcp`, so every segment passes pathtrace's filters at all three points and is written to its file; %s (filtered to the VIPs and the backend) rejects every segment at the same points, as pathtrace does when not watching the bulk flow, and keeps every segment when it also watches the bulk flow (`or (host %s and tcp port %d)`): the cost of capturing it at three points without pathtrace's observers:\n\n",
		bulkDst, lab.HostVeth, lab.Uplink, b.cfg.window, bulkRounds, bulkDst, toolTcpdump3, bulkDst.Addr(), bulkDst.Port())
	p("The machine's speed drifts from minute to minute (the nothing-attached rounds differ by up to a quarter), so each round's run is compared with the nothing-attached run of the same round, minutes apart at most, and the target takes the median of those ratios; the ratio of the means is shown beside it.\n\n")
	p("| run | Gbit/s per round | mean | ratio of the means | ratio per round: median (range; target ≥ %.2f×) | captured / drops | process CPU |\n|---|---|---:|---:|---:|---:|---:|\n", minThroughputRate)
	baseMean := bulkMean(res.Bulk, toolNone)
	for _, variant := range bulkVariants {
		var rounds []string
		var caps, cpus []string
		for _, r := range res.Bulk {
			if r.Tool != variant {
				continue
			}
			rounds = append(rounds, fmt.Sprintf("%.2f", r.Bps/1e9))
			if r.Cap != nil {
				caps = append(caps, fmt.Sprintf("%d / %d", r.Cap.totalCaptured(), r.Cap.totalDrops()+r.Cap.OtherLosses))
				cpus = append(cpus, fmt.Sprintf("%.0f%%", 100*r.Cap.WindowCPU.Seconds()/r.Window.Seconds()))
			}
		}
		m := bulkMean(res.Bulk, variant)
		p("| %s | %s | %.2f | %s | %s | %s | %s |\n", variant, strings.Join(rounds, ", "), m/1e9, ratio(m, baseMean),
			ratioRange(bulkRatios(res.Bulk, variant)), orDash(strings.Join(caps, ", ")), orDash(strings.Join(cpus, ", ")))
	}
	p("\n")
}

func (b *bench) targetsSection(p printer, res *results) {
	p("## Targets\n\n")
	p("| target | result | met |\n|---|---|---|\n")

	var dropFails, cpuRes []string
	cpuMet := true
	for _, rate := range b.cfg.rates {
		var ratios []float64
		for _, g := range groupByRate(res.Capture) {
			if g.rate != rate {
				continue
			}
			td, pt := g.tcpdump.Cap, g.pathtrace.Cap
			if td.totalDrops() == 0 && pt.totalDrops()+pt.OtherLosses > 0 {
				dropFails = append(dropFails, fmt.Sprintf("%s: %d", b.runName(g.rate, g.round), pt.totalDrops()+pt.OtherLosses))
			}
			if tc := cpuPer(td.WindowCPU, td.totalCaptured()); tc > 0 {
				ratios = append(ratios, cpuPer(pt.WindowCPU, pt.totalCaptured())/tc)
			}
		}
		if len(ratios) == 0 {
			continue
		}
		slices.Sort(ratios)
		med := median(ratios)
		cpuMet = cpuMet && med <= 1
		s := fmt.Sprintf("%s: %.2f×", rateName(rate), med)
		if len(ratios) > 1 {
			s += fmt.Sprintf(" (%.2f–%.2f)", ratios[0], ratios[len(ratios)-1])
		}
		cpuRes = append(cpuRes, s)
	}
	if len(dropFails) == 0 {
		p("| zero drops at every rate where tcpdump has zero | none | yes |\n")
	} else {
		p("| zero drops at every rate where tcpdump has zero | pathtrace lost packets where tcpdump lost none: %s | **no** |\n", strings.Join(dropFails, "; "))
	}
	what := "pathtrace ÷ tcpdump"
	if b.cfg.rounds > 1 {
		what += fmt.Sprintf(", median of %d rounds (range)", b.cfg.rounds)
	}
	p("| process CPU per captured packet ≤ tcpdump's | %s: %s | %s |\n", what, strings.Join(cpuRes, "; "), yesNo(cpuMet))

	var peak uint64
	for _, r := range append(append([]windowRun{res.Long}, res.Capture...), res.Unrelated...) {
		if r.Cap != nil && r.Tool == toolPathtrace {
			peak = max(peak, r.Cap.PeakRSS)
		}
	}
	for _, r := range res.Bulk {
		if r.Cap != nil && (r.Tool == toolPathtrace || r.Tool == bulkWatched) {
			peak = max(peak, r.Cap.PeakRSS)
		}
	}
	p("| pathtrace RSS ≤ 64 MiB whatever the duration | peak %s over every run (long run: %s) | %s |\n", mib(peak), mib(res.Long.Cap.PeakRSS), yesNo(peak <= rssLimit))

	processNearZero := true
	var busyCPU []string
	var busyWire uint64
	for _, r := range res.Unrelated {
		if r.Tool == toolPathtrace {
			processNearZero = processNearZero && r.Cap.totalCaptured() == 0 && r.Cap.WindowCPU <= res.Idle.Cap.WindowCPU+50*time.Millisecond
			busyCPU = append(busyCPU, fmt.Sprintf("%.3f", r.Cap.WindowCPU.Seconds()))
			busyWire += r.Wire[lab.Uplink]
		}
	}
	rates := sentRatios(res.Unrelated, toolPathtrace)
	p("| unrelated traffic costs pathtrace near zero | process: %s s CPU per round with %s unrelated packets on `%s` in all, %.3f s with no traffic, nothing captured (%s); kernel, per round against nothing attached, median (range): system CPU %s per unrelated packet, one sender reaches %s of its rate | process %s, kernel %s |\n",
		strings.Join(busyCPU, ", "), count(float64(busyWire)), lab.Uplink, res.Idle.Cap.WindowCPU.Seconds(), yesNo(processNearZero),
		diffRange(sysOverheads(res.Unrelated, toolPathtrace), "µs"), ratioRange(rates),
		yesNo(processNearZero), yesNo(median(rates) >= minThroughputRate))
	p("| (reference: %s) | system CPU %s per unrelated packet; one sender reaches %s of its rate | – |\n",
		toolTcpdump3, diffRange(sysOverheads(res.Unrelated, toolTcpdump3), "µs"), ratioRange(sentRatios(res.Unrelated, toolTcpdump3)))

	latMet := true
	var latRes []string
	for _, pacing := range []struct {
		name string
		lat  map[string][]time.Duration
	}{{"paced", res.Paced}, {"back to back", res.Latency}} {
		base, with, td3 := pacing.lat[toolNone], pacing.lat[toolPathtrace], pacing.lat[toolTcpdump3]
		med := float64(percentile(with, 50)) / float64(percentile(base, 50))
		p99 := float64(percentile(with, 99)) / float64(percentile(base, 99))
		latMet = latMet && med <= maxLatencyRatio && p99 <= maxLatencyRatio
		idle := pacing.lat[toolIdleTaps]
		latRes = append(latRes, fmt.Sprintf("%s: median %.2f×, p99 %.2f× (%s: %s, %s; %s: %s, %s)", pacing.name, med, p99,
			toolTcpdump3, latRatio(td3, base, 50), latRatio(td3, base, 99), toolIdleTaps, latRatio(idle, base, 50), latRatio(idle, base, 99)))
	}
	p("| connect() latency ≤ %.2f× | %s | %s |\n", maxLatencyRatio, strings.Join(latRes, "; "), yesNo(latMet))

	baseMean := bulkMean(res.Bulk, toolNone)
	unwatched, watched := bulkRatios(res.Bulk, toolPathtrace), bulkRatios(res.Bulk, bulkWatched)
	p("| TCP throughput ≥ %.2f× | ratio per round, median (range): %s bulk flow not watched, %s bulk flow watched and captured (ratio of the means: %.2f×, %.2f×); %s: %s not keeping the bulk flow, %s keeping it | %s |\n\n",
		minThroughputRate, ratioRange(unwatched), ratioRange(watched),
		bulkMean(res.Bulk, toolPathtrace)/baseMean, bulkMean(res.Bulk, bulkWatched)/baseMean,
		toolTcpdump3, ratioRange(bulkRatios(res.Bulk, toolTcpdump3)), ratioRange(bulkRatios(res.Bulk, bulkWatchedTaps3)),
		yesNo(median(unwatched) >= minThroughputRate && median(watched) >= minThroughputRate))
}

func (b *bench) limitsSection(p printer, res *results) {
	p("## The lab's limit, and what limits these figures\n\n")
	var best windowRun // the fastest run with nothing attached
	for _, r := range res.Capture {
		if r.Tool == toolNone && (best.Sent == 0 || r.sentPPS() > best.sentPPS()) {
			best = r
		}
	}
	p("- **Physical limit of the lab** (nothing attached, the fastest of the runs above): one sending thread reaches **%s datagrams/s** to the VIP (offered %s), i.e. %s packets/s through `%s` and %s through `%s` (RX+TX, requests and echoes). ",
		count(best.sentPPS()), rateName(best.Rate), count(float64(best.Wire[lab.HostVeth])/best.Elapsed.Seconds()), lab.HostVeth, count(float64(best.Wire[lab.Uplink])/best.Elapsed.Seconds()), lab.Uplink)
	p("To unrelated traffic (no echo) it reaches %s datagrams/s. Every hop is a veth: the sender's `sendmmsg` carries each datagram through the Pod's stack, `%s`, the bridge, `%s` (VLAN push), the gateway's routing and the backend's socket in its own softirq, so one core's speed is the limit (the none rows above show how much the same run varies).\n",
		count(slices.Max(append(sentRates(res.Unrelated, toolNone), 0))), lab.HostVeth, lab.Uplink)
	p("- The machine has **%d cores** for everything: the generator thread (and the softirqs it runs), the backend's Go echo server, and the capture process. At the top rates the capture competes with traffic for CPU, so drops and offered-vs-sent gaps there measure CPU starvation as much as capture efficiency; the offered rates are only reached while a core is left over.\n", runtime.NumCPU())
	p("- System CPU is read in 10 ms steps over a %s window and includes everything else the machine did meanwhile (see the load average): at the low rates its per-packet figures are mostly background. Short runs also keep the pcapng writer's page cache warm; disk speed is not measured. Runs are sequential, so at the top rates each tool sees the traffic its own overhead leaves: compare per-packet figures there, not totals.\n", b.cfg.window+settle)
	p("- The capture cost that runs in softirq (the eBPF/classic socket filter, the copy into the ring, pathtrace's tcx observers and their ring-buffer events) is charged to whichever task is on the CPU, usually the sender: it shows only in the *system CPU* columns, not in the process CPU.\n")
	p("- pathtrace keeps %d-byte snaps at three points and writes each packet with a per-packet comment (flow id, before/after translation, verdict); tcpdump keeps one point, no comment.", 96)
	for _, g := range groupByRate(res.Capture) {
		if g.rate != 0 {
			continue
		}
		td, pt := g.tcpdump.Cap, g.pathtrace.Cap
		p(" At the maximum rate its file holds %s bytes per packet against tcpdump's %s: the process CPU of both includes writing them (`write(2)` copies every byte into the page cache), so the larger blocks are part of the difference in CPU per packet.",
			bytesPer(pt.FileBytes, pt.totalCaptured()), bytesPer(td.FileBytes, td.totalCaptured()))
		break
	}
	if b.cfg.dumpcap != "" {
		p(" The format pathtrace writes (pcapng, an interface per point) costs more than that in the reference tool: see the %s rows.", toolDumpcap)
	}
	p("\n")
	p("- In the kernel, an AF_PACKET tap clones every frame its device transmits before its filter runs, and copies what the filter keeps; pathtrace has three taps where tcpdump has one, and its socket, tc and netfilter observers run on every packet of the node that passes their hooks (reporting the first packets of each flow). That is the cost the traced system sees: the unrelated-traffic, connect() and throughput ratios above, where %s (filtered as pathtrace is) measures the taps alone, so what pathtrace costs beyond it is its observers. Where, per program, is in section 5 (its first packets are reported, the sockets it watches and each flow's event budget kept in small tables of 4-way sets, the clients it learns in an LRU map).\n", toolTcpdump3)
	p("- The machine is a virtual machine whose speed varies from minute to minute (other tenants): the overhead runs alternate with and without pathtrace for that reason, and two runs of the same build differ by tens of percent in the ratios.\n")
}

// rateGroup is the runs at one offered rate in one round.
type rateGroup struct {
	rate, round                       int
	none, tcpdump, pathtrace, dumpcap windowRun
}

func groupByRate(runs []windowRun) []rateGroup {
	var groups []rateGroup
	for _, r := range runs {
		if last := len(groups) - 1; last < 0 || groups[last].rate != r.Rate || groups[last].round != r.Round || r.Tool == toolNone {
			groups = append(groups, rateGroup{rate: r.Rate, round: r.Round})
		}
		g := &groups[len(groups)-1]
		switch r.Tool {
		case toolNone:
			g.none = r
		case toolTcpdump:
			g.tcpdump = r
		case toolPathtrace:
			g.pathtrace = r
		case toolDumpcap:
			g.dumpcap = r
		}
	}
	return groups
}

// uplinkCount is the packets captured on the uplink (pathtrace names its
// points role:ifname, tcpdump's only point is the ifname).
func uplinkCount(captured map[string]uint64) uint64 {
	for k, v := range captured {
		if k == lab.Uplink || strings.HasSuffix(k, ":"+lab.Uplink) {
			return v
		}
	}
	return 0
}

// median is the middle value of v (the upper one of an even count), 0 for
// none; v is left as it was.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	return s[len(s)/2]
}

func cpuPer(cpu time.Duration, pkts uint64) float64 {
	if pkts == 0 {
		return 0
	}
	return cpu.Seconds() / float64(pkts)
}

// minPackets is the fewest packets a per-packet figure is given for: below,
// stray frames (ARP, IPv6 router solicitations) would make it meaningless.
const minPackets = 1000

func perMillion(cpu time.Duration, pkts uint64) string {
	if pkts < minPackets {
		return "–"
	}
	return fmt.Sprintf("%.2f", cpu.Seconds()*1e6/float64(pkts))
}

func perFlow(cpu time.Duration, flows uint64) string {
	if flows == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f µs", cpu.Seconds()*1e6/float64(flows))
}

// overhead is the system CPU per wire packet of run minus that of none.
func overhead(run, none windowRun) string {
	w, w0 := run.Wire[lab.Uplink], none.Wire[lab.Uplink]
	if w < minPackets || w0 < minPackets {
		return "–"
	}
	return fmt.Sprintf("%+.2f", (cpuPer(run.SysBusy, w)-cpuPer(none.SysBusy, w0))*1e6)
}

func ratio(a, b float64) string {
	if b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

func latRatio(with, base []time.Duration, pct float64) string {
	return ratio(float64(percentile(with, pct)), float64(percentile(base, pct)))
}

// percentile is the nearest-rank percentile of samples.
func percentile(samples []time.Duration, pct float64) time.Duration {
	if len(samples) == 0 {
		return 0
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	i := int(pct/100*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// perRound pairs each run of variant with the run with nothing attached of
// the same round (key gives a run's tool and round) and gives what pair
// makes of the two, where it makes something.
func perRound[R any](runs []R, variant string, key func(R) (string, int), pair func(run, none R) (float64, bool)) []float64 {
	base := map[int]R{}
	for _, r := range runs {
		if tool, round := key(r); tool == toolNone {
			base[round] = r
		}
	}
	var v []float64
	for _, r := range runs {
		tool, round := key(r)
		none, ok := base[round]
		if !ok || tool != variant {
			continue
		}
		if x, ok := pair(r, none); ok {
			v = append(v, x)
		}
	}
	return v
}

func bulkKey(r bulkRun) (string, int)     { return r.Tool, r.Round }
func windowKey(r windowRun) (string, int) { return r.Tool, r.Round }

// bulkRatios is, per round, variant's throughput over that of the run with
// nothing attached in the same round.
func bulkRatios(runs []bulkRun, variant string) []float64 {
	return perRound(runs, variant, bulkKey, func(r, none bulkRun) (float64, bool) { return r.Bps / none.Bps, none.Bps > 0 })
}

// sentRatios is, per round, the rate tool's runs let the sender reach over
// that of the run with nothing attached in the same round.
func sentRatios(runs []windowRun, tool string) []float64 {
	return perRound(runs, tool, windowKey, func(r, none windowRun) (float64, bool) { return r.sentPPS() / none.sentPPS(), none.Sent > 0 })
}

// sysOverheads is, per round, the system CPU per wire packet (µs) of tool's
// runs minus that of the run with nothing attached in the same round.
func sysOverheads(runs []windowRun, tool string) []float64 {
	return perRound(runs, tool, windowKey, func(r, none windowRun) (float64, bool) {
		w, w0 := r.Wire[lab.Uplink], none.Wire[lab.Uplink]
		return (cpuPer(r.SysBusy, w) - cpuPer(none.SysBusy, w0)) * 1e6, w >= minPackets && w0 >= minPackets
	})
}

// sentRates is the sender's rate in each of tool's runs.
func sentRates(runs []windowRun, tool string) []float64 {
	var v []float64
	for _, r := range runs {
		if r.Tool == tool {
			v = append(v, r.sentPPS())
		}
	}
	return v
}

// ratioRange is "median× (lowest–highest)" of ratios.
func ratioRange(ratios []float64) string {
	if len(ratios) == 0 {
		return "–"
	}
	s := slices.Sorted(slices.Values(ratios))
	if len(s) == 1 {
		return fmt.Sprintf("%.2f×", s[0])
	}
	return fmt.Sprintf("%.2f× (%.2f–%.2f)", median(s), s[0], s[len(s)-1])
}

// diffRange is "median unit (lowest to highest)" of differences, with
// their signs.
func diffRange(diffs []float64, unit string) string {
	if len(diffs) == 0 {
		return "–"
	}
	s := slices.Sorted(slices.Values(diffs))
	if len(s) == 1 {
		return fmt.Sprintf("%+.2f %s", s[0], unit)
	}
	return fmt.Sprintf("%+.2f %s (%+.2f to %+.2f)", median(s), unit, s[0], s[len(s)-1])
}

func bulkMean(runs []bulkRun, variant string) float64 {
	var total float64
	var n int
	for _, r := range runs {
		if r.Tool == variant {
			total += r.Bps
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return total / float64(n)
}

func count(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e4:
		return fmt.Sprintf("%.0fk", v/1e3)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

// bytesPer is a file's size per packet it holds (headers included).
func bytesPer(size, pkts uint64) string {
	if pkts == 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f", float64(size)/float64(pkts))
}

func mib(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func us(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond)) }

func yesNo(ok bool) string {
	if ok {
		return "yes"
	}
	return "**no**"
}

func orDash(s string) string {
	if s == "" {
		return "–"
	}
	return s
}

// shellJoin quotes argv for a reader to paste, shortening the benchmark's
// temporary and binary paths.
func shellJoin(argv []string) string {
	var out []string
	for _, a := range argv {
		if filepath.IsAbs(a) && strings.HasPrefix(filepath.Base(filepath.Dir(a)), "ptbench-") {
			a = "$DIR/" + filepath.Base(a)
		}
		if wd, err := os.Getwd(); err == nil && strings.HasPrefix(a, wd+"/") {
			a = strings.TrimPrefix(a, wd+"/")
		}
		out = append(out, a)
	}
	return strings.Join(out, " ")
}

// loadAverage is the 1-, 5- and 15-minute load average.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

func kernelRelease() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

func firstLine(argv ...string) string { return firstLines(1, argv...) }

// firstLines is the first n lines of what argv prints (stdout and stderr),
// "" when it fails.
func firstLines(n int, argv ...string) string {
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return ""
	}
	lines := strings.SplitN(strings.TrimSpace(string(out)), "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}

// quickSummary is the short text of a partial run (--only): the figures to
// compare between two builds, one line each.
func quickSummary(res *results) string {
	var w strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&w, format, a...) }
	for _, r := range res.Capture {
		if r.Cap == nil {
			p("capture %-9s %-9s sent %s pps\n", rateName(r.Rate), r.Tool, count(r.sentPPS()))
			continue
		}
		c := r.Cap
		p("capture %-9s %-9s sent %s pps, captured %d, drops %d+%d %v, CPU %s s/M captured, peak RSS %s\n", rateName(r.Rate), r.Tool,
			count(r.sentPPS()), c.totalCaptured(), c.totalDrops(), c.OtherLosses, c.KernelDrops, perMillion(c.WindowCPU, c.totalCaptured()), mib(c.PeakRSS))
	}
	for _, r := range res.Unrelated {
		p("unrelated round %d %-23s sent %s pps, system CPU %s s/M wire\n", r.Round, r.Tool, count(r.sentPPS()), perMillion(r.SysBusy, r.Wire[lab.Uplink]))
	}
	if len(res.Unrelated) > 0 {
		for _, tool := range unrelatedTools[1:] {
			p("unrelated %-23s per round: sent %s, system CPU %s per packet\n", tool, ratioRange(sentRatios(res.Unrelated, tool)), diffRange(sysOverheads(res.Unrelated, tool), "µs"))
		}
	}
	if c := res.Long.Cap; c != nil {
		var samples []string
		for _, s := range res.Long.RSS {
			samples = append(samples, fmt.Sprintf("%.1f", float64(s)/(1<<20)))
		}
		p("long: %d flows offered, %d captured, drops %d+%d %v, CPU %s per flow, peak RSS %s, VmRSS each second (MiB) %s\n", res.Long.Sent, c.totalCaptured(),
			c.totalDrops(), c.OtherLosses, c.LossCounters, perFlow(c.WindowCPU, res.Long.Sent), mib(c.PeakRSS), strings.Join(samples, " "))
	}
	for _, pacing := range []struct {
		name string
		lat  map[string][]time.Duration
	}{{"back to back", res.Latency}, {"paced", res.Paced}} {
		base := pacing.lat[toolNone]
		if len(base) == 0 {
			continue
		}
		for _, tool := range latencyTools[1:] {
			with := pacing.lat[tool]
			p("connect %-12s %-23s median %s → %s (%s), p99 %s → %s (%s)\n", pacing.name, tool, us(percentile(base, 50)), us(percentile(with, 50)), latRatio(with, base, 50),
				us(percentile(base, 99)), us(percentile(with, 99)), latRatio(with, base, 99))
		}
	}
	if n := len(res.Latency[toolPathtrace]) + len(res.Paced[toolPathtrace]); n > 0 {
		p("connect: pathtrace CPU %s per connection, %.0f%% of a core while they ran, %.2f page faults per connection\n", perFlow(res.LatencyCPU, uint64(n)), 100*res.LatencyCPU.Seconds()/res.LatencyElapsed.Seconds(), float64(res.LatencyFaults)/float64(n))
	}
	if o := res.Observers; o != nil {
		for _, c := range o.Connect {
			p("observer %-16s %.2f runs per connection, %.0f ns per run\n", c.Name, float64(c.Runs)/float64(o.Connects), float64(c.Time.Nanoseconds())/float64(c.Runs))
		}
		for _, c := range o.Datagram {
			p("observer %-16s %.2f runs per unrelated datagram, %.0f ns per run\n", c.Name, float64(c.Runs)/float64(o.Unrelated), float64(c.Time.Nanoseconds())/float64(c.Runs))
		}
		for _, c := range o.Bulk {
			p("observer %-16s %.2f runs per bulk packet, %.0f ns per run\n", c.Name, float64(c.Runs)/float64(o.BulkPackets), float64(c.Time.Nanoseconds())/float64(c.Runs))
		}
		p("observers: %s per connection, %s per unrelated datagram, %s per bulk packet\n", perConnect(o), perDatagram(o), perBulkPacket(o))
	}
	if len(res.Bulk) > 0 {
		base := bulkMean(res.Bulk, toolNone)
		for _, variant := range bulkVariants {
			m := bulkMean(res.Bulk, variant)
			p("bulk %-40s %.2f Gbit/s (%s; per round %s)\n", variant, m/1e9, ratio(m, base), ratioRange(bulkRatios(res.Bulk, variant)))
		}
	}
	return w.String()
}
