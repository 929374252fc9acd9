package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/gopacket/gopacket"
	"github.com/gopacket/gopacket/layers"
	"github.com/gopacket/gopacket/pcapgo"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/lab"
)

// pathtrace runs the test binary as the pathtrace CLI.
func pathtrace(args ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	return cmd
}

func needRoot(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: builds the lab and attaches BPF observers")
	}
}

func TestBadInputExitsTwo(t *testing.T) {
	// A capture whose FILE.partial an interrupted run left.
	stale := filepath.Join(t.TempDir(), "x.pcapng")
	if err := os.WriteFile(stale+".partial", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cases := [][]string{
		{"--svc", "999.1.1.1"},
		{"--svc", "10.0.0.1:99999"},
		{"--svc", "10.0.0.1:80/tcp,10.0.0.2:53/udp"},
		{"--svc", "10.0.0.1", "--duration", "-1s"},
		{"--svc", "10.0.0.1", "--host-netns", "/nonexistent"},
		{"--svc", "10.0.0.1", "--output", "xml"},
		{"--svc", "10.0.0.1", "--pod-ip", "10.0.0.300"},
		{"--svc", "10.0.0.1", "--pod-ip", "10.0.0.3", "--pod-pid", "1"},
		{"--svc", "10.0.0.1", "--pod-pid", "0", "--duration", "1s"}, // not "every Pod"
		{"incident", "--svc", "10.0.0.1", "--pod-pid", "0", "--duration", "1s", "--out", filepath.Join(t.TempDir(), "inc")},
		{"--duration", "5s"},
		{"--svc", "10.0.0.1", "--no-such-flag"},
		{"--svc", "10.0.0.1", "--pcap", "/nonexistent-dir/x.pcapng"},
		{"--svc", "10.0.0.1", "--pcap", "/etc/hostname"},
		{"--svc", "10.0.0.1", "--pcap", stale},
		{"--svc", "10.0.0.1", "--max-packets", "5"},
		{"--svc", "10.0.0.1", "--pcap", "/tmp/x.pcapng", "--max-bytes", "12X"},
		{"--svc", "10.0.0.1", "--buffer-size", ""},
		{"--svc", "10.0.0.1", "--buffer-size", "1K"},
		{"--svc", "10.0.0.1", "--buffer-size", "1G"},
		{"--svc", "10.0.0.1", "--snaplen", "65535", "--buffer-size", "64K"},
		{"--svc", "10.0.0.1", "--nice", "-21"},
		{"--svc", "10.0.0.1", "--nice", "20"},
		{"help", "nosuchtopic"},
		{"help", "lab", "up"},
		{"lab", "client", "--name", "ptbadinput", "--timeout", "0"},
		{"lab", "client", "--name", "ptbadinput", "--interval", "-1s"},
	}
	for _, args := range cases {
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stderr = &stderr
		err := cmd.Run()
		code := exitCode(err)
		msg := strings.TrimSpace(stderr.String())
		if code != exitUsage || msg == "" || strings.Contains(msg, "\n") {
			t.Errorf("pathtrace %s: exit %d, stderr %q; want exit 2 and one line", strings.Join(args, " "), code, msg)
		}
	}
}

// TestHelpTopics: "pathtrace help [incident|lab]" prints the same help as
// --help, to stdout, and exits 0; so does "pathtrace help --help".
func TestHelpTopics(t *testing.T) {
	for _, c := range []struct{ help, flag []string }{
		{[]string{"help"}, []string{"--help"}},
		{[]string{"help", "--help"}, []string{"--help"}},
		{[]string{"help", "incident"}, []string{"incident", "--help"}},
		{[]string{"help", "lab"}, []string{"lab", "--help"}},
	} {
		got, err := pathtrace(c.help...).Output()
		if err != nil {
			t.Fatalf("pathtrace %s: %v", strings.Join(c.help, " "), err)
		}
		want, err := pathtrace(c.flag...).Output()
		if err != nil {
			t.Fatalf("pathtrace %s: %v", strings.Join(c.flag, " "), err)
		}
		if len(got) == 0 || !bytes.Equal(got, want) {
			t.Errorf("pathtrace %s printed %d bytes, not what pathtrace %s prints (%d bytes)", strings.Join(c.help, " "), len(got), strings.Join(c.flag, " "), len(want))
		}
	}
}

// Inputs that only discovery can reject: a pod IP nobody has, an uplink that
// does not exist.
func TestBadNodeInputExitsTwo(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNowhere)
	for _, args := range [][]string{
		{"--svc", "10.120.0.80", "--host-netns", l.NodeNetNS(), "--pod-ip", "203.0.113.77", "--duration", "1s"},
		{"--svc", "10.120.0.80", "--host-netns", l.NodeNetNS(), "--uplink", "nosuchif", "--duration", "1s"},
		{"--svc", "10.120.0.80", "--host-netns", l.NodeNetNS(), "--uplink", "lo", "--duration", "1s"}, // not Ethernet
		{"--svc", "10.120.0.80", "--host-netns", l.NodeNetNS(), "--duration", "1s", "--max-bytes", "100",
			"--pcap", filepath.Join(t.TempDir(), "small.pcapng")}, // smaller than the file's header
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(args...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		if msg := strings.TrimSpace(stderr.String()); code != exitUsage || strings.Contains(msg, "\n") {
			t.Errorf("pathtrace %s: exit %d, stderr %q; want exit 2 and one line", strings.Join(args, " "), code, msg)
		}
	}
}

// TestSamePcapTwiceAtOnce: two runs started together with one --pcap both
// pass the flag check (the file is made after discovery); the one that
// finds the name taken then is a usage error too, exit 2 and one line, and
// the other's file is whole.
func TestSamePcapTwiceAtOnce(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNowhere)
	path := filepath.Join(t.TempDir(), "same.pcapng")
	type result struct {
		code   int
		stderr string
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			var stderr bytes.Buffer
			cmd := pathtrace("--svc", lab.TCPVIP.String(), "--host-netns", l.NodeNetNS(), "--duration", "2s", "--pcap", path)
			cmd.Stderr = &stderr
			results <- result{exitCode(cmd.Run()), strings.TrimSpace(stderr.String())}
		}()
	}
	var codes []int
	for range 2 {
		r := <-results
		codes = append(codes, r.code)
		if r.code == exitUsage && (!strings.Contains(r.stderr, "same.pcapng") || strings.Contains(r.stderr, "\n")) {
			t.Errorf("refused run's stderr %q: want one line naming the file", r.stderr)
		}
	}
	slices.Sort(codes)
	if codes[0] != exitOK || codes[1] != exitUsage {
		t.Fatalf("exit codes %v: want one run to finish (0) and the other refused as bad usage (2)", codes)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("the finished run's file: %v", err)
	}
	defer f.Close()
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatalf("the finished run's file: %v", err)
	}
	for {
		if _, _, err := r.ReadPacketData(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatalf("the finished run's file: %v", err)
		}
	}
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}

