package main

import (
	"context"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
)

// TestSocketLBToOwnPod: the socket LB picks the client's own Pod, as
// Cilium's does for a Pod that calls a Service it is an endpoint of: the
// backend's address is one of the Pod's own (here on its lo), so each
// connection goes through the Pod's loopback and reaches no tap. Before a
// server listens there, the Pod's kernel refuses the connection (NO_SOCKET
// on lo); then one is answered. Neither is a hairpin the node lost, which
// the reasons said, with bridge hairpin advice, and no flow was refused.
func TestSocketLBToOwnPod(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-ownpod")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeSocket); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	mustRun(t, nil, "ip", "-n", filepath.Base(l.PodNetNS()), "addr", "add", lab.TCPBackend.Addr().String()+"/32", "dev", "lo")

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "60s")
	r.waitNode(t)
	if _, err := l.Client(ctx, lab.ClientOptions{Requests: 1}); err != nil {
		t.Fatal(err)
	}
	serveIn(t, l.PodNetNS(), lab.TCPBackend.String())
	if _, err := l.Client(ctx, lab.ClientOptions{Requests: 1}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, _ := r.rest(t)
	if len(flows) != 2 {
		t.Fatalf("%d flows, want 2: %s", len(flows), dump(flows))
	}
	for i, want := range []string{"but nothing listened there", "never left the Pod"} {
		f := flows[i]
		reason, _ := f["reason"].(string)
		refused := f["refused"] == true
		if f["rewritten_at"] != "socket" || f["backend"] != lab.TCPBackend.String() || !strings.Contains(reason, want) ||
			strings.Contains(reason, "hairpin") || refused != (i == 0) {
			t.Errorf("flow %d: want socket to %s, refused %v, its reason saying %q and naming no hairpin: %s", i+1, lab.TCPBackend, i == 0, want, dump([]map[string]any{f}))
		}
	}
}
