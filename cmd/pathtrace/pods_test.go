package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// otherPodIPs are free addresses of the lab Pod's subnet.
var otherPodIPs = []string{"10.244.8.24", "10.244.8.25"}

// TestSeveralPods adds two Pods to the lab's bridge and traces all three at
// once: every Pod is found, each one's flows get their verdict, each Pod's
// eth0 is a capture point (pcapng interface, counter) of its own, and the
// Pods' six capture points share their rings (the uplink keeps a whole one).
func TestSeveralPods(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	var pods []string
	for _, ip := range otherPodIPs {
		pods = append(pods, addPod(t, l, ip))
	}

	pcap := filepath.Join(t.TempDir(), "pods.pcapng")
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s", "--pcap", pcap)
	node := r.waitNode(t)
	if pods, _ := node["pods"].([]any); len(pods) != 3 {
		t.Errorf("%d pods in the node object, want 3", len(pods))
	}
	checkSharedRings(t, node, 6)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := l.Client(ctx, lab.ClientOptions{Requests: 2}); err != nil {
		t.Fatal(err)
	}
	for _, pod := range pods {
		if err := connectFrom(pod, lab.TCPVIP.String(), 2); err != nil {
			t.Fatalf("connect from %s: %v", pod, err)
		}
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, summary := r.rest(t)

	perClient := map[string]int{}
	for _, f := range flows {
		if f["proto"] == "tcp" && f["rewritten_at"] == "netfilter" && f["backend"] == lab.TCPBackend.String() {
			if host, _, err := net.SplitHostPort(fmt.Sprint(f["client"])); err == nil {
				perClient[host]++
			}
		}
	}
	clients := append([]string{lab.PodIP.String()}, otherPodIPs...)
	pc, _ := summary["pcap"].(map[string]any)
	per, _ := pc["per_interface"].(map[string]any)
	for _, ip := range clients {
		if perClient[ip] != 2 {
			t.Errorf("TCP flows rewritten by netfilter per client: %v, want 2 for each Pod: %s", perClient, dump(flows))
		}
		if n, _ := per["pod:eth0@"+ip].(float64); n == 0 {
			t.Errorf("pcapng interface pod:eth0@%s holds no packet: %v", ip, per)
		}
	}
}

// TestSelectedPodOnly: with a Pod selected, the flows are that Pod's: the
// node-wide points (netfilter, conntrack, the uplink) also see another
// Pod's connections to the VIP, which are left out and counted
// (out_of_scope), not listed with the selected Pod's gateway judged for them.
func TestSelectedPodOnly(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	other := addPod(t, l, otherPodIPs[0])
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s", "--pod-ip", lab.PodIP.String())
	r.waitNode(t)
	if err := connectFrom(other, lab.TCPVIP.String(), 2); err != nil {
		t.Fatalf("connect from the other Pod: %v", err)
	}
	flows, summary := r.connectAndStop(t, l.PodNetNS(), lab.TCPVIP.String(), 2)
	if len(flows) != 2 || len(flowsFrom(flows, lab.PodIP.String())) != 2 {
		t.Errorf("flows %s: want the selected Pod's 2 only", dump(flows))
	}
	if n, _ := summary["out_of_scope"].(float64); n == 0 {
		t.Errorf("out_of_scope %v: want the other Pod's observations counted", summary["out_of_scope"])
	}
}

// checkSharedRings checks the node object's af_packet observers: the Pods'
// points (eth0 and host veth) name a ring smaller than --buffer-size's 4M
// and say it is shared, the uplink's does not.
func checkSharedRings(t *testing.T, node map[string]any, podPoints int) {
	t.Helper()
	shared := 0
	for _, o := range nodeObservers(node) {
		switch o.name {
		case "af_packet pod", "af_packet host":
			if strings.Contains(o.note, fmt.Sprintf("the Pods' %d capture points share", podPoints)) && !strings.Contains(o.note, "ring 4M") {
				shared++
			}
		case "af_packet uplink":
			if strings.Contains(o.note, "share") {
				t.Errorf("the uplink's ring is shared: %q", o.note)
			}
		}
	}
	if shared != podPoints {
		t.Errorf("%d af_packet observers note a shared ring, want %d: %+v", shared, podPoints, nodeObservers(node))
	}
}

// addedPodVeth is the host veth addPod gives the Pod of address ip.
func addedPodVeth(ip string) string { return "veth-pt" + ip[strings.LastIndexByte(ip, '.')+1:] }

// TestSeveralPodsTC: two Pods, each host veth with its own copy of the tc LB
// (one program name, two ids, as Cilium attaches one per endpoint): each
// flow's "by" names the program of its own Pod's veth, never "one of".
func TestSeveralPodsTC(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	ip := otherPodIPs[0]
	pod := addPod(t, l, ip)
	if err := l.AttachTCLBTo(addedPodVeth(ip)); err != nil {
		t.Fatal(err)
	}

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s")
	node := r.waitNode(t)
	// The id of the ingress LB on each host veth, from discovery.
	idOn := map[string]float64{}
	progs, _ := node["tc_programs"].([]any)
	for _, p := range progs {
		prog, _ := p.(map[string]any)
		if prog["dir"] == "ingress" && prog["name"] == "lab_from_container" {
			idOn[fmt.Sprint(prog["ifname"])] = prog["id"].(float64)
		}
	}
	if len(idOn) != 2 || idOn[lab.HostVeth] == idOn[addedPodVeth(ip)] {
		t.Fatalf("want a tc LB of its own on each host veth, discovery found %v", idOn)
	}
	if err := connectFrom(l.PodNetNS(), lab.TCPVIP.String(), 2); err != nil {
		t.Fatal(err)
	}
	if err := connectFrom(pod, lab.TCPVIP.String(), 2); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, _ := r.rest(t)

	vethOf := map[string]string{lab.PodIP.String(): lab.HostVeth, ip: addedPodVeth(ip)}
	perClient := map[string]int{}
	for _, f := range flows {
		client, _, _ := net.SplitHostPort(fmt.Sprint(f["client"]))
		perClient[client]++
		want := fmt.Sprintf("tcx ingress lab_from_container (id %d)", int(idOn[vethOf[client]]))
		if f["rewritten_at"] != "tc" || f["by"] != want {
			t.Errorf("want rewritten at tc by %q (the LB of %s): %s", want, vethOf[client], dump([]map[string]any{f}))
		}
	}
	if perClient[lab.PodIP.String()] != 2 || perClient[ip] != 2 {
		t.Errorf("flows per client %v, want 2 each", perClient)
	}
}

// TestPodDeletedMidTrace deletes a Pod's veth (as the CNI does when the Pod
// goes) while pathtrace traces: the report names both of its capture points
// as ended, with when and why, and the other Pod's flows are traced on.
func TestPodDeletedMidTrace(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	ip := otherPodIPs[0]
	addPod(t, l, ip)

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s")
	r.waitNode(t)
	mustRun(t, nil, "ip", "-n", filepath.Base(l.NodeNetNS()), "link", "del", addedPodVeth(ip))
	time.Sleep(300 * time.Millisecond)
	if err := connectFrom(l.PodNetNS(), lab.TCPVIP.String(), 2); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, summary := r.rest(t)

	ended, _ := summary["capture_ended"].(map[string]any)
	for _, point := range []string{"pod:eth0@" + ip, "host:" + addedPodVeth(ip)} {
		if why, _ := ended[point].(string); !strings.Contains(why, "network is down") {
			t.Errorf("capture_ended[%q] = %q, want it ended with ENETDOWN: %v", point, why, ended)
		}
	}
	if len(ended) != 2 {
		t.Errorf("capture_ended %v, want only the deleted Pod's two points", ended)
	}
	if len(flows) != 2 {
		t.Errorf("%d flows, want the 2 of the remaining Pod: %s", len(flows), dump(flows))
	}
}

// connectFrom opens and closes n TCP connections to addr from inside netns.
func connectFrom(netns, addr string, n int) error {
	return nsutil.Do(netns, func() error {
		for range n {
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err != nil {
				return err
			}
			c.Close()
		}
		return nil
	})
}

// addPod creates a Pod netns on the lab's bridge with address ip (a /22 of
// the lab Pod's subnet, default route via the lab's gateway), removed when
// the test ends.
func addPod(t *testing.T, l *lab.Lab, ip string) string {
	t.Helper()
	name := filepath.Base(l.PodNetNS()) + ip[strings.LastIndexByte(ip, '.')+1:]
	hostVeth := addedPodVeth(ip)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() }) // takes both veth ends with it
	node := filepath.Base(l.NodeNetNS())
	for _, args := range [][]string{
		{"netns", "add", name},
		{"link", "add", hostVeth, "netns", node, "type", "veth", "peer", "name", lab.PodIface, "netns", name},
		{"-n", node, "link", "set", hostVeth, "master", lab.Bridge, "up"},
		{"-n", name, "addr", "add", ip + "/22", "dev", lab.PodIface},
		{"-n", name, "link", "set", lab.PodIface, "up"},
		{"-n", name, "route", "add", "default", "via", lab.GatewayIP.String()},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	return "/run/netns/" + name
}