func upLab(t *testing.T, mode lab.Mode) *lab.Lab {
	t.Helper()
	l := testLab(t, "ptlab-cli")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, mode); err != nil {
		t.Fatalf("lab up %s: %v", mode, err)
	}
	return l
}

// run is one pathtrace process whose JSON lines are collected.
type run struct {
	cmd    *exec.Cmd
	lines  chan map[string]any
	stderr bytes.Buffer
	// intervals are the "interval" lines rest read, which it refuses
	// unless the run was started with --report-every (withIntervals).
	withIntervals bool
	intervals     []map[string]any
}

func startJSON(t *testing.T, args ...string) *run {
	t.Helper()
	return startCmdJSON(t, pathtrace(append(args, "--output", "json")...))
}

func startCmdJSON(t *testing.T, cmd *exec.Cmd) *run {
	t.Helper()
	r := &run{lines: make(chan map[string]any, 1024), cmd: cmd}
	r.cmd.Stderr = &r.stderr
	out, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.cmd.Process.Kill(); _ = r.cmd.Wait() })
	go func() {
		defer close(r.lines)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) != nil {
				m = map[string]any{"type": "invalid JSON line", "line": sc.Text()}
			}
			if n := bytes.Count(sc.Bytes(), []byte(`"type":`)); m["type"] == "node" && n != 1 {
				m = map[string]any{"type": "node object with a repeated type key", "line": sc.Text()}
			}
			r.lines <- m
		}
	}()
	return r
}

