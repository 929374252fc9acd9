package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/probe"
	"github.com/pathtrace/pathtrace/internal/report"
	"github.com/pathtrace/pathtrace/internal/session"
)

const traceUsage = `pathtrace follows every flow to a Kubernetes Service VIP on this node and says,
per flow, WHERE the VIP was rewritten to a backend (socket, tc, netfilter, ipvs or
nowhere), BY WHAT (program or rule), which backend, what the frame looked like on
the uplink (802.1Q VLAN, destination MAC) and whether a reply came back.

Usage:
  pathtrace --svc IP[:PORT][/tcp|udp] [--svc ...] [flags]
  pathtrace incident --svc ... --out DIR    (a bounded incident bundle; see 'pathtrace incident --help')
  pathtrace lab up|down|status|client ...   (the built-in test lab; see 'pathtrace lab --help')
  pathtrace help [incident|lab]             (this help, or a subcommand's)

Examples:
  sudo pathtrace --svc 10.120.0.80 --duration 30s
  sudo pathtrace --svc 10.120.0.80:80/tcp --svc 10.120.0.10:53/udp --pod-ip 10.244.8.23
  sudo pathtrace --svc 10.96.0.10:53/udp --output json | jq 'select(.type=="flow")'
  sudo pathtrace --host-netns /run/netns/ptlab-node --svc 10.120.0.80 --duration 10s
  sudo pathtrace --svc 10.120.0.80 --duration 30s --pcap /var/tmp/svc.pcapng
  sudo pathtrace --svc 10.96.0.10:53/udp --duration 0 --output json   (until stopped: a flow log)

How it decides: every place that can rewrite a destination is bracketed by an
observation just before and just after it (syscall arguments vs cgroup connect4/
sendmsg4 observers; the socket's destination vs its first packet, which leaves after
the Pod's own NAT, e.g. a sidecar proxy's redirect; host-veth tap and tcx head vs tcx
tail; netfilter observers at NAT priority -101/-99 and conntrack; the uplink TX tap).
A flow whose brackets are incomplete is reported as "unknown" with the reason, never
guessed.

Output (table; --output json has the same as JSON lines): the node (Pods, capture
points, the Service mechanisms found, every observer's status), then one row per flow:
  REWRITTEN AT    socket, tc, netfilter, ipvs, nowhere (not rewritten: it left the node with the VIP,
                  the VIP is the node's own address, the node's filter rejected or dropped it, or
                  the node dropped it unrewritten after NAT: named below the rows) or unknown
  BY              the program or rule that rewrote it (shortened; the summary, with each rule's
                  flows, and JSON "by" have it whole)
  VLAN            uplink 802.1Q tag ("untagged"; "0 (802.1Q)": a priority tag; "-": the flow never reached the uplink)
  UPLINK DST MAC  destination MAC on the uplink, "gw" when it is the Pod's gateway, else the
                  neighbour the node knows it as, "(172.30.0.1)", a VXLAN uplink's remote VTEP
  REPLY           yes, no, rst (refused), icmp (an ICMP error instead, listed below the rows)
                  or unseen (the flow never left the client's netns)
then the flows per verdict, the flows per backend with their replies (a backend that
answered none is marked), every drop counter (and which flag to change where one could
have avoided the loss), what changed on the node meanwhile (Pods that started and were
followed, capture points whose Pod went, tc programs and NAT rules that appeared: flows
name those of their time) and why the run stopped.

Until stopped (--duration 0, e.g. a DaemonSet's flow log): each flow is written as it
ends, a TCP connection once closed and quiet for 9 s, any flow once idle for
--flow-timeout (JSON: a flow line each, flushed at once; table: rows under a header
repeated every 40 rows and when a column widens); at the end the flows still open, then the summary, which
counts them all. --max-flows bounds the flows open at once; --pcap needs --max-bytes,
which ends the file, not the run. A connection idle past --flow-timeout that speaks
again is a new flow whose "continues" names the earlier one.

A second Ctrl-C (or stop signal) ends pathtrace at once, without the report.

Exit codes: 0 done, 1 runtime failure (not root, kernel feature missing,
--pcap cut by a write error: the report is still printed; the report's reader
went away, | head), 2 bad usage.

Flags:
`

type traceFlags struct {
	svcs      []string
	duration  time.Duration
	podIP     string
	podNetNS  string
	podPID    pidFlag
	hostNetNS string
	hostVeth  string
	uplink    string
	cgroup    string
	output    string
	snaplen   int
	bufSize   string
	maxFlows  int
	nice      int
	pcap      string
	maxPkts   uint64
	maxBytes  string
	version   bool
	// flowTimeout: with --duration 0, a flow idle this long is reported
	// and forgotten.
	flowTimeout time.Duration
	// reportEvery: with --duration 0, how often the summary so far is written.
	reportEvery time.Duration
}

