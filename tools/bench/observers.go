package main

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// observerPrefix names pathtrace's kernel programs (observers and the taps'
// socket filter); the lab's own are lab_*.
const observerPrefix = "pt_"

// progCost is what one of pathtrace's kernel programs ran over a workload.
type progCost struct {
	Name string
	Runs uint64
	Time time.Duration
}

// observerCost is the kernel's own account (BPF run-time statistics) of
// pathtrace's programs over paced connects to the TCP VIP and over unrelated
// datagrams.
type observerCost struct {
	Connects  int
	Connect   []progCost
	Unrelated uint64 // datagrams sent
	Datagram  []progCost
	// BulkPackets are the packets of one bulk TCP connection pathtrace
	// watches (segments and ACKs, counted on the uplink), Bulk what its
	// programs ran for them: the per-packet cost of a traced flow's data.
	BulkPackets uint64
	Bulk        []progCost
}

func total(costs []progCost) time.Duration {
	var t time.Duration
	for _, c := range costs {
		t += c.Time
	}
	return t
}

// observerRuns measures observerCost in pathtrace runs of their own: the
// statistics add their own cost to every program run, which the overhead
// runs must not carry.
func (b *bench) observerRuns(ctx context.Context, res *results) error {
	o := &observerCost{Connects: b.cfg.connects}
	progress("observer cost: pathtrace with the kernel's BPF run-time statistics on")
	_, err := b.window(ctx, toolPathtrace, b.toolArgvs(toolPathtrace), 0, func(ctx context.Context) (uint64, time.Duration, error) {
		start := time.Now()
		var err error
		o.Connect, err = b.programCost(func() error {
			_, err := connectLatencies(ctx, b.lab.PodNetNS(), lab.TCPVIP, b.cfg.connects, pacedEvery)
			return err
		})
		if err != nil {
			return 0, 0, err
		}
		o.Datagram, err = b.programCost(func() (err error) {
			o.Unrelated, _, err = b.udp.send(ctx, unrelatedDst, 0, time.Second)
			return err
		})
		return 0, time.Since(start), err
	}, false)
	if err != nil {
		return fmt.Errorf("observer cost: %w", err)
	}
	progress("observer cost: pathtrace watching the bulk flow, with the statistics on")
	_, err = b.window(ctx, toolPathtrace, b.toolArgvs(toolPathtrace, bulkDst.String()+"/tcp"), 0, func(ctx context.Context) (uint64, time.Duration, error) {
		start := time.Now()
		var err error
		o.Bulk, err = b.programCost(func() error {
			l0, err := linkPackets(b.lab.NodeNetNS(), lab.Uplink)
			if err != nil {
				return err
			}
			if _, err := bulkThroughput(ctx, b.lab.PodNetNS(), b.sink, bulkDst, time.Second); err != nil {
				return err
			}
			l1, err := linkPackets(b.lab.NodeNetNS(), lab.Uplink)
			o.BulkPackets = l1[lab.Uplink] - l0[lab.Uplink]
			return err
		})
		return 0, time.Since(start), err
	}, false)
	if err != nil {
		return fmt.Errorf("observer cost, bulk flow: %w", err)
	}
	res.Observers = o
	return nil
}

// programCost is what the programs of the window's pathtrace ran during
// work, with the kernel's run-time statistics on. Only that process's
// programs: another pathtrace on the machine (a test, another session)
// runs programs of the same names, which the workload passes through too.
func (b *bench) programCost(work func() error) ([]progCost, error) {
	stats, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
	if err != nil {
		return nil, fmt.Errorf("enable BPF run-time statistics: %w", err)
	}
	defer stats.Close()
	before, err := observerStats(b.running)
	if err != nil {
		return nil, err
	}
	if err := work(); err != nil {
		return nil, err
	}
	after, err := observerStats(b.running)
	if err != nil {
		return nil, err
	}
	return costDelta(before, after), nil
}

// observerStats sums the run count and run time of the pathtrace programs
// that the processes pids hold, by name (the taps share one socket filter;
// a name loaded twice counts once).
func observerStats(pids []int) (map[string]progCost, error) {
	ids, err := heldPrograms(pids)
	if err != nil {
		return nil, err
	}
	out := map[string]progCost{}
	for _, id := range ids {
		prog, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // unloaded meanwhile
		}
		info, ierr := prog.Info()
		st, serr := prog.Stats()
		prog.Close()
		if ierr != nil || serr != nil || !strings.HasPrefix(info.Name, observerPrefix) {
			continue
		}
		c := out[info.Name]
		c.Name, c.Runs, c.Time = info.Name, c.Runs+st.RunCount, c.Time+st.Runtime
		out[info.Name] = c
	}
	return out, nil
}