// connectAndStop connects n times from the netns at path netns to addr,
// then ends the run as an SRE does (SIGTERM) once the last packets had
// time to reach it, and returns its flows and summary.
func (r *run) connectAndStop(t *testing.T, netns, addr string, n int) ([]map[string]any, map[string]any) {
	t.Helper()
	if err := connectFrom(netns, addr, n); err != nil {
		t.Fatalf("connect from %s to %s: %v", netns, addr, err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	return r.rest(t)
}

// waitNode waits for the node object, printed once every observer is attached.
func (r *run) waitNode(t *testing.T) map[string]any {
	t.Helper()
	select {
	case m, ok := <-r.lines:
		if !ok || m["type"] != "node" {
			t.Fatalf("first JSON line is not the node object: %v (stderr: %s)", m, r.stderr.String())
		}
		return m
	case <-time.After(30 * time.Second):
		t.Fatalf("pathtrace did not get ready (stderr: %s)", r.stderr.String())
	}
	return nil
}

func (r *run) rest(t *testing.T) (flows []map[string]any, summary map[string]any) {
	t.Helper()
	for m := range r.lines {
		switch m["type"] {
		case "flow":
			flows = append(flows, m)
		case "summary":
			summary = m
		case "interval":
			if !r.withIntervals {
				t.Errorf("interval line without --report-every: %v", m)
			}
			r.intervals = append(r.intervals, m)
		default:
			t.Errorf("unexpected JSON line: %v", m)
		}
	}
	if err := r.cmd.Wait(); err != nil {
		t.Fatalf("pathtrace: %v (stderr: %s)", err, r.stderr.String())
	}
	return flows, summary
}

// testLab is a lab instance of this test process (name prefix plus its PID),
// removed when the test ends.
func testLab(t *testing.T, prefix string) *lab.Lab {
	t.Helper()
	l := lab.New(fmt.Sprintf("%s%d", prefix, os.Getpid()%100000))
	t.Cleanup(func() {
		if err := l.Down(); err != nil {
			t.Errorf("lab down: %v", err)
		}
	})
	return l
}

// TestVerdictPerLabMode is the end-to-end check: in each lab mode, with the lab
// client sending TCP and UDP requests during the run, every flow's verdict,
// backend, uplink frame and reply are right.
func TestVerdictPerLabMode(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-e2e")
	const requests = 3
	for _, mode := range lab.Modes() {
		t.Run(string(mode), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := l.Up(ctx, mode); err != nil {
				t.Fatalf("lab up: %v", err)
			}
			gwMAC, err := l.GatewayMAC()
			if err != nil {
				t.Fatal(err)
			}
			pcap := filepath.Join(t.TempDir(), string(mode)+".pcapng")
			r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp",
				"--svc", lab.UDPVIP.String()+"/udp", "--duration", "60s", "--pcap", pcap)
			checkTCObservers(t, r.waitNode(t), mode)
			res, err := l.Client(ctx, lab.ClientOptions{Requests: requests})
			if err != nil {
				t.Fatalf("lab client: %v", err)
			}
			// SIGINT right after the last reply ends the run early: the
			// report must still be complete, with the packets the kernel
			// took just before the signal.
			_ = r.cmd.Process.Signal(syscall.SIGINT)
			flows, summary := r.rest(t)

			works := mode != lab.ModeNowhere
			for _, pr := range []lab.ProtoResult{res.TCP, res.UDP} {
				if works && pr.OK != requests || !works && pr.Failed != requests {
					t.Errorf("client %s: %d ok, %d failed; want all to %s", pr.Target, pr.OK, pr.Failed, map[bool]string{true: "succeed", false: "fail"}[works])
				}
			}
			if summary == nil {
				t.Fatal("no summary line")
			}
			if len(flows) != 2*requests {
				t.Errorf("%d flows, want %d: %s", len(flows), 2*requests, dump(flows))
			}
			for _, f := range flows {
				checkFlow(t, mode, f, gwMAC.String())
			}
			checkPcap(t, pcap, summary)
			checkCommentsBy(t, pcap, flows)
			if mode == lab.ModeNowhere {
				checkICMPErrors(t, pcap, flows)
			}
		})
	}
}

// openNg opens a pcapng file for reading until the test ends.
func openNg(t *testing.T, path string) *pcapgo.NgReader {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// checkCommentsBy: every packet comment that gives its flow's final verdict
// names the rewriter as the report does, shortened for comments only
// (flow.CommentBy: in netfilter mode, kube-proxy's chains).
func checkCommentsBy(t *testing.T, path string, flows []map[string]any) {
	t.Helper()
	r := openNg(t, path)
	verdictOf := map[string]string{} // flow ID -> "rewritten_at=PLACE by=BY" as comments end
	for _, fl := range flows {
		v := fmt.Sprintf("rewritten_at=%v", fl["rewritten_at"])
		if by, _ := fl["by"].(string); by != "" {
			v += " by=" + flow.CommentBy(by)
		}
		verdictOf[fmt.Sprint(fl["id"])] = v
	}
	checked, wrong := 0, 0
	for {
		_, _, opts, err := r.ReadPacketDataWithOptions()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("pcapng read: %v", err)
		}
		for _, c := range opts.Comments {
			id, _, _ := strings.Cut(strings.TrimPrefix(c, "flow "), " ")
			want, ok := verdictOf[id]
			place, _, _ := strings.Cut(want, " by=")
			if !strings.HasPrefix(c, "flow ") || !ok || !strings.Contains(c, "; "+place) {
				continue // not a flow's packet, or not with its final verdict yet
			}
			checked++
			if !strings.HasSuffix(c, "; "+want) && wrong < 3 {
				wrong++
				t.Errorf("comment %q, want it to end with %q", c, want)
			}
		}
	}
	if checked == 0 {
		t.Error("no packet comment gives its flow's final verdict")
	}
}

