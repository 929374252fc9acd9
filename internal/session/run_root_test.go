package session

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gopacket/gopacket/pcapgo"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// TestRunLeavesNothingBehind: a session that ended leaves the process as it
// found it: no goroutine, no descriptor (observers, taps, maps, netlink
// sockets) and no process-wide setting of its own, since another session
// of the process may still be capturing (a daemon runs several).
func TestRunLeavesNothingBehind(t *testing.T) {
	name := testNetNS(t, "pttest-leave", "")[0]
	gcPercent := debug.SetGCPercent(100)
	defer debug.SetGCPercent(gcPercent)
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)

	_, err := Run(context.Background(), Options{
		Services: []flow.Service{{Addr: netip.MustParseAddr("192.0.2.80")}},
		Duration: 100 * time.Millisecond,
		Discover: discover.Options{HostNetNS: "/run/netns/" + name},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := debug.SetGCPercent(100); got != 100 {
		t.Errorf("GC percent %d after the session, want the process's 100 kept", got)
	}
	// What ends asynchronously (a goroutine's last steps) is given a moment.
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		now, open := runtime.NumGoroutine(), openFDs(t)
		if now <= goroutines && slices.Equal(open, fds) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the session: %d goroutines (before: %d), descriptors %v (before: %v)", now, goroutines, open, fds)
		}
	}
}

// openFDs lists the process's open descriptors, with what each refers to.
func openFDs(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name()) // the directory's own descriptor is gone by now
		out = append(out, e.Name()+" "+target)
	}
	return out
}

// TestNothingCountedAfterTheRun: what the node does once the run is over
// is not the run's. Flows that start after it (here, while the report is
// about to be built) would fill the observers' ring, which nobody reads
// any more, and be counted as losses, telling the user to trace fewer
// Pods or ports; conntrack events lost so would undo verdicts.
func TestNothingCountedAfterTheRun(t *testing.T) {
	netns, vip := vipToNowhere(t, "pttest-after")
	var sendErr error
	res, err := Run(context.Background(), Options{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Duration: 100 * time.Millisecond,
		Discover: discover.Options{HostNetNS: netns},
		// Several times what the 512 KiB ring holds: a flow per socket.
		CaptureDone: func() { sendErr = sendFromSockets(netns, vip, 5000) },
	})
	if err != nil {
		t.Fatal(err)
	}
	if sendErr != nil {
		t.Fatal(sendErr)
	}
	for _, d := range []string{"ringbuf_losses", "conntrack_drops", "conntrack_errors"} {
		if n := res.Drops[d]; n != 0 {
			t.Errorf("%s = %d: counted after the run", d, n)
		}
	}
}

