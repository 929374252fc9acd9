package session

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/export"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// TestUntilStoppedFollowsChurn: a run until stopped (Finished set) on a
// node whose Pods come and go follows new Pods long after more Pods than
// its bound (MaxPods) came: a Pod that went gives its room back, its taps
// are forgotten (their counts go to points-gone) and it leaves the node's
// lists; the bound still holds on the Pods there at once. With a pcapng
// file, whose interfaces are the taps' slots, the slots are reused once
// the file ended, and the file's interfaces keep their names.
func TestUntilStoppedFollowsChurn(t *testing.T) {
	t.Run("no file", func(t *testing.T) { testChurn(t, "") })
	t.Run("file", func(t *testing.T) { testChurn(t, t.TempDir()+"/churn.pcapng") })
}

func testChurn(t *testing.T, pcap string) {
	names := testNetNS(t, "pdchurn", "-node", "-pa")
	node, first := names[0], names[1]
	base := strings.TrimSuffix(node, "-node")
	nodePath := "/run/netns/" + node
	run(t, "ip", "-n", node, "link", "add", "br0", "type", "bridge")
	run(t, "ip", "-n", node, "addr", "add", "10.98.0.1/24", "dev", "br0")
	run(t, "ip", "-n", node, "link", "set", "br0", "up")
	// addPod makes a Pod: a netns behind veth hv<i> on br0, routing
	// through it; deleting its netns deletes the pair.
	addPod := func(ns string, i int) {
		t.Helper()
		veth := fmt.Sprintf("hv%d", i)
		run(t, "ip", "-n", node, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
		run(t, "ip", "-n", node, "link", "set", veth, "master", "br0", "up")
		run(t, "ip", "-n", ns, "addr", "add", fmt.Sprintf("10.98.0.%d/24", 10+i), "dev", "eth0")
		run(t, "ip", "-n", ns, "link", "set", "eth0", "up")
		run(t, "ip", "-n", ns, "route", "add", "default", "via", "10.98.0.1")
	}
	// logStep says when the test changed the node: a failure shows it
	// next to when pathtrace saw each Pod start or left it out.
	logStep := func(format string, args ...any) {
		t.Helper()
		t.Logf("%s "+format, append([]any{time.Now().Format("15:04:05.000")}, args...)...)
	}
	newPod := func(i int) string {
		t.Helper()
		ns := fmt.Sprintf("%s-p%d", base, i)
		run(t, "ip", "netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		addPod(ns, i)
		logStep("Pod %d made (hv%d)", i, i)
		return ns
	}
	addPod(first, 0)

	// The labels of the capture points open, as the progress says them.
	var mu sync.Mutex
	var points map[string]uint64
	ready := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		res *Result
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := Run(ctx, Options{
			Services: []flow.Service{{Addr: netip.MustParseAddr("192.0.2.80")}},
			Discover: discover.Options{HostNetNS: nodePath, MaxPods: 2},
			Finished: func([]flow.Flow) {},
			Ready:    func(*discover.NodeInfo, []probe.Attachment) { close(ready) },
			Progress: func(p Progress) {
				mu.Lock()
				points = p.Packets
				mu.Unlock()
			},
			// The file ends at its first frame, and the run goes on.
			Pcap: pcap, PcapLimits: export.Limits{MaxPackets: 1}, PcapBoundEndsFileOnly: true,
		})
		done <- result{res, err}
	}()
	select {
	case <-ready:
	case r := <-done:
		t.Fatalf("the run ended before it was ready: %v", r.err)
	}
	// until waits for the points open to satisfy ok (a look for Pods comes
	// every 2 s, the progress every second).
	until := func(what string, ok func(map[string]uint64) bool) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			mu.Lock()
			p := points
			mu.Unlock()
			if p != nil && ok(p) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: capture points open %v", what, mapsKeys(p))
			}
		}
	}
	has := func(label string) func(map[string]uint64) bool {
		return func(p map[string]uint64) bool { _, ok := p[label]; return ok }
	}
	hasNot := func(label string) func(map[string]uint64) bool {
		return func(p map[string]uint64) bool { _, ok := p[label]; return !ok }
	}
	until("the Pod of the start", has("host:hv0"))
	started := map[int]string{}
	if pcap != "" {
		// A Pod starts while the file takes frames: its taps are
		// interfaces of the file, which it keeps when they go.
		started[1] = newPod(1)
		until("Pod 1 started", has("host:hv1"))
		// A datagram to the VIP from the first Pod fills the file.
		if err := sendFromSockets("/run/netns/"+first, netip.MustParseAddrPort("192.0.2.80:53"), 1); err != nil {
			t.Fatal(err)
		}
		until("the first Pod's datagram", func(p map[string]uint64) bool { return p["pod:eth0"] > 0 })
		logStep("the first Pod's datagram captured")
	}
	// Pods come and go, one at a time: twice the bound and more.
	const churn = 5
	for i := 1; i <= churn; i++ {
		ns, ok := started[i]
		if !ok {
			ns = newPod(i)
			until(fmt.Sprintf("Pod %d started", i), has(fmt.Sprintf("host:hv%d", i)))
		}
		run(t, "ip", "netns", "del", ns)
		logStep("Pod %d deleted", i)
		until(fmt.Sprintf("Pod %d went", i), hasNot(fmt.Sprintf("host:hv%d", i)))
		logStep("Pod %d gone from the capture points", i)
	}
	until("the points of the Pods that went", has(goneLabel))
	// The bound holds on the Pods there at once: of two that start, one
	// is followed.
	newPod(churn + 1)
	newPod(churn + 2)
	until("one of two more Pods followed", func(p map[string]uint64) bool {
		_, a := p[fmt.Sprintf("host:hv%d", churn+1)]
		_, b := p[fmt.Sprintf("host:hv%d", churn+2)]
		return a != b
	})
	// Give the watch another look or two: the other one must stay out.
	time.Sleep(5 * time.Second)
	cancel()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	res := r.res
	if len(res.Node.Pods) != 2 {
		var got []string
		for _, p := range res.Node.Pods {
			got = append(got, p.NetNS.Path)
		}
		t.Errorf("the node's Pods at the end: %v; want the first one and one of the last two", got)
	}
	hosts := 0
	for _, cp := range res.Node.CapturePoints {
		if cp.Role == discover.RoleHost {
			hosts++
		}
	}
	if hosts != 2 {
		t.Errorf("%d host veth capture points at the end, want 2: %+v", hosts, res.Node.CapturePoints)
	}
	open := 0
	for label := range res.Packets {
		if strings.HasPrefix(label, "host:") {
			open++
		}
	}
	if open != 2 {
		t.Errorf("packets counted at %d host veths, want the 2 there at the end: %v", open, mapsKeys(res.Packets))
	}
	// The Pod left out is named by its host veth: of the last two, the one
	// not among the capture points.
	left := fmt.Sprintf("hv%d", churn+1)
	if slices.ContainsFunc(res.Node.CapturePoints, func(cp discover.CapturePoint) bool { return cp.Ifname == left }) {
		left = fmt.Sprintf("hv%d", churn+2)
	}
	for _, want := range []string{fmt.Sprintf("%d Pods followed went", churn), "1 not followed: pathtrace follows at most 2 Pods at once (host veth " + left + " at "} {
		if !slices.ContainsFunc(res.PodsStarted, func(s string) bool { return strings.Contains(s, want) }) {
			t.Errorf("Pods started %q: want %q", res.PodsStarted, want)
		}
	}
	if slices.ContainsFunc(res.PodsStarted, func(s string) bool { return strings.Contains(s, "capture points of new Pods not opened") }) {
		t.Errorf("Pods started %q: capture points not opened", res.PodsStarted)
	}
	if pcap != "" {
		// The file's interfaces are the taps open before it ended (the
		// first Pod's and Pod 1's), named as they were, whatever took
		// their slots since.
		var ifaces []string
		if res.Pcap != nil {
			ifaces = mapsKeys(res.Pcap.PerInterface)
		}
		if want := []string{"host:hv0", "host:hv1", "pod:eth0", "pod:eth0@10.98.0.11"}; res.Pcap == nil || res.Pcap.Packets != 1 || res.Pcap.PerInterface["pod:eth0"] != 1 || !slices.Equal(ifaces, want) {
			t.Errorf("pcapng file: %+v; want the datagram, at pod:eth0, of interfaces %q", res.Pcap, want)
		}
	}
}

func mapsKeys(m map[string]uint64) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