// checkICMPErrors: in the nowhere mode the gateway answers each request that
// kept the VIP with an ICMP net unreachable, which makes the client fail.
// The pcapng has them at every capture point, each commented with what it is
// and the flow of the request it quotes (a flow of the report).
func checkICMPErrors(t *testing.T, path string, flows []map[string]any) {
	t.Helper()
	r := openNg(t, path)
	flowOf := map[string]float64{} // "client service" -> flow ID
	for _, fl := range flows {
		id, _ := fl["id"].(float64)
		flowOf[fmt.Sprint(fl["client"], " ", fl["service"])] = id
	}
	perPoint := map[string]int{}
	for {
		data, ci, opts, err := r.ReadPacketDataWithOptions()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("pcapng read: %v", err)
		}
		p := capture.Packet{Data: data}
		e, ok := p.ICMPError()
		if !ok {
			continue
		}
		ifc, err := r.Interface(ci.InterfaceIndex)
		if err != nil {
			t.Fatal(err)
		}
		comment := ""
		if len(opts.Comments) > 0 {
			comment = opts.Comments[0]
		}
		id, known := flowOf[e.Src.String()+" "+e.Dst.String()]
		want := fmt.Sprintf("ICMP destination unreachable (code 0: net unreachable) from %v about flow %v request to VIP (not translated); rewritten_at=nowhere", lab.GatewayIP, id)
		if e.Type != capture.ICMPDestUnreachable || e.From != lab.GatewayIP || e.To != lab.PodIP || !known || comment != want {
			t.Errorf("%s: %s from %v to %v about %s (flow known: %v), comment %q; want the gateway's net unreachable about a flow's request to the VIP, comment %q",
				ifc.Name, e.Kind(), e.From, e.To, e.QuotedString(), known, comment, want)
			continue
		}
		perPoint[ifc.Name]++
	}
	for _, point := range []string{"pod:eth0", "host:veth-a", "uplink:bond0"} {
		if perPoint[point] == 0 {
			t.Errorf("no ICMP net unreachable from the gateway on %s in the pcapng (per point: %v)", point, perPoint)
		}
	}
	if _, err := exec.LookPath("tshark"); err != nil {
		return
	}
	out, err := exec.Command("tshark", "-r", path, "-Y", "icmp.type == 3", "-T", "fields",
		"-e", "frame.interface_name", "-e", "icmp.code", "-e", "frame.comment").Output()
	if err != nil {
		t.Fatalf("tshark -r %s: %v", path, err)
	}
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Split(line, "\t")
		if len(fields) < 3 || fields[1] != "0" || !strings.HasPrefix(fields[2], "ICMP destination unreachable (code 0: net unreachable) from ") {
			t.Errorf("tshark: ICMP unreachable %q, want a net unreachable with its comment", line)
		}
		n++
	}
	if total := perPoint["pod:eth0"] + perPoint["host:veth-a"] + perPoint["uplink:bond0"]; n != total {
		t.Errorf("tshark shows %d ICMP unreachable frames, gopacket's reader %d", n, total)
	}
}

// TestTraceAmidTraffic starts pathtrace, and stops it with SIGINT, while the
// Pod keeps making requests, as on a busy node. The flows cut by the start or the stop
// may be undecided, but each says so (and the summary counts them); every
// other flow gets its verdict.
func TestTraceAmidTraffic(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-amid")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeTC); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	clientCtx, stopClient := context.WithCancel(ctx)
	clientDone := make(chan struct{})
	go func() {
		defer close(clientDone)
		_, _ = l.Client(clientCtx, lab.ClientOptions{Requests: 1 << 20, Interval: time.Millisecond}) // ends when stopped
	}()
	defer func() { stopClient(); <-clientDone }()
	time.Sleep(300 * time.Millisecond) // the traffic is flowing before pathtrace starts

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp",
		"--svc", lab.UDPVIP.String()+"/udp", "--duration", "1m")
	r.waitNode(t)
	time.Sleep(2 * time.Second)
	_ = r.cmd.Process.Signal(syscall.SIGINT) // as an SRE ends a run
	flows, summary := r.rest(t)
	if summary == nil {
		t.Fatal("no summary line")
	}
	// began: an undecided flow began at this end of the capture window. A
	// connection caught mid-way (began_before_run) says so first, then
	// when its first packet seen came.
	began := func(f map[string]any, when string) bool {
		reason, _ := f["reason"].(string)
		if f["began_before_run"] == true {
			return strings.Contains(reason, "its first packet seen came "+when)
		}
		return strings.HasPrefix(reason, "it began "+when)
	}
	var decided, atStart, atEnd int
	for _, f := range flows {
		switch {
		case f["rewritten_at"] == "tc":
			decided++
		case f["rewritten_at"] != "unknown":
			t.Errorf("a flow rewritten at %v in tc mode: %s", f["rewritten_at"], dump([]map[string]any{f}))
		case began(f, "before pathtrace was in place at every point"):
			atStart++
		case began(f, "after the capture was asked to stop"):
			atEnd++
		default:
			t.Errorf("an unknown flow that began while every point was in place: %s", dump([]map[string]any{f}))
			for _, g := range flows {
				if g["client"] == f["client"] && g["id"] != f["id"] { // a reused port: which flow took what
					t.Logf("another flow of its client endpoint: %s", dump([]map[string]any{g}))
				}
			}
		}
	}
	count := func(key string) int { n, _ := summary[key].(float64); return int(n) }
	if count("unknown_began_before_ready") != atStart || count("unknown_began_after_stop") != atEnd {
		t.Errorf("summary counts %v before ready and %v after the stop, the flows' reasons %d and %d",
			summary["unknown_began_before_ready"], summary["unknown_began_after_stop"], atStart, atEnd)
	}
	if decided < 100 {
		t.Errorf("only %d of %d flows decided in 2 s of requests every millisecond", decided, len(flows))
	}
	t.Logf("%d flows: %d rewritten in tc, %d undecided that began before pathtrace was ready, %d after the stop", len(flows), decided, atStart, atEnd)
}

