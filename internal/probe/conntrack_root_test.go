package probe

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestConntrackKernelFilter: the socket filter of a conntrack subscription
// drops, in the kernel, the events of connections to addresses nobody
// watches, and lets those of watched ones through, on the messages the
// kernel really sends.
func TestConntrackKernelFilter(t *testing.T) {
	needRoot(t)
	name := fmt.Sprintf("ptct%d", os.Getpid()%100000)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	ns := "/run/netns/" + name
	// A ct expression turns conntrack on in the netns.
	rules := "table ip ptct {\n chain out {\n  type filter hook output priority 0; policy accept;\n  ct state new counter\n }\n}\n"
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	if out, err := exec.Command("ip", "-n", name, "link", "set", "lo", "up").CombinedOutput(); err != nil {
		t.Fatalf("lo up: %v: %s", err, out)
	}
	connect := func() {
		t.Helper()
		err := nsutil.Do(ns, func() error {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				return err
			}
			defer ln.Close()
			for range 3 {
				c, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					return err
				}
				c.Close()
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// events reports whether the subscription read any message in a while.
	events := func(watched string) bool {
		t.Helper()
		conn, err := listenConntrack(ns, nil, conntrackFilter([]netip.Addr{netip.MustParseAddr(watched)}))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		connect()
		if err := conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		msgs, err := conn.Receive()
		return err == nil && len(msgs) > 0
	}
	if events("192.0.2.1") {
		t.Error("events of connections to 127.0.0.1 passed a filter watching 192.0.2.1")
	}
	if !events("127.0.0.1") {
		t.Error("no event of connections to 127.0.0.1 passed a filter watching it")
	}

	// A Probe's subscription follows its watch list: nothing before the
	// address is watched, its connections' entries after.
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Watch(netip.MustParseAddr("192.0.2.1")); err != nil {
		t.Fatal(err)
	}
	if a := p.AttachConntrack(ns); a[0].Err != nil {
		t.Fatal(a[0].Err)
	}
	connect()
	time.Sleep(300 * time.Millisecond)
	if n := len(p.ctObs); n != 0 || p.counters.ctErrors.Load() != 0 {
		t.Errorf("%d observations, %d errors before 127.0.0.1 was watched; want none", n, p.counters.ctErrors.Load())
	}
	if err := p.Watch(netip.MustParseAddr("127.0.0.1")); err != nil {
		t.Fatal(err)
	}
	connect()
	select {
	case o := <-p.ctObs:
		lo := netip.MustParseAddr("127.0.0.1")
		if o.Proto != obs.TCP || o.Dst.Addr() != lo || o.Src.Addr() != lo || o.Src.Port() == 0 || o.Dst.Port() == 0 {
			t.Errorf("observation %+v, want a TCP connection to 127.0.0.1, ports and all", o)
		}
	case <-time.After(2 * time.Second):
		t.Error("no conntrack observation after 127.0.0.1 was watched")
	}
}

// TestConntrackStopDuringReconnect: a subscription whose socket failed
// opens a new one, unless it was stopped meanwhile. Here stop comes after
// the follower counted the error and before it reopens: the new socket
// would never be closed, nor the follower end, and stop (Probe.Close)
// would wait for it forever.
func TestConntrackStopDuringReconnect(t *testing.T) {
	needRoot(t)
	if err := conntrackModulesErr(kmod.System); err != nil {
		t.Skipf("conntrack netlink: %v", err)
	}
	ns := newNetns(t, fmt.Sprintf("ptctstop%d", os.Getpid()%100000))
	conn, err := listenConntrack(ns, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := &Probe{ctObs: make(chan obs.Observation, 1)}
	sub := &ctSubscription{netnsPath: ns, quit: make(chan struct{}), done: make(chan struct{}), conn: conn}
	go p.followConntrack(sub)
	waitStack(t, "(*ctReader).next")
	sub.mu.Lock() // the follower waits here to reopen
	// A receive error that is not ENOBUFS: the deadline passed.
	if err := conn.SetReadDeadline(time.Now()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); p.counters.ctErrors.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			sub.mu.Unlock()
			t.Fatal("the follower saw no error")
		}
	}
	// What stop does, while the follower waits for the lock.
	close(sub.quit)
	sub.conn.Close()
	sub.mu.Unlock()
	select {
	case <-sub.done:
	case <-time.After(2 * time.Second):
		t.Error("the follower opened a new socket after stop and never ended")
		sub.mu.Lock()
		sub.conn.Close()
		sub.mu.Unlock()
		<-sub.done
	}
}

// waitStack waits until a goroutine's stack holds fn (it parked there).
func waitStack(t *testing.T, fn string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		var b strings.Builder
		if err := pprof.Lookup("goroutine").WriteTo(&b, 2); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(b.String(), fn) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no goroutine in %s", fn)
		}
	}
}

// TestConntrackFilterLearnsSNATSource: the conntrack subscription's filter
// learns, in the kernel, the source the node's SNAT gave a watched flow (the
// reply tuple's destination) as a client endpoint, so the taps keep the
// flow's frames beyond the SNAT even when their destination is watched by no
// one (a tc program on the uplink's egress rewrote it after netfilter).
func TestConntrackFilterLearnsSNATSource(t *testing.T) {
	needRoot(t)
	name := fmt.Sprintf("ptsn%d", os.Getpid()%100000)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	ns := "/run/netns/" + name
	rules := "table ip ptsn {\n chain post {\n  type nat hook postrouting priority 100; policy accept;\n" +
		"  ip daddr 127.0.0.1 meta l4proto tcp snat ip to 127.0.0.2\n }\n}\n"
	cmd := exec.Command("ip", "netns", "exec", name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft: %v: %s", err, out)
	}
	if out, err := exec.Command("ip", "-n", name, "link", "set", "lo", "up").CombinedOutput(); err != nil {
		t.Fatalf("lo up: %v: %s", err, out)
	}
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Watch(netip.MustParseAddr("127.0.0.1")); err != nil {
		t.Fatal(err)
	}
	if a := p.AttachConntrack(ns); a[0].Err != nil {
		t.Fatal(a[0].Err)
	}
	if p.ctSubs[0].prog == nil {
		t.Skip("the conntrack subscription has no eBPF filter here (classic fallback)")
	}
	var snatted []netip.AddrPort
	err = nsutil.Do(ns, func() error {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		defer ln.Close()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			return err
		}
		defer s.Close()
		snatted = append(snatted, netip.MustParseAddrPort(s.RemoteAddr().String()))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if snatted[0].Addr() != netip.MustParseAddr("127.0.0.2") {
		t.Fatalf("the server saw the client as %s: the SNAT rule did not apply", snatted[0])
	}
	var v uint8
	if err := p.maps["watch_clients"].Lookup(clientKey(snatted[0], obs.TCP), &v); err != nil {
		t.Errorf("the SNAT source %s of a connection to a watched address was not learned as a client: %v", snatted[0], err)
	}
}
