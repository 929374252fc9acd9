package report_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/report"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// callerDrops are the counters the session adds (capture and probe losses).
var callerDrops = map[string]uint64{"uplink_kernel_drops": 0, "pod_kernel_drops": 2, "ringbuf_lost": 0}

type node struct {
	Host   string   `json:"host"`
	Points []string `json:"points"`
}

func nodeTable(w io.Writer) { fmt.Fprintln(w, "NODE lab-node  points: pod host uplink") }

// run writes a full report of the mixed-modes scenario (one flow per verdict).
func run(t *testing.T, format string) []byte {
	t.Helper()
	s, err := flowtest.Load("../../testdata/flows/mixed-modes.json")
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	var buf bytes.Buffer
	w := report.NewWriter(&buf, format)
	if err := w.Node(node{Host: "lab-node", Points: []string{"pod", "host", "uplink"}}, nodeTable); err != nil {
		t.Fatal(err)
	}
	if err := w.Flows(e.Flows()); err != nil {
		t.Fatal(err)
	}
	if err := w.Summary(e.Summary(), callerDrops, report.Run{Stop: "duration"}); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file (go test -update rewrites it):\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestTableGolden(t *testing.T) {
	golden(t, "report.table.golden", run(t, report.FormatTable))
}

func TestJSONGolden(t *testing.T) {
	golden(t, "report.jsonl.golden", run(t, report.FormatJSON))
}

// TestJSONContract checks the fields other tools script against.
func TestJSONContract(t *testing.T) {
	lines := strings.Split(strings.TrimSpace(string(run(t, report.FormatJSON))), "\n")
	var types []string
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not a JSON object: %s", l)
		}
		typ, _ := m["type"].(string)
		types = append(types, typ)
		switch typ {
		case "flow":
			for _, k := range []string{"proto", "client", "service", "backend", "rewritten_at", "by", "vlan",
				"uplink_dst_mac", "reply", "reason"} {
				if _, ok := m[k]; !ok {
					t.Errorf("flow line lacks %q: %s", k, l)
				}
			}
			if m["rewritten_at"] == "nowhere" && (m["backend"] != "" || m["vlan"] != 200.0) {
				t.Errorf("nowhere flow: backend %v vlan %v, want \"\" and 200", m["backend"], m["vlan"])
			}
			if m["rewritten_at"] == "unknown" && (m["vlan"] != nil || m["reason"] == "") {
				t.Errorf("unknown flow never at the uplink: vlan %v reason %v, want null and a reason", m["vlan"], m["reason"])
			}
		case "summary":
			drops, _ := m["drops"].(map[string]any)
			for _, k := range []string{"flows_over_max", "unmatched_overflow", "uplink_kernel_drops", "pod_kernel_drops"} {
				if _, ok := drops[k]; !ok {
					t.Errorf("summary drops lack %q: %s", k, l)
				}
			}
			if m["flows"] != 5.0 {
				t.Errorf("summary flows = %v, want 5", m["flows"])
			}
			// Optional fields (pods_started, observers_added, ...) are
			// left out when empty, never null.
			for k, v := range m {
				if v == nil {
					t.Errorf("summary field %q is null: %s", k, l)
				}
			}
		}
	}
	want := "node flow flow flow flow flow summary"
	if got := strings.Join(types, " "); got != want {
		t.Errorf("line types %q, want %q", got, want)
	}
}

func TestEmptyTable(t *testing.T) {
	var buf bytes.Buffer
	e := flow.NewEngine(flow.Config{})
	if err := report.WriteTable(&buf, e.Flows(), e.Summary()); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	// What to check when no flow was seen: the Service given, the node's
	// netns, whether the points saw its traffic.
	for _, want := range []string{"No flow", "--svc", "--host-netns", "Captured:", "flows_over_max", "unknown"} {
		if !strings.Contains(out, want) {
			t.Errorf("empty table lacks %q:\n%s", want, out)
		}
	}
}

func TestNodeMustBeAnObject(t *testing.T) {
	w := report.NewWriter(io.Discard, report.FormatJSON)
	if err := w.Node([]int{1}, nodeTable); err == nil {
		t.Error("a node that is not a JSON object was accepted")
	}
}

func TestProgress(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/mixed-modes.json")
	if err != nil {
		t.Fatal(err)
	}
	sum := s.Run(nil).Summary()
	onePod := map[string]uint64{"uplink:bond0": 17, "pod:eth0": 20, "host:veth-a": 19}
	for _, tt := range []struct {
		duration time.Duration
		pending  int
		packets  map[string]uint64
		width    int
		want     string
	}{
		{30 * time.Second, 0, onePod, 200, "12s/30s  flows 5 (socket 1, tc 1, netfilter 1, nowhere 1, unknown 1)  drops 2  seen: pod 20 host 19 uplink 17"},
		// The unknown flow may still be decided.
		{0, 1, onePod, 200, "12s  flows 5 (socket 1, tc 1, netfilter 1, nowhere 1, pending 1)  drops 2  seen: pod 20 host 19 uplink 17"},
		// 80 columns: the packet counts go first, then the verdicts.
		{30 * time.Second, 0, onePod, 80, "12s/30s  flows 5 (socket 1, tc 1, netfilter 1, nowhere 1, unknown 1)  drops 2"},
		{30 * time.Second, 0, onePod, 40, "12s/30s  flows 5  drops 2"},
		{30 * time.Second, 0, nil, 8, "12s/30s"},
		{30 * time.Second, 0, nil, 5, "12s/"},
	} {
		got := report.Progress(12*time.Second+400*time.Millisecond, tt.duration, sum, tt.pending, tt.packets, callerDrops, tt.width)
		if got != tt.want {
			t.Errorf("progress at %d columns:\n got %s\nwant %s", tt.width, got, tt.want)
		}
		if len(got) >= tt.width {
			t.Errorf("progress at %d columns is %d long: it wraps", tt.width, len(got))
		}
	}
}