func newTraceFlagSet(f *traceFlags) *pflag.FlagSet {
	fs := pflag.NewFlagSet("pathtrace", pflag.ContinueOnError)
	fs.SortFlags = false
	addSelectionFlags(fs, f)
	fs.StringVarP(&f.output, "output", "o", "table", "report format: table or json (JSON lines: node, one per flow, summary)")
	fs.StringVarP(&f.pcap, "pcap", "w", "", "write every captured frame to this pcapng `file`, one interface per capture point (\"-\" = stdout, the report then goes to stderr); written as FILE.partial, renamed to FILE when the capture ends (cut by a full disk too: the report says so; a killed run leaves FILE.partial), mode 0600")
	fs.Uint64Var(&f.maxPkts, "max-packets", 0, "stop after writing this many packets to --pcap (0 = no bound)")
	fs.StringVar(&f.maxBytes, "max-bytes", "", "stop before --pcap grows beyond this `size` (bytes, or with K, M, G suffix; the file never exceeds it)")
	fs.DurationVar(&f.flowTimeout, "flow-timeout", 0, fmt.Sprintf("with --duration 0: a flow idle this long is reported then and forgotten (a TCP connection is reported once closed and quiet for 9 s); a long idle connection that speaks again after it is a new flow, whose JSON \"continues\" names the earlier one; at least %s (default %s)", minFlowTimeout, flow.DefaultFlowTimeout))
	fs.DurationVar(&f.reportEvery, "report-every", 0, "with --duration 0: write the counts so far (flows per verdict, drops, how long pathtrace's threads waited for a CPU) this often (at least 1s), a {\"type\":\"interval\"} JSON line or a table line (0 = never)")
	fs.BoolVar(&f.version, "version", false, "print the version and exit")
	// Only --help prints this (ContinueOnError: errors are one line each),
	// to stdout, so that it pages.
	fs.SetOutput(os.Stdout)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), traceUsage)
		fs.PrintDefaults()
	}
	return fs
}

// addSelectionFlags adds what the trace and incident commands share: the
// Services, the duration, and which Pods and node to look at.
func addSelectionFlags(fs *pflag.FlagSet, f *traceFlags) {
	fs.StringArrayVar(&f.svcs, "svc", nil, "Service `IP[:PORT][/tcp|udp]` to trace, repeatable (required): a ClusterIP, or a NodePort as NODE-IP:PORT; without a port any port of that IP")
	fs.DurationVar(&f.duration, "duration", 30*time.Second, "how long to trace; Ctrl-C, SIGTERM or SIGHUP (the terminal went away; not when ignored, as under nohup) ends early and still prints the full report (incident: and writes the bundle); 0: until stopped (not for incident), each flow reported as it ends (see --flow-timeout), memory bounded (--max-flows bounds the flows open at once; --pcap needs --max-bytes)")
	fs.StringVar(&f.podIP, "pod-ip", "", "trace only the Pod that owns this IPv4 address, and the one made again with it during the run (default: every Pod of the node, and those that start during the run; give at most one of --pod-ip, --pod-netns, --pod-pid)")
	fs.StringVar(&f.podNetNS, "pod-netns", "", "trace only the Pod whose network namespace is this `path` (/proc/PID/ns/net, /run/netns/NAME)")
	fs.Var(&f.podPID, "pod-pid", "trace only the Pod in which this process runs")
	fs.StringVar(&f.hostNetNS, "host-netns", "", "the node's network namespace `path` (default: pathtrace's own; set it for kind/k3d nodes or the lab)")
	fs.StringVar(&f.hostVeth, "host-veth", "", "host-side veth `name` of the Pod (default: found from the Pod's eth0 peer)")
	fs.StringVar(&f.uplink, "uplink", "", "uplink interface `name` (default: the bridge port towards the Pod's gateway; for routed Pods the device of the route to the backends, else to the VIP; below a VLAN device, where frames carry the tag; a name given here is captured as is)")
	fs.StringVar(&f.cgroup, "cgroup", "", "cgroup v2 `dir` where socket observers attach (default: the cgroup2 root from /proc/self/mountinfo)")
	fs.IntVar(&f.snaplen, "snaplen", 96, "bytes kept per captured frame, 64 to 65535, as tcpdump -s")
	fs.StringVar(&f.bufSize, "buffer-size", "4M", "kernel ring of each capture point, `size` 16K to 256M, in bytes or with K, M, G suffix (as tcpdump -B; part of pathtrace's RSS); raise it when the report shows kernel drops; with more than two Pods, the Pods' points share 4 such rings")
	fs.IntVar(&f.nice, "nice", defaultNice, "nice `value` of pathtrace's threads, -20 to 19: below 0 the capture drains its rings ahead of the processes that share its CPU cgroup (in the root cgroup, with autogroup: its login session), so it loses fewer frames when they saturate the CPUs; against Pods in other cgroups their cgroups' CPU weights decide, whatever the nice value (its CPU use stays the same); 0 runs it like any process")
	fs.IntVar(&f.maxFlows, "max-flows", defaultMaxFlows, "bound on tracked flows (about 2.5 KiB each, 4 KiB of memory beyond the default; with --duration 0, on the flows open at once); more are counted as dropped (flows_over_max) and reported, their packets still captured")
}

