package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/google/nftables"
	"github.com/gopacket/gopacket/pcapgo"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestIncidentBundle runs `pathtrace incident` against the lab in netfilter
// mode: the bundle holds every part, a second incident is refused while one
// runs, and the node is the same before and after.
func TestIncidentBundle(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	before := nodeState(t, l)

	out := filepath.Join(t.TempDir(), "incident")
	cmd := pathtrace("incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--svc", lab.UDPVIP.String(), "--duration", "5s", "--out", out)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	// The capture file appears once the lock is held and the taps are open.
	// The bundle is built beside its final name.
	waitFor(t, filepath.Join(out+".partial", "capture.pcapng.partial"), cmd)

	second := pathtrace("incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--duration", "1s", "--out", out+"-second")
	msg, err := second.CombinedOutput()
	if exitCode(err) != exitRuntime || !strings.Contains(string(msg), "another pathtrace incident is running") {
		t.Errorf("second incident: exit %d, %q; want it refused", exitCode(err), msg)
	}
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 2}); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident: %v\n%s", err, stderr.String())
	}

	for _, name := range []string{"SUMMARY.md", "report.txt", "report.json", "capture.pcapng", "MANIFEST.txt",
		"manifest.json", "net-node.txt", "net-pod-1.txt", "bridges.txt", "tc.txt", "cgroup-sock.txt",
		"nftables.txt", "iptables-legacy-nat.txt", "conntrack.txt", "sysctl.txt", "kernel.txt"} {
		if st, err := os.Stat(filepath.Join(out, name)); err != nil || st.Size() == 0 {
			t.Errorf("bundle part %s: %v", name, err)
		}
	}
	if _, err := os.Stat(out + ".tar.gz"); err != nil {
		t.Errorf("bundle archive: %v", err)
	}
	if _, err := os.Stat(out + ".partial"); err == nil {
		t.Errorf("%s.partial is left beside the finished bundle", out)
	}
	summary, _ := os.ReadFile(filepath.Join(out, "SUMMARY.md"))
	if !strings.Contains(string(summary), "netfilter") || !strings.Contains(string(summary), "10.244.20.31:3000") {
		t.Errorf("SUMMARY.md does not state the netfilter verdict:\n%s", summary)
	}
	// The reports name the capture file within the bundle, as it is once
	// renamed from DIR.partial, archived and unpacked elsewhere.
	txt, _ := os.ReadFile(filepath.Join(out, "report.txt"))
	if _, pcapLine, _ := strings.Cut(string(txt), "\nPcapng: "); !strings.HasPrefix(pcapLine, "capture.pcapng, ") {
		t.Errorf("report.txt does not name capture.pcapng within the bundle: Pcapng: %.80s", pcapLine)
	}
	js, err := os.ReadFile(filepath.Join(out, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	last := bytes.TrimSpace(js)
	last = last[bytes.LastIndexByte(last, '\n')+1:]
	var summaryLine struct {
		Pcap struct {
			Path string `json:"path"`
		} `json:"pcap"`
	}
	if err := json.Unmarshal(last, &summaryLine); err != nil || summaryLine.Pcap.Path != "capture.pcapng" {
		t.Errorf("report.json's summary.pcap.path is %q (%v), want capture.pcapng", summaryLine.Pcap.Path, err)
	}
	nft, _ := os.ReadFile(filepath.Join(out, "nftables.txt"))
	if !strings.Contains(string(nft), "kube-proxy") {
		t.Errorf("nftables.txt lacks the kube-proxy table:\n%s", nft)
	}
	if after := nodeState(t, l); after != before {
		t.Errorf("the node changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestIncidentBundleWithinMaxBytes runs an incident whose flows do not all
// fit in its --max-bytes beside the capture: the directory and the archive
// stay within the bound, both reports are whole files that say how many
// flows they leave out, and the archive holds them.
func TestIncidentBundleWithinMaxBytes(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	const budget = 1 << 20
	out := filepath.Join(t.TempDir(), "incident")
	cmd, stderr := startIncident(t, out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--svc", lab.UDPVIP.String(), "--duration", "8s", "--max-bytes", "1M")
	// 2 x 1200 flows: their reports alone are about 2 MB.
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 1200}); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident: %v\n%s", err, stderr.String())
	}
	var total int64
	entries, err := os.ReadDir(out)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		info, _ := e.Info()
		total += info.Size()
	}
	if total > budget {
		t.Errorf("bundle directory holds %d bytes, over --max-bytes %d", total, budget)
	}
	if st, err := os.Stat(out + ".tar.gz"); err != nil || st.Size() > budget {
		t.Errorf("bundle archive: %v (over %d bytes?)", err, budget)
	}
	if strings.Contains(stderr.String(), "was written without") {
		t.Errorf("the archive left files out: %s", stderr.String())
	}
	js, _ := os.ReadFile(filepath.Join(out, "report.json"))
	lines := strings.Split(strings.TrimSpace(string(js)), "\n")
	if !strings.HasPrefix(lines[0], `{"type":"node"`) || !strings.HasPrefix(lines[len(lines)-1], `{"type":"summary"`) {
		t.Errorf("report.json is not whole: first %.40q, last %.40q", lines[0], lines[len(lines)-1])
	}
	if !strings.Contains(string(js), `{"type":"omitted","flows":`) {
		t.Errorf("report.json does not say which flows it leaves out (%d bytes)", len(js))
	}
	txt, _ := os.ReadFile(filepath.Join(out, "report.txt"))
	if !strings.Contains(string(txt), "more flows (from id") {
		t.Errorf("report.txt does not say which flows it leaves out (%d bytes)", len(txt))
	}
	manifest, _ := os.ReadFile(filepath.Join(out, "MANIFEST.txt"))
	if !strings.Contains(string(manifest), "flows not written") {
		t.Errorf("MANIFEST.txt does not note the flows left out of the reports:\n%s", manifest)
	}
}

// TestIncidentCaptureFileFills runs an incident whose capture file fills
// its share of --max-bytes during the first burst of requests: the file
// ends, not the run, which goes on to --duration and still correlates the
// flows of a second burst, sent after the file filled; the reports and
// SUMMARY.md say how many captured frames the file left out, and never
// that nothing was lost.
func TestIncidentCaptureFileFills(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	out := filepath.Join(t.TempDir(), "incident")
	cmd, stderr := startIncident(t, out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--svc", lab.UDPVIP.String(), "--duration", "10s", "--max-bytes", "1M")
	client := func(rounds int) {
		t.Helper()
		if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: rounds}); err != nil {
			t.Fatal(err)
		}
	}
	// The file's share of 1M is 256 KiB, about 1,100 frames; a round (one
	// TCP and one UDP request) is about 36 at the three points. Once the
	// file is within a few frames of its share (it is written up to a
	// second behind the traffic), 20 more rounds fill it: the last rounds
	// begin after it filled. All their flows still fit in the reports.
	const before, filling, after = 60, 20, 5
	client(before)
	share := captureBudget(1 << 20)
	nearlyFull := func() bool {
		st, err := os.Stat(filepath.Join(out+".partial", "capture.pcapng.partial"))
		return err == nil && st.Size() >= share-2048
	}
	for deadline := time.Now().Add(20 * time.Second); !nearlyFull(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the capture file never came near its share of %d bytes", share)
		}
	}
	client(filling)
	client(after)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident: %v\n%s", err, stderr.String())
	}

	js, err := os.ReadFile(filepath.Join(out, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	var summary struct {
		Flows      int               `json:"flows"`
		Drops      map[string]uint64 `json:"drops"`
		StopReason string            `json:"stop_reason"`
		Packets    map[string]uint64 `json:"packets"`
		Pcap       struct {
			Packets          uint64    `json:"packets"`
			StopReason       string    `json:"stop_reason"`
			EndedAt          time.Time `json:"ended_at"`
			FramesNotWritten uint64    `json:"frames_not_written"`
		} `json:"pcap"`
	}
	type flowLine struct {
		ID          int       `json:"id"`
		First       time.Time `json:"first"`
		RewrittenAt string    `json:"rewritten_at"`
	}
	var flows []flowLine
	for line := range strings.Lines(string(js)) {
		var typed struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal([]byte(line), &typed); err != nil {
			t.Fatalf("report.json: %v: %s", err, line)
		}
		var err error
		switch typed.Type {
		case "flow":
			var fl flowLine
			err = json.Unmarshal([]byte(line), &fl)
			flows = append(flows, fl)
		case "omitted":
			t.Errorf("report.json leaves flows out, which the test needs: %s", line)
		case "summary":
			err = json.Unmarshal([]byte(line), &summary)
		}
		if err != nil {
			t.Fatalf("report.json: %v: %s", err, line)
		}
	}
	if summary.StopReason != "duration" {
		t.Errorf("the run stopped for %q, want duration: the full capture file must not end it", summary.StopReason)
	}
	// A UDP socket that reused a client port while the earlier one's flow
	// was still seen is counted in it (flows_joined).
	if want := 2 * (before + filling + after); summary.Flows+int(summary.Drops["flows_joined"]) != want {
		t.Errorf("%d flows, of which %d joined, want %d (one TCP and one UDP flow per round)", summary.Flows, summary.Drops["flows_joined"], want)
	}
	p := summary.Pcap
	var captured uint64
	for _, n := range summary.Packets {
		captured += n
	}
	if p.StopReason != "max-bytes" || p.EndedAt.IsZero() || p.FramesNotWritten == 0 || p.Packets+p.FramesNotWritten != captured {
		t.Fatalf("summary.pcap: stop %q, ended at %v, %d packets and %d not written; want max-bytes, a time, and the %d frames captured in all",
			p.StopReason, p.EndedAt, p.Packets, p.FramesNotWritten, captured)
	}
	if n := countPcapng(t, filepath.Join(out, "capture.pcapng")); uint64(n) != p.Packets {
		t.Errorf("capture.pcapng holds %d packets, the report says %d", n, p.Packets)
	}
	late := 0
	for _, f := range flows {
		if f.First.After(p.EndedAt) {
			late++
			if f.RewrittenAt != "tc" {
				t.Errorf("flow %d, begun after the file filled, rewritten at %q, want tc", f.ID, f.RewrittenAt)
			}
		}
	}
	if late+int(summary.Drops["flows_joined"]) < 2*after {
		t.Errorf("%d flows began after the file filled at %s, want at least the last rounds' %d", late, p.EndedAt, 2*after)
	}

	md, _ := os.ReadFile(filepath.Join(out, "SUMMARY.md"))
	digits := strings.ReplaceAll(string(md), ",", "") // the counts have thousands separators
	for _, want := range []string{"- The capture file filled its share (",
		fmt.Sprintf("run: it holds %d of the %d frames captured; the verdicts cover the whole run. Raise --max-bytes to keep more.", p.Packets, captured),
		"Capture stopped: duration; the capture file filled after "} {
		if !strings.Contains(digits, strings.ReplaceAll(want, ",", "")) {
			t.Errorf("SUMMARY.md lacks %q:\n%s", want, md)
		}
	}
	if strings.Contains(string(md), "Nothing was lost") {
		t.Errorf("SUMMARY.md says nothing was lost, although the capture file left frames out:\n%s", md)
	}
	txt, _ := os.ReadFile(filepath.Join(out, "report.txt"))
	if want := fmt.Sprintf("ended by max-bytes at %s: %d of the %d frames captured are not in it", p.EndedAt.Local().Format("15:04:05.000"), p.FramesNotWritten, captured); !strings.Contains(string(txt), want) {
		_, pcapLine, _ := strings.Cut(string(txt), "\nPcapng: ")
		t.Errorf("report.txt lacks %q: Pcapng: %.300s", want, pcapLine)
	}
}

// TestIncidentKilled kills an incident during its capture: no bundle
// appears under its name, the capture so far stays readable in
// DIR.partial, and a new incident with the same --out is refused.
func TestIncidentKilled(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	out := filepath.Join(t.TempDir(), "incident")
	cmd := pathtrace("incident", "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(),
		"--duration", "30s", "--out", out)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	partial := filepath.Join(out+".partial", "capture.pcapng.partial")
	waitFor(t, partial, cmd)
	if _, err := l.Client(context.Background(), lab.ClientOptions{Requests: 3}); err != nil {
		t.Fatal(err)
	}
	// The frames leave the reorder hold within a second (with no newer
	// frame to push them out), then the file within flushInterval: on a
	// loaded machine later, so the kill waits for the first one written.
	for deadline := time.Now().Add(15 * time.Second); packetsWritten(partial) == 0 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	for _, p := range []string{out, out + ".tar.gz"} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s exists after the incident was killed", p)
		}
	}
	if n := countPcapng(t, partial); n == 0 {
		t.Errorf("%s holds no packet", partial)
	}
	again := pathtrace("incident", "--svc", lab.TCPVIP.String(), "--out", out)
	msg, err := again.CombinedOutput()
	if exitCode(err) != exitUsage || !strings.Contains(string(msg), ".partial exists") {
		t.Errorf("incident over a killed one's --out: exit %d, %q; want exit 2 naming %s.partial", exitCode(err), msg, out)
	}
}

