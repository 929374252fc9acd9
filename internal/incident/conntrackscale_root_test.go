package incident

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// conntrackNode is a netns whose conntrack table holds entries unrelated
// UDP entries (a flood to many ports) and 3 entries to testVIP.
func conntrackNode(tb testing.TB, entries int) string {
	tb.Helper()
	if testing.Short() || os.Geteuid() != 0 {
		tb.Skip("needs root (and not -short): creates a network namespace")
	}
	name := fmt.Sprintf("pttest-ctscale-%06x", rand.IntN(1<<24))
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Fatalf("ip netns add: %v: %s", err, out)
	}
	tb.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	path := "/run/netns/" + name
	ns, err := netns.GetFromPath(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer ns.Close()
	conn, err := conntrack.Dial(&netlink.Config{NetNS: int(ns)})
	if err != nil {
		tb.Fatal(err)
	}
	defer conn.Close()
	src, dst := netip.MustParseAddr(testPodIP), netip.MustParseAddr("192.0.2.7")
	for i := range entries {
		f := conntrack.NewFlow(unix.IPPROTO_UDP, 0, src, dst, uint16(1024+i/60000), uint16(1024+i%60000), 600, 0)
		if err := conn.Create(f); err != nil {
			tb.Fatalf("create conntrack entry %d: %v", i, err)
		}
	}
	for i := range 3 {
		f := conntrack.NewFlow(unix.IPPROTO_UDP, 0, src, netip.MustParseAddr(testVIP), uint16(40000+i), 53, 600, 0)
		f.TupleReply.IP.SourceAddress = netip.MustParseAddr(testBackend)
		f.TupleReply.Proto.SourcePort = 5353
		if err := conn.Create(f); err != nil {
			tb.Fatalf("create conntrack entry: %v", err)
		}
	}
	return path
}

// BenchmarkSnapshotConntrackManyEntries: conntrack.txt of a node whose
// table holds 100,000 entries besides the VIP's 3. What it holds in memory
// (B/op) must not grow with the table.
func BenchmarkSnapshotConntrackManyEntries(b *testing.B) {
	path := conntrackNode(b, 100000)
	s := &snapshot{hostPath: path, vips: []netip.Addr{netip.MustParseAddr(testVIP)}}
	for b.Loop() {
		w := newTopicWriter(1 << 20)
		if err := s.conntrack(context.Background(), w); err != nil {
			b.Fatal(err)
		}
		if got := w.buf.String(); strings.Count(got, "dst="+testVIP) != 3 || !strings.Contains(got, "# 3 of 100003 entries matched") {
			b.Fatalf("conntrack.txt:\n%s", got)
		}
	}
	// The process's peak RSS: the table is created over netlink, entry by
	// entry, so the peak is the dump's.
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err == nil {
		b.ReportMetric(float64(ru.Maxrss)/1024, "peak-RSS-MiB")
	}
}

// TestSnapshotConntrackAllEntries: a dump spans many socket reads; every
// entry is counted and the VIP's found among them.
func TestSnapshotConntrackAllEntries(t *testing.T) {
	path := conntrackNode(t, 5000)
	s := &snapshot{hostPath: path, vips: []netip.Addr{netip.MustParseAddr(testVIP)}}
	w := newTopicWriter(1 << 20)
	if err := s.conntrack(context.Background(), w); err != nil {
		t.Fatal(err)
	}
	got := w.buf.String()
	if strings.Count(got, "dst="+testVIP) != 3 || !strings.Contains(got, "# 3 of 5003 entries matched") ||
		!strings.Contains(got, "src="+testBackend+" dst="+testPodIP+" sport=5353 dport=40001") {
		t.Fatalf("conntrack.txt:\n%s", got)
	}
}