// pidFlag is --pod-pid, which knows whether it was given: --pod-pid 0, as
// by a script's PID lookup that found nothing, is refused, not taken for the
// flag left out (every Pod).
type pidFlag struct {
	pid   int
	given bool
}

func (p *pidFlag) Set(s string) error {
	pid, err := strconv.Atoi(s)
	if err != nil {
		// In pflag's words for its own number flags, not strconv's.
		return errors.New("must be a process id (the PID of a process in the Pod)")
	}
	p.pid, p.given = pid, true
	return nil
}

func (p *pidFlag) String() string { return strconv.Itoa(p.pid) }
func (p *pidFlag) Type() string   { return "int" }

// validate turns the flags into session options; every error is a usage error.
func (f *traceFlags) validate() (session.Options, error) {
	var opt session.Options
	if len(f.svcs) == 0 {
		return opt, usagef("--svc is required: the Service VIP to trace, e.g. --svc 10.120.0.80:80/tcp")
	}
	for _, s := range f.svcs {
		svc, err := parseService(s)
		if err != nil {
			return opt, err
		}
		opt.Services = append(opt.Services, svc)
	}
	if f.duration < 0 {
		return opt, usagef("--duration %s: must be positive (or 0: until stopped), e.g. --duration 30s", f.duration)
	}
	if f.output != "table" && f.output != "json" {
		return opt, usagef("--output %q: use table or json", f.output)
	}
	if f.snaplen < 64 || f.snaplen > 65535 {
		return opt, usagef("--snaplen %d: use 64-65535 (headers up to L4 need 64)", f.snaplen)
	}
	ring, err := parseSize(f.bufSize)
	if err != nil {
		return opt, usagef("--buffer-size %s: %v", f.bufSize, err)
	}
	if ring < capture.MinRingBytes || ring > capture.MaxRingBytes {
		return opt, usagef("--buffer-size %s: use %dK to %dM, e.g. --buffer-size 8M", f.bufSize, capture.MinRingBytes>>10, capture.MaxRingBytes>>20)
	}
	// A ring whose blocks cannot hold one frame of --snaplen opens no tap
	// at all: every capture point would be reported not attached, and a
	// --pcap run would fail with no interface to write.
	if need := capture.MinRingFor(f.snaplen); ring < int64(need) {
		return opt, usagef("--buffer-size %s cannot hold a frame of --snaplen %d: give at least %dK, or a smaller --snaplen", f.bufSize, f.snaplen, need>>10)
	}
	opt.RingBytes = int(ring)
	if f.nice < -20 || f.nice > 19 {
		return opt, usagef("--nice %d: use -20 to 19 (0 = the default priority)", f.nice)
	}
	if f.maxFlows < 1 {
		return opt, usagef("--max-flows %d: must be at least 1", f.maxFlows)
	}
	// The conflict first: checking a selector (a /proc entry to stat) would
	// report its own error instead.
	selectors := 0
	for _, given := range []bool{f.podIP != "", f.podNetNS != "", f.podPID.given} {
		if given {
			selectors++
		}
	}
	if selectors > 1 {
		return opt, usagef("--pod-ip, --pod-netns and --pod-pid select the same thing: give at most one")
	}
	d := &opt.Discover
	if f.podIP != "" {
		// `ip addr` in the Pod prints its address with the prefix length.
		if p, err := netip.ParsePrefix(f.podIP); err == nil && p.Addr().Is4() {
			return opt, usagef("--pod-ip %s: give the Pod's address without its prefix length: --pod-ip %s", f.podIP, p.Addr())
		}
		a, err := netip.ParseAddr(f.podIP)
		if err != nil || !a.Is4() {
			return opt, usagef("--pod-ip %q is not an IPv4 address: give the Pod's IP (kubectl get pod -o wide), e.g. --pod-ip 10.244.8.23", f.podIP)
		}
		d.PodIP = a
	}
	if f.podNetNS != "" {
		if _, err := os.Stat(f.podNetNS); errors.Is(err, fs.ErrPermission) && strings.HasSuffix(f.podNetNS, "/ns/net") {
			return opt, ptraceDenied("--pod-netns", f.podNetNS, err)
		} else if err != nil {
			return opt, usagef("--pod-netns %s: %v; give a netns file such as /run/netns/NAME or /proc/PID/ns/net", f.podNetNS, errors.Unwrap(err))
		}
		d.PodNetNS = f.podNetNS
	}
	if f.podPID.given {
		pid := f.podPID.pid
		if pid <= 0 {
			return opt, usagef("--pod-pid %d: not a process id: give the PID of a process in the Pod (its pause, or its container's main process)", pid)
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d/ns/net", pid)); errors.Is(err, fs.ErrNotExist) {
			return opt, discover.PodPIDMissing(pid)
		} else if errors.Is(err, fs.ErrPermission) {
			return opt, ptraceDenied("--pod-pid", strconv.Itoa(pid), err)
		} else if err != nil {
			return opt, usagef("--pod-pid %d: %v", pid, err)
		}
		d.PodPID = pid
	}
	if f.hostNetNS != "" {
		if _, err := os.Stat(f.hostNetNS); errors.Is(err, fs.ErrPermission) && strings.HasSuffix(f.hostNetNS, "/ns/net") {
			return opt, ptraceDenied("--host-netns", f.hostNetNS, err)
		} else if err != nil {
			return opt, usagef("--host-netns %s: %v; give a netns file such as /run/netns/NAME or /proc/PID/ns/net", f.hostNetNS, errors.Unwrap(err))
		}
		d.HostNetNS = f.hostNetNS
	}
	if f.cgroup != "" {
		if _, err := os.Stat(f.cgroup); err != nil {
			return opt, usagef("--cgroup %s: %v; give a cgroup v2 directory (default: the cgroup2 root)", f.cgroup, errors.Unwrap(err))
		}
		// Absolute: discovery walks up its parents to "/", and attachments
		// and reports name it.
		abs, err := filepath.Abs(f.cgroup)
		if err != nil {
			return opt, usagef("--cgroup %s: %v; give an absolute path", f.cgroup, err)
		}
		d.Cgroup = abs
	}
	d.HostVeth, d.Uplink = f.hostVeth, f.uplink
	if (f.maxPkts > 0 || f.maxBytes != "") && f.pcap == "" {
		return opt, usagef("--max-packets and --max-bytes bound the --pcap file: give --pcap FILE too")
	}
	if f.maxBytes != "" {
		n, err := parseSize(f.maxBytes)
		if err != nil {
			return opt, usagef("--max-bytes %q: %v", f.maxBytes, err)
		}
		opt.PcapLimits.MaxBytes = n
	}
	if f.pcap == "-" && stdoutIsTerminal() {
		return opt, usagef("--pcap -: stdout is a terminal, which binary pcapng would garble: pipe it to a reader (--pcap - | wireshark -k -i -) or give a file (--pcap /var/tmp/svc.pcapng)")
	}
	if f.pcap != "" && f.pcap != "-" {
		if st, err := os.Stat(f.pcap); err == nil && st.IsDir() {
			return opt, usagef("--pcap %s: a directory; give a file to write in it, e.g. --pcap %s", f.pcap, filepath.Join(f.pcap, "svc.pcapng"))
		}
		// Lstat: a symbolic link, even one to nothing, is a name taken too.
		if st, err := os.Lstat(f.pcap); err == nil && st.Mode()&fs.ModeNamedPipe != 0 {
			return opt, usagef("--pcap %s: a named pipe; pathtrace writes a new file, or streams to stdout: --pcap - > %s", f.pcap, f.pcap)
		} else if err == nil {
			return opt, usagef("--pcap %s: the file exists; pathtrace never overwrites a capture, give a new name", f.pcap)
		}
		if _, err := os.Lstat(f.pcap + ".partial"); err == nil && export.PartialInUse(f.pcap) {
			return opt, usagef("--pcap %s: %s.partial is being written by a capture running now (another pathtrace): give another file", f.pcap, f.pcap)
		} else if err == nil {
			return opt, usagef("--pcap %s: %s.partial exists (left by an interrupted capture?): remove it or give a new name", f.pcap, f.pcap)
		}
		if st, err := os.Stat(filepath.Dir(f.pcap)); err != nil || !st.IsDir() {
			return opt, usagef("--pcap %s: no directory %s to write it in", f.pcap, filepath.Dir(f.pcap))
		}
		if err := canWriteIn(filepath.Dir(f.pcap)); err != nil {
			return opt, usagef("--pcap %s: cannot write in %s: %v; give a file in a writable directory", f.pcap, filepath.Dir(f.pcap), err)
		}
		if err := partialFits(f.pcap, ".partial"); err != nil {
			return opt, usagef("--pcap %s: %v", f.pcap, err)
		}
		if hasNoRoom(filepath.Dir(f.pcap)) {
			return opt, capError{fmt.Sprintf("--pcap %s: no space left on the filesystem of %s: free some, or give a file on another filesystem", f.pcap, filepath.Dir(f.pcap))}
		}
	}
	if f.duration == 0 && f.pcap != "" && f.maxBytes == "" && f.maxPkts > 0 {
		return opt, usagef("--pcap with --duration 0 (until stopped) needs --max-bytes: --max-packets bounds the packets, not the bytes on disk; give --max-bytes SIZE too (e.g. --max-bytes 1G)")
	}
	if f.duration == 0 && f.pcap != "" && f.maxBytes == "" {
		return opt, usagef("--pcap with --duration 0 (until stopped) would grow without end: give --max-bytes SIZE too (e.g. --max-bytes 1G); the file ends at that size and tracing goes on")
	}
	switch {
	case f.duration != 0 && f.flowTimeout != 0:
		return opt, usagef("--flow-timeout %s: with --duration 0 only (a bounded run reports every flow at its end)", f.flowTimeout)
	case f.duration == 0 && f.flowTimeout == 0:
		f.flowTimeout = flow.DefaultFlowTimeout
	case f.duration == 0 && f.flowTimeout < minFlowTimeout:
		return opt, usagef("--flow-timeout %s: use at least %s (flows are reported after a few seconds' quiet anyway)", f.flowTimeout, minFlowTimeout)
	}
	if f.reportEvery < 0 || f.reportEvery > 0 && f.duration != 0 {
		return opt, usagef("--report-every %s: use a positive interval, with --duration 0 only (a bounded run reports at its end)", f.reportEvery)
	}
	if f.reportEvery > 0 && f.reportEvery < time.Second {
		// The counts are taken on the run's one-second tick: a shorter
		// interval would silently be a second.
		return opt, usagef("--report-every %s: give at least 1s, e.g. --report-every 10s", f.reportEvery)
	}
	opt.FlowTimeout = f.flowTimeout
	opt.ReportEvery = f.reportEvery
	opt.Pcap = f.pcap
	opt.PcapLimits.MaxPackets = f.maxPkts
	opt.Duration = f.duration
	opt.Snaplen = f.snaplen
	opt.MaxFlows = f.maxFlows
	return opt, nil
}