// TestProgressBoundedWithManyPods: 40 Pods' points are summed by role, so
// the line stays as long as with one.
func TestProgressBoundedWithManyPods(t *testing.T) {
	packets := map[string]uint64{"uplink:bond0": 4000}
	for i := range 40 {
		packets[fmt.Sprintf("pod:eth0@10.244.8.%d", i+2)] = 100
		packets[fmt.Sprintf("host:veth%02d", i)] = 100
	}
	packets["host:veth07#2"] = 5 // a Pod that came back with the same veth name
	sum := flow.Summary{Flows: 40, RewrittenAt: map[flow.Place]int{flow.PlaceTC: 40}}
	got := report.Progress(10*time.Second, 0, sum, 0, packets, nil, 120)
	if want := "10s  flows 40 (tc 40)  drops 0  seen: pod 4000 host 4005 uplink 4000"; got != want {
		t.Errorf("progress:\n got %s\nwant %s", got, want)
	}
}

// TestClientUnknown: a flow whose connect failed before the kernel chose a
// source address (no route) has no client; the table says "-", not Go's
// "invalid AddrPort".
func TestClientUnknown(t *testing.T) {
	var buf bytes.Buffer
	flows := []flow.Flow{{ID: 3, Proto: "tcp", Service: netip.MustParseAddrPort("10.120.0.80:80"), RewrittenAt: flow.PlaceUnknown, Reason: "no route"}}
	if err := report.WriteTable(&buf, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	if strings.Contains(out, "invalid") || !strings.Contains(out, "3   tcp    -  ") {
		t.Errorf("a flow without a client is shown as:\n%s", out)
	}
}

// TestReplyUnseen: a flow a sidecar's redirect kept in its Pod was never
// where a reply could be seen: the table says so rather than "no".
func TestReplyUnseen(t *testing.T) {
	var buf bytes.Buffer
	flows := []flow.Flow{{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40026"), Service: netip.MustParseAddrPort("10.120.0.80:80"),
		Backend: netip.MustParseAddrPort("127.0.0.1:15001"), RewrittenAt: flow.PlaceNetfilter, By: flow.ByClientNetfilter}}
	if err := report.WriteTable(&buf, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	if row := strings.Split(buf.String(), "\n")[1]; !strings.HasSuffix(strings.TrimSpace(row), "unseen") {
		t.Errorf("row %q, want the reply column to say unseen", row)
	}
}

// TestReplyUnseenSocketToOwnPod: a flow a socket LB sent to its client's
// own Pod (its own address, or loopback) went through the Pod's loopback,
// where no tap is: the table says unseen, not no; a node process's, or a
// Pod's to another backend, keeps "no"; and it is not listed among the
// requests lost on the node.
func TestReplyUnseenSocketToOwnPod(t *testing.T) {
	pod := netip.MustParseAddrPort("10.244.8.23:40026")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: pod, Backend: netip.MustParseAddrPort("10.244.8.23:8080")},
		{ID: 2, Proto: "udp", Client: netip.MustParseAddrPort("127.0.0.1:40027"), Backend: netip.MustParseAddrPort("127.0.0.1:5353")},
		{ID: 3, Proto: "tcp", Client: netip.MustParseAddrPort("192.168.77.2:40028"), Backend: netip.MustParseAddrPort("192.168.77.2:6443"), NodeClient: true},
		{ID: 4, Proto: "tcp", Client: pod, Backend: netip.MustParseAddrPort("10.244.20.31:3000")},
	}
	for i := range flows {
		flows[i].Service, flows[i].RewrittenAt, flows[i].By = netip.MustParseAddrPort("10.120.0.80:80"), flow.PlaceSocket, "connect4 cil_sock4_connect (id 41)"
		flows[i].Reason = fmt.Sprintf("reason of flow %d", i+1)
	}
	var buf bytes.Buffer
	if err := report.WriteTable(&buf, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(buf.String(), "\n")
	for i, want := range []string{"unseen", "unseen", "no", "no"} {
		if row := strings.TrimSpace(lines[i+1]); !strings.HasSuffix(row, " "+want) {
			t.Errorf("row %q, want the reply column to say %s", row, want)
		}
	}
	for id, listed := range []bool{false, false, true, true} {
		if got := strings.Contains(buf.String(), fmt.Sprintf("reason of flow %d", id+1)); got != listed {
			t.Errorf("flow %d listed among the unanswered: %v, want %v:\n%s", id+1, got, listed, buf.String())
		}
	}
}

// TestProxyRedirects: the rows of connections a sidecar's redirect kept in
// their Pod end at the proxy's port; under the rows, each names the flows
// that can be its proxy's upstream, whose rows say where the VIP was
// rewritten, or says why there is none.
func TestProxyRedirects(t *testing.T) {
	var buf bytes.Buffer
	svc, proxy := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("127.0.0.1:15001")
	app := func(id int, port uint16) flow.Flow {
		return flow.Flow{ID: id, Proto: "tcp", Client: netip.AddrPortFrom(netip.MustParseAddr("10.244.8.23"), port), Service: svc,
			Backend: proxy, RewrittenAt: flow.PlaceNetfilter, By: flow.ByClientNetfilter}
	}
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:49616"), Service: svc, Backend: netip.MustParseAddrPort("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy nat-prerouting -> dnat to 10.244.20.31:3000", Reply: true},
		app(2, 49604), app(3, 49626), app(4, 49630),
	}
	flows[1].ProxyUpstreams = []int{1}
	flows[3].Refused = true
	flows[3].KernelDrops = []flow.KernelDrop{{Direction: "request", Count: 1, Reason: "NO_SOCKET", Function: "tcp_v4_rcv"}}
	if err := report.WriteTable(&buf, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"Redirected to a proxy in the client's Pod (its own NAT; the row of the proxy's upstream says where the VIP was rewritten):\n",
		"  flow 2: to 127.0.0.1:15001; the proxy's upstream can be flow 1\n",
		"  flow 3: to 127.0.0.1:15001; no connection of its Pod to 10.120.0.80:80 by another process followed (a proxy that picks the endpoint itself connects to a backend's address, which no flow follows; one may reuse a connection it opened before, or answer itself, as Istio's DNS proxy does for the cluster's names)\n",
		"  flow 4: to 127.0.0.1:15001, where nothing listened: the Pod's kernel refused it (the proxy not running, or not ready)\n",
	} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("table:\n%s\nwant %q", buf.String(), want)
		}
	}
}