// checkTCObservers: the host veth's tcx observers are attached where they
// bracket something: all four with a tcx program there (mode tc), the heads
// only with legacy cls_bpf alone (tc-legacy: the tails would see what the
// heads do), none without a tc program; each one left out says why.
func checkTCObservers(t *testing.T, node map[string]any, mode lab.Mode) {
	t.Helper()
	n := 0
	for _, o := range nodeObservers(node) {
		if !strings.HasPrefix(o.name, "tcx ") {
			continue
		}
		n++
		tail := strings.HasSuffix(o.name, " tail")
		want, why := false, "no tc program"
		switch {
		case mode == lab.ModeTC:
			want = true
		case mode == lab.ModeTCLegacy && !tail:
			want = true
		case mode == lab.ModeTCLegacy:
			why = "the head observer sees what the tail would"
		}
		if o.attached != want || !want && !strings.Contains(o.err, why) {
			t.Errorf("%+v: want attached %v (else skipped: %s)", o, want, why)
		}
	}
	if n != 4 {
		t.Errorf("%d tcx observers in the node object, want 4: %+v", n, nodeObservers(node))
	}
}

// observer is one entry of the node object's observers list.
type observer struct {
	name, note, err string
	attached        bool
}

func nodeObservers(node map[string]any) []observer {
	list, _ := node["observers"].([]any)
	var out []observer
	for _, o := range list {
		m, _ := o.(map[string]any)
		var ob observer
		ob.name, _ = m["observer"].(string)
		ob.note, _ = m["note"].(string)
		ob.err, _ = m["error"].(string)
		ob.attached, _ = m["attached"].(bool)
		out = append(out, ob)
	}
	return out
}

func checkFlow(t *testing.T, mode lab.Mode, f map[string]any, gwMAC string) {
	t.Helper()
	desc := dump([]map[string]any{f})
	want := map[lab.Mode]string{lab.ModeSocket: "socket", lab.ModeTC: "tc", lab.ModeTCLegacy: "tc",
		lab.ModeNetfilter: "netfilter", lab.ModeNowhere: "nowhere"}[mode]
	if f["rewritten_at"] != want {
		t.Errorf("rewritten_at = %v, want %s: %s", f["rewritten_at"], want, desc)
	}
	backend := map[string]string{"tcp": lab.TCPBackend.String(), "udp": lab.UDPBackend.String()}[f["proto"].(string)]
	if mode == lab.ModeNowhere {
		backend = ""
	}
	if f["backend"] != backend {
		t.Errorf("backend = %v, want %q: %s", f["backend"], backend, desc)
	}
	if v, ok := f["vlan"].(float64); !ok || v != lab.VLAN {
		t.Errorf("vlan = %v, want %d: %s", f["vlan"], lab.VLAN, desc)
	}
	if f["uplink_dst_mac"] != gwMAC {
		t.Errorf("uplink_dst_mac = %v, want the gateway's %s: %s", f["uplink_dst_mac"], gwMAC, desc)
	}
	if f["uplink_dst_is_gateway"] != true {
		t.Errorf("uplink_dst_is_gateway = %v, want true: %s", f["uplink_dst_is_gateway"], desc)
	}
	if f["reply"] != (mode != lab.ModeNowhere) {
		t.Errorf("reply = %v in mode %s: %s", f["reply"], mode, desc)
	}
	// The gateway refuses what leaves with the VIP: its net unreachable is
	// reported with the flow, in that mode only.
	icmp, _ := f["icmp_error"].(map[string]any)
	switch {
	case mode == lab.ModeNowhere && (icmp == nil || icmp["from"] != lab.GatewayIP.String() ||
		icmp["message"] != "ICMP destination unreachable (code 0: net unreachable)"):
		t.Errorf("icmp_error = %v, want the gateway's net unreachable: %s", f["icmp_error"], desc)
	case mode != lab.ModeNowhere && icmp != nil:
		t.Errorf("icmp_error = %v in mode %s: %s", icmp, mode, desc)
	}
	// The lab drops none of a flow's packets in the kernel but the
	// requests that keep the VIP, which the gateway (a netns of the same
	// kernel) cannot route: no drop of a packet that went on (a tap's
	// copy, a driver's freeing of a sent packet) may show.
	drops, _ := f["kernel_drops"].([]any)
	for _, d := range drops {
		if m, _ := d.(map[string]any); mode != lab.ModeNowhere || m["direction"] != "request" {
			t.Errorf("kernel drop %v in mode %s: %s", d, mode, desc)
		}
	}
	by, _ := f["by"].(string)
	wantBy := map[lab.Mode]string{lab.ModeSocket: "lab_sock4_", lab.ModeTC: "tcx ingress lab_from_container",
		lab.ModeTCLegacy: "cls_bpf ingress lab_from_container", lab.ModeNetfilter: "kube-proxy"}[mode]
	if !strings.Contains(by, wantBy) {
		t.Errorf("by = %q, want it to name %q: %s", by, wantBy, desc)
	}
}

func dump(v any) string {
	b, _ := json.MarshalIndent(v, "", " ")
	return string(b)
}