// minFlowTimeout bounds --flow-timeout from below: a flow is idle for a
// few of the engine's reordering windows before it may be over.
const minFlowTimeout = 10 * time.Second

// capError is an input pathtrace could not use for want of a capability:
// a runtime failure (exit 1), not bad usage.
type capError struct{ msg string }

func (e capError) Error() string { return e.msg }

// exitFor is the exit code of an error found while checking the flags.
func exitFor(err error) int {
	var ce capError
	if errors.As(err, &ce) {
		return exitRuntime
	}
	return exitUsage
}

// ptraceDenied says why a /proc/PID/ns/net (or another netns file) could not
// be read: another user's or a non-dumpable process's needs CAP_SYS_PTRACE,
// which a container given only what pathtrace requires lacks.
func ptraceDenied(flag, what string, err error) error {
	eff, cerr := effectiveCaps()
	return ptraceDeniedWith(flag, what, err, eff, cerr == nil)
}

// ptraceDeniedWith is ptraceDenied for the effective capability set eff
// (known: read); a process that has CAP_SYS_PTRACE (root on most nodes)
// was refused by something else, which the message must not blame on a
// capability it has.
func ptraceDeniedWith(flag, what string, err error, eff uint64, known bool) error {
	if known && eff&(1<<unix.CAP_SYS_PTRACE) != 0 {
		return capError{fmt.Sprintf("%s %s: %v although this process has CAP_SYS_PTRACE: something besides capabilities refuses it (a security module such as AppArmor or SELinux, a sandbox); give the Pod's netns by its name under /run/netns (--pod-netns /run/netns/NAME)", flag, what, errors.Unwrap(err))}
	}
	return capError{fmt.Sprintf("%s %s: %v: reading another user's (or a non-dumpable) process's netns needs CAP_SYS_PTRACE, which this process lacks: add it, or give the Pod's netns by its name under /run/netns", flag, what, errors.Unwrap(err))}
}

