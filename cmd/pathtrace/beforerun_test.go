package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestConnectionBeganBeforeTheRun: a keep-alive connection the lab's Pod
// opened to the VIP before pathtrace started, which sends requests during
// the run, is one flow marked began_before_run, whose reason says so first
// and whose verdict comes from its packets (the lab's mode: netfilter by
// the NAT observers around it, tc by the tcx head and netfilter), with its
// backend and its replies; no connection counts as seen by its replies
// alone, and the missing handshake is taken for no refusal.
func TestConnectionBeganBeforeTheRun(t *testing.T) {
	needRoot(t)
	l := testLab(t, "hsbbr")
	for _, mode := range []lab.Mode{lab.ModeNetfilter, lab.ModeTC} {
		t.Run(string(mode), func(t *testing.T) { beganBeforeTheRun(t, l, mode) })
	}
}

func beganBeforeTheRun(t *testing.T, l *lab.Lab, mode lab.Mode) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := l.Up(ctx, mode); err != nil {
		t.Fatalf("lab up %s: %v", mode, err)
	}
	var conn net.Conn
	if err := nsutil.Do(l.PodNetNS(), func() (err error) {
		conn, err = net.DialTimeout("tcp", lab.TCPVIP.String(), 2*time.Second)
		return err
	}); err != nil {
		t.Fatalf("connect from the lab's Pod to %s: %v", lab.TCPVIP, err)
	}
	defer conn.Close()
	rd := bufio.NewReader(conn)
	get := func() error {
		_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", lab.TCPVIP); err != nil {
			return err
		}
		resp, err := http.ReadResponse(rd, nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return err
		}
		if resp.Close {
			return fmt.Errorf("the server closed the keep-alive connection")
		}
		return nil
	}
	if err := get(); err != nil {
		t.Fatalf("request before the run: %v", err)
	}
	// The connection is established and idle when the run begins.
	time.Sleep(300 * time.Millisecond)

	r := startJSON(t, "--host-netns", l.NodeNetNS(), "--svc", lab.TCPVIP.String()+"/tcp", "--duration", "1m")
	r.waitNode(t)
	for i := range 3 {
		if err := get(); err != nil {
			t.Fatalf("request %d during the run: %v", i, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	flows, summary := r.rest(t)
	if summary == nil {
		t.Fatal("no summary line")
	}
	client := conn.LocalAddr().String()
	var mine []map[string]any
	for _, f := range flows {
		if f["client"] == client {
			mine = append(mine, f)
		} else {
			t.Errorf("a flow of another client endpoint than the connection's (%s): %s", client, dump([]map[string]any{f}))
		}
	}
	if len(mine) != 1 {
		t.Fatalf("%d flows of the connection %s, want 1: %s", len(mine), client, dump(flows))
	}
	f := mine[0]
	reason, _ := f["reason"].(string)
	t.Logf("the connection's flow: %s", reason)
	if f["began_before_run"] != true || !strings.HasPrefix(reason, "the connection began before the run") {
		t.Errorf("began_before_run %v, reason %q: want true, said first", f["began_before_run"], reason)
	}
	want := map[lab.Mode]string{lab.ModeNetfilter: "netfilter", lab.ModeTC: "tc"}[mode]
	if f["rewritten_at"] != want || f["backend"] != lab.TCPBackend.String() || f["reply"] != true || f["refused"] != nil {
		t.Errorf("want %s to %s with a reply, not refused: %s", want, lab.TCPBackend, dump(mine))
	}
	if n, _ := summary["replies_without_request"].(float64); n != 0 {
		t.Errorf("replies_without_request %v, want 0: the connection's requests were seen", summary["replies_without_request"])
	}
}