// TestSIGKILLLeavesNothingAttached kills pathtrace while it traces and checks
// that every BPF program and link it held is gone.
func TestSIGKILLLeavesNothingAttached(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "60s")
	r.waitNode(t)
	progs, links := heldBPF(t, r.cmd.Process.Pid)
	if len(progs) == 0 || len(links) == 0 {
		t.Fatalf("pathtrace holds %d programs and %d links; want some", len(progs), len(links))
	}
	_ = r.cmd.Process.Signal(syscall.SIGKILL)
	_ = r.cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for {
		left := 0
		for _, id := range links {
			if lk, err := link.NewFromID(link.ID(id)); err == nil {
				lk.Close()
				left++
			}
		}
		for _, id := range progs {
			if p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id)); err == nil {
				p.Close()
				left++
			}
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of pathtrace's programs/links still exist 10s after SIGKILL", left)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The lab still works: nothing pathtrace did outlived it.
	res, err := l.Client(context.Background(), lab.ClientOptions{Requests: 2})
	if err != nil || res.TCP.OK != 2 {
		t.Fatalf("lab client after SIGKILL: %+v, %v", res.TCP, err)
	}
}

// TestThreadsRunAtTheirNice: every thread of a running pathtrace, those the
// Go runtime started after the flag took effect too, has the --nice value.
func TestThreadsRunAtTheirNice(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "60s", "--nice", "-3")
	r.waitNode(t)
	// Traffic makes the runtime start threads for the work it brings.
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 20}); err != nil {
		t.Fatalf("lab client: %v", err)
	}
	pid := r.cmd.Process.Pid
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) < 2 {
		t.Fatalf("threads of pathtrace: %d, %v", len(tasks), err)
	}
	for _, task := range tasks {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			continue // the thread ended since the list was read
		}
		if err != nil {
			t.Fatal(err)
		}
		// Fields after the command name in parentheses start at field 3
		// (state); nice is field 19.
		fields := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		if len(fields) < 17 || fields[16] != "-3" {
			t.Errorf("thread %s: stat %q, want nice -3", task.Name(), stat)
		}
	}
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	r.rest(t)
}

// heldBPF lists the BPF program and link ids a process holds fds of.
func heldBPF(t *testing.T, pid int) (progs, links []uint32) {
	t.Helper()
	infos, err := filepath.Glob(fmt.Sprintf("/proc/%d/fdinfo/*", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range infos {
		f, err := os.Open(p)
		if err != nil {
			continue
		}
		b, _ := io.ReadAll(f)
		f.Close()
		isLink := bytes.Contains(b, []byte("link_type:"))
		for _, line := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			id, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
			if err != nil {
				continue
			}
			switch {
			case k == "link_id":
				links = append(links, uint32(id))
			case k == "prog_id" && !isLink:
				progs = append(progs, uint32(id))
			}
		}
	}
	return progs, links
}

// checkPcap reads the pcapng back: one interface per capture point, VLAN 200
// written back into uplink frames, direction flags and comments on every
// packet, snaplen honoured, and per-interface counts equal to the report's.
func checkPcap(t *testing.T, path string, summary map[string]any) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("pcapng: %v", err)
	}
	defer f.Close()
	if st, _ := f.Stat(); st.Mode().Perm() != 0o600 {
		t.Errorf("pcapng mode %v, want 0600", st.Mode().Perm())
	}
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatalf("pcapng: %v", err)
	}
	counts := map[string]float64{}
	vlanOnUplink, unnamed := 0, 0
	for {
		data, ci, opts, err := r.ReadPacketDataWithOptions()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("pcapng read: %v", err)
		}
		ifc, err := r.Interface(ci.InterfaceIndex)
		if err != nil {
			t.Fatal(err)
		}
		counts[ifc.Name]++
		if len(data) > 96+4 {
			t.Errorf("%s: %d bytes captured, snaplen is 96 (+4 for a written-back tag)", ifc.Name, len(data))
		}
		if opts.Flags == nil || opts.Flags.Direction == 0 || len(opts.Comments) == 0 {
			t.Errorf("%s: packet without direction flag or comment: %+v", ifc.Name, opts)
		}
		// A rewrite the lab's own program or rule made is named from the
		// first flow's first packet on (a socket LB's cgroup is looked up
		// as soon as its first event names it).
		for _, c := range opts.Comments {
			for _, place := range []string{"socket", "tc", "netfilter"} {
				if strings.Contains(c, "rewritten_at="+place) && !strings.Contains(c, "rewritten_at="+place+" by=") && unnamed < 3 {
					unnamed++
					t.Errorf("%s: comment without the rewriter: %q", ifc.Name, c)
				}
			}
		}
		if strings.HasPrefix(ifc.Name, "uplink:") {
			pkt := gopacket.NewPacket(data, layers.LayerTypeEthernet, gopacket.Default)
			if d, ok := pkt.Layer(layers.LayerTypeDot1Q).(*layers.Dot1Q); ok && d.VLANIdentifier == lab.VLAN {
				vlanOnUplink++
			}
		}
	}
	if vlanOnUplink == 0 {
		t.Errorf("no uplink frame carries VLAN %d in the pcapng", lab.VLAN)
	}
	checkTshark(t, path)
	packets, _ := summary["packets"].(map[string]any)
	for _, point := range []string{"pod:eth0", "host:veth-a", "uplink:bond0"} {
		if counts[point] == 0 || counts[point] != packets[point] {
			t.Errorf("pcapng has %v packets on %s, the report says %v", counts[point], point, packets[point])
		}
	}
}