// canWriteIn tells why files cannot be made in dir (a read-only filesystem, a
// container's read-only root or volume, no permission, a kernel filesystem
// such as /proc or /sys), nil when they can: found before anything is
// attached, not when the capture opens its file.
func canWriteIn(dir string) error {
	err := unix.Faccessat(unix.AT_FDCWD, dir, unix.W_OK|unix.X_OK, unix.AT_EACCESS)
	if errors.Is(err, unix.EROFS) {
		return errors.New("read-only file system")
	}
	if errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM) {
		return errors.New("permission denied")
	}
	// Root passes that check on /proc and /sys too: only making a file
	// tells. An unnamed one leaves nothing behind; a named one where the
	// filesystem cannot make those.
	if fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, 0o600); err == nil {
		return unix.Close(fd)
	}
	f, err := os.CreateTemp(dir, ".pathtrace-check-")
	if err != nil {
		if name := kernelFS(dir); name != "" {
			return fmt.Errorf("the kernel's %s filesystem, which holds no files", name)
		}
		return errors.Unwrap(err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// hasNoRoom tells whether dir's filesystem cannot take one page more (a
// full disk): a runtime condition, not bad usage, but known before anything
// is attached, where the file's header would fail only once the observers
// and taps were in place. A new file is unnamed, so it leaves nothing behind.
func hasNoRoom(dir string) bool {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false // the create will say
	}
	defer unix.Close(fd)
	return errors.Is(unix.Fallocate(fd, 0, 0, int64(os.Getpagesize())), unix.ENOSPC)
}

// partialFits tells why path cannot be built as PATH+suffix (FILE.partial;
// an incident's archive, DIR.tar.gz.partial): a name longer than its
// filesystem takes, which failed only once the capture had begun.
func partialFits(path, suffix string) error {
	var st unix.Statfs_t
	if unix.Statfs(filepath.Dir(path), &st) != nil || st.Namelen == 0 {
		return nil // the create will say
	}
	if n := len(filepath.Base(path) + suffix); int64(n) > st.Namelen {
		return fmt.Errorf("built as NAME%s, a name of %d bytes, more than the %d its filesystem takes: give a shorter name", suffix, n, st.Namelen)
	}
	return nil
}

// kernelFS names the kernel's own filesystem dir is on, "" for any other.
func kernelFS(dir string) string {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return ""
	}
	return map[int64]string{unix.PROC_SUPER_MAGIC: "proc", unix.SYSFS_MAGIC: "sysfs", unix.CGROUP2_SUPER_MAGIC: "cgroup2",
		unix.CGROUP_SUPER_MAGIC: "cgroup", unix.BPF_FS_MAGIC: "bpf", unix.TRACEFS_MAGIC: "tracefs", unix.DEBUGFS_MAGIC: "debugfs"}[st.Type]
}

