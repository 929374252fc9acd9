package main

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// secondPodIP is a free address of the lab Pod's subnet.
const secondPodIP = "10.244.8.24"

// TestSeveralPods adds a second Pod to the lab's bridge and traces both at
// once: both Pods are found, each one's flows get their verdict, and each
// Pod's eth0 is a capture point (pcapng interface, counter) of its own.
func TestSeveralPods(t *testing.T) {
	needRoot(t)
	l := upLab(t, lab.ModeNetfilter)
	pod2 := addPod(t, l, secondPodIP)

	pcap := filepath.Join(t.TempDir(), "pods.pcapng")
	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "30s", "--pcap", pcap)
	node := r.waitNode(t)
	if pods, _ := node["pods"].([]any); len(pods) != 2 {
		t.Errorf("%d pods in the node object, want 2", len(pods))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := l.Client(ctx, lab.ClientOptions{Requests: 2}); err != nil {
		t.Fatal(err)
	}
	if err := connectFrom(pod2, lab.TCPVIP.String(), 2); err != nil {
		t.Fatalf("connect from the second Pod: %v", err)
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
	if perClient[lab.PodIP.String()] != 2 || perClient[secondPodIP] != 2 {
		t.Errorf("TCP flows rewritten by netfilter per client: %v, want 2 for each Pod: %s", perClient, dump(flows))
	}
	pc, _ := summary["pcap"].(map[string]any)
	per, _ := pc["per_interface"].(map[string]any)
	for _, name := range []string{"pod:eth0@" + lab.PodIP.String(), "pod:eth0@" + secondPodIP} {
		if n, _ := per[name].(float64); n == 0 {
			t.Errorf("pcapng interface %q holds no packet: %v", name, per)
		}
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
	name := filepath.Base(l.PodNetNS()) + "2"
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() }) // takes both veth ends with it
	node := filepath.Base(l.NodeNetNS())
	for _, args := range [][]string{
		{"netns", "add", name},
		{"link", "add", "veth-pt2", "netns", node, "type", "veth", "peer", "name", lab.PodIface, "netns", name},
		{"-n", node, "link", "set", "veth-pt2", "master", lab.Bridge, "up"},
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