// TestIncidentSecondInterruptWhileCaptureStops: a second stop signal right
// after the first, while the capture stops (its observers detaching), cuts
// the snapshot short as the help says, rather than being lost: the bundle
// is written, and its manifest names the parts not collected.
func TestIncidentSecondInterruptWhileCaptureStops(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	out := filepath.Join(t.TempDir(), "incident")
	cmd, stderr := startIncident(t, out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "30s")
	// Back to back, within the capture's stop (150-300 ms in the lab: the
	// tcx observers detach). Another signal than the first: two of one
	// kind are merged into one, by the kernel while both are pending, by
	// the Go runtime while the first waits for its os/signal goroutine, as
	// a pathtrace that a loaded machine keeps off the CPU lets them be.
	_ = cmd.Process.Signal(os.Interrupt)
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("incident interrupted twice: %v (%s)", err, stderr.String())
	}
	manifest, err := os.ReadFile(filepath.Join(out, "MANIFEST.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(manifest), "not collected") {
		t.Errorf("a second Ctrl-C while the capture stopped collected the whole snapshot (stderr %q):\n%s", stderr.String(), manifest)
	}
}

// waitFor waits until path exists or cmd exits.
func waitFor(t *testing.T, path string, cmd interface{ String() string }) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
	}
	t.Fatalf("%s never appeared (%s)", path, cmd)
}