// observersLoaded tells whether pathtrace observers are loaded already (a
// pathtrace another test or developer runs on this machine): then no trace
// here is alone on the node.
func observersLoaded(t *testing.T) bool {
	t.Helper()
	for id := ebpf.ProgramID(0); ; {
		next, err := ebpf.ProgramGetNextID(id)
		if err != nil {
			return false
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue
		}
		info, err := p.Info()
		p.Close()
		if err == nil && strings.HasPrefix(info.Name, "pt_") {
			return true
		}
	}
}

// TestTwoTracesAtOnce runs two pathtraces on one node, as two SREs may: the
// second finds the first's observers on the host veth and the cgroup, and
// must not take them for rewriters. Both name the lab's tc LB alone.
func TestTwoTracesAtOnce(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	args := []string{"--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String() + "/tcp", "--duration", "30s"}
	alone := !observersLoaded(t)
	first := startJSON(t, args...)
	if notes := fmt.Sprint(first.waitNode(t)["notes"]); alone && strings.Contains(notes, "another pathtrace") {
		t.Errorf("the first trace, alone on the node, says another runs: %s", notes)
	}
	second := startJSON(t, args...)
	node := second.waitNode(t)
	if notes := fmt.Sprint(node["notes"]); !strings.Contains(notes, "another pathtrace runs on this node") {
		t.Errorf("the second trace's notes do not name the first: %s", notes)
	}
	progs, _ := node["tc_programs"].([]any)
	var lb float64
	for _, p := range progs {
		prog, _ := p.(map[string]any)
		if name := fmt.Sprint(prog["name"]); strings.HasPrefix(name, "pt_") {
			t.Errorf("the second trace lists the first's observer %s as a tc program of the node", name)
		}
		if prog["dir"] == "ingress" && prog["name"] == "lab_from_container" {
			lb = prog["id"].(float64)
		}
	}
	if err := connectFrom(l.PodNetNS(), lab.TCPVIP.String(), 2); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	want := fmt.Sprintf("tcx ingress lab_from_container (id %d)", int(lb))
	for i, r := range []*run{first, second} {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		flows, _ := r.rest(t)
		if len(flows) != 2 {
			t.Errorf("trace %d: %d flows, want 2: %s", i+1, len(flows), dump(flows))
		}
		for _, f := range flows {
			if f["rewritten_at"] != "tc" || f["by"] != want {
				t.Errorf("trace %d: want rewritten at tc by %q: %s", i+1, want, dump([]map[string]any{f}))
			}
		}
	}
}

// TestSidecarRedirect: a service mesh's capture (Istio's iptables in the
// Pod) redirects the app's connection to the VIP to a proxy in the Pod
// itself. The rewrite is netfilter OUTPUT in the Pod's netns: the socket
// names the VIP, its first packet (the cgroup egress hook runs after that
// NAT) the proxy. The flow never leaves the Pod.
func TestSidecarRedirect(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	const proxy = "127.0.0.1:15001"
	rules := fmt.Sprintf(`table ip pt-mesh {
	chain output {
		type nat hook output priority -100; policy accept;
		ip daddr %s tcp dport %d redirect to :15001
	}
}
`, lab.TCPVIP.Addr(), lab.TCPVIP.Port())
	mustRun(t, strings.NewReader(rules), "ip", "netns", "exec", filepath.Base(l.PodNetNS()), "nft", "-f", "-")
	serveIn(t, l.PodNetNS(), ":15001") // the proxy

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s")
	r.waitNode(t)
	if err := connectFrom(l.PodNetNS(), lab.TCPVIP.String(), 2); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, _ := r.rest(t)
	if len(flows) != 2 {
		t.Fatalf("%d flows, want 2: %s", len(flows), dump(flows))
	}
	for _, f := range flows {
		reason, _ := f["reason"].(string)
		if f["rewritten_at"] != "netfilter" || f["backend"] != proxy || f["by"] != "netfilter OUTPUT in the client's netns (its rules are not read)" ||
			!strings.Contains(reason, "sidecar proxy") || !strings.Contains(reason, "never left the Pod") {
			t.Errorf("want rewritten at netfilter in the Pod's netns to %s, as a sidecar's capture: %s", proxy, dump([]map[string]any{f}))
		}
	}
}

// TestPodStartedMidTrace adds a Pod to the lab's bridge while pathtrace
// traces every Pod of the node (a Deployment rolled out during an
// incident): pathtrace finds it, captures on its eth0 and host veth (pcapng
// interfaces of their own), takes its socket events in, gives its flows
// their verdict, and the summary names it.
func TestPodStartedMidTrace(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	ip := otherPodIPs[1]
	pcap := filepath.Join(t.TempDir(), "started.pcapng")
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "60s", "--pcap", pcap)
	r.waitNode(t)
	pod := addPod(t, l, ip)
	// Found within two looks (every 2 s, on a 1 s tick): one may come while
	// the Pod's netns is still being set up.
	waitUntil(t, r, "the new Pod's eth0 tapped", func() bool { return packetSockets(t, pod) > 0 })
	flows, summary := r.connectAndStop(t, pod, lab.TCPVIP.String(), 2)

	mine := flowsFrom(flows, ip)
	for _, f := range mine {
		if f["rewritten_at"] != "netfilter" || f["backend"] != lab.TCPBackend.String() {
			t.Errorf("flow of the new Pod %v: %v to %v, want netfilter to %s", f["client"], f["rewritten_at"], f["backend"], lab.TCPBackend)
		}
		if f["pid"] == nil {
			t.Errorf("flow of the new Pod %v has no socket evidence: its netns is out of scope", f["client"])
		}
		if !strings.Contains(fmt.Sprint(f["points"]), "pod:eth0@"+ip) {
			t.Errorf("flow of the new Pod %v was not seen on its eth0: %v", f["client"], f["points"])
		}
	}
	if len(mine) != 2 {
		t.Errorf("%d flows from the new Pod %s, want 2: %s", len(mine), ip, dump(flows))
	}
	started, _ := summary["pods_started"].([]any)
	if len(started) != 1 || !strings.Contains(fmt.Sprint(started[0]), ip) || !strings.Contains(fmt.Sprint(started[0]), "pod:eth0@"+ip) {
		t.Errorf("pods_started %v, want the new Pod with its taps", started)
	}
	pc, _ := summary["pcap"].(map[string]any)
	per, _ := pc["per_interface"].(map[string]any)
	for _, point := range []string{"pod:eth0@" + ip, "host:" + addedPodVeth(ip)} {
		if n, _ := per[point].(float64); n == 0 {
			t.Errorf("pcapng interface %s holds no packet: %v", point, per)
		}
	}
}

