package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/spf13/pflag"
)

const labHelp = `pathtrace lab — a small Kubernetes-like datapath in network namespaces (a Pod, a node
with a bridge and a VLAN uplink, a gateway, a backend) to try pathtrace on.

Usage:
  pathtrace lab up [--mode MODE] [--name NAME]   build the lab (idempotent) or switch its mode
  pathtrace lab client [--name NAME] [--requests N] [--interval D] [--timeout D] [--json]
                                                  send requests to the Services from the Pod;
                                                  prints what failed and exits 0 even so (the
                                                  nowhere mode fails on purpose)
  pathtrace lab status [--name NAME] [--json]     show what exists and a health check (exit 1
                                                  when it fails)
  pathtrace lab down [--name NAME]                remove everything the lab made

Topology (namespaces NAME-pod, NAME-node, NAME-gw, NAME-backend under /run/netns):
  pod      eth0 10.244.8.23/22, default via 10.244.8.1
  node     veth-a (the Pod's host veth) and bond0 (uplink) on bridge br-pod (no IP);
           bond0 carries VLAN 200 (tag pushed/popped by BPF on both ends)
  gw       10.244.8.1/22 on the VLAN side, 10.244.20.1/22 to the backend; no Service routes
  backend  10.244.20.31: HTTP on tcp/3000, UDP echo on udp/5353
Services: 10.120.0.80:80/tcp -> 10.244.20.31:3000, 10.120.0.10:53/udp -> 10.244.20.31:5353

Modes (where the VIP is translated):
  socket     cgroup connect4/sendmsg4/recvmsg4/getpeername4 programs on the client's cgroup
  tc         tcx programs on veth-a: DNAT on ingress, reverse NAT on egress
  tc-legacy  the same programs as cls_bpf filters (clsact, direct-action) on veth-a, as older
             Cilium and Calico attach them: the kernel runs them after the whole tcx chain
  netfilter  kube-proxy nftables rules (table ip kube-proxy) in the node, bridge-nf-call-iptables=1
  nowhere    the same rules with bridge-nf-call-iptables=0: frames leave the uplink with the VIP,
             the gateway answers ICMP unreachable and every request fails fast
The client succeeds in every mode but nowhere, where it fails.

Flags:
  --name NAME       lab instance name (default "ptlab"), prefix of every object
  --mode MODE       up: socket, tc, tc-legacy, netfilter or nowhere (default "socket")
  --requests N      client: requests per protocol (default 5)
  --interval D      client: pause between requests, e.g. 200ms (default 0)
  --timeout D       client: per-request timeout (default 1s)
  --json            client, status: print JSON

Example:
  sudo pathtrace lab up --mode nowhere && sudo pathtrace lab client --requests 5
  sudo pathtrace lab down

Needs root, Linux >= 6.6 (tcx), cgroup v2.
`

// runLab runs `pathtrace lab ...`.
func runLab(args []string) int {
	// Buffered: a write error (stdout's reader gone, a full disk) stays
	// and is told by Flush, whatever the command printed after it.
	out := bufio.NewWriter(os.Stdout)
	err := labCommand(args, out)
	if ferr := out.Flush(); ferr != nil {
		fmt.Fprintf(os.Stderr, "pathtrace lab: its output could not be written: %v\n", outputLost(ferr))
		// What status and client print is what they are run for; up and
		// down did their work, only its one line is lost.
		if err == nil && (args[0] == "status" || args[0] == "client") {
			return exitRuntime
		}
	}
	var uerr usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, pflag.ErrHelp):
		help := bufio.NewWriter(os.Stdout)
		fmt.Fprint(help, labHelp)
		return helpWritten("pathtrace lab", help)
	case errors.As(err, &uerr):
		fmt.Fprintf(os.Stderr, "pathtrace lab: %v (see 'pathtrace lab --help')\n", err)
		return exitUsage
	default:
		fmt.Fprintf(os.Stderr, "pathtrace lab: %v\n", err)
		return exitRuntime
	}
}

