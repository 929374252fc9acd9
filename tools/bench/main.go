// Command bench measures pathtrace's packet capture against tcpdump, and its
// overhead on the traced system, in a lab instance of its own that it always
// removes. It writes the results as Markdown (BENCH.md) and prints them.
//
//	sudo go run ./tools/bench --pathtrace bin/pathtrace --out BENCH.md
//
// Every datagram and connection it makes stays inside the lab's namespaces.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

type config struct {
	pathtrace string
	tcpdump   string
	dumpcap   string // "" when not installed: its reference runs are left out
	out       string
	rates     []int // offered datagrams per second; 0 = as fast as the generator goes
	rounds    int   // capture runs per rate and tool
	window    time.Duration
	long      time.Duration
	churnRate int
	connects  int
	only      map[string]bool // sections to run; nil = all, and BENCH.md is written
}

// sections are the parts of the benchmark, in the order they run.
var sections = []string{"capture", "unrelated", "long", "latency", "observers", "bulk"}

func main() {
	// The lab's backend servers are this binary re-executed.
	lab.RunWorkerIfRequested()
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
}

func parseFlags() (config, error) {
	var cfg config
	var rates string
	flag.StringVar(&cfg.pathtrace, "pathtrace", "bin/pathtrace", "pathtrace binary to measure")
	flag.StringVar(&cfg.tcpdump, "tcpdump", "tcpdump", "tcpdump binary to compare with")
	flag.StringVar(&cfg.dumpcap, "dumpcap", "dumpcap", "Wireshark's dumpcap binary, a reference for pcapng capture at several points (left out when not installed)")
	flag.StringVar(&cfg.out, "out", "BENCH.md", "Markdown file to write the results to (\"\" = print only)")
	flag.StringVar(&rates, "rates", "10000,50000,100000,200000,0", "offered UDP rates in datagrams/s, 0 = as fast as the generator goes")
	flag.DurationVar(&cfg.window, "window", 3*time.Second, "traffic time of each measured run")
	flag.IntVar(&cfg.rounds, "rounds", 3, "capture runs per rate and tool, and unrelated-traffic runs per tool, in alternating rounds: the targets take the median ratio (the machine's speed drifts between runs)")
	flag.DurationVar(&cfg.long, "long", 20*time.Second, "traffic time of the long run (RSS over time, one new flow per datagram)")
	flag.IntVar(&cfg.churnRate, "churn-rate", 5000, "new flows per second in the long run")
	flag.IntVar(&cfg.connects, "connects", 1500, "connect() calls per latency run")
	flag.StringVar(&profileDir, "cpuprofile", "", "directory where each pathtrace run writes its CPU profile (PATHTRACE_CPUPROFILE), for make pgo")
	only := flag.String("only", "", "comma-separated sections to run ("+strings.Join(sections, ",")+"), printing a short summary instead of writing --out: for quick comparisons while developing")
	flag.Parse()
	if *only != "" {
		cfg.only = map[string]bool{}
		for _, s := range strings.Split(*only, ",") {
			if !slices.Contains(sections, s) {
				return cfg, fmt.Errorf("--only: %q is not one of %s", s, strings.Join(sections, ","))
			}
			cfg.only[s] = true
		}
		cfg.out = ""
	}
	for _, s := range strings.Split(rates, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 0 {
			return cfg, fmt.Errorf("--rates: %q is not a rate", s)
		}
		cfg.rates = append(cfg.rates, n)
	}
	if cfg.window <= 0 || cfg.long <= 0 || cfg.churnRate <= 0 || cfg.connects <= 0 || cfg.rounds <= 0 {
		return cfg, errors.New("--window, --long, --churn-rate, --connects and --rounds must be positive")
	}
	if profileDir != "" {
		dir, err := filepath.Abs(profileDir)
		if err != nil {
			return cfg, err
		}
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			return cfg, fmt.Errorf("--cpuprofile %s: not a directory", profileDir)
		}
		profileDir = dir
	}
	abs, err := filepath.Abs(cfg.pathtrace)
	if err != nil {
		return cfg, err
	}
	cfg.pathtrace = abs
	if _, err := os.Stat(abs); err != nil {
		return cfg, fmt.Errorf("pathtrace binary: %w (run make build)", err)
	}
	if cfg.tcpdump, err = exec.LookPath(cfg.tcpdump); err != nil {
		return cfg, fmt.Errorf("tcpdump: %w (apt-get install tcpdump)", err)
	}
	if path, err := exec.LookPath(cfg.dumpcap); err == nil {
		cfg.dumpcap = path
	} else {
		fmt.Fprintf(os.Stderr, "bench: no dumpcap (%v): its reference runs are left out (apt-get install wireshark-common)\n", err)
		cfg.dumpcap = ""
	}
	return cfg, nil
}

func run() (err error) {
	cfg, err := parseFlags()
	if err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return errors.New("needs root: it builds a lab of network namespaces and runs pathtrace and tcpdump")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	defer stop()

	l := lab.New("ptbench-" + randomHex(4))
	fmt.Fprintf(os.Stderr, "bench: building lab %s (mode tc)\n", l.Name())
	defer func() {
		if derr := l.Down(); derr != nil {
			err = errors.Join(err, derr)
		}
	}()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "ptbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	b := &bench{cfg: cfg, lab: l, dir: dir, commands: map[string][]string{}}
	if b.udp, err = openUDPSender(l.PodNetNS()); err != nil {
		return err
	}
	defer b.udp.Close()
	if b.sink, err = startBulkSink(l.GatewayNetNS(), bulkDst); err != nil {
		return err
	}
	defer b.sink.Close()

	started := time.Now()
	b.loadStart = loadAverage()
	res, err := b.run(ctx)
	if err != nil {
		return err
	}
	if cfg.only != nil {
		fmt.Print(quickSummary(res))
		return nil
	}
	md := b.markdown(res, started)
	fmt.Print(md)
	if cfg.out != "" {
		if err := os.WriteFile(cfg.out, []byte(md), 0o644); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: wrote %s\n", cfg.out)
	}
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