// TestNodeClientsNamed: a flow of a process in the node's own netns (a
// hostNetwork Pod, the kubelet) is said to be the node's under the rows,
// with its command: its client address alone does not tell it from a
// Pod's, and it is traced whichever Pod is selected.
func TestNodeClientsNamed(t *testing.T) {
	var buf bytes.Buffer
	svc, be := netip.MustParseAddrPort("10.96.4.20:80"), netip.MustParseAddrPort("10.77.2.7:8080")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.77.1.5:40000"), Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, Reply: true, Comm: "wget"},
		{ID: 2, Proto: "tcp", Client: netip.MustParseAddrPort("172.31.9.2:40002"), Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, Reply: true, NodeClient: true, Comm: "curl"},
		{ID: 3, Proto: "tcp", Client: netip.MustParseAddrPort("172.31.9.2:40004"), Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, Reply: true, NodeClient: true, Comm: "curl"},
	}
	if err := report.WriteTable(&buf, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	want := "Clients in the node's own netns, not Pods (hostNetwork Pods, the kubelet, node processes): flows 2, 3 (curl)\n"
	if !strings.Contains(buf.String(), want) {
		t.Errorf("table:\n%s\nwant a line %q", buf.String(), want)
	}
	buf.Reset()
	if err := report.WriteTable(&buf, flows[:1], flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "node's own netns") {
		t.Errorf("table without node clients names some:\n%s", buf.String())
	}
}

// TestRunEndedEarly: a capture point or the observers' reader that ended
// before the run did is said in both formats, with when and why, and so
// are the NAT rules and tc programs that changed.
func TestRunEndedEarly(t *testing.T) {
	run := report.Run{Stop: "duration",
		CaptureEnded:      map[string]string{"pod:eth0": "ended at 03:12:09: network is down"},
		CaptureGaps:       map[string]string{"uplink:bond0": "went down once (first at 03:12:05.000), 1.2 s in all"},
		ObserversEnded:    "ended at 03:12:10: read ring buffer: bad address",
		NATRulesReread:    "read again at 03:12:07 (flows reached backends that no rule read before named): 2 rule(s) or IPVS service(s) appeared, 0 went",
		TCProgramsChanged: []string{"at 03:12:07 on veth-a (host veth #2): tcx ingress lab_from_container (id 52) went, cls_bpf ingress lab_from_container (id 60) appeared"}}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"Capture at pod:eth0 ended at 03:12:09: network is down: later frames there are missing",
		"Observer events ended at 03:12:10: read ring buffer: bad address: later flows lack",
		"Interface of uplink:bond0 went down once (first at 03:12:05.000), 1.2 s in all: nothing crossed it meanwhile (its capture went on)",
		"NAT rules read again at 03:12:07",
		"tc programs that changed during the run (each flow's \"by\" names those of its time): at 03:12:07 on veth-a (host veth #2): tcx ingress lab_from_container (id 52) went, cls_bpf ingress lab_from_container (id 60) appeared\n",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table has no %q:\n%s", want, table.String())
		}
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, "json").Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	var got struct {
		CaptureEnded   map[string]string `json:"capture_ended"`
		CaptureGaps    map[string]string `json:"capture_gaps"`
		ObserversEnded string            `json:"observers_ended"`
		NATRulesReread string            `json:"nat_rules_reread"`
		TCChanged      []string          `json:"tc_programs_changed"`
	}
	if err := json.Unmarshal(js.Bytes(), &got); err != nil {
		t.Fatalf("%v: %s", err, js.String())
	}
	if got.ObserversEnded != run.ObserversEnded || got.CaptureEnded["pod:eth0"] != run.CaptureEnded["pod:eth0"] ||
		got.CaptureGaps["uplink:bond0"] != run.CaptureGaps["uplink:bond0"] || got.NATRulesReread != run.NATRulesReread ||
		!slices.Equal(got.TCChanged, run.TCProgramsChanged) {
		t.Errorf("JSON summary %s, want both endings, the gap and what changed", js.String())
	}
}