func labCommand(args []string, out io.Writer) error {
	if len(args) == 0 {
		return usagef("missing command: up, client, status or down")
	}
	cmd := args[0]
	if cmd == "-h" || cmd == "--help" || cmd == "help" {
		return pflag.ErrHelp
	}
	fs := pflag.NewFlagSet("lab "+cmd, pflag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported in one line by runLab
	name := fs.String("name", lab.DefaultName, "lab instance name")
	var (
		mode     *string
		requests *int
		interval *time.Duration
		timeout  *time.Duration
		asJSON   *bool
	)
	switch cmd {
	case "up":
		mode = fs.String("mode", string(lab.ModeSocket), "translation mode")
	case "client":
		requests = fs.Int("requests", 5, "requests per protocol")
		interval = fs.Duration("interval", 0, "pause between requests")
		timeout = fs.Duration("timeout", time.Second, "per-request timeout")
		asJSON = fs.Bool("json", false, "print JSON")
	case "status":
		asJSON = fs.Bool("json", false, "print JSON")
	case "down":
	default:
		if strings.HasPrefix(cmd, "-") { // lab --name x status, as the main command's flags go
			return usagef("%s: give the command first, then its flags, e.g. pathtrace lab status --name NAME", cmd)
		}
		return usagef("unknown command %q: want up, client, status or down", cmd)
	}
	if err := parseStrict(fs, args[1:]); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return err
		}
		return usagef("%s: %v", cmd, err)
	}
	if fs.NArg() > 0 {
		return usagef("%s: unexpected argument %q", cmd, fs.Arg(0))
	}
	if err := lab.CheckName(*name); err != nil {
		return usagef("%s: %v", cmd, err)
	}
	if cmd == "client" && *requests < 1 {
		return usagef("client: --requests must be at least 1")
	}
	if cmd == "client" && *timeout <= 0 {
		return usagef("client: --timeout %s: give a positive per-request timeout, e.g. --timeout 1s", *timeout)
	}
	if cmd == "client" && *interval < 0 {
		return usagef("client: --interval %s: give 0 (back to back) or a pause, e.g. --interval 200ms", *interval)
	}
	if cmd == "up" {
		if _, err := lab.ParseMode(*mode); err != nil {
			return usagef("up: %v", err)
		}
	}
	if os.Geteuid() != 0 {
		return errors.New("the lab needs root (namespaces, BPF, cgroups): run it with sudo")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	l := lab.New(*name)
	switch cmd {
	case "up":
		if err := l.Up(ctx, lab.Mode(*mode)); err != nil {
			return err
		}
		fmt.Fprintf(out, "lab %s is up in %s mode (netns %s-{pod,node,gw,backend}); try: %s --requests 5\n",
			l.Name(), *mode, l.Name(), l.Command("client"))
	case "down":
		if err := l.Down(); err != nil {
			return err
		}
		fmt.Fprintf(out, "lab %s is down\n", l.Name())
	case "status":
		st, err := l.Status()
		if *asJSON {
			err = errors.Join(err, writeJSON(out, st))
		} else {
			printLabStatus(out, st)
		}
		if err == nil && !st.Healthy {
			err = errors.New("the health check failed (see above)")
		}
		return err
	case "client":
		res, err := l.Client(ctx, lab.ClientOptions{Requests: *requests, Interval: *interval, Timeout: *timeout})
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(out, res)
		}
		printProtoResult(out, "tcp", res.TCP)
		printProtoResult(out, "udp", res.UDP)
	}
	return nil
}

func writeJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// printProtoResult prints e.g. "tcp 10.120.0.80:80  0/5 ok, 5 failed: 5 unreachable (connect: ...)".
func printProtoResult(out io.Writer, proto string, r lab.ProtoResult) {
	fmt.Fprintf(out, "%s %-16s %d/%d ok", proto, r.Target, r.OK, r.OK+r.Failed)
	if r.Failed > 0 {
		kinds := map[lab.FailureKind]int{}
		example := map[lab.FailureKind]string{}
		for _, req := range r.Requests {
			if !req.OK {
				kinds[req.Kind]++
				example[req.Kind] = req.Error
			}
		}
		var parts []string
		for k, n := range kinds {
			parts = append(parts, fmt.Sprintf("%d %s (%s)", n, k, example[k]))
		}
		sort.Strings(parts)
		fmt.Fprintf(out, ", %d failed: %s", r.Failed, strings.Join(parts, ", "))
	}
	var total time.Duration
	for _, req := range r.Requests {
		total += req.Duration
	}
	if n := len(r.Requests); n > 0 {
		fmt.Fprintf(out, "; %s per request on average", (total / time.Duration(n)).Round(10*time.Microsecond))
	}
	fmt.Fprintln(out)
}

func printLabStatus(out io.Writer, st lab.Status) {
	mode := string(st.Mode)
	if mode == "" {
		mode = "none"
	}
	fmt.Fprintf(out, "lab %s: complete=%t mode=%s\n", st.Name, st.Complete, mode)
	fmt.Fprintln(out, "namespaces:")
	for _, ns := range st.Namespaces {
		state := "missing"
		if ns.Exists {
			state = "exists"
		}
		fmt.Fprintf(out, "  %-8s %-32s %s\n", ns.Role, ns.Path, state)
	}
	if len(st.Interfaces) > 0 {
		fmt.Fprintln(out, "interfaces:")
		for _, i := range st.Interfaces {
			state := "down"
			if i.Up {
				state = "up"
			}
			extra := strings.Join(i.Addrs, ",")
			if i.Master != "" {
				extra = strings.TrimPrefix(extra+" master "+i.Master, " ")
			}
			fmt.Fprintf(out, "  %-8s %-11s %-4s %s %s\n", i.NetNS, i.Name, state, i.MAC, extra)
		}
	}
	cg := st.ClientCgroup
	if cg == "" {
		cg = "missing"
	}
	fmt.Fprintf(out, "client cgroup: %s\n", cg)
	fmt.Fprintln(out, "lab BPF programs:")
	if len(st.Programs) == 0 {
		fmt.Fprintln(out, "  none")
	}
	for _, p := range st.Programs {
		fmt.Fprintf(out, "  %-20s id %-6d %s\n", p.Name, p.ID, p.Where)
	}
	fmt.Fprintf(out, "netfilter: kube-proxy table %s, bridge-nf-call-iptables=%s\n",
		map[bool]string{true: "present", false: "absent"}[st.KubeProxyRules], orDash(st.BridgeNFCallIPTables))
	server := "not running"
	if st.Server.Running {
		server = fmt.Sprintf("running (pid %d)", st.Server.PID)
	}
	fmt.Fprintf(out, "backend server: %s, %s\n", server, strings.Join(st.Server.Listen, ", "))
	health := "FAIL"
	if st.Healthy {
		health = "ok"
	}
	fmt.Fprintf(out, "health: %s: %s\n", health, st.Health)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