// stampedVersion is set by `make build` (-X): the commit it was built from.
var stampedVersion string

func version() string {
	if stampedVersion != "" {
		return "pathtrace " + stampedVersion
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				return "pathtrace " + bi.Main.Version + " (" + s.Value[:12] + ")"
			}
		}
		return "pathtrace " + bi.Main.Version
	}
	return "pathtrace (unknown version)"
}

// interruptedStart says what a stop signal during start-up (discovery, before
// any observer is attached) did, where the error is only "context canceled".
const interruptedStart = "stopped while starting (Ctrl-C or a stop signal before tracing began): nothing was traced, nothing stays attached"

// errReaderGone is the cause that ends a run until stopped whose stdout's
// reader went away (watchReaderGone); stopReaderGone is the stop reason it
// gives the report.
var errReaderGone = errors.New("stdout's reader went away")

const stopReaderGone = "reader-gone"

// startInterrupted tells whether err ended the run because ctx, the run's stop
// signals, was done before tracing began.
func startInterrupted(ctx context.Context, err error) bool {
	return errors.Is(err, context.Canceled) && ctx.Err() != nil
}

func runTrace(args []string) int {
	var f traceFlags
	fs := newTraceFlagSet(&f)
	help := bufio.NewWriter(os.Stdout) // its write error is told by helpWritten
	fs.SetOutput(help)
	err := parseStrict(fs, args)
	// The arguments parsed before an error: a subcommand after the main
	// command's flags makes its own flags unknown ones (--out).
	if sub := subcommandIn(fs.Args()); sub != "" {
		fmt.Fprintf(os.Stderr, "pathtrace: %s is a subcommand: give it first, before its flags (see pathtrace %s --help)\n", sub, sub)
		return exitUsage
	}
	if err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return helpWritten("pathtrace", help)
		}
		fmt.Fprintf(os.Stderr, "pathtrace: %v (see pathtrace --help)\n", err)
		return exitUsage
	}
	if f.version {
		fmt.Fprintln(help, version())
		return helpWritten("pathtrace", help)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "pathtrace: unexpected argument %q: Services are given with --svc (see pathtrace --help)\n", fs.Arg(0))
		return exitUsage
	}
	opt, err := f.validate()
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: %v\n", err)
		return exitFor(err)
	}
	limitMemory(opt.MaxFlows)
	if msg := capsProblem("pathtrace"); msg != "" {
		fmt.Fprintln(os.Stderr, msg)
		return exitRuntime
	}
	if err := setNice(f.nice); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: %v; capturing at the priority it has\n", err)
	}

	// The first stop signal ends the run and lets the report be written;
	// the next one ends pathtrace at once (endAtOnce): a report stuck on an
	// output that is not read (a pipe whose reader stalled, a terminal
	// stopped with Ctrl-S) or a stop that takes too long is not a process
	// Ctrl-C or SIGTERM can no longer end.
	sigs := make(chan os.Signal, 2) // both may come before this reads one
	signal.Notify(sigs, stopSignals()...)
	defer signal.Stop(sigs)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		<-sigs
		stop()
		endAtOnce(<-sigs)
	}()
	// runCtx also ends when a run until stopped can no longer write its
	// report (stdout closed, its disk full): it would trace on for days
	// with nothing to show; its cause says when stdout's reader went away
	// first (errReaderGone).
	runCtx, endRunCause := context.WithCancelCause(ctx)
	endRun := func() { endRunCause(nil) }
	defer endRun()
	if path := os.Getenv("PATHTRACE_CPUPROFILE"); path != "" {
		defer profileCPU(path)()
	}

	// With the capture on stdout the report goes to stderr, and a reader that
	// goes away (Wireshark closed) becomes a write error, not a silent death.
	out := io.Writer(os.Stdout)
	if f.pcap == "-" {
		out = os.Stderr
	}
	// So too a report whose reader went away (`| head -1`, a log shipper
	// that died; SIGPIPE is caught in main): the write fails with EPIPE and
	// is said on stderr, exit 1, as for any lost report (a run until
	// stopped ends then: runCtx, with the open flows' end).
	if opt.Duration == 0 || opt.Pcap == "" || opt.Pcap == "-" {
		// A run until stopped may write nothing for hours (no flow to the
		// VIP), a bounded one nothing until its end: a reader that went
		// away after the node block (`| head -1`) is seen when it goes,
		// not at a next write that may never come. So is a --pcap -
		// stream's (`| tshark -r - -c 5`). A bounded run goes on for its
		// --pcap file.
		watchReaderGone(os.Stdout, func() { endRunCause(errReaderGone) })
	}
	rw := report.NewWriter(out, f.output)
	if isTerminal(os.Stderr) {
		opt.Progress = func(p session.Progress) { fmt.Fprintf(os.Stderr, "\r\033[K%s", progressLine(p)) }
	}
	opt.CaptureStart, opt.CaptureDone = hugeHeap, tightenHeap
	opt.CaptureBehind = moreProcsWhenBehind()
	if opt.Duration == 0 {
		// Until stopped: each flow is reported as it ends, the file (if
		// any) ends at its bound while tracing goes on.
		// The progress line (stderr, a terminal) is cleared first: the
		// rows would go on from where it ends, on the same terminal; the
		// next tick writes it again below them.
		clearProgress := func() {
			if opt.Progress != nil {
				fmt.Fprint(os.Stderr, "\r\033[K")
			}
		}
		reportLost := func() {
			if rw.Err() != nil {
				endRun()
			}
		}
		opt.Finished = func(fs []flow.Flow) { clearProgress(); rw.Finished(fs); reportLost() }
		opt.PcapBoundEndsFileOnly = true
		opt.Interval = func(s flow.Summary, drops, packets map[string]uint64, wait *session.CPUWait) {
			clearProgress()
			rw.Interval(time.Now(), s, drops, packets, cpuWaitOf(wait))
			reportLost()
		}
	}
	opt.Ready = func(node *discover.NodeInfo, atts []probe.Attachment) {
		rw.Node(nodeJSON(node, atts), func(w io.Writer) { writeNodeTable(w, node, atts) })
		// A report lost from its start ends a run that has nothing else
		// to show: a bounded one goes on only for its --pcap file.
		if rw.Err() != nil && (opt.Duration == 0 || opt.Pcap == "") {
			endRun()
		}
	}
	res, err := session.Run(runCtx, opt)
	if opt.Progress != nil {
		fmt.Fprint(os.Stderr, "\r\033[K")
	}
	if err != nil {
		var ue *discover.UsageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "pathtrace: %v\n", ue)
			return exitUsage
		}
		if errors.Is(err, export.ErrTaken) { // taken after the flags were checked: another run started with the same --pcap
			fmt.Fprintf(os.Stderr, "pathtrace: %v\n", err)
			return exitUsage
		}
		if errors.Is(err, export.ErrLimit) { // the bound cannot even hold the file's header
			fmt.Fprintf(os.Stderr, "pathtrace: --max-bytes %s: %v; give a larger bound, e.g. --max-bytes 64M\n", f.maxBytes, err)
			return exitUsage
		}
		// The stream's reader may go while the observers attach, when the
		// run's end is not looked at: the header's write then tells it.
		if errors.Is(err, context.Canceled) && errors.Is(context.Cause(runCtx), errReaderGone) || f.pcap == "-" && errors.Is(err, syscall.EPIPE) {
			reader := "the report's reader"
			if f.pcap == "-" {
				reader = "the capture stream's reader"
			}
			fmt.Fprintf(os.Stderr, "pathtrace: %s went away (stdout closed) before tracing began: nothing was traced, nothing stays attached\n", reader)
			return exitRuntime
		}
		if startInterrupted(ctx, err) {
			fmt.Fprintf(os.Stderr, "pathtrace: %s\n", interruptedStart)
			return exitRuntime
		}
		fmt.Fprintf(os.Stderr, "pathtrace: %s\n", explainDenied(err))
		return exitRuntime
	}
	if path := os.Getenv("PATHTRACE_MEMPROFILE"); path != "" {
		profileHeap(path)
	}
	if errors.Is(context.Cause(runCtx), errReaderGone) && (res.StopReason == "interrupted" || res.StopReason == "pcap-error") {
		// Not a signal: the run ended because stdout's reader (the --pcap -
		// stream's; the report's, which then is lost anyway) went away,
		// whether or not a write to the stream failed before the run saw it.
		res.StopReason = stopReaderGone
	}
	rw.Flows(res.Flows)
	rw.Summary(res.Summary, res.Drops, runOf(res, res.Pcap))
	code := exitOK
	// A report lost to its output (stdout on a full disk, closed) is never
	// a silent success.
	if err := rw.Err(); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: the report could not be written: %v\n", outputLost(err))
		code = exitRuntime
	}
	// The capture file is cut (a full disk, a reader that went away): a
	// runtime failure, so that a script does not ship the cut file as the
	// capture it asked for.
	if res.Pcap != nil && res.Pcap.Error != "" {
		fmt.Fprintf(os.Stderr, "pathtrace: the capture %s is incomplete (%d packets written): %s\n", pcapName(f.pcap), res.Pcap.Packets, res.Pcap.Error)
		code = exitRuntime
	}
	return code
}