// TestPcapEndedEarly: a capture file that a bound ended before the run
// did says when, and how many of the frames captured it does not hold, in
// both formats.
func TestPcapEndedEarly(t *testing.T) {
	ended := time.Date(2025, 1, 1, 3, 12, 9, 123e6, time.Local)
	run := report.Run{Stop: "duration", Pcap: &export.Summary{Path: "capture.pcapng", Packets: 1075, Bytes: 1 << 20,
		PerInterface: map[string]uint64{"pod:eth0": 1075}, StopReason: "max-bytes", EndedAt: ended, FramesNotWritten: 4328}}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	if want := "Pcapng: capture.pcapng, 1075 packets, 1048576 bytes (pod:eth0 1075); ended by max-bytes at 03:12:09.123: 4328 of the 5403 frames captured are not in it\n"; !strings.Contains(table.String(), want) {
		t.Errorf("table has no %q:\n%s", want, table.String())
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, "json").Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Pcap struct {
			StopReason       string    `json:"stop_reason"`
			EndedAt          time.Time `json:"ended_at"`
			FramesNotWritten uint64    `json:"frames_not_written"`
		} `json:"pcap"`
	}
	if err := json.Unmarshal(js.Bytes(), &got); err != nil {
		t.Fatalf("%v: %s", err, js.String())
	}
	if got.Pcap.StopReason != "max-bytes" || !got.Pcap.EndedAt.Equal(ended) || got.Pcap.FramesNotWritten != 4328 {
		t.Errorf("JSON summary %s, want the file's stop reason, ended_at and frames_not_written", js.String())
	}
	// A file that held the whole run has neither.
	run.Pcap = &export.Summary{Path: "capture.pcapng", Packets: 5}
	js.Reset()
	if err := report.NewWriter(&js, "json").Summary(flow.Summary{}, nil, run); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(js.String(), "ended_at") || strings.Contains(js.String(), "frames_not_written") {
		t.Errorf("JSON summary of a whole capture file names an end: %s", js.String())
	}
}

func TestUnknownOutsideTheWindowNamed(t *testing.T) {
	s := flow.Summary{Flows: 5, RewrittenAt: map[flow.Place]int{flow.PlaceUnknown: 4}, UnknownBeforeReady: 3, UnknownAfterStop: 1}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Summary(s, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"Of the unknown, 3 began while pathtrace was still attaching",
		"Of the unknown, 1 began after the capture was asked to stop",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table has no %q:\n%s", want, table.String())
		}
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, "json").Summary(s, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"unknown_began_before_ready":3`, `"unknown_began_after_stop":1`} {
		if !strings.Contains(js.String(), want) {
			t.Errorf("JSON summary has no %s: %s", want, js.String())
		}
	}
}

// TestOmittedFlows: flows left out of a report (a size bound) are said, in
// both formats, between the flows and the summary, and their rewriters still
// reach the table's summary.
func TestOmittedFlows(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceTC, By: "tcx ingress lb"},
		{ID: 4, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, By: "nft kube-proxy"},
		{ID: 5, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, By: "nft kube-proxy"},
	}
	for _, format := range []string{report.FormatTable, report.FormatJSON} {
		var buf bytes.Buffer
		w := report.NewWriter(&buf, format)
		if err := w.Flows(flows[:1]); err != nil {
			t.Fatal(err)
		}
		if err := w.Omitted(flows[1:], "a bound"); err != nil {
			t.Fatal(err)
		}
		if err := w.Summary(flow.Summary{Flows: 3}, nil, report.Run{}); err != nil {
			t.Fatal(err)
		}
		out := buf.String()
		want := map[string]string{
			report.FormatTable: "2 more flows (from id 4 on) are not written here: a bound.",
			report.FormatJSON:  `{"type":"omitted","flows":2,"first_id":4,"reason":"a bound"}`,
		}[format]
		if !strings.Contains(out, want) || strings.Index(out, want) > strings.Index(out, "summary") && format == report.FormatJSON {
			t.Errorf("%s: want %q before the summary in:\n%s", format, want, out)
		}
		if format == report.FormatTable && !strings.Contains(out, "nft kube-proxy") {
			t.Errorf("the table's summary lacks the omitted flows' rewriter:\n%s", out)
		}
	}
}

// TestWithoutPortsNamed: packets that can be no flow's (ICMP, later
// fragments) are counted by name in both formats.
func TestWithoutPortsNamed(t *testing.T) {
	s := flow.Summary{WithoutPorts: 7}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Summary(s, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	if want := "Observations without TCP/UDP ports (ICMP, IP fragments after the first; no flow's): 7"; !strings.Contains(table.String(), want) {
		t.Errorf("table has no %q:\n%s", want, table.String())
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, "json").Summary(flow.Summary{}, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	if want := `"without_ports":0`; !strings.Contains(js.String(), want) {
		t.Errorf("JSON summary has no %s (it is reported even when zero): %s", want, js.String())
	}
}

// TestRepliesWithoutRequestNamed: the connections seen by their replies
// alone, and those of them whose request came later, are said in a table
// line and counted in the JSON summary (replies_without_request even when
// zero); the table says nothing of them when there were none.
func TestRepliesWithoutRequestNamed(t *testing.T) {
	s := flow.Summary{RepliesWithoutRequest: 3, RequestedAfterReplies: 1}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Summary(s, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	if want := "Replies without request (connections seen by their replies alone, none of their requests: began before the run?; no flows): 3; 1 more until a request came (flows since)"; !strings.Contains(table.String(), want) {
		t.Errorf("table has no %q:\n%s", want, table.String())
	}
	table.Reset()
	if err := report.NewWriter(&table, "table").Summary(flow.Summary{}, nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(table.String(), "Replies without request") {
		t.Errorf("table names replies without request when there were none:\n%s", table.String())
	}
	for _, tc := range []struct {
		s    flow.Summary
		want []string
	}{
		{s, []string{`"replies_without_request":3`, `"requested_after_replies":1`}},
		{flow.Summary{}, []string{`"replies_without_request":0`}},
	} {
		var js bytes.Buffer
		if err := report.NewWriter(&js, "json").Summary(tc.s, nil, report.Run{}); err != nil {
			t.Fatal(err)
		}
		for _, want := range tc.want {
			if !strings.Contains(js.String(), want) {
				t.Errorf("JSON summary has no %s: %s", want, js.String())
			}
		}
	}
}

// TestBeganBeforeRunListed: flows seen from the middle of their connection
// are listed under the table's rows and carry began_before_run in JSON.
func TestBeganBeforeRunListed(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, BeganBeforeRun: true, Reply: true},
		{ID: 2, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, Reply: true},
	}
	var table bytes.Buffer
	if err := report.NewWriter(&table, "table").Flows(flows); err != nil {
		t.Fatal(err)
	}
	if want := "Connections that began before the run (no SYN, SYN-ACK or connect() seen; verdict from their packets only): flow 1\n"; !strings.Contains(table.String(), want) {
		t.Errorf("table has no %q:\n%s", want, table.String())
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, "json").Flows(flows); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(js.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"began_before_run":true`) || strings.Contains(lines[1], "began_before_run") {
		t.Errorf("JSON flows: want began_before_run true on the first only:\n%s", js.String())
	}
}