// TestPodStartedMidTraceTC: a Pod starts during the trace and its CNI
// attaches its tc LB to the host veth a moment later, as Cilium does: the
// tcx observers are attached there once the program appears, so its flows
// are bracketed at tc as the first Pod's, and named by the program of their
// own veth.
func TestPodStartedMidTraceTC(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeTC)
	ip := otherPodIPs[1]
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "60s")
	r.waitNode(t)
	pod := addPod(t, l, ip)
	// The Pod is found first, without a tc program; then the tc programs
	// are read every 2 s. Each is waited for as the kernel shows it: a
	// loaded machine can keep pathtrace from its looks for seconds.
	waitUntil(t, r, "the new Pod's eth0 tapped", func() bool { return packetSockets(t, pod) > 0 })
	if err := l.AttachTCLBTo(addedPodVeth(ip)); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, r, "tcx observers next to the LB", func() bool { return tcxIngress(t, l.NodeNetNS(), addedPodVeth(ip)) > 1 })
	flows, summary := r.connectAndStop(t, pod, lab.TCPVIP.String(), 2)

	mine := flowsFrom(flows, ip)
	for _, f := range mine {
		by, _ := f["by"].(string)
		if f["rewritten_at"] != "tc" || !strings.HasPrefix(by, "tcx ingress lab_from_container") || strings.Contains(by, "one of") {
			t.Errorf("flow of the new Pod: want rewritten at tc by its veth's LB: %s", dump([]map[string]any{f}))
		}
		if !strings.Contains(fmt.Sprint(f["points"]), "tc_head") {
			t.Errorf("flow of the new Pod %v: no tcx observer saw it: %v", f["client"], f["points"])
		}
	}
	if len(mine) != 2 {
		// What the run found of the Pod, to tell a Pod never found from
		// its flows lost.
		t.Errorf("%d flows from the new Pod %s, want 2: %s; pods_started %v, out_of_scope %v; stderr: %s",
			len(mine), ip, dump(flows), summary["pods_started"], summary["out_of_scope"], r.stderr.String())
	}
	added, _ := summary["observers_added"].([]any)
	if len(added) != 1 || !strings.Contains(fmt.Sprint(added[0]), "tcx observers on "+addedPodVeth(ip)) || strings.Contains(fmt.Sprint(added[0]), "not attached") {
		t.Errorf("observers_added %v, want the new Pod's veth's, attached", added)
	}
}