// checkTshark has Wireshark's reader decode the file, where it is installed.
func checkTshark(t *testing.T, path string) {
	t.Helper()
	if _, err := exec.LookPath("tshark"); err != nil {
		t.Log("tshark not installed: the pcapng was checked with gopacket's reader only")
		return
	}
	out, err := exec.Command("tshark", "-r", path, "-T", "fields",
		"-e", "frame.interface_name", "-e", "vlan.id", "-e", "frame.comment").Output()
	if err != nil {
		t.Fatalf("tshark -r %s: %v", path, err)
	}
	names := map[string]bool{}
	vlan := false
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Split(line, "\t")
		if len(fields) < 3 || fields[2] == "" {
			t.Errorf("tshark: packet without comment: %q", line)
			continue
		}
		names[fields[0]] = true
		vlan = vlan || (strings.HasPrefix(fields[0], "uplink:") && fields[1] == strconv.Itoa(lab.VLAN))
	}
	for _, n := range []string{"pod:eth0", "host:veth-a", "uplink:bond0"} {
		if !names[n] {
			t.Errorf("tshark shows no packet on interface %s (has %v)", n, names)
		}
	}
	if !vlan {
		t.Errorf("tshark decodes no VLAN %d on the uplink", lab.VLAN)
	}
}

// TestAttachDetachMidTraffic starts and stops pathtrace while the lab client
// sends a steady stream of requests: observers must never break traffic, at
// attach, while attached, or at detach.
func TestAttachDetachMidTraffic(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-mid")
	for _, mode := range []lab.Mode{lab.ModeSocket, lab.ModeTC, lab.ModeNetfilter} {
		t.Run(string(mode), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := l.Up(ctx, mode); err != nil {
				t.Fatalf("lab up: %v", err)
			}
			type result struct {
				res lab.ClientResult
				err error
			}
			done := make(chan result, 1)
			go func() {
				res, err := l.Client(ctx, lab.ClientOptions{Requests: 60, Interval: 50 * time.Millisecond})
				done <- result{res, err}
			}()
			// Two short runs inside the client's three seconds: attach and
			// detach both happen while requests are in flight.
			for i := 0; i < 2; i++ {
				time.Sleep(400 * time.Millisecond)
				out, err := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
					"--svc", lab.UDPVIP.String(), "--duration", "700ms", "-o", "json").CombinedOutput()
				if err != nil {
					t.Fatalf("pathtrace: %v\n%s", err, out)
				}
			}
			r := <-done
			if r.err != nil {
				t.Fatal(r.err)
			}
			for _, pr := range []lab.ProtoResult{r.res.TCP, r.res.UDP} {
				if pr.Failed != 0 {
					t.Errorf("%s: %d of %d requests failed while pathtrace attached and detached: %+v",
						pr.Target, pr.Failed, pr.OK+pr.Failed, failures(pr))
				}
			}
		})
	}
}

func failures(pr lab.ProtoResult) []lab.RequestResult {
	var out []lab.RequestResult
	for _, r := range pr.Requests {
		if !r.OK {
			out = append(out, r)
		}
	}
	return out
}

// TestPodSelection selects the lab's Pod by IP and by netns path: its flows
// are traced and its capture points are the only Pod points.
func TestPodSelection(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	for _, sel := range [][]string{{"--pod-ip", lab.PodIP.String()}, {"--pod-netns", l.PodNetNS()}} {
		r := startJSON(t, append([]string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "30s"}, sel...)...)
		node := r.waitNode(t)
		if pods, _ := node["pods"].([]any); len(pods) != 1 {
			t.Errorf("%v: %d pods in the node object, want 1", sel, len(pods))
		}
		if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 2}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		flows, _ := r.rest(t)
		tcp := 0
		for _, f := range flows {
			if f["proto"] == "tcp" && f["rewritten_at"] == "tc" {
				tcp++
			}
		}
		if tcp != 2 {
			t.Errorf("%v: %d TCP flows rewritten at tc, want 2: %s", sel, tcp, dump(flows))
		}
	}
}

// TestPcapBoundsEndTheRun: --max-packets holds exactly and ends the run with
// that stop reason; --max-bytes is never exceeded.
func TestPcapBoundsEndTheRun(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	for _, bound := range [][]string{{"--max-packets", "5"}, {"--max-bytes", "3000"}} {
		pcap := filepath.Join(t.TempDir(), "bounded.pcapng")
		r := startJSON(t, append([]string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
			"--duration", "30s", "--pcap", pcap}, bound...)...)
		r.waitNode(t)
		if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 5}); err != nil {
			t.Fatal(err)
		}
		_, summary := r.rest(t) // ends by itself: the bound stops the run
		want := map[string]string{"--max-packets": "max-packets", "--max-bytes": "max-bytes"}[bound[0]]
		if summary["stop_reason"] != want {
			t.Errorf("%v: stop_reason %v, want %s", bound, summary["stop_reason"], want)
		}
		st, err := os.Stat(pcap)
		if err != nil {
			t.Fatal(err)
		}
		f, _ := os.Open(pcap)
		rd, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for {
			if _, _, err := rd.ReadPacketData(); err != nil {
				if err != io.EOF {
					t.Errorf("%v: reading the pcapng: %v", bound, err)
				}
				break
			}
			n++
		}
		f.Close()
		switch bound[0] {
		case "--max-packets":
			if n != 5 {
				t.Errorf("--max-packets 5: the file holds %d packets", n)
			}
		case "--max-bytes":
			if st.Size() > 3000 || n == 0 {
				t.Errorf("--max-bytes 3000: the file has %d bytes and %d packets", st.Size(), n)
			}
		}
	}
}