// TestICMPErrorInsteadOfReply: a flow answered by an ICMP error shows
// "icmp" as its reply, and the message and its sender are listed under the
// table (once for the flows they answered); JSON carries it as icmp_error.
func TestICMPErrorInsteadOfReply(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.99:8080")
	unreach := &flow.ICMPError{Message: "ICMP destination unreachable (code 0: net unreachable)", From: netip.MustParseAddr("10.244.8.1"), Point: "uplink"}
	flows := []flow.Flow{
		{ID: 6, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNowhere, ICMPError: unreach},
		{ID: 7, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNowhere, ICMPError: unreach},
		{ID: 8, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNowhere},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	rows := strings.Split(table.String(), "\n")
	for i, want := range []string{"icmp", "icmp", "no"} {
		if got := strings.Fields(rows[i+1]); got[len(got)-1] != want {
			t.Errorf("row %q: reply %q, want %q", rows[i+1], got[len(got)-1], want)
		}
	}
	if want := "  flows 6, 7: ICMP destination unreachable (code 0: net unreachable) from 10.244.8.1\n"; !strings.Contains(table.String(), want) {
		t.Errorf("the table does not list the ICMP error %q:\n%s", want, table.String())
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, report.FormatJSON).Flows(flows[:1]); err != nil {
		t.Fatal(err)
	}
	if want := `"icmp_error":{"message":"ICMP destination unreachable (code 0: net unreachable)","from":"10.244.8.1","point":"uplink"`; !strings.Contains(js.String(), want) {
		t.Errorf("JSON flow lacks %s: %s", want, js.String())
	}
}

// TestICMPErrorNotesListed: an ICMP error that reached the client quoting
// the backend, not the VIP (QuotedDst), is listed apart from the same
// message that quoted the VIP, saying what it quoted; one no capture point
// saw, known from a node's reject rule (FromRule), says so.
func TestICMPErrorNotesListed(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.10:53")
	be := netip.MustParseAddrPort("10.244.20.31:5353")
	unreach := flow.ICMPError{Message: "ICMP destination unreachable (code 3: port unreachable)", From: be.Addr(), Point: "uplink"}
	quoting := unreach
	quoting.QuotedDst = be
	fromRule := flow.ICMPError{Message: unreach.Message, From: netip.MustParseAddr("192.168.77.2"), FromRule: true}
	flows := []flow.Flow{
		{ID: 1, Proto: "udp", Service: svc, RewrittenAt: flow.PlaceTC, ICMPError: &quoting},
		{ID: 2, Proto: "udp", Service: svc, RewrittenAt: flow.PlaceNetfilter, ICMPError: &unreach},
		{ID: 3, Proto: "udp", Service: svc, RewrittenAt: flow.PlaceNowhere, ICMPError: &fromRule, NodeClient: true},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"  flow 1: ICMP destination unreachable (code 3: port unreachable) from 10.244.20.31, reaching the client quoting 10.244.20.31:5353, not the Service 10.120.0.10:53: no reverse NAT of the quoted header\n",
		"  flow 2: ICMP destination unreachable (code 3: port unreachable) from 10.244.20.31\n",
		"  flow 3: ICMP destination unreachable (code 3: port unreachable) from 192.168.77.2 (the node's filter rule's answer, through loopback: known from the rule, not captured)\n",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("the table does not list %q:\n%s", want, table.String())
		}
	}
}

