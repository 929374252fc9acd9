package main

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// userHZ is the unit of the CPU times in /proc/stat (USER_HZ, 100 on every
// Linux architecture Go supports): system CPU figures are in steps of 10 ms.
const userHZ = 100

func ticks(n uint64) time.Duration { return time.Duration(n) * time.Second / userHZ }

// processCPU is the CPU time of every live thread of pid: the first field of
// /proc/PID/task/TID/schedstat (sum_exec_runtime, in nanoseconds, where
// /proc/PID/stat only has 10 ms steps). Threads that exited are not
// counted; neither capture tool ends threads while it runs.
func processCPU(pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var total time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue // the thread just exited
		}
		ns, err := parseSchedstat(b)
		if err != nil {
			return 0, err
		}
		total += ns
	}
	return total, nil
}

// parseSchedstat reads the run time of a /proc/.../schedstat line.
func parseSchedstat(b []byte) (time.Duration, error) {
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return 0, fmt.Errorf("malformed schedstat %q", b)
	}
	ns, err := strconv.ParseUint(f[0], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("malformed schedstat %q", b)
	}
	return time.Duration(ns), nil
}

// processFaults is pid's minor page faults so far, its exited threads' too:
// on a VM each costs microseconds, and a new flow's memory may take some.
func processFaults(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseMinflt(b)
}

// parseMinflt reads minflt, the 10th field of a /proc/PID/stat line (the
// command, field 2, is in parentheses and may hold spaces).
func parseMinflt(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed stat %q", stat)
	}
	f := strings.Fields(string(stat[i+1:])) // from field 3 on
	if len(f) < 8 {
		return 0, fmt.Errorf("malformed stat %q", stat)
	}
	n, err := strconv.ParseUint(f[10-3], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("malformed stat %q", stat)
	}
	return n, nil
}

// systemBusy is the CPU time every CPU spent not idle since boot, from
// /proc/stat: it includes softirq work (packet forwarding, socket filters,
// AF_PACKET copies, tc programs) that no process is charged for.
func systemBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	return parseSystemBusy(b)
}

// parseSystemBusy sums user, nice, system, irq, softirq and steal of the
// aggregate "cpu" line (guest time is already inside user).
func parseSystemBusy(stat []byte) (time.Duration, error) {
	line, _, _ := bytes.Cut(stat, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("malformed /proc/stat first line %q", line)
	}
	var busy uint64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system [idle iowait] irq softirq steal
		n, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("malformed /proc/stat field %q", f[i])
		}
		busy += n
	}
	return ticks(busy), nil
}

// linkPackets is RX+TX packets of each named link in the netns at nsPath.
func linkPackets(nsPath string, names ...string) (map[string]uint64, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", nsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	out := map[string]uint64{}
	for _, name := range names {
		l, err := h.LinkByName(name)
		if err != nil {
			return nil, fmt.Errorf("link %s in %s: %w", name, nsPath, err)
		}
		s := l.Attrs().Statistics
		if s == nil {
			return nil, fmt.Errorf("link %s: no statistics", name)
		}
		out[name] = s.RxPackets + s.TxPackets
	}
	return out, nil
}

// cpuModel is the first "model name" of /proc/cpuinfo.
func cpuModel() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for line := range strings.Lines(string(b)) {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// niceScope says within which group the scheduler weighs the tools' nice
// values against other processes', and who shares it: their CPU cgroup, or
// their session when they are in the root cgroup with autogroup on (the
// lab's servers start sessions of their own).
func niceScope() string {
	b, _ := os.ReadFile("/proc/self/cgroup")
	path := cpuCgroup(string(b))
	auto, _ := os.ReadFile("/proc/sys/kernel/sched_autogroup_enabled")
	if path == "/" && strings.TrimSpace(string(auto)) == "1" {
		return "here the benchmark's session (its processes are in the root CPU cgroup, with autogroup on): every tool shares it with the traffic generator, which runs in the benchmark's own process, not with the lab's servers, which run in sessions of their own"
	}
	return fmt.Sprintf("here the benchmark's CPU cgroup (`%s`), which every tool shares with the traffic generator and the lab's servers", path)
}

// cpuCgroup is the CPU cgroup in a /proc/PID/cgroup file: the v1 hierarchy
// with the cpu controller, else the v2 one.
func cpuCgroup(file string) string {
	v2 := "/"
	for line := range strings.Lines(file) {
		parts := strings.SplitN(strings.TrimSpace(line), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[1] == "" {
			v2 = parts[2]
			continue
		}
		if slices.Contains(strings.Split(parts[1], ","), "cpu") {
			return parts[2]
		}
	}
	return v2
}