// nodeState renders what the lab node has that pathtrace must leave as it
// was: its nftables ruleset, tcx programs on its interfaces, qdiscs and tc
// filters, and the programs on the lab client's cgroup.
func nodeState(t *testing.T, l *lab.Lab) string {
	t.Helper()
	var b strings.Builder
	err := nsutil.Do(l.NodeNetNS(), func() error {
		h, err := netns.Get()
		if err != nil {
			return err
		}
		defer h.Close()
		conn, err := nftables.New(nftables.WithNetNSFd(int(h)))
		if err != nil {
			return err
		}
		tables, err := conn.ListTables()
		if err != nil {
			return err
		}
		for _, tb := range tables {
			chains, _ := conn.ListChainsOfTableFamily(tb.Family)
			for _, c := range chains {
				if c.Table.Name != tb.Name {
					continue
				}
				rules, _ := conn.GetRules(tb, c)
				fmt.Fprintf(&b, "nft %s %s: %d rules\n", tb.Name, c.Name, len(rules))
			}
		}
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, lk := range links {
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				res, err := link.QueryPrograms(link.QueryOptions{Target: lk.Attrs().Index, Attach: at})
				if err == nil {
					fmt.Fprintf(&b, "tcx %s %v: %d programs\n", lk.Attrs().Name, at, len(res.Programs))
				}
			}
			qds, _ := netlink.QdiscList(lk)
			fmt.Fprintf(&b, "qdiscs %s: %d\n", lk.Attrs().Name, len(qds))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The lab client's cgroup, not the root: other test binaries attach
	// observers to the root while this test runs.
	f, err := os.Open(l.ClientCgroup())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, at := range []ebpf.AttachType{ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupInetEgress, ebpf.AttachCGroupInet6Connect} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at})
		if err == nil {
			fmt.Fprintf(&b, "cgroup %s %v: %d programs\n", l.ClientCgroup(), at, len(res.Programs))
		}
	}
	return b.String()
}