// TestMaxFlowsCountedOnce: with --max-flows 1, the flows beyond it are each
// counted once in the report's drops (they were counted twice, once by the
// engine and once more with the capture's counters).
func TestMaxFlowsCountedOnce(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "30s", "--max-flows", "1")
	r.waitNode(t)
	const requests = 4
	res, err := l.Client(context.Background(), lab.ClientOptions{Requests: requests})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, summary := r.rest(t)
	drops, _ := summary["drops"].(map[string]any)
	if tcpOK := res.TCP.OK; tcpOK != requests || len(flows) != 1 || drops["flows_over_max"] != float64(requests-1) {
		t.Errorf("%d TCP requests ok, %d flows, flows_over_max %v; want %d, 1, %d (drops %v)",
			res.TCP.OK, len(flows), drops["flows_over_max"], requests, requests-1, drops)
	}
}

// TestPcapToStdout: with --pcap - the capture streams to stdout, as
// `pathtrace --pcap - | wireshark -k -i -` reads it, and the report goes to
// stderr; the stream holds what the report counts, and a reader sees the
// first packets while the run goes on.
func TestPcapToStdout(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	cmd := pathtrace("--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--svc", lab.UDPVIP.String()+"/udp",
		"--duration", "60s", "--pcap", "-", "--output", "json")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// The report's lines, from stderr.
	lines := make(chan map[string]any, 64)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				lines <- m
			}
		}
	}()
	// The stream is kept as a file (mode 0600, as checkPcap wants of a
	// capture).
	path := filepath.Join(t.TempDir(), "stream.pcapng")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	copied := make(chan error, 1)
	go func() {
		_, err := io.Copy(f, stdout)
		f.Close()
		copied <- err
	}()
	select { // the node line comes once every observer is attached
	case m := <-lines:
		if m["type"] != "node" {
			t.Fatalf("first report line %v, want the node", m)
		}
	case <-time.After(time.Minute):
		t.Fatal("no node line on stderr")
	}
	res, err := l.Client(context.Background(), lab.ClientOptions{Requests: 2})
	if err != nil || res.TCP.OK != 2 || res.UDP.OK != 2 {
		t.Fatalf("lab client: %+v %v", res, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if st, err := os.Stat(path); err == nil && st.Size() > 4096 {
			break // the header and the first packets, before the run ends
		}
		if time.Now().After(deadline) {
			t.Fatal("no packet reached stdout while pathtrace ran")
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	var summary map[string]any
	for m := range lines {
		if m["type"] == "summary" {
			summary = m
		}
	}
	if err := <-copied; err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace: %v", err)
	}
	if summary == nil {
		t.Fatal("no summary line on stderr")
	}
	checkPcap(t, path, summary)
}

// TestSocketObserversPerProtocol: the socket observers only one protocol's
// flows need are left out, with the reason, when no traced Service has that
// protocol (a node's unconnected UDP sends then pay nothing for a TCP
// trace), and the socket LB is still placed at the socket for the flows
// traced.
func TestSocketObserversPerProtocol(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeSocket)
	for _, c := range []struct {
		svc           netip.AddrPort
		proto, unused string // the traced protocol; the observer left out
		left, kept    string
	}{
		{lab.TCPVIP, "tcp", "udp", "cgroup/sendmsg4", "tp_btf/inet_sock_set_state"},
		{lab.UDPVIP, "udp", "tcp", "tp_btf/inet_sock_set_state", "cgroup/sendmsg4"},
	} {
		t.Run(c.proto, func(t *testing.T) {
			r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", c.svc.String()+"/"+c.proto, "--duration", "60s")
			seen := map[string]observer{}
			for _, o := range nodeObservers(r.waitNode(t)) {
				seen[o.name] = o
			}
			if o, ok := seen[c.left]; !ok || o.attached || !strings.Contains(o.err, "no traced Service is "+strings.ToUpper(c.unused)) {
				t.Errorf("%s: %+v (listed %v), want not attached: no traced Service is %s", c.left, o, ok, strings.ToUpper(c.unused))
			}
			if o := seen[c.kept]; !o.attached {
				t.Errorf("%s: %+v, want attached", c.kept, o)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if _, err := l.Client(ctx, lab.ClientOptions{Requests: 2}); err != nil {
				t.Fatalf("lab client: %v", err)
			}
			_ = r.cmd.Process.Signal(syscall.SIGINT)
			flows, _ := r.rest(t)
			if len(flows) != 2 {
				t.Fatalf("%d flows, want the 2 of %s: %s", len(flows), c.proto, dump(flows))
			}
			for _, f := range flows {
				if f["proto"] != c.proto || f["rewritten_at"] != "socket" {
					t.Errorf("flow %s, want %s rewritten at the socket", dump([]map[string]any{f}), c.proto)
				}
			}
		})
	}
}