// waitUntil waits for cond, which pathtrace's run r brings about, for up
// to 30 s.
func waitUntil(t *testing.T, r *run, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30 s (stderr: %s)", what, r.stderr.String())
		}
	}
}

// packetSockets counts the packet sockets of the netns at path that are
// bound to an interface and running: pathtrace's taps, in a Pod's.
func packetSockets(t *testing.T, path string) int {
	t.Helper()
	var n int
	err := nsutil.Do(path, func() error {
		b, err := os.ReadFile("/proc/thread-self/net/packet")
		for _, line := range strings.Split(string(b), "\n")[1:] { // sk RefCnt Type Proto Iface R ...
			if f := strings.Fields(line); len(f) > 5 && f[4] != "0" && f[5] == "1" {
				n++
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// tcxIngress counts the tcx programs on the ingress of the node netns's
// interface ifname.
func tcxIngress(t *testing.T, nodeNetNS, ifname string) int {
	t.Helper()
	var n int
	err := nsutil.Do(nodeNetNS, func() error {
		ifc, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifc.Index, Attach: ebpf.AttachTCXIngress})
		if err != nil {
			return err
		}
		n = len(res.Programs)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPodReplacedMidTrace: a Pod goes (its netns deleted, not its veth)
// and another comes back with its address and veth name (a StatefulSet's
// Pod restarted): the first one's tap is closed, so that its netns and veth
// pair go (the capture alone kept them), and the new one is a capture point
// of its own, with a label of its own; each keeps its counters.
func TestPodReplacedMidTrace(t *testing.T) {
	l, ip, pod, r := tracedAddedPod(t)
	mustRun(t, nil, "ip", "netns", "del", filepath.Base(pod))
	// The kernel takes the veth pair with the netns, a moment later.
	for deadline := time.Now().Add(10 * time.Second); exec.Command("ip", "-n", filepath.Base(l.NodeNetNS()), "link", "show", addedPodVeth(ip)).Run() == nil; {
		if time.Now().After(deadline) {
			t.Fatalf("%s still there 10 s after its netns was deleted", addedPodVeth(ip))
		}
		time.Sleep(50 * time.Millisecond)
	}
	addPod(t, l, ip)
	time.Sleep(7 * time.Second)
	if err := connectFrom(pod, lab.TCPVIP.String(), 1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	_, summary := r.rest(t)
	ended, _ := summary["capture_ended"].(map[string]any)
	if why, _ := ended["pod:eth0@"+ip].(string); !strings.Contains(why, "netns was deleted") {
		t.Errorf("capture_ended %v: want the first Pod's eth0 released, its netns deleted", ended)
	}
	// Its veth went down, then away: a capture that ended, not a gap it
	// went on across.
	gaps, _ := summary["capture_gaps"].(map[string]any)
	for point := range ended {
		if gap, ok := gaps[point]; ok {
			t.Errorf("%s is in capture_ended (%v) and in capture_gaps (%v)", point, ended[point], gap)
		}
	}
	packets, _ := summary["packets"].(map[string]any)
	for _, point := range []string{"pod:eth0@" + ip, "pod:eth0@" + ip + "#2", "host:" + addedPodVeth(ip), "host:" + addedPodVeth(ip) + "#2"} {
		if n, _ := packets[point].(float64); n == 0 {
			t.Errorf("no packet counted at %s: %v", point, packets)
		}
	}
}

// tracedAddedPod adds a Pod to a netfilter lab, traces the node for a
// minute and connects once from the Pod: the start of the tests of a Pod
// that goes mid-trace.
func tracedAddedPod(t *testing.T) (l *lab.Lab, ip, pod string, r *run) {
	needRoot(t)
	l = upLab(t, lab.ModeNetfilter)
	ip = otherPodIPs[0]
	pod = addPod(t, l, ip)
	r = startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "60s")
	r.waitNode(t)
	if err := connectFrom(pod, lab.TCPVIP.String(), 1); err != nil {
		t.Fatal(err)
	}
	return l, ip, pod, r
}

// flowsFrom returns the flows whose client address is ip.
func flowsFrom(flows []map[string]any, ip string) []map[string]any {
	var out []map[string]any
	for _, f := range flows {
		if host, _, _ := net.SplitHostPort(fmt.Sprint(f["client"])); host == ip {
			out = append(out, f)
		}
	}
	return out
}

// TestPodDeletedByCNIMidTrace: a Pod goes as a CNI deletes it, its veth
// first, then the runtime its netns. Its taps end with their interfaces;
// the netns going a moment later must not have them reported released, as
// if the capture alone had kept the netns alive.
func TestPodDeletedByCNIMidTrace(t *testing.T) {
	l, ip, pod, r := tracedAddedPod(t)
	mustRun(t, nil, "ip", "-n", filepath.Base(l.NodeNetNS()), "link", "del", addedPodVeth(ip))
	time.Sleep(time.Second)
	mustRun(t, nil, "ip", "netns", "del", filepath.Base(pod))
	time.Sleep(5 * time.Second) // the Pod watch looks every 2 s
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	_, summary := r.rest(t)
	ended, _ := summary["capture_ended"].(map[string]any)
	for _, point := range []string{"pod:eth0@" + ip, "host:" + addedPodVeth(ip)} {
		why, _ := ended[point].(string)
		if !strings.HasPrefix(why, "ended at ") || strings.Contains(why, "released") {
			t.Errorf("capture_ended[%s] = %q: want it ended with its interface, not released", point, why)
		}
	}
}