// subcommandIn returns the first of args that names a subcommand, "" when none.
func subcommandIn(args []string) string {
	for _, a := range args {
		switch a {
		case "incident", "lab":
			return a
		}
	}
	return ""
}

// profileCPU writes a CPU profile of the run to path (for developers: set
// PATHTRACE_CPUPROFILE); the returned function ends it.
func profileCPU(path string) func() {
	f, err := os.Create(path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: cpu profile: %v\n", err)
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: cpu profile: %v\n", err)
		f.Close()
		return func() {}
	}
	return func() { pprof.StopCPUProfile(); f.Close() }
}

// profileHeap writes a heap profile at the end of the run, while the flows
// are still live (for developers: set PATHTRACE_MEMPROFILE).
func profileHeap(path string) {
	f, err := os.Create(path)
	if err == nil {
		err = errors.Join(pprof.WriteHeapProfile(f), f.Close())
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "pathtrace: heap profile: %v\n", err)
	}
}

// parseSize reads a byte count with an optional K, M or G suffix (powers of 1024).
func parseSize(s string) (int64, error) {
	// 10MB, 10MiB: the units other tools take, whose B is not ours.
	if t := strings.TrimRight(s, "iIbB"); len(t) < len(s) && len(t) > 1 && strings.ContainsAny(t[len(t)-1:], "kKmMgG") {
		return 0, fmt.Errorf("write %s: K, M and G are powers of 1024, written without B", t)
	}
	mult := int64(1)
	switch strings.ToUpper(s[max(len(s)-1, 0):]) {
	case "K":
		mult = 1 << 10
	case "M":
		mult = 1 << 20
	case "G":
		mult = 1 << 30
	}
	if mult > 1 {
		s = s[:len(s)-1]
	}
	n, err := strconv.ParseInt(s, 10, 64)
	switch {
	case errors.Is(err, strconv.ErrRange) || n > (1<<62)/mult:
		return 0, errors.New("too large")
	case err != nil:
		return 0, errors.New("not a size: give bytes, or a whole number with a K, M or G suffix, e.g. 64M")
	case n <= 0:
		return 0, errors.New("not a positive size, e.g. 64M")
	}
	return n * mult, nil
}