// packetsWritten counts the packets of a pcapng file being written, up to
// its first block not whole yet.
func packetsWritten(path string) int {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		return 0
	}
	for n := 0; ; n++ {
		if _, _, err := r.ReadPacketData(); err != nil {
			return n
		}
	}
}

// countPcapng counts the packets of a pcapng file, which must read without
// error to its end.
func countPcapng(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	for n := 0; ; n++ {
		if _, _, err := r.ReadPacketData(); err != nil {
			if err != io.EOF {
				t.Errorf("%s: packet %d: %v", path, n+1, err)
			}
			return n
		}
	}
}

// TestIncidentBadOutExitsTwo: an --out that is missing, exists, or whose
// archive or partial bundle exists is refused before anything runs, with
// one line and exit 2 (as a normal user too: the flags are checked first).
func TestIncidentBadOutExitsTwo(t *testing.T) {
	dir := t.TempDir()
	existing := filepath.Join(dir, "exists")
	withTarball := filepath.Join(dir, "archived")
	withPartial := filepath.Join(dir, "killed")
	for _, p := range []string{existing, withPartial + ".partial"} {
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(withTarball+".tar.gz", []byte("an earlier incident"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--svc", "10.0.0.1"},
		{"--svc", "10.0.0.1", "--out", existing},
		{"--svc", "10.0.0.1", "--out", withTarball},
		{"--svc", "10.0.0.1", "--out", withPartial},
		{"--svc", "10.0.0.1", "--out", filepath.Join(dir, "no-such-dir", "x")},
		{"--svc", "10.0.0.1", "--out", filepath.Join(dir, "new"), "--max-bytes", "100K"},
		// A stray word (a Service without --svc, a typo) is refused, not
		// ignored: the incident would trace something else than meant.
		{"10.0.0.2", "--svc", "10.0.0.1", "--out", filepath.Join(dir, "new"), "--duration", "1s"},
	} {
		var stderr bytes.Buffer
		cmd := pathtrace(append([]string{"incident"}, args...)...)
		cmd.Stderr = &stderr
		code := exitCode(cmd.Run())
		msg := strings.TrimSpace(stderr.String())
		if code != exitUsage || msg == "" || strings.Contains(msg, "\n") {
			t.Errorf("pathtrace incident %s: exit %d, stderr %q; want exit 2 and one line", strings.Join(args, " "), code, msg)
		}
	}
	if b, _ := os.ReadFile(withTarball + ".tar.gz"); string(b) != "an earlier incident" {
		t.Errorf("the earlier archive changed: %q", b)
	}
}

// TestCommandLine: the command a bundle records reads back in a shell.
func TestCommandLine(t *testing.T) {
	got := commandLine([]string{"/usr/local/bin/pathtrace", "incident", "--svc", "10.120.0.80:80/tcp", "--out", "/var/tmp/inc 42", "--pod-ip", "it's"})
	want := `pathtrace incident --svc 10.120.0.80:80/tcp --out '/var/tmp/inc 42' --pod-ip 'it'\''s'`
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

// TestIncidentPodStarted: a Pod that starts during an incident's capture is
// in the bundle as the Pods of the start are: SUMMARY.md says it started,
// the reports' node lists its capture points, taps and the tcx observers
// its tc program brought (the tails not loaded, since no host veth had a
// tcx program at the start, and saying so), the snapshot reads the tc
// programs of its host veth.
func TestIncidentPodStarted(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	ip := otherPodIPs[1]
	out := filepath.Join(t.TempDir(), "incident")
	cmd, stderr := startIncident(t, out, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String(), "--duration", "8s")
	addPod(t, l, ip)
	if err := l.AttachTCLBTo(addedPodVeth(ip)); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pathtrace incident: %v\n%s", err, stderr.String())
	}
	veth := addedPodVeth(ip)
	summary, _ := os.ReadFile(filepath.Join(out, "SUMMARY.md"))
	if !strings.Contains(string(summary), "started during the capture") || !strings.Contains(string(summary), "host "+veth) {
		t.Errorf("SUMMARY.md does not name the Pod that started, nor its host veth among the capture points:\n%s", summary)
	}
	tc, _ := os.ReadFile(filepath.Join(out, "tc.txt"))
	if !strings.Contains(string(tc), "## host "+veth) {
		t.Errorf("tc.txt does not read the started Pod's host veth:\n%s", tc)
	}
	js, err := os.ReadFile(filepath.Join(out, "report.json"))
	if err != nil {
		t.Fatal(err)
	}
	var node map[string]any
	if err := json.Unmarshal(js[:bytes.IndexByte(js, '\n')], &node); err != nil {
		t.Fatal(err)
	}
	if s := fmt.Sprint(node["capture_points"]); !strings.Contains(s, veth) {
		t.Errorf("report.json's node lacks the started Pod's capture points: %s", s)
	}
	if s := fmt.Sprint(node["observers"]); !strings.Contains(s, veth) {
		t.Errorf("report.json's node lacks the started Pod's taps: %s", s)
	}
	points := map[string]string{} // the error of each tcx observer on veth
	list, _ := node["observers"].([]any)
	for _, o := range list {
		m, _ := o.(map[string]any)
		if where, point := fmt.Sprint(m["where"]), fmt.Sprint(m["point"]); strings.Contains(where, veth) && strings.HasPrefix(point, "tc_") {
			points[point], _ = m["error"].(string)
		}
	}
	if why, ok := points["tc_head"]; !ok || why != "" {
		t.Errorf("tc_head on %s: attached %v, error %q; want it attached (observers %v)", veth, ok, why, points)
	}
	if why := points["tc_tail"]; !strings.Contains(why, "when the trace started") {
		t.Errorf("tc_tail on %s: error %q, want it not loaded since the start (observers %v)", veth, why, points)
	}
}

// startIncident starts "pathtrace incident ARGS --out out", its stderr
// kept, killed when the test ends, and waits until it captures.
func startIncident(t *testing.T, out string, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := pathtrace(append(append([]string{"incident"}, args...), "--out", out)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	waitFor(t, filepath.Join(out+".partial", "capture.pcapng.partial"), cmd)
	return cmd, &stderr
}