// heldPrograms lists the BPF programs the processes pids hold a descriptor
// of (the prog_id lines of /proc/PID/fdinfo), each once.
func heldPrograms(pids []int) ([]ebpf.ProgramID, error) {
	seen := map[ebpf.ProgramID]bool{}
	for _, pid := range pids {
		dir := fmt.Sprintf("/proc/%d/fdinfo", pid)
		fds, err := os.ReadDir(dir)
		if err != nil {
			return nil, fmt.Errorf("programs of pid %d: %w", pid, err)
		}
		for _, fd := range fds {
			b, err := os.ReadFile(dir + "/" + fd.Name())
			if err != nil {
				continue // closed meanwhile
			}
			if id, ok := fdinfoProgID(string(b)); ok {
				seen[id] = true
			}
		}
	}
	if len(seen) == 0 {
		return nil, fmt.Errorf("processes %v hold no BPF program", pids)
	}
	ids := slices.Sorted(maps.Keys(seen))
	return ids, nil
}

// fdinfoProgID reads the prog_id line of a BPF program descriptor's fdinfo.
func fdinfoProgID(fdinfo string) (ebpf.ProgramID, bool) {
	for line := range strings.Lines(fdinfo) {
		if v, ok := strings.CutPrefix(line, "prog_id:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
			return ebpf.ProgramID(n), err == nil
		}
	}
	return 0, false
}

// costDelta is what each program ran from before to after, busiest first.
func costDelta(before, after map[string]progCost) []progCost {
	var out []progCost
	for name, a := range after {
		b := before[name]
		if a.Runs < b.Runs || a.Time < b.Time {
			continue // not the same programs (unloaded and loaded again)
		}
		d := progCost{Name: name, Runs: a.Runs - b.Runs, Time: a.Time - b.Time}
		if d.Runs > 0 {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(x, y progCost) int { return int(y.Time - x.Time) })
	return out
}

func (b *bench) observerSection(p printer, res *results) {
	o := res.Observers
	if o == nil {
		return
	}
	p("## 5. What pathtrace's kernel programs cost\n\n")
	p("The kernel's own account (`BPF_ENABLE_STATS`, run count and run time of each program) in pathtrace runs of their own: %d connects to %s paced one every %s (each a traced flow: SYN, SYN-ACK, ACK, RST), then unrelated datagrams to %s for 1 s (%d sent); then, in a run that also watches the bulk flow (`--svc %s/tcp`), one bulk TCP connection to it for 1.3 s (%d packets on `%s`, segments and ACKs: what a traced flow's data costs per packet). The statistics add two clock reads to every run (some tens of ns), included here; the overhead runs above were made without them.\n\n",
		o.Connects, lab.TCPVIP, pacedEvery, unrelatedDst, o.Unrelated, bulkDst, o.BulkPackets, lab.Uplink)
	p("| program | runs per connection | ns per run | ns per connection | runs per unrelated datagram | ns per run | ns per datagram | runs per bulk packet | ns per run | ns per bulk packet |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	byName := map[string][3]progCost{}
	for i, costs := range [][]progCost{o.Connect, o.Datagram, o.Bulk} {
		for _, c := range costs {
			v := byName[c.Name]
			v[i] = c
			byName[c.Name] = v
		}
	}
	names := slices.Sorted(maps.Keys(byName))
	cell := func(c progCost, n uint64) string {
		if c.Runs == 0 || n == 0 {
			return "– | – | –"
		}
		return fmt.Sprintf("%.2f | %.0f | %.0f", float64(c.Runs)/float64(n), float64(c.Time.Nanoseconds())/float64(c.Runs), float64(c.Time.Nanoseconds())/float64(n))
	}
	for _, n := range names {
		v := byName[n]
		p("| `%s` | %s | %s | %s |\n", n, cell(v[0], uint64(o.Connects)), cell(v[1], o.Unrelated), cell(v[2], o.BulkPackets))
	}
	p("| all | | | **%s** | | | **%s** | | | **%s** |\n\n", perConnect(o), perDatagram(o), perBulkPacket(o))
}

func perConnect(o *observerCost) string {
	return fmt.Sprintf("%.1f µs", float64(total(o.Connect).Nanoseconds())/float64(o.Connects)/1e3)
}

func perDatagram(o *observerCost) string {
	if o.Unrelated == 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f ns", float64(total(o.Datagram).Nanoseconds())/float64(o.Unrelated))
}

func perBulkPacket(o *observerCost) string {
	if o.BulkPackets == 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f ns", float64(total(o.Bulk).Nanoseconds())/float64(o.BulkPackets))
}