// stdoutIsTerminal tells whether stdout is a terminal (a variable: tests
// have none).
var stdoutIsTerminal = func() bool { return isTerminal(os.Stdout) }

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// progressLine is the live status for stderr, a terminal: its width is read
// at each tick, so a window resized mid-run gets lines that fit it.
func progressLine(p session.Progress) string {
	return report.Progress(p.Elapsed, p.Duration, p.Summary, p.Pending, p.Packets, p.Drops, termWidth(os.Stderr))
}

// termWidth is the width in columns of the terminal f is, 80 when it does
// not say (a serial console reports 0).
func termWidth(f *os.File) int {
	ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ)
	if err != nil || ws.Col == 0 {
		return 80
	}
	return int(ws.Col)
}

// pcapName names the --pcap destination in messages.
func pcapName(path string) string {
	if path == "-" {
		return "stream on stdout"
	}
	return "file " + path
}

// watchReaderGone calls gone once the reader of f, a pipe or a socket, has
// gone away (its end closed: poll says POLLERR or POLLHUP), whether or not
// anything is written to f meanwhile; nothing for other files.
func watchReaderGone(f *os.File, gone func()) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFIFO && t != unix.S_IFSOCK {
		return
	}
	fd := int32(f.Fd())
	go func() {
		for {
			// No event asked for: poll returns on POLLERR, POLLHUP or
			// POLLNVAL only, which it always reports.
			fds := []unix.PollFd{{Fd: fd}}
			_, err := unix.Poll(fds, -1)
			if err == unix.EINTR {
				continue
			}
			if err != nil || fds[0].Revents&(unix.POLLERR|unix.POLLHUP|unix.POLLNVAL) != 0 {
				gone()
				return
			}
		}
	}()
}

// runOf is what the report says of the session's run, with the capture
// file summarized as pcap.
func runOf(res *session.Result, pcap *export.Summary) report.Run {
	return report.Run{Stop: res.StopReason, Packets: res.Packets, Pcap: pcap, Summarized: res.Summarized,
		CaptureEnded: res.CaptureEnded, CaptureGaps: res.CaptureGaps, ObserversEnded: res.ObserversEnded,
		NATRulesReread: res.NATRulesReread, TCProgramsChanged: res.TCProgramsChanged, PodsStarted: res.PodsStarted, ObserversAdded: res.ObserversAdded,
		CPUWait: cpuWaitOf(res.CPUWait)}
}

// cpuWaitOf is a session's CPU wait as the report says it; nil when the
// kernel did not say.
func cpuWaitOf(w *session.CPUWait) *report.CPUWait {
	if w == nil {
		return nil
	}
	return report.NewCPUWait(w.Total, w.Worst)
}