// TestShortByKeepsWhatTellsFlowsApart: a long "by" in the flow table keeps
// a program's name and id and a chain's translating rule.
func TestShortByKeepsWhatTellsFlowsApart(t *testing.T) {
	for _, tc := range []struct{ by, want string }{
		{"tcx ingress lab_from_container (id 120524)", "tcx ingress lab_from_container (id 120524)"},
		{"connect4 lb (id 7) on /sys/fs/cgroup/unified/kubepods.slice/kubepods-besteffort.slice/lab-client", "connect4 lb (id 7) on …/lab-client"},
		{"connect4 cil_sock4_connect (id 1349) on /sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice", "connect4 cil_sock4_connect (id 1349)"},
		// A NAT rule: its source and table, and the chain that names the
		// Service; not the "dnat to" that BACKEND shows.
		{"nftables ip kube-proxy nat-prerouting -> services -> service-SUSTUHLJ-default/web/tcp/http -> endpoint-TUXOSQTE-default/web/tcp/http__10.244.20.31/3000 -> dnat to 10.244.20.31:3000",
			"nftables ip kube-proxy … service-SUSTUHLJ-default/web/tcp/http"},
		{"nftables ip kube-proxy nat-prerouting -> services -> nodeports -> external-SUSTUHLJ-default/web/tcp/http -> service-SUSTUHLJ-default/web/tcp/http -> endpoint-TUXOSQTE-default/web/tcp/http__10.244.20.31/3000 -> dnat to 10.244.20.31:3000",
			"nftables ip kube-proxy … service-SUSTUHLJ-default/web/tcp/http"},
		{"iptables-legacy nat PREROUTING -> KUBE-SERVICES -> KUBE-SVC-ERIFXISQEP7F7OF4 -> KUBE-SEP-AAAABBBBCCCCDDDD -> dnat to 10.244.20.31:3000",
			"iptables-legacy nat … KUBE-SVC-ERIFXISQEP7F7OF4"},
		{"iptables-legacy nat OUTPUT -> KUBE-SERVICES -> KUBE-SVL-ERIFXISQEP7F7OF4 -> KUBE-SEP-AAAABBBBCCCCDDDD -> dnat to 10.244.20.31:3000",
			"iptables-legacy nat … KUBE-SVL-ERIFXISQEP7F7OF4"},
		// A long Service name keeps its start; no kube-proxy chain: the rule's own.
		{"nftables ip kube-proxy nat-prerouting -> services -> service-ABCDEFGH-a-long-namespace/a-long-service-name/tcp/http -> endpoint-X -> dnat to 10.244.20.31:3000",
			"nftables ip kube-proxy … service-ABCDEFGH-a-long-namespace/a-lo…"},
		{"nftables ip custom prerouting -> to-backends -> pick-one-of-the-backends-of-this-service -> dnat to 10.244.20.31:3000",
			"nftables ip custom … pick-one-of-the-backends-of-this-service"},
		{"ipvs tcp [fd00:10:120::80]:8080 wrr -> [fd00:10:244:20::31]:3000", "ipvs tcp [fd00:10:120::80]:8080 wrr"},
	} {
		var buf bytes.Buffer
		f := flow.Flow{ID: 1, Proto: "tcp", Service: netip.MustParseAddrPort("10.120.0.80:80"), RewrittenAt: flow.PlaceNetfilter, By: tc.by}
		if err := report.WriteTable(&buf, []flow.Flow{f}, flow.Summary{}); err != nil {
			t.Fatal(err)
		}
		if row := strings.Split(buf.String(), "\n")[1]; !strings.Contains(row, tc.want+" ") {
			t.Errorf("by %q shows as\n%s\nwant %q", tc.by, row, tc.want)
		}
	}
}

// TestRefusedReply: a flow whose server answered with a RST instead of a
// SYN-ACK shows "rst" as its reply; JSON carries "refused":true.
func TestRefusedReply(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, Reply: true, Refused: true},
		{ID: 2, Proto: "tcp", Service: svc, RewrittenAt: flow.PlaceNetfilter, Reply: true},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	rows := strings.Split(table.String(), "\n")
	for i, want := range []string{"rst", "yes"} {
		if got := strings.Fields(rows[i+1]); got[len(got)-1] != want {
			t.Errorf("row %q: reply %q, want %q", rows[i+1], got[len(got)-1], want)
		}
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, report.FormatJSON).Flows(flows); err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(js.String(), `"refused":true`); got != 1 {
		t.Errorf(`JSON has %d "refused":true, want 1: %s`, got, js.String())
	}
}

