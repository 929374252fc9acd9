package main

import (
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestUplinkDownFloodedRequest: the lab's uplink port goes down, which
// makes the bridge forget the gateway's MAC it learned there: a Pod's
// request, DNATed by kube-proxy, is flooded to the bridge's other port, a
// second Pod's host veth, whose Pod drops it (OTHERHOST), and never leaves
// the node. Its flow says the uplink never saw the request after its
// rewrite; it said only that the other Pod dropped it, the copy there
// counted as delivered to a Pod of the node.
func TestUplinkDownFloodedRequest(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-flood")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeNetfilter); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	addPod(t, l, otherPodIPs[0])
	node := filepath.Base(l.NodeNetNS())
	uplink := func(state string) {
		if out, err := exec.Command("ip", "-n", node, "link", "set", lab.Uplink, state).CombinedOutput(); err != nil {
			t.Fatalf("uplink %s: %v: %s", state, err, out)
		}
	}
	r := startJSON(t, "--svc", lab.TCPVIP.String(), "--host-netns", l.NodeNetNS(), "--duration", "2m")
	r.waitNode(t)
	// A first request, answered: the Pod knows its gateway's MAC, and the
	// bridge the port it is behind.
	if err := connectFrom(l.PodNetNS(), lab.TCPVIP.String(), 1); err != nil {
		t.Fatalf("request before the uplink went down: %v", err)
	}
	uplink("down")
	t.Cleanup(func() { _ = exec.Command("ip", "-n", node, "link", "set", lab.Uplink, "up").Run() })
	var client string
	err := nsutil.Do(l.PodNetNS(), func() error {
		c, err := net.DialTimeout("tcp", lab.TCPVIP.String(), 1500*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		return err
	})
	if err == nil {
		t.Fatal("the request went through with the uplink down")
	}
	uplink("up")
	flows, _ := r.connectAndStop(t, l.PodNetNS(), lab.TCPVIP.String(), 0)
	var found bool
	for _, f := range flows {
		if !strings.HasPrefix(f["client"].(string), lab.PodIP.String()+":") || f["reply"] == true {
			continue
		}
		found, client = true, f["client"].(string)
		reason := f["reason"].(string)
		if !strings.Contains(reason, "the uplink TX (captured) never saw the request after its rewrite") ||
			strings.Contains(reason, "the kernel dropped it on the node") {
			t.Errorf("flow %v from %s: reason %q: want it to say the uplink never saw the request, not that the kernel dropped it on the node", f["id"], client, reason)
		}
	}
	if !found {
		t.Fatalf("no unanswered flow from %s among %d flows", lab.PodIP, len(flows))
	}
}
