package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"sort"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/lab"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestPortReusedAtOnce: a Pod's client that binds its port and reuses it
// for a new connection half a second after the server closed the last one
// (the server keeps the TIME_WAIT), through kube-proxy's DNAT. conntrack
// reports each connection's new entry as it confirms it, ahead of the
// packets, which the observers' ring and the taps' blocks hand over later:
// each flow has its own conntrack events, and none the next connection's.
// The closed flow took them before (every second flow had none, and each
// before it twice its share and its last sighting in the next one).
func TestPortReusedAtOnce(t *testing.T) {
	needRoot(t)
	l := testLab(t, "ptlab-reuse")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := l.Up(ctx, lab.ModeNetfilter); err != nil {
		t.Fatalf("lab up: %v", err)
	}
	r := startJSON(t, "--svc", lab.TCPVIP.String(), "--host-netns", l.NodeNetNS(), "--duration", "2m")
	r.waitNode(t)
	const conns, port = 6, 40321
	for i := range conns {
		if i > 0 {
			time.Sleep(500 * time.Millisecond) // within the second a close is told from a reuse by
		}
		if err := getFromPort(l.PodNetNS(), port, lab.TCPVIP.String()); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	flows, _ := r.connectAndStop(t, l.PodNetNS(), lab.TCPVIP.String(), 0)
	client := fmt.Sprintf("%s:%d", lab.PodIP, port)
	var mine []map[string]any
	for _, f := range flows {
		if f["client"] == client {
			mine = append(mine, f)
		}
	}
	sort.Slice(mine, func(i, j int) bool { return mine[i]["first"].(string) < mine[j]["first"].(string) })
	if len(mine) != conns {
		t.Fatalf("%d flows from %s, want %d: %v", len(mine), client, conns, mine)
	}
	for i, f := range mine {
		events := 0.0
		for _, p := range f["points"].([]any) {
			if p := p.(map[string]any); p["point"] == "conntrack" {
				events += p["packets"].(float64)
			}
		}
		if events == 0 {
			t.Errorf("flow %v: no conntrack event (reason %q)", f["id"], f["reason"])
		}
		if i+1 < len(mine) && f["last"].(string) >= mine[i+1]["first"].(string) {
			t.Errorf("flow %v: last seen %v, not before the next connection's flow %v began (%v)", f["id"], f["last"], mine[i+1]["id"], mine[i+1]["first"])
		}
	}
}

// getFromPort makes one HTTP/1.0 request to addr from the netns at path
// netns, from the given local port (SO_REUSEADDR), and reads the answer to
// the server's close.
func getFromPort(netns string, port int, addr string) error {
	return nsutil.Do(netns, func() error {
		d := net.Dialer{
			Timeout:   2 * time.Second,
			LocalAddr: &net.TCPAddr{Port: port},
			Control: func(_, _ string, c syscall.RawConn) error {
				var serr error
				if err := c.Control(func(fd uintptr) {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
				}); err != nil {
					return err
				}
				return serr
			},
		}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.0\r\n\r\n"); err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, c)
		return err
	})
}
