package incident

import (
	"bytes"
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/report"
)

var update = flag.Bool("update", false, "rewrite the golden files")

func vlan(v uint16) *uint16 { return &v }

// summaryFlows is one incident's flows: three socket-LB'd requests from one
// client, one per other verdict, a DNS flow load-balanced over two backends,
// and one a sidecar proxy's redirect kept in its Pod.
func summaryFlows() []flow.Flow {
	ap := netip.MustParseAddrPort
	at := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	socket := func(id int, port uint16) flow.Flow {
		return flow.Flow{ID: id, Proto: "tcp", Client: netip.AddrPortFrom(netip.MustParseAddr("10.244.8.23"), port),
			Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.31:3000"), RewrittenAt: flow.PlaceSocket,
			By:     "connect4 lab_sock4_connect (id 41) on /sys/fs/cgroup/unified/lab-client",
			Reason: "VIP 10.120.0.80:80 at the app's request (sockaddr), backend 10.244.20.31:3000 at the socket (sockaddr)",
			VLAN:   vlan(200), UplinkDstMAC: "02:00:0a:f4:08:01", UplinkDstIsGateway: true, Reply: true, First: at, Last: at}
	}
	return []flow.Flow{
		socket(1, 40020), socket(2, 40021),
		{ID: 3, Proto: "tcp", Client: ap("10.244.8.23:40022"), Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceTC, By: "tcx ingress lab_lb_ingress (id 52)",
			Reason: "VIP 10.120.0.80:80 at tc head ingress, backend 10.244.20.31:3000 at netfilter before NAT",
			VLAN:   vlan(200), UplinkDstMAC: "02:00:0a:f4:08:01", UplinkDstIsGateway: true, Reply: true},
		{ID: 4, Proto: "udp", Client: ap("10.244.8.23:51020"), Service: ap("10.120.0.10:53"), Backend: ap("10.244.20.31:5353"),
			Backends:    []netip.AddrPort{ap("10.244.20.31:5353"), ap("10.244.20.32:5353")},
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy service-dns -> endpoint-1 dnat to 10.244.20.31:5353",
			Reason: "VIP at netfilter before NAT, backend after NAT", VLAN: vlan(0), UplinkDstMAC: "02:00:0a:f4:08:99", Reply: true},
		socket(5, 40023),
		{ID: 6, Proto: "tcp", Client: ap("10.244.8.23:40024"), Service: ap("10.120.0.99:8080"), RewrittenAt: flow.PlaceNowhere,
			Reason: "the uplink saw the VIP 10.120.0.99:8080 as destination", VLAN: vlan(200), UplinkDstMAC: "02:00:0a:f4:08:01",
			UplinkDstIsGateway: true, ICMPError: &flow.ICMPError{Message: "ICMP destination unreachable (code 0: net unreachable)",
				From: netip.MustParseAddr("10.244.8.1"), Point: "uplink", At: at}},
		{ID: 7, Proto: "tcp", Client: ap("10.244.8.23:40025"), Service: ap("10.120.0.80:80"), RewrittenAt: flow.PlaceUnknown,
			Reason: "the VIP was last seen at pod eth0 TX; no rewrite observed and the uplink never saw this flow"},
		// Nothing listens on the backend's port: it answered with a RST.
		{ID: 9, Proto: "tcp", Client: ap("10.244.8.23:40027"), Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.33:3000"),
			RewrittenAt: flow.PlaceTC, By: "tcx ingress lab_lb_ingress (id 52)",
			Reason: "VIP 10.120.0.80:80 at tc head ingress, backend 10.244.20.33:3000 at netfilter before NAT",
			VLAN:   vlan(200), UplinkDstMAC: "02:00:0a:f4:08:01", UplinkDstIsGateway: true, Reply: true, Refused: true},
		// The backend answers from another port than it was asked on.
		{ID: 10, Proto: "udp", Client: ap("10.244.8.23:51022"), Service: ap("10.120.0.10:53"), Backend: ap("10.244.20.31:5353"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy service-dns -> endpoint-1 dnat to 10.244.20.31:5353",
			Reason: "VIP at netfilter before NAT, backend after NAT", VLAN: vlan(0), UplinkDstMAC: "02:00:0a:f4:08:99",
			StrayReplies: &flow.StrayReplies{From: ap("10.244.20.31:5354"), Packets: 2, Point: "pod", At: at}},
		// A sidecar proxy's redirect in the Pod: it never leaves the Pod.
		{ID: 8, Proto: "tcp", Client: ap("10.244.8.23:40026"), Service: ap("10.120.0.80:80"), Backend: ap("127.0.0.1:15001"),
			RewrittenAt: flow.PlaceNetfilter, By: flow.ByClientNetfilter,
			Reason: "VIP 10.120.0.80:80 at the socket tuple (sockstate), backend 127.0.0.1:15001 at the socket's first packet (sockegress)"},
		// A Service without endpoints: kube-proxy's filter rejects it on
		// the node; it never reaches the uplink.
		{ID: 11, Proto: "tcp", Client: ap("10.244.8.23:40028"), Service: ap("10.120.0.60:80"), RewrittenAt: flow.PlaceNowhere,
			Reason: "not rewritten: 10.120.0.60:80 was still the destination after netfilter's NAT (no DNAT applied), and the node's filter ends it: nftables ip kube-proxy filter-forward -> service-endpoints-check -> reject (\"default/empty:http has no endpoints\")",
			ICMPError: &flow.ICMPError{Message: "ICMP destination unreachable (code 3: port unreachable)",
				From: netip.MustParseAddr("10.244.8.1"), Point: "pod", At: at}},
		// A backend Pod on the client's bridge answers it straight over
		// the bridge (bridge-nf-call-iptables 0): untranslated.
		{ID: 12, Proto: "tcp", Client: ap("10.244.8.23:40029"), Service: ap("10.120.0.80:80"), Backend: ap("10.244.8.30:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy service-web -> endpoint-2 dnat to 10.244.8.30:3000",
			Reason:              "VIP at netfilter before NAT, backend after NAT",
			UntranslatedReplies: &flow.StrayReplies{From: ap("10.244.8.30:3000"), Packets: 3, Point: "pod", At: at}},
	}
}

func summaryNode() *discover.NodeInfo {
	yes, no := true, false
	return &discover.NodeInfo{
		Kernel:    "6.18.44",
		HostNetNS: discover.NetNS{Path: "/proc/self/ns/net", Inode: 4026531840},
		Pods: []discover.Pod{{
			NetNS: discover.NetNS{Path: "/run/netns/lab-pod"}, NSName: "lab-pod",
			Eth0:    discover.Iface{Name: "eth0", Kind: "veth", Addrs: []netip.Prefix{netip.MustParsePrefix("10.244.8.23/22")}},
			Gateway: netip.MustParseAddr("10.244.8.1"), GatewayMAC: "02:00:0a:f4:08:01",
			HostPeer: &discover.HostPeer{Iface: discover.Iface{Name: "veth-a"}, Master: "br-pod", MasterKind: "bridge"},
			Uplinks:  []string{"bond0"}, UplinkHow: "bridge FDB: the gateway MAC is learned on bond0",
		}},
		CapturePoints: []discover.CapturePoint{
			{Role: "pod", Ifname: "eth0", Kind: "veth"}, {Role: "host", Ifname: "veth-a", Kind: "veth"},
			{Role: "uplink", Ifname: "bond0", Kind: "veth"},
		},
		SockPrograms: []discover.SockProgram{{Attach: "connect4", Name: "lab_sock4_connect", ID: 41, Cgroup: "/sys/fs/cgroup/unified/lab-client"}},
		SockCgroup:   "/sys/fs/cgroup/unified/lab-client",
		TCPrograms: []discover.TCProgram{{Ifname: "veth-a", Dir: "ingress", Via: "tcx", Name: "lab_lb_ingress", ID: 52},
			{Ifname: "bond0", Dir: "egress", Via: "u32", Name: "pref 10", Action: "nat ingress 10.120.0.99/32 -> 10.244.20.40", Rewrites: netip.MustParsePrefix("10.120.0.99/32")}},
		Netfilter: discover.Netfilter{BridgeNFCallIPTables: &yes, IPForward: &no, Rules: []discover.NATRule{{
			Source: "nftables", Table: "ip kube-proxy", Hook: "prerouting", Service: netip.MustParseAddr("10.120.0.10"),
			Chains: []string{"nat-prerouting", "services", "service-dns"}, Backend: netip.MustParseAddrPort("10.244.20.31:5353")}},
			DeviceChains: []discover.DeviceChain{{Family: "netdev", Table: "lb", Chain: "in", Hook: "ingress", Devices: []string{"veth-a"}, Priority: -500,
				Rewrites: []discover.NATRule{{Source: "nftables", Table: "netdev lb", Hook: "ingress", Service: netip.MustParseAddr("10.120.0.99"),
					Chains: []string{"in"}, Note: "? (a map's or an expression's value: not decoded)"}}}},
			BackendDrops: []discover.NATRule{{Source: "nftables", Table: "ip filter", Hook: "forward", Service: netip.MustParseAddr("10.244.20.31"),
				Chains: []string{"FORWARD", "KUBE-ROUTER-FORWARD", "KUBE-POD-FW-WEB"}, Verdict: "reject", Comment: "rule to REJECT traffic destined for POD name:web"}},
			// Flow 11's Service, without endpoints.
			Rejects: []discover.NATRule{{Source: "nftables", Table: "ip kube-proxy", Hook: "forward", Service: netip.MustParseAddr("10.120.0.60"), Port: 80, Proto: "tcp",
				Chains: []string{"filter-forward", "service-endpoints-check"}, Verdict: "reject", RejectWith: "icmp-port-unreachable", Comment: "default/empty:http has no endpoints", AfterNAT: true}}},
		ServicesWithoutNAT: []string{"10.120.0.80", "10.120.0.60"},
		Notes:              []string{"IPVS not checked: /proc/net/ip_vs absent"},
	}
}

func summarySummary() flow.Summary {
	return flow.Summary{
		Flows: 8,
		RewrittenAt: map[flow.Place]int{flow.PlaceSocket: 3, flow.PlaceTC: 1, flow.PlaceNetfilter: 2,
			flow.PlaceNowhere: 1, flow.PlaceUnknown: 1},
		Drops:        map[string]uint64{"flows_over_max": 0, "pod_kernel_drops": 2},
		Unmatched:    4,
		Observations: map[string]uint64{"uplink": 30, "pod": 42, "host": 40},
	}
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -update creates it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file (go test -update rewrites it):\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestSummaryGolden(t *testing.T) {
	dir := t.TempDir()
	m := Manifest{Notes: []string{"ovs.txt: flows of OVS bridge br-int not read: timeout"}}
	if err := m.Write(dir); err != nil {
		t.Fatal(err)
	}
	if err := WriteSummary(dir, summaryFlows(), summarySummary(), summaryNode(), "duration", Ended{}, Taken{Version: "pathtrace v1.2.3", Command: "pathtrace incident --svc 10.120.0.80 --out /var/tmp/inc-42"}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, SummaryFile))
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "SUMMARY.golden.md", got)
}

func TestSummaryWithoutFlowsOrManifest(t *testing.T) {
	dir := t.TempDir()
	s := flow.Summary{Drops: map[string]uint64{"pod_kernel_drops": 0}}
	if err := WriteSummary(dir, nil, s, nil, "interrupted", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{"No flow to a Service VIP was seen", "Capture stopped: interrupted.",
		"The capture lost nothing", "## Notes\n\nNone: every source was read."} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummaryNamesLossesAndEndedCaptures: the capture's own losses (kernel
// drops of a tap, as the caller adds them to the engine's) and a capture
// point that ended early are stated, never "nothing was lost".
func TestSummaryNamesLossesAndEndedCaptures(t *testing.T) {
	dir := t.TempDir()
	s := flow.Summary{Drops: map[string]uint64{"flows_over_max": 0}}.WithDrops(map[string]uint64{"uplink:bond0 kernel_drops": 12})
	ended := Ended{Captures: map[string]string{"pod:eth0@10.0.0.5": "ended at 03:12:09: capture pod eth0: socket error: network is down"},
		Gaps:       map[string]string{"uplink:bond0": "went down once (first at 03:12:05.000), 1.2 s in all"},
		NATRules:   "read again at 03:12:07 (flows reached backends that no rule read before named): 2 rule(s) or IPVS service(s) appeared, 0 went",
		TCPrograms: []string{"at 03:12:07 on veth-a (host veth #2): tcx ingress lab_from_container (id 52) went"},
		CPUWait:    report.NewCPUWait(2500*time.Millisecond, 310*time.Millisecond)}
	if err := WriteSummary(dir, nil, s, nil, "duration", ended, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{"Lost: uplink:bond0 kernel_drops 12.", "--buffer-size",
		"The capture at pod:eth0@10.0.0.5 ended at 03:12:09: capture pod eth0: socket error: network is down: later frames there are missing.",
		"The interface of uplink:bond0 went down once (first at 03:12:05.000), 1.2 s in all: nothing crossed it meanwhile, and its capture went on.",
		"The NAT rules changed during the capture: read again at 03:12:07",
		"- The tc programs changed during the capture: at 03:12:07 on veth-a (host veth #2): tcx ingress lab_from_container (id 52) went.\n",
		"  - Meanwhile pathtrace's threads waited for a CPU while runnable (the kernel's run_delay): one of them 310ms within one second at most, 2.5s in all."} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(string(got), "The capture lost nothing") {
		t.Errorf("summary says nothing was lost:\n%s", got)
	}

	// Every counter zero, but the observers' reader ended: not "nothing was
	// lost" either.
	ended = Ended{Observers: "ended at 03:12:10: read ring buffer: bad address"}
	if err := WriteSummary(dir, nil, flow.Summary{Drops: map[string]uint64{"flows_over_max": 0}}, nil, "duration", ended, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "The observers' events ended at 03:12:10: read ring buffer: bad address: later flows lack"; !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
	if strings.Contains(string(got), "The capture lost nothing") {
		t.Errorf("summary says nothing was lost:\n%s", got)
	}
}

// TestSummaryCaptureFileEnded: a capture file that filled its share of
// the budget while the run went on is said in plain words, with what to
// change, and never as "nothing was lost".
func TestSummaryCaptureFileEnded(t *testing.T) {
	s := flow.Summary{Drops: map[string]uint64{"flows_over_max": 0}}
	file := &FileEnded{Share: 655_360, Budget: 1 << 20, After: 3140 * time.Millisecond, Run: 20 * time.Second, Written: 1075, Captured: 5403}
	for _, c := range []struct {
		lowered bool
		want    string
	}{
		{false, "- The capture file filled its share (655,360 bytes of --max-bytes 1,048,576) after 3.1 s of the 20.0 s run: " +
			"it holds 1,075 of the 5,403 frames captured; the verdicts cover the whole run. Raise --max-bytes to keep more.\n"},
		{true, "- The capture file filled its share (655,360 bytes of --max-bytes, lowered to 1,048,576: half of what the disk had free) after 3.1 s of the 20.0 s run: " +
			"it holds 1,075 of the 5,403 frames captured; the verdicts cover the whole run. Give --out a filesystem with more free space to keep more.\n"},
	} {
		dir := t.TempDir()
		file.LoweredToFitDisk = c.lowered
		if err := WriteSummary(dir, nil, s, nil, "duration", Ended{File: file}, Taken{}); err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
		for _, want := range []string{c.want, "Capture stopped: duration; the capture file filled after 3.1 s (see What was captured).\n",
			"- Every drop counter is zero, but what follows ended early.\n"} {
			if !strings.Contains(string(got), want) {
				t.Errorf("summary lacks %q:\n%s", want, got)
			}
		}
		if strings.Contains(string(got), "The capture lost nothing") {
			t.Errorf("summary says nothing was lost although the file left frames out:\n%s", got)
		}
	}
}

// TestSummaryNotesHeading: the node's notes that are no read failure (a
// second pathtrace) come under a heading that does not call them one.
func TestSummaryNotesHeading(t *testing.T) {
	dir := t.TempDir()
	node := &discover.NodeInfo{Notes: []string{"another pathtrace runs on this node: 3 of its observer programs were found, and left out of attribution"}}
	if err := WriteSummary(dir, nil, flow.Summary{}, node, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "## Notes\n\n- another pathtrace runs on this node"; !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
	if strings.Contains(string(got), "could not be read") {
		t.Errorf("summary calls its notes read failures:\n%s", got)
	}
}

func TestSummaryBoundsGroupsAndIDs(t *testing.T) {
	var flows []flow.Flow
	for i := range maxSummaryGroups + 5 {
		flows = append(flows, flow.Flow{ID: i + 1, Proto: "tcp", RewrittenAt: flow.PlaceNowhere,
			Client:  netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 1),
			Service: netip.MustParseAddrPort("10.120.0.80:80")})
	}
	for i := range 25 {
		flows = append(flows, flow.Flow{ID: 1000 + i, Proto: "udp", RewrittenAt: flow.PlaceSocket,
			Client: netip.MustParseAddrPort("10.9.9.9:1"), Service: netip.MustParseAddrPort("10.120.0.10:53")})
	}
	dir := t.TempDir()
	if err := WriteSummary(dir, flows, flow.Summary{Flows: len(flows)}, nil, "max-flows", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if n := strings.Count(string(got), "\n- "); n > maxSummaryGroups+1+3 {
		t.Errorf("%d bullet lines, want at most %d groups", n, maxSummaryGroups)
	}
	for _, want := range []string{"25 UDP flows from 10.9.9.9", "flows 1000, 1001", "and 15 more)", "more groups of flows: see the JSON report"} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummarySaysFlowsNotFollowed: five minutes of churn put 76,586 of
// 80,683 flows beyond --max-flows; "In all 4096 flows" must not read as
// all there was.
func TestSummarySaysFlowsNotFollowed(t *testing.T) {
	flows := []flow.Flow{{ID: 1, Proto: "tcp", RewrittenAt: flow.PlaceTC,
		Client: netip.MustParseAddrPort("10.244.8.23:40000"), Service: netip.MustParseAddrPort("10.120.0.80:80")}}
	for over, want := range map[uint64]string{
		0:     "In all 1 flow: 1 tc.\n",
		1:     "In all 1 flow: 1 tc. 1 more was not followed (beyond --max-flows): no verdict, in no count above.\n",
		76586: "In all 1 flow: 1 tc. 76,586 more were not followed (beyond --max-flows)",
	} {
		dir := t.TempDir()
		s := flow.Summary{Flows: 1, RewrittenAt: map[flow.Place]int{flow.PlaceTC: 1}, Drops: map[string]uint64{flow.DropFlowsOverMax: over}}
		if err := WriteSummary(dir, flows, s, nil, "duration", Ended{}, Taken{}); err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
		if !strings.Contains(string(got), want) {
			t.Errorf("flows_over_max %d: summary lacks %q:\n%s", over, want, got)
		}
	}
}

// TestSummaryNamesPacketsLostOnTheNode: a flow some of whose request
// packets never left the uplink (a dropping qdisc there) says so in the
// ticket's words; the capture's counters being zero is not "nothing lost".
func TestSummaryNamesPacketsLostOnTheNode(t *testing.T) {
	dir := t.TempDir()
	vlan := uint16(200)
	flows := []flow.Flow{{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40099"), Service: netip.MustParseAddrPort("10.120.0.80:80"),
		Backend: netip.MustParseAddrPort("10.244.20.31:3000"), RewrittenAt: flow.PlaceNetfilter, By: "nft", Reply: true, VLAN: &vlan, LostOnNode: 3}}
	s := flow.Summary{Flows: 1, Drops: map[string]uint64{"uplink:bond0 kernel_drops": 0}}
	if err := WriteSummary(dir, flows, s, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{"3 of its request packets that reached the host veth never left the uplink",
		"they count pathtrace's own losses; packets the node dropped are said with their flows"} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummaryNamesRequestsDroppedAfterRewrite: a flow whose requests a tc
// program rewrote and the kernel dropped on the node before the uplink's
// capture saw any (not_sent, nothing lost after that capture) says the
// requests never left, not that the uplink's device dropped what its
// capture saw.
func TestSummaryNamesRequestsDroppedAfterRewrite(t *testing.T) {
	dir := t.TempDir()
	flows := []flow.Flow{{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40099"), Service: netip.MustParseAddrPort("10.120.0.80:80"),
		Backend: netip.MustParseAddrPort("10.244.20.31:3000"), RewrittenAt: flow.PlaceTC, By: "tcx ingress lb (id 7)", NotSent: true,
		KernelDrops: []flow.KernelDrop{{Direction: "request", Count: 2, Reason: "TC_INGRESS", NetNS: 4026531840, Ifindex: 3}}}}
	if err := WriteSummary(dir, flows, flow.Summary{Flows: 1}, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "it was never seen on the uplink; none of its requests left the node: the kernel dropped every one on the node after its rewrite"; !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
	if strings.Contains(string(got), "the uplink's capture saw") {
		t.Errorf("summary says the uplink's capture saw requests it never saw:\n%s", got)
	}
}

// TestSummaryNamesRepliesLostOnTheNode: a flow whose backend answered on
// the uplink while nothing reached the client's Pod says so, rather than
// "no reply came back" (the backend did answer).
func TestSummaryNamesRepliesLostOnTheNode(t *testing.T) {
	dir := t.TempDir()
	vlan := uint16(305)
	flows := []flow.Flow{{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("172.18.9.66:49842"), Service: netip.MustParseAddrPort("192.168.200.15:8080"),
		Backend: netip.MustParseAddrPort("100.64.99.21:8080"), RewrittenAt: flow.PlaceNetfilter, By: "nft", VLAN: &vlan, RepliesLostOnNode: 2}}
	s := flow.Summary{Flows: 1, Drops: map[string]uint64{"uplink:eth1 kernel_drops": 0}}
	if err := WriteSummary(dir, flows, s, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	want := "its backend answered, but none of the replies that came in on the uplink reached the client's Pod"
	if !strings.Contains(string(got), want) || strings.Contains(string(got), "no reply came back") {
		t.Errorf("summary lacks %q (or says no reply came back):\n%s", want, got)
	}
}

// TestSummaryNamesKernelDrops: replies the kernel dropped are named with
// their reason and function, not read as "no reply came back".
func TestSummaryNamesKernelDrops(t *testing.T) {
	dir := t.TempDir()
	flows := []flow.Flow{{ID: 1, Proto: "udp", Client: netip.MustParseAddrPort("10.244.8.23:40000"), Service: netip.MustParseAddrPort("10.120.0.10:53"),
		Backend: netip.MustParseAddrPort("10.244.20.31:5353"), RewrittenAt: flow.PlaceNetfilter, By: "nft",
		KernelDrops: []flow.KernelDrop{{Direction: "reply", Count: 2, Reason: "NETFILTER_DROP", Function: "nft_do_chain [nf_tables]", NetNS: 4026531840, Ifindex: 5}}}}
	s := flow.Summary{Flows: 1, Drops: map[string]uint64{}}
	if err := WriteSummary(dir, flows, s, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{
		"its backend answered, but the kernel dropped the replies before any reached the client: NETFILTER_DROP in nft_do_chain [nf_tables]",
		"  - Dropped by the kernel (flow 1): 2 reply packets, NETFILTER_DROP in nft_do_chain [nf_tables] (netns 4026531840, ifindex 5)\n",
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(string(got), "no reply came back") {
		t.Errorf("summary says no reply came back:\n%s", got)
	}
}

// TestSummaryConnectionsBeforeTheCapture: connections seen by their replies
// alone (and those whose request came later), and flows that began before
// the capture, are said in plain words.
func TestSummaryConnectionsBeforeTheCapture(t *testing.T) {
	dir := t.TempDir()
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40100"), Service: svc, RewrittenAt: flow.PlaceNetfilter, BeganBeforeRun: true, Reply: true,
			Reason: "the connection began before the run: ..."},
		{ID: 2, Proto: "tcp", Client: netip.MustParseAddrPort("10.244.8.23:40101"), Service: svc, RewrittenAt: flow.PlaceNetfilter, Reply: true},
	}
	s := flow.Summary{Flows: 2, RewrittenAt: map[flow.Place]int{flow.PlaceNetfilter: 2}, Drops: map[string]uint64{"flows_over_max": 0},
		RepliesWithoutRequest: 3, RequestedAfterReplies: 1}
	if err := WriteSummary(dir, flows, s, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{
		"1 connection (flow 1) began before the capture: its handshake and connect() were not seen, and its verdict rests on its packets alone.",
		"- 3 connections were seen by their replies alone, none of their requests (begun before the capture?): no verdict, in no flow (replies_without_request).",
		"- 1 connection was seen by its replies alone until a request came: a flow since (requested_after_replies).",
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummaryServicesTracedFromFlags: "Services traced" names every Service
// the run traced (--svc, as the node block has them), also those no flow
// reached: the one without traffic is often what the ticket is about.
func TestSummaryServicesTracedFromFlags(t *testing.T) {
	dir := t.TempDir()
	node := summaryNode()
	node.Services = []string{"10.120.0.80:80/tcp", "10.96.0.10:53/udp"}
	flows := summaryFlows()[:1] // to 10.120.0.80:80 only
	if err := WriteSummary(dir, flows, summarySummary(), node, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "Services traced: 10.120.0.80:80/tcp, 10.96.0.10:53/udp."; !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
	if err := WriteSummary(dir, nil, flow.Summary{}, node, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "Services traced: 10.120.0.80:80/tcp, 10.96.0.10:53/udp."; !strings.Contains(string(got), want) {
		t.Errorf("summary of a run without flows lacks %q:\n%s", want, got)
	}
}

// scenarioSummary runs a flow scenario of testdata/flows and writes its
// SUMMARY.md: the flows, and the summary's text.
func scenarioSummary(t *testing.T, scenario string) ([]flow.Flow, string) {
	t.Helper()
	s, err := flowtest.Load(filepath.Join("../../testdata/flows", scenario))
	if err != nil {
		t.Fatal(err)
	}
	e := s.Run(nil)
	flows := e.Flows()
	dir := t.TempDir()
	if err := WriteSummary(dir, flows, e.Summary(), nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, SummaryFile))
	if err != nil {
		t.Fatal(err)
	}
	return flows, string(b)
}

// TestSummaryTCPlaceIsWhereItsProgramIs: a flow placed at tc by a program on
// the uplink (an outside client's NodePort, Cilium's bpf_host) or on the
// Pod's own eth0 was not rewritten "on the host side of the pod's veth":
// SUMMARY.md must not say so when the flow's own `by` names another device.
func TestSummaryTCPlaceIsWhereItsProgramIs(t *testing.T) {
	for _, c := range []struct{ scenario, on string }{
		{"tc-uplink-ingress-nodeport.json", "on the uplink"},
		{"tc-uplink-egress-dnat.json", "on the uplink"},
		{"tc-pod-eth0-egress.json", "on the Pod's eth0"},
	} {
		flows, b := scenarioSummary(t, c.scenario)
		checked := 0
		for _, f := range flows {
			if f.RewrittenAt != flow.PlaceTC || !strings.HasSuffix(f.By, c.on) || strings.HasPrefix(f.By, "one of") {
				continue
			}
			checked++
			for _, line := range strings.Split(b, "\n") {
				if strings.HasPrefix(line, "- ") && strings.Contains(line, " by "+f.By+";") && strings.Contains(line, "host side of the pod's veth") {
					t.Errorf("%s: flow %d was rewritten by %q, but SUMMARY.md says:\n%s", c.scenario, f.ID, f.By, line)
				}
			}
		}
		if checked == 0 {
			t.Errorf("%s: no flow placed at tc by a program %s", c.scenario, c.on)
		}
	}
}

// TestSummaryRejectedOutsideRequestNeverLeftTheUplink: an outside client's
// NodePort requests that came in on the uplink and that the node rejected
// (no endpoints) or reset itself never left the uplink again: their VLAN is
// the one they came in on. SUMMARY.md must not say they left the uplink with
// the VIP still as destination, which their flows contradict.
func TestSummaryRejectedOutsideRequestNeverLeftTheUplink(t *testing.T) {
	flows, b := scenarioSummary(t, "netfilter-nodeport-no-endpoints-external.json")
	checked := 0
	for _, f := range flows {
		if f.VLAN == nil {
			continue
		}
		for _, p := range f.Points {
			if p.Point == "uplink" && !p.Reply && p.Dir != "in" {
				t.Fatalf("flow %d: its request left the uplink; the scenario no longer tests this", f.ID)
			}
		}
		checked++
		for _, line := range strings.Split(b, "\n") {
			if strings.Contains(line, "("+idList([]int{f.ID})+")") && strings.Contains(line, "left the uplink") {
				t.Errorf("flow %d came in on the uplink and never left it, but SUMMARY.md says:\n%s", f.ID, line)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no flow of the scenario came in on the uplink")
	}
}

// TestSummaryCapturePointsNameTheirPod: with several Pods (a node whose
// Pods came and went during the incident), each Pod's eth0 among the
// capture points says whose it is: five "pod eth0 (veth)" tell nothing.
func TestSummaryCapturePointsNameTheirPod(t *testing.T) {
	node := summaryNode()
	second := node.Pods[0]
	second.NetNS, second.NSName = discover.NetNS{Path: "/run/netns/lab-pod2"}, "lab-pod2"
	node.Pods = append(node.Pods, second)
	node.CapturePoints = []discover.CapturePoint{
		{Role: "pod", NetNS: "/run/netns/lab-pod", Ifname: "eth0", Kind: "veth"},
		{Role: "pod", NetNS: "/run/netns/lab-pod2", Ifname: "eth0", Kind: "veth"},
		{Role: "uplink", NetNS: "/proc/self/ns/net", Ifname: "bond0", Kind: "veth"},
	}
	var b strings.Builder
	writeWhereLooked(&b, node)
	want := "- Capture points: pod eth0 of lab-pod (veth); pod eth0 of lab-pod2 (veth); uplink bond0 (veth).\n"
	if !strings.Contains(b.String(), want) {
		t.Errorf("capture points do not name their Pods, want %q in:\n%s", want, b.String())
	}
}

// TestSummaryNamesTheUplinkMACsNeighbour: on a routed node (Calico's, whose
// Pods' gateway is the node itself) a flow's uplink frame goes to the next
// hop's MAC, never the Pod's gateway's: SUMMARY.md names the neighbour the
// node maps it to, as the table does, rather than only that it is "not the
// pod's gateway", which reads as a fault.
func TestSummaryNamesTheUplinkMACsNeighbour(t *testing.T) {
	ap := netip.MustParseAddrPort
	vlan := uint16(0)
	flows := []flow.Flow{{ID: 2, Proto: "tcp", Client: ap("10.60.1.12:54126"), Service: ap("10.96.60.10:80"), Backend: ap("10.60.2.12:8080"),
		RewrittenAt: flow.PlaceNetfilter, By: "nftables ip nat PREROUTING -> KUBE-SERVICES -> KUBE-SVC-WQ7TB3LCFZG2XHNA -> KUBE-SEP-P5DBIQ7OKSUX3MHE -> dnat to 10.60.2.12:8080",
		Reason: "VIP at netfilter before NAT, backend after NAT", VLAN: &vlan, UplinkDstMAC: "1e:10:dd:1f:56:17", UplinkDstNeighbor: "192.168.60.1", Reply: true}}
	dir := t.TempDir()
	if err := WriteSummary(dir, flows, flow.Summary{Flows: 1}, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	want := "on the uplink the frames were untagged and went to MAC 1e:10:dd:1f:56:17, which the node's neighbour table gives to 192.168.60.1."
	if !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
}

// TestSummaryUplinkMACOfClientsNotPods: a node process's flow and an
// outside client's NodePort flow (in on the uplink) have no Pod, so no
// Pod's gateway their uplink frame should have gone to: SUMMARY.md does
// not compare its MAC with one.
func TestSummaryUplinkMACOfClientsNotPods(t *testing.T) {
	ap := netip.MustParseAddrPort
	untagged := uint16(0)
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: ap("10.0.0.5:41000"), NodeClient: true, Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip nat OUTPUT -> KUBE-SERVICES -> dnat to 10.244.20.31:3000",
			VLAN: &untagged, UplinkDstMAC: "02:00:0a:00:00:99", Reply: true},
		{ID: 2, Proto: "tcp", Client: ap("192.168.1.50:52000"), Service: ap("10.0.0.5:30080"), Backend: ap("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip nat PREROUTING -> KUBE-NODEPORTS -> dnat to 10.244.20.31:3000",
			VLAN: &untagged, UplinkDstMAC: "02:00:0a:00:00:99", Reply: true},
	}
	dir := t.TempDir()
	if err := WriteSummary(dir, flows, flow.Summary{Flows: 2}, summaryNode(), "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if strings.Contains(string(got), "pod's gateway") {
		t.Errorf("a flow whose client is no Pod is compared with the pod's gateway:\n%s", got)
	}
	if n := strings.Count(string(got), "went to MAC 02:00:0a:00:00:99, which no neighbour entry of the node names"); n != 2 {
		t.Errorf("%d flows say their MAC is unnamed, want 2:\n%s", n, got)
	}
}

// TestSummaryRuleAnswerNotSeen: a node process's flow that a reject rule
// ends gets the rule's ICMP error through loopback, which no capture
// point sees (icmp_error from_rule): the kernel may not have sent it (it
// rate-limits ICMP errors). SUMMARY.md must not say that it came back.
func TestSummaryRuleAnswerNotSeen(t *testing.T) {
	flows, b := scenarioSummary(t, "netfilter-reject-node-icmp.json")
	if len(flows) != 1 || flows[0].ICMPError == nil || !flows[0].ICMPError.FromRule {
		t.Fatalf("the scenario no longer has a rule's ICMP answer known from the rule: %+v", flows)
	}
	if strings.Contains(b, "but ICMP") {
		t.Errorf("SUMMARY.md says an ICMP error nobody saw came back:\n%s", b)
	}
	want := "no reply came back, and no answer was seen: the node's reject rule answers with ICMP destination unreachable (code 3: port unreachable) through loopback, which pathtrace does not capture"
	if !strings.Contains(b, want) {
		t.Errorf("SUMMARY.md lacks %q:\n%s", want, b)
	}
}

// TestSummaryRefusedWithoutBackend: a NodePort no rule rewrote meets the
// node's own stack, whose reset refuses it: no backend was there to
// refuse it, and SUMMARY.md must not say one did.
func TestSummaryRefusedWithoutBackend(t *testing.T) {
	flows, b := scenarioSummary(t, "netfilter-nodeport-no-endpoints-external.json")
	checked := 0
	for _, f := range flows {
		if !f.Refused || f.Backend.IsValid() {
			continue
		}
		checked++
		for _, line := range strings.Split(b, "\n") {
			if !strings.HasPrefix(line, "- ") || !strings.Contains(line, "("+idList([]int{f.ID})+")") {
				continue
			}
			if strings.Contains(line, "backend refused") || !strings.Contains(line, "the connection was refused") {
				t.Errorf("flow %d, refused without a backend:\n%s", f.ID, line)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no flow of the scenario was refused without a backend")
	}
}

// TestSummarySays8021adTags: an uplink that carries a Pod's frames with an
// 802.1ad service tag (TPID 0x88a8, alone or as QinQ's outer tag) is not on
// the 802.1Q VLAN of that number: SUMMARY.md says which, as the table does
// ("300 (802.1ad)"), and does not put such flows with 802.1Q ones.
func TestSummarySays8021adTags(t *testing.T) {
	ap := netip.MustParseAddrPort
	vid := uint16(300)
	f := flow.Flow{ID: 1, Proto: "udp", Client: ap("10.77.1.11:40000"), Service: ap("10.177.0.10:53"), Backend: ap("10.77.2.31:5353"),
		RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy nat-prerouting -> dnat to 10.77.2.31:5353",
		VLAN: &vid, VLANProto: "802.1ad", UplinkDstMAC: "02:00:0a:4d:01:01", UplinkDstIsGateway: true, Reply: true}
	g := f
	g.ID, g.Client, g.VLANProto = 2, ap("10.77.1.11:40001"), ""
	dir := t.TempDir()
	if err := WriteSummary(dir, []flow.Flow{f, g}, flow.Summary{Flows: 2}, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{"(flow 1) was rewritten", "on the uplink the frames carried VLAN 300 (802.1ad) and went",
		"(flow 2) was rewritten", "on the uplink the frames carried VLAN 300 and went"} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummarySaysPriorityTags: an uplink frame with an 802.1Q priority tag
// (VLAN ID 0, a tag in the frame that names no VLAN) is not untagged:
// SUMMARY.md says the tag, as the table does ("0 (802.1Q)").
func TestSummarySaysPriorityTags(t *testing.T) {
	ap := netip.MustParseAddrPort
	vid := uint16(0)
	f := flow.Flow{ID: 1, Proto: "udp", Client: ap("10.77.1.11:40000"), Service: ap("10.177.0.10:53"), Backend: ap("10.77.2.31:5353"),
		RewrittenAt: flow.PlaceNetfilter, By: "nftables ip kube-proxy nat-prerouting -> dnat to 10.77.2.31:5353",
		VLAN: &vid, VLANProto: "802.1Q", UplinkDstMAC: "02:00:0a:4d:01:01", UplinkDstIsGateway: true, Reply: true}
	dir := t.TempDir()
	if err := WriteSummary(dir, []flow.Flow{f}, flow.Summary{Flows: 1}, nil, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	if want := "on the uplink the frames carried VLAN 0 (802.1Q) and went"; !strings.Contains(string(got), want) {
		t.Errorf("summary lacks %q:\n%s", want, got)
	}
}

// TestSummaryNamesXDPPrograms: an uplink's XDP program (Cilium's bpf_xdp, a
// Katran-like LB) rewrites requests before any capture: SUMMARY.md lists it
// where it lists the tc programs, as the node block does.
func TestSummaryNamesXDPPrograms(t *testing.T) {
	node := summaryNode()
	node.XDPPrograms = []discover.XDPProgram{{Ifname: "bond0", Ifindex: 3, Role: "uplink", Mode: "xdpgeneric", Name: "cil_xdp_entry", ID: 77}}
	var b strings.Builder
	writeWhereLooked(&b, node)
	want := "- XDP programs on the host veths and the uplinks (they run before the device's capture): bond0 xdpgeneric cil_xdp_entry (id 77).\n"
	if !strings.Contains(b.String(), want) {
		t.Errorf("want %q in:\n%s", want, b.String())
	}
}

// TestSummaryBridgeNFOfRoutedPods: a routed Pod's traffic (its host veth on
// no bridge, as Calico and Cilium's native routing have it) meets netfilter
// whatever bridge-nf-call-iptables says, so SUMMARY.md does not give it that
// sysctl's word for it; a node of bridged Pods keeps it, and a node of both
// says which Pods it concerns.
func TestSummaryBridgeNFOfRoutedPods(t *testing.T) {
	routedPod := func(name string) discover.Pod {
		return discover.Pod{NetNS: discover.NetNS{Path: "/run/netns/" + name}, NSName: name,
			HostPeer: &discover.HostPeer{Iface: discover.Iface{Name: "cali" + name}, MasterKind: "none"}}
	}
	for _, c := range []struct {
		name  string
		pods  func(bridged discover.Pod) []discover.Pod
		want  string
		lacks string
	}{
		{"bridged", func(br discover.Pod) []discover.Pod { return []discover.Pod{br} },
			"- Bridged traffic meets netfilter (bridge-nf-call-iptables): yes; IP forwarding: no.\n", "routes"},
		{"routed", func(discover.Pod) []discover.Pod { return []discover.Pod{routedPod("web-1"), routedPod("web-2")} },
			"- The node routes its Pods' traffic (their host veths are on no bridge): it meets netfilter whatever bridge-nf-call-iptables says; IP forwarding, which routing needs: no.\n", "Bridged"},
		{"mixed", func(br discover.Pod) []discover.Pod {
			return []discover.Pod{routedPod("web-1"), br, routedPod("web-2"), routedPod("web-3"), routedPod("web-4")}
		},
			"- Bridged traffic meets netfilter (bridge-nf-call-iptables): yes, that of the Pods on a bridge (lab-pod); the node routes that of the Pods whose host veth is on no bridge (web-1, web-2, web-3 and 1 more), which meets netfilter whatever that says; IP forwarding, which routing needs: no.\n", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			node := summaryNode()
			node.Pods = c.pods(node.Pods[0])
			var b strings.Builder
			writeWhereLooked(&b, node)
			if !strings.Contains(b.String(), c.want) {
				t.Errorf("want %q in:\n%s", c.want, b.String())
			}
			if c.lacks != "" && strings.Contains(b.String(), c.lacks) {
				t.Errorf("%q in:\n%s", c.lacks, b.String())
			}
		})
	}
}

// TestSummaryUnknownNotSaidRewritten: an unknown flow that no point saw go
// to a backend (dropped on the node with the VIP, before a place that could
// rewrite it) is not known to have been rewritten at all: SUMMARY.md does
// not say it was; one seen going to a backend was, and names it.
func TestSummaryUnknownNotSaidRewritten(t *testing.T) {
	for _, tc := range []struct {
		scenario, want, lacks string
	}{
		{"kernel-drops-request-no-route.json", "could not be placed: no point saw it go to a backend, and pathtrace cannot tell whether or where it was rewritten", "cannot tell where"},
		{"unknown-tc-or-netfilter.json", "could not be placed: pathtrace cannot tell where it was rewritten to 10.244.20.31:3000", "whether"},
	} {
		flows, b := scenarioSummary(t, tc.scenario)
		if !slices.ContainsFunc(flows, func(f flow.Flow) bool { return f.RewrittenAt == flow.PlaceUnknown }) {
			t.Fatalf("%s: no unknown flow", tc.scenario)
		}
		if !strings.Contains(b, tc.want) || strings.Contains(b, tc.lacks) {
			t.Errorf("%s: SUMMARY.md lacks %q, or has %q:\n%s", tc.scenario, tc.want, tc.lacks, b)
		}
	}
}

// TestSummaryRoutedPodsUplinkMAC: a routed Pod's gateway is the node itself
// (Calico's 169.254.1.1, answered by its host veth's proxy ARP), so its
// frames leave the uplink to the node's next hop, never to that gateway:
// a MAC no neighbour entry names is said so, not "not the pod's gateway",
// which reads as a fault; a bridged Pod's keeps the comparison.
func TestSummaryRoutedPodsUplinkMAC(t *testing.T) {
	ap := netip.MustParseAddrPort
	untagged := uint16(0)
	node := summaryNode()
	routed := node.Pods[0]
	routed.Eth0.Addrs = []netip.Prefix{netip.MustParsePrefix("10.244.9.5/32")}
	routed.HostPeer = &discover.HostPeer{Iface: discover.Iface{Name: "cali1"}, MasterKind: "none"}
	node.Pods = append(node.Pods, routed)
	flowFrom := func(id int, client string) flow.Flow {
		return flow.Flow{ID: id, Proto: "tcp", Client: ap(client), Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip nat PREROUTING -> dnat to 10.244.20.31:3000",
			VLAN: &untagged, UplinkDstMAC: "02:00:0a:00:00:99", Reply: true}
	}
	flows := []flow.Flow{flowFrom(1, "10.244.8.23:40000"), flowFrom(2, "10.244.9.5:40000")}
	dir := t.TempDir()
	if err := WriteSummary(dir, flows, flow.Summary{Flows: 2}, node, "duration", Ended{}, Taken{}); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
	for _, want := range []string{
		"(flow 1) was rewritten in netfilter (DNAT) on the node to 10.244.20.31:3000 by nftables ip nat PREROUTING -> dnat to 10.244.20.31:3000; replies came back; on the uplink the frames were untagged and went to MAC 02:00:0a:00:00:99, which is not the pod's gateway.",
		"(flow 2) was rewritten in netfilter (DNAT) on the node to 10.244.20.31:3000 by nftables ip nat PREROUTING -> dnat to 10.244.20.31:3000; replies came back; on the uplink the frames were untagged and went to MAC 02:00:0a:00:00:99, which no neighbour entry of the node names.",
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

// TestSummaryUntranslatedRepliesDroppedByTheClient: replies that entered
// the client's Pod untranslated are dropped there by its kernel (NO_SOCKET:
// no socket is connected to the backend's address) after it resets them:
// they reached the client, and what failed is their translation, which
// SUMMARY.md says, not that the kernel dropped them before any reached it.
func TestSummaryUntranslatedRepliesDroppedByTheClient(t *testing.T) {
	flows, b := scenarioSummary(t, "netfilter-routed-untranslated-reply.json")
	if len(flows) != 1 || flows[0].UntranslatedReplies == nil || len(flows[0].KernelDrops) == 0 {
		t.Fatalf("the scenario no longer has untranslated replies the kernel dropped: %+v", flows)
	}
	want := "no reply came back translated: 10.244.20.31 answered, but its replies entered the client's Pod from 10.244.20.31:3000, not from the VIP"
	if !strings.Contains(b, want) || strings.Contains(b, "before any reached the client") {
		t.Errorf("SUMMARY.md lacks %q, or says the replies were dropped before reaching the client:\n%s", want, b)
	}
}

// TestSummaryNamesTheUplinkOfSeveral: on a node of several uplinks (a
// routed node's route to the VIPs and its route to the backends leave by
// different devices), "the uplink" does not tell which the frames left by:
// SUMMARY.md names it, and keeps "the uplink" on a node of one.
func TestSummaryNamesTheUplinkOfSeveral(t *testing.T) {
	ap := netip.MustParseAddrPort
	untagged := uint16(0)
	flows := []flow.Flow{
		{ID: 1, Proto: "tcp", Client: ap("10.244.8.23:40000"), Service: ap("10.120.0.80:80"), Backend: ap("10.244.20.31:3000"),
			RewrittenAt: flow.PlaceNetfilter, By: "nftables ip nat PREROUTING -> dnat to 10.244.20.31:3000",
			VLAN: &untagged, UplinkDstMAC: "02:00:0a:00:00:01", UplinkDstNeighbor: "192.168.78.1", UplinkIfindex: 5, Reply: true},
		{ID: 2, Proto: "tcp", Client: ap("10.244.8.23:40001"), Service: ap("10.120.0.81:80"),
			RewrittenAt: flow.PlaceNowhere, Reason: "the uplink TX showed the VIP as destination: it left the node unrewritten",
			VLAN: &untagged, UplinkDstMAC: "02:00:0a:00:00:02", UplinkDstNeighbor: "192.168.77.1", UplinkIfindex: 4,
			Points: []flow.PointSeen{{Point: "uplink", Dir: "out", Packets: 1}}},
	}
	node := summaryNode()
	for _, c := range []struct {
		name    string
		uplinks []discover.CapturePoint
		want    []string
	}{
		{"several", []discover.CapturePoint{{Role: discover.RoleUplink, Ifname: "up0", Ifindex: 4}, {Role: discover.RoleUplink, Ifname: "up1", Ifindex: 5}},
			[]string{"replies came back; on uplink up1 the frames were untagged", "it left uplink up0 with the VIP still as destination; no reply came back; on uplink up0 the frames were untagged"}},
		{"one", []discover.CapturePoint{{Role: discover.RoleUplink, Ifname: "bond0", Ifindex: 4}},
			[]string{"replies came back; on the uplink the frames were untagged", "it left the uplink with the VIP still as destination; no reply came back; on the uplink the frames were untagged"}},
	} {
		node.CapturePoints = c.uplinks
		dir := t.TempDir()
		if err := WriteSummary(dir, flows, flow.Summary{Flows: 2}, node, "duration", Ended{}, Taken{}); err != nil {
			t.Fatal(err)
		}
		got, _ := os.ReadFile(filepath.Join(dir, SummaryFile))
		for _, want := range c.want {
			if !strings.Contains(string(got), want) {
				t.Errorf("%s: summary lacks %q:\n%s", c.name, want, got)
			}
		}
	}
}

// TestSummarySidecarProxyNotListening: a connection its Pod's sidecar
// redirect sent to a proxy port where nothing listened was refused by the
// Pod's own kernel (known from its NO_SOCKET drop): no backend refused it,
// and SUMMARY.md says the proxy was not there to take it.
func TestSummarySidecarProxyNotListening(t *testing.T) {
	flows, b := scenarioSummary(t, "sidecar-redirect.json")
	checked := 0
	for _, f := range flows {
		if !f.Refused || f.By != flow.ByClientNetfilter {
			continue
		}
		for _, line := range strings.Split(b, "\n") {
			if !strings.HasPrefix(line, "- ") || !strings.Contains(line, "("+idList([]int{f.ID})+")") {
				continue
			}
			checked++
			if strings.Contains(line, "backend refused") || !strings.Contains(line, "nothing listened on the proxy's port in the client's Pod") {
				t.Errorf("flow %d, refused by its Pod's kernel:\n%s", f.ID, line)
			}
		}
	}
	if checked == 0 {
		t.Fatalf("no line for a flow refused in its Pod:\n%s", b)
	}
}

// TestSummaryPodNATBackendRefused: a connection its Pod's own NAT sent to a
// backend out of the Pod, which refused it with a reset that came back, was
// refused by that backend: SUMMARY.md says so, not that nothing listened on
// a proxy's port in the Pod (no proxy, no drop).
func TestSummaryPodNATBackendRefused(t *testing.T) {
	flows, b := scenarioSummary(t, "pod-nat-backend-refused.json")
	if len(flows) != 1 || !flows[0].Refused || flows[0].By != flow.ByClientNetfilter {
		t.Fatalf("want one flow refused, by %q: %+v", flow.ByClientNetfilter, flows)
	}
	for _, line := range strings.Split(b, "\n") {
		if strings.HasPrefix(line, "- ") && strings.Contains(line, "(flow 1)") {
			if strings.Contains(line, "the proxy's port") || !strings.Contains(line, "the backend refused the connection") {
				t.Errorf("refused by its backend:\n%s", line)
			}
			return
		}
	}
	t.Fatalf("no line for flow 1:\n%s", b)
}