// TestStrayRepliesListed: a flow without a reply to whose client the
// backend's address answered from another port is listed under the table
// with the answers' source; JSON carries stray_replies.
func TestStrayRepliesListed(t *testing.T) {
	stray := &flow.StrayReplies{From: netip.MustParseAddrPort("10.244.20.31:5354"), Packets: 3, Point: "pod"}
	flows := []flow.Flow{
		{ID: 4, Proto: "udp", Service: netip.MustParseAddrPort("10.120.0.10:53"), Backend: netip.MustParseAddrPort("10.244.20.31:5353"),
			RewrittenAt: flow.PlaceNetfilter, StrayReplies: stray},
		{ID: 5, Proto: "udp", Service: netip.MustParseAddrPort("10.120.0.10:53"), RewrittenAt: flow.PlaceNetfilter, Reply: true},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	if want := "  flow 4: 3 packets from 10.244.20.31:5354, not from 10.120.0.10:53 or 10.244.20.31:5353\n"; !strings.Contains(table.String(), want) {
		t.Errorf("the table does not list the stray replies %q:\n%s", want, table.String())
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, report.FormatJSON).Flows(flows[:1]); err != nil {
		t.Fatal(err)
	}
	if want := `"stray_replies":{"from":"10.244.20.31:5354","packets":3,"point":"pod"`; !strings.Contains(js.String(), want) {
		t.Errorf("JSON flow lacks %s: %s", want, js.String())
	}
}

// TestUntranslatedRepliesListed: a flow whose replies entered the client's
// Pod from the backend's address (not translated back to the VIP) shows no
// reply and is listed under the table with their source; JSON carries
// untranslated_replies.
func TestUntranslatedRepliesListed(t *testing.T) {
	u := &flow.StrayReplies{From: netip.MustParseAddrPort("10.244.1.11:8080"), Packets: 2, Point: "pod"}
	flows := []flow.Flow{
		{ID: 2, Proto: "tcp", Service: netip.MustParseAddrPort("10.96.0.50:80"), Backend: netip.MustParseAddrPort("10.244.1.11:8080"),
			RewrittenAt: flow.PlaceNetfilter, UntranslatedReplies: u},
		{ID: 3, Proto: "tcp", Service: netip.MustParseAddrPort("10.96.0.50:80"), RewrittenAt: flow.PlaceNetfilter, Reply: true},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	out := table.String()
	if want := "Replies not translated back to the VIP"; !strings.Contains(out, want) {
		t.Errorf("the table lacks %q:\n%s", want, out)
	}
	if want := "  flow 2: 2 packets from 10.244.1.11:8080, not from 10.96.0.50:80\n"; !strings.Contains(out, want) {
		t.Errorf("the table does not list the untranslated replies %q:\n%s", want, out)
	}
	if strings.Contains(out, "  flow 3:") {
		t.Errorf("the table lists flow 3, whose replies were translated:\n%s", out)
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, report.FormatJSON).Flows(flows[:1]); err != nil {
		t.Fatal(err)
	}
	if want := `"untranslated_replies":{"from":"10.244.1.11:8080","packets":2,"point":"pod"`; !strings.Contains(js.String(), want) {
		t.Errorf("JSON flow lacks %s: %s", want, js.String())
	}
}

// TestWriterErr: a write error of the tables' many small writes is kept,
// so the caller learns at the end that the report was lost.
func TestWriterErr(t *testing.T) {
	for _, format := range []string{report.FormatTable, report.FormatJSON} {
		rw := report.NewWriter(failingWriter{}, format)
		rw.Node(map[string]any{"kernel": "x"}, func(w io.Writer) { fmt.Fprintln(w, "node") })
		rw.Flows(nil)
		rw.Summary(flow.Summary{}, nil, report.Run{})
		if !errors.Is(rw.Err(), syscall.ENOSPC) {
			t.Errorf("%s: Err() = %v, want ENOSPC", format, rw.Err())
		}
	}
	if err := report.NewWriter(io.Discard, report.FormatTable).Err(); err != nil {
		t.Errorf("no write yet: Err() = %v", err)
	}
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, syscall.ENOSPC }

// TestUnansweredOnNodeExplained: a rewritten flow that got no answer and
// never reached the uplink (a qdisc on the uplink dropped it) has its reason
// under the flows, as the nowhere and unknown ones do: its row alone reads
// as a backend that does not answer. One that left the uplink, or was
// answered, is not listed.
func TestUnansweredOnNodeExplained(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	be := netip.MustParseAddrPort("10.244.20.31:3000")
	vlan, untagged := uint16(200), uint16(0)
	lost := "VIP 10.120.0.80:80 at netfilter before NAT, backend 10.244.20.31:3000 at netfilter after NAT; no answer, and the uplink TX (captured) never saw the request after its rewrite"
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: lost},
		{ID: 2, Proto: "tcp", Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: "left", VLAN: &vlan, UplinkDstMAC: "02:00:0a:f4:08:01"},
		{ID: 3, Proto: "tcp", Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: "answered", Reply: true},
		{ID: 4, Proto: "tcp", Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: "data lost", Reply: true, VLAN: &vlan, LostOnNode: 6},
		{ID: 5, Proto: "tcp", Service: svc, Backend: be, RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: "replies lost", VLAN: &vlan, RepliesLostOnNode: 2},
		// An outside client's request to a NodePort: its VLAN is the one it
		// came in on, and it never left after its rewrite.
		{ID: 6, Proto: "tcp", Client: netip.MustParseAddrPort("172.16.0.5:40000"), Service: netip.MustParseAddrPort("192.168.88.1:31080"), Backend: be,
			RewrittenAt: flow.PlaceNetfilter, By: "nft", Reason: "outside client's lost", VLAN: &untagged},
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	out := table.String()
	if want := "Rewritten, not all sent out or no reply:\n  flow 1: " + lost + "\n"; !strings.Contains(out, want) {
		t.Errorf("the table does not explain flow 1 (want %q):\n%s", want, out)
	}
	// Its SYN got through and was answered, its data did not leave.
	if want := "  flow 4: data lost\n"; !strings.Contains(out, want) {
		t.Errorf("the table does not explain flow 4, which lost packets on the node (want %q):\n%s", want, out)
	}
	// It left the uplink and was answered there; the answers never reached
	// the client's Pod.
	if want := "  flow 5: replies lost\n"; !strings.Contains(out, want) {
		t.Errorf("the table does not explain flow 5, whose replies the node lost (want %q):\n%s", want, out)
	}
	if want := "  flow 6: outside client's lost\n"; !strings.Contains(out, want) {
		t.Errorf("the table does not explain flow 6, an outside client's request that never left the node after its rewrite (want %q):\n%s", want, out)
	}
	if strings.Contains(out, "flow 2:") || strings.Contains(out, "flow 3:") {
		t.Errorf("the table explains a flow that left the uplink or was answered:\n%s", out)
	}
}

// TestKernelDropsListed: the flows' packets the kernel dropped are listed
// under the table's rows with their reason and function, and in JSON as
// kernel_drops; a flow whose replies the kernel dropped reads REPLY no.
func TestKernelDropsListed(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/kernel-drops.json")
	if err != nil {
		t.Fatal(err)
	}
	flows := s.Run(nil).Flows()
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"Dropped by the kernel",
		"  flow 1: 2 reply packets, NETFILTER_DROP in nft_do_chain [nf_tables] (netns 4026531840, ifindex 5)\n",
		"  flow 2: 1 request packet, NETFILTER_DROP in nft_do_chain [nf_tables] (netns 4026531840, ifindex 4)\n",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, table.String())
		}
	}
	if row := strings.Fields(strings.Split(table.String(), "\n")[1]); row[0] != "1" || row[len(row)-1] != "no" {
		t.Errorf("flow 1's row %v: want REPLY no", row)
	}
	var js bytes.Buffer
	if err := report.NewWriter(&js, report.FormatJSON).Flows(flows[:1]); err != nil {
		t.Fatal(err)
	}
	if want := `"kernel_drops":[{"direction":"reply","count":2,"reason":"NETFILTER_DROP","function":"nft_do_chain [nf_tables]","netns":4026531840,"ifindex":5,`; !strings.Contains(js.String(), want) {
		t.Errorf("JSON flow lacks %s: %s", want, js.String())
	}
}

