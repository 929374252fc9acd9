package session

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestReleaseGone: a Pod tap whose netns path went while another name still
// holds the netns (an app container that restarted in a Pod that lives on)
// is kept, and looks at the other path from then on; once nothing holds the
// netns, the tap is closed and says why.
func TestReleaseGone(t *testing.T) {
	names := testNetNS(t, "pttest-release", "")
	name := names[0]
	first, second := "/run/netns/"+name, "/run/netns/"+name+"-b"
	t.Cleanup(func() {
		exec.Command("umount", second).Run()
		os.Remove(second)
	})
	run(t, "ip", "-n", name, "link", "add", "pt0", "type", "veth", "peer", "name", "pt1")
	inode, err := nsutil.Inode(first)
	if err != nil {
		t.Fatal(err)
	}
	tp, err := capture.Open(capture.Config{NetNS: first, Ifname: "pt0", Role: discover.RolePod})
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Close()
	// A second name for the netns, then the first one goes.
	run(t, "touch", second)
	run(t, "mount", "--bind", first, second)
	run(t, "ip", "netns", "del", name)

	tr := &tracer{taps: []tap{{role: discover.RolePod, ifname: "pt0", netns: first, inode: inode, t: tp, ended: new(string), released: new(string)}},
		scope: map[uint64]bool{inode: true}}
	tr.releaseGone(time.Now())
	if got := tr.taps[0]; *got.released != "" || got.netns != second {
		t.Fatalf("netns still held by %s: released %q, looks at %s; want kept, looking there", second, *got.released, got.netns)
	}
	if !tr.scope[inode] {
		t.Error("the netns of a Pod that lives on left the scope")
	}
	run(t, "umount", second)
	tr.releaseGone(time.Now())
	if got := *tr.taps[0].released; !strings.Contains(got, "kept it (and its veth pair) alive") {
		t.Fatalf("netns held by nothing but the tap: released %q; want it released, saying the capture kept its veth pair", got)
	}
	waitClosed(t, tp)
	// The kernel gives a freed netns's inode number to the next netns made
	// (another node's Pod, a test's): its sockets are no Pod's of the run.
	if tr.scope[inode] {
		t.Errorf("the inode %d of the released netns is still in scope: the next netns to get it would be traced", inode)
	}
}

// TestReleaseGoneVethFirst: a Pod whose CNI deleted the veth before the
// runtime deleted the netns is not released: its tap, unbound, ends by
// itself (its Run returns the error the capture_ended report gives), and it
// never kept the netns alive.
func TestReleaseGoneVethFirst(t *testing.T) {
	names := testNetNS(t, "pttest-vethfirst", "")
	name := names[0]
	path := "/run/netns/" + name
	run(t, "ip", "-n", name, "link", "add", "pt0", "type", "veth", "peer", "name", "pt1")
	inode, err := nsutil.Inode(path)
	if err != nil {
		t.Fatal(err)
	}
	tp, err := capture.Open(capture.Config{NetNS: path, Ifname: "pt0", Role: discover.RolePod})
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Close()
	run(t, "ip", "-n", name, "link", "del", "pt0")
	run(t, "ip", "netns", "del", name)
	tr := &tracer{taps: []tap{{role: discover.RolePod, ifname: "pt0", netns: path, inode: inode, t: tp, ended: new(string), released: new(string)}},
		scope: map[uint64]bool{inode: true}}
	tr.releaseGone(time.Now())
	if got := *tr.taps[0].released; got != "" {
		t.Errorf("released %q; want the unbound tap left to end by itself", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tp.Run(ctx, func(*capture.Packet) {}); err == nil || ctx.Err() != nil {
		t.Errorf("Run of the unbound tap: %v (context %v); want it ended at once with the interface's error", err, ctx.Err())
	}
}

// waitClosed fails unless tp is closed within a second (releaseGone closes
// taps in the background).
func waitClosed(t *testing.T, tp *capture.Tap) {
	t.Helper()
	for deadline := time.Now().Add(time.Second); tp.SetFilter(nil) == nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Error("the released tap is still open")
			return
		}
	}
}

// TestReleaseGoneWhileProducing: the tap of a Pod whose netns was deleted is
// released while its producer waits for the consumer to take a batch (the
// consumer lags: a busy node); releaseGone runs on the consumer, so it must
// not wait for that producer.
func TestReleaseGoneWhileProducing(t *testing.T) {
	names := testNetNS(t, "pttest-busy", "", "-peer")
	name, peer := names[0], names[1]
	pod := "/run/netns/" + name
	run(t, "ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "pt1", "netns", peer)
	run(t, "ip", "-n", name, "addr", "add", "192.0.2.1/24", "dev", "eth0")
	run(t, "ip", "-n", name, "link", "set", "eth0", "up")
	run(t, "ip", "-n", peer, "addr", "add", "192.0.2.2/24", "dev", "pt1")
	run(t, "ip", "-n", peer, "link", "set", "pt1", "up")
	inode, err := nsutil.Inode(pod)
	if err != nil {
		t.Fatal(err)
	}
	filter, err := capture.FilterFor([]obs.Watch{obs.WatchAddr(netip.MustParseAddr("192.0.2.1"))}, 96)
	if err != nil {
		t.Fatal(err)
	}
	tp, err := capture.Open(capture.Config{NetNS: pod, Ifname: "eth0", Role: discover.RolePod, Filter: filter})
	if err != nil {
		t.Fatal(err)
	}
	defer tp.Close()
	tr := &tracer{taps: []tap{{role: discover.RolePod, ifname: "eth0", netns: pod, inode: inode, t: tp, ended: new(string), released: new(string)}},
		free: newBatchPool(freeBatches), freeSmall: newBatchPool(freeBatches)}
	items := make(chan *batch) // nobody takes them: the consumer is busy
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		tr.produce(ctx, 0, tr.taps[0], items)
	}()
	// A frame for the tap: the producer hands it over at the block's end.
	if err := nsutil.Do("/run/netns/"+peer, func() error {
		c, err := net.Dial("udp", "192.0.2.1:9")
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("x"))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	run(t, "ip", "netns", "del", name) // the tap's socket alone holds it now

	released := make(chan struct{})
	go func() {
		defer close(released)
		tr.releaseGone(time.Now())
	}()
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		t.Error("releaseGone waits for the producer, which waits for the consumer that runs releaseGone")
	}
	// The consumer takes the batches again: the producer ends.
	cancel()
	for {
		select {
		case <-items:
			continue
		case <-produced:
		}
		break
	}
	<-released
	if *tr.taps[0].released == "" {
		t.Error("the tap of the deleted netns was not released")
	}
	waitClosed(t, tp)
}

// testNetNS makes a network namespace for each suffix, named prefix, a
// random part and the suffix, deleted when the test ends; it skips the test
// unless it runs as root and not -short.
func testNetNS(t *testing.T, prefix string, suffixes ...string) []string {
	t.Helper()
	if testing.Short() || os.Geteuid() != 0 {
		t.Skip("needs root (and not -short): makes network namespaces")
	}
	base := fmt.Sprintf("%s-%06x", prefix, rand.IntN(1<<24))
	var names []string
	for _, sfx := range suffixes {
		name := base + sfx
		run(t, "ip", "netns", "add", name)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
		names = append(names, name)
	}
	return names
}

// run runs a command, and fails the test when it fails.
func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%v: %v: %s", args, err, out)
	}
}