// TestEveryLossCounterReported: the summary's drops hold every loss
// counter, zeros included (README), so that a script or a dashboard reads
// a zero as nothing lost rather than as a counter it cannot find.
// points_unnamed was there only once non-zero.
func TestEveryLossCounterReported(t *testing.T) {
	netns, vip := vipToNowhere(t, "pttest-drops")
	res, err := Run(context.Background(), Options{
		Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Duration: 100 * time.Millisecond,
		Discover: discover.Options{HostNetNS: netns},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"ringbuf_losses", "kernel_learn_errors", "filter_update_errors", "event_decode_errors", "conntrack_errors", "conntrack_drops", "points_unnamed"} {
		if _, ok := res.Drops[d]; !ok {
			t.Errorf("drops lack %s: %v", d, res.Drops)
		}
	}
	for _, d := range []string{flow.DropFlowsOverMax, flow.DropFlowsJoined, flow.DropUnmatchedOverflow, flow.DropUnrelatedOverflow} {
		if _, ok := res.Summary.Drops[d]; !ok {
			t.Errorf("the engine's drops lack %s: %v", d, res.Summary.Drops)
		}
	}
}

// TestCaptureHooksInOrder: a caller that tunes its process for the capture
// (CaptureStart) and after it (CaptureDone) is called once each, in that
// order, once the capture is in place (Ready).
func TestCaptureHooksInOrder(t *testing.T) {
	netns, vip := vipToNowhere(t, "pttest-hooks")
	var calls []string
	_, err := Run(context.Background(), Options{
		Services:     []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
		Duration:     100 * time.Millisecond,
		Discover:     discover.Options{HostNetNS: netns},
		Ready:        func(*discover.NodeInfo, []probe.Attachment) { calls = append(calls, "ready") },
		CaptureStart: func() { calls = append(calls, "start") },
		CaptureDone:  func() { calls = append(calls, "done") },
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"ready", "start", "done"}; !slices.Equal(calls, want) {
		t.Errorf("hooks called %v, want %v", calls, want)
	}
}

// vipToNowhere makes a netns (its name made from prefix) whose route to a
// UDP VIP, returned with the netns's path, leads to a veth whose peer has
// no address: datagrams to it pass the observers and the uplink's tap, and
// go nowhere.
func vipToNowhere(t *testing.T, prefix string) (netns string, vip netip.AddrPort) {
	t.Helper()
	name := testNetNS(t, prefix, "")[0]
	run(t, "ip", "-n", name, "link", "add", "pt0", "type", "veth", "peer", "name", "pt1")
	run(t, "ip", "-n", name, "link", "set", "pt1", "up")
	run(t, "ip", "-n", name, "addr", "add", "192.0.2.1/24", "dev", "pt0")
	run(t, "ip", "-n", name, "link", "set", "pt0", "up")
	return "/run/netns/" + name, netip.MustParseAddrPort("192.0.2.80:53")
}

// TestCaptureBehind: a run whose capture ring backs up says so through
// CaptureBehind (here a burst sent before the capture reads anything fills
// the smallest ring), so that the caller may give the capture more CPU; a
// run that keeps up does not.
func TestCaptureBehind(t *testing.T) {
	netns, vip := vipToNowhere(t, "pttest-behind")
	// A neighbour for the VIP: the datagrams leave pt0 (where the uplink's
	// tap sees them) instead of waiting for an ARP reply.
	run(t, "ip", "-n", filepath.Base(netns), "neigh", "add", vip.Addr().String(), "lladdr", "02:00:00:00:00:50", "dev", "pt0", "nud", "permanent")
	for _, burst := range []int{0, 400} {
		var behind atomic.Int32
		var sendErr error
		res, err := Run(context.Background(), Options{
			Services:  []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
			Duration:  300 * time.Millisecond,
			Discover:  discover.Options{HostNetNS: netns},
			RingBytes: capture.MinRingBytes, // 4 blocks of 4 KiB: 400 frames are many times that
			// Ready comes before the taps are read.
			Ready: func(*discover.NodeInfo, []probe.Attachment) {
				if burst > 0 {
					sendErr = sendFromSockets(netns, vip, burst)
				}
			},
			CaptureBehind: func() { behind.Add(1) },
		})
		if err != nil {
			t.Fatal(err)
		}
		if sendErr != nil {
			t.Fatal(sendErr)
		}
		if called := behind.Load() > 0; called != (burst > 0) {
			t.Errorf("burst of %d datagrams before the capture read: CaptureBehind called %d times (captured %v, drops %v)",
				burst, behind.Load(), res.Packets, res.Drops)
		}
	}
}

// sendFromSockets sends one datagram to dst from each of n sockets of the
// netns at path.
func sendFromSockets(path string, dst netip.AddrPort, n int) error {
	return nsutil.Do(path, func() error {
		for range n {
			c, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(dst))
			if err != nil {
				return err
			}
			_, err = c.Write([]byte("x"))
			c.Close()
			if err != nil {
				return err
			}
		}
		return nil
	})
}

// TestLastFramesReachTheFile: the frames of a burst that no later frame
// follows (a Pod's last requests before pathtrace is killed, what a live
// reader of --pcap - waits for) reach the file once their merge window
// passed (200 ms, plus a ring block's 100 ms and the writer's 100 ms), not
// at the consumer's next tick, up to a second later (about 0.3 s against
// 1.1 s in the lab: the bound leaves a loaded machine room).
func TestLastFramesReachTheFile(t *testing.T) {
	netns, vip := vipToNowhere(t, "ptr2-due")
	run(t, "ip", "-n", filepath.Base(netns), "neigh", "add", vip.Addr().String(), "lladdr", "02:00:00:00:00:50", "dev", "pt0", "nud", "permanent")
	pcap := filepath.Join(t.TempDir(), "due.pcapng")
	sent := make(chan time.Time, 1)
	done := make(chan error, 1)
	go func() {
		_, err := Run(context.Background(), Options{
			Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}},
			Duration: 3 * time.Second,
			Discover: discover.Options{HostNetNS: netns},
			Pcap:     pcap,
			// Sent as the run begins: its first tick is a second away.
			Ready: func(*discover.NodeInfo, []probe.Attachment) {
				if err := sendFromSockets(netns, vip, 3); err != nil {
					t.Error(err)
				}
				sent <- time.Now()
			},
		})
		done <- err
	}()
	var at time.Time
	select {
	case at = <-sent:
	case err := <-done:
		t.Fatalf("the run ended before it was ready: %v", err)
	}
	const within = 900 * time.Millisecond
	for packetsIn(t, pcap+".partial") == 0 {
		if waited := time.Since(at); waited > within {
			t.Errorf("no frame in the file %v after the burst", waited.Round(time.Millisecond))
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// packetsIn counts the packets of a capture file being written.
func packetsIn(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, err := pcapgo.NewNgReader(f, pcapgo.DefaultNgReaderOptions)
	if err != nil {
		return 0 // the header is not written yet
	}
	n := 0
	for {
		if _, _, err := r.ReadPacketData(); err != nil {
			return n
		}
		n++
	}
}