// TestSameFateOneLine: the lists under the rows give the flows that met one
// same fate in one line, as the reasons do, three ids or more in a row as a
// range: an incident's many dropped requests, stray or untranslated replies
// read at a glance.
func TestSameFateOneLine(t *testing.T) {
	drop := flow.KernelDrop{Direction: "request", Count: 1, Reason: "NETFILTER_DROP", Function: "nft_do_chain", NetNS: 4026531840, Ifindex: 2}
	from := netip.MustParseAddrPort("10.244.20.31:3000")
	var flows []flow.Flow
	for _, id := range []int{5, 1, 2, 3, 6} {
		flows = append(flows, flow.Flow{ID: id, Proto: "tcp",
			Client:              netip.MustParseAddrPort(fmt.Sprintf("10.244.8.23:%d", 40000+id)),
			Service:             netip.MustParseAddrPort("10.120.0.80:80"),
			RewrittenAt:         flow.PlaceNetfilter,
			KernelDrops:         []flow.KernelDrop{drop},
			UntranslatedReplies: &flow.StrayReplies{Packets: 2, From: from},
		})
	}
	var table bytes.Buffer
	if err := report.WriteTable(&table, flows, flow.Summary{}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"  flows 1-3, 5, 6: 1 request packet, NETFILTER_DROP in nft_do_chain (netns 4026531840, ifindex 2)\n",
		"  flows 1-3, 5, 6: 2 packets from 10.244.20.31:3000, not from 10.120.0.80:80\n",
	} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, table.String())
		}
	}
}

// TestBackendsSummaryDroppedAfterTCRewrite: flows whose requests a tc
// program rewrote and the kernel then dropped on the node (at the host
// veth's tc ingress, at the uplink's tc egress) are counted at tc, by the
// program, for the backend the dropped requests went to, as unsent: no
// request reached that backend, which the summary must not blame.
func TestBackendsSummaryDroppedAfterTCRewrite(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/kernel-drops-request-after-tc-rewrite.json")
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	var b bytes.Buffer
	w := report.NewWriter(&b, report.FormatTable)
	if err := w.Flows(e.Flows()); err != nil {
		t.Fatal(err)
	}
	if err := w.Summary(e.Summary(), nil, report.Run{}); err != nil {
		t.Fatal(err)
	}
	_, summary, _ := strings.Cut(b.String(), "REWRITTEN AT  FLOWS")
	for _, want := range []string{
		"tc            2      tcx ingress lb_from_pod (id 80)  (flows 1, 2)\n",
		"10.78.0.8:5353  1      unsent 1  <- no request reached it: the node dropped them on their way out\n",
		"10.78.0.8:8080  1      unsent 1  <- no request reached it: the node dropped them on their way out\n",
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
}
