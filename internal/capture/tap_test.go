package capture

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

func TestOpenRejectsBadConfig(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Ifname: "eth0", Snaplen: -1},
		{Ifname: "eth0", Snaplen: 70000},
		{Ifname: "eth0", RingBytes: MinRingBytes - 1},
		{Ifname: "eth0", RingBytes: MaxRingBytes + 1},
		{Ifname: "eth0", RingBytes: MinRingBytes, Snaplen: 4000}, // larger than a 4 KiB block
		{Ifname: "eth0", NetNS: "/nonexistent/netns"},
	} {
		if tap, err := Open(cfg); err == nil {
			tap.Close()
			t.Errorf("Open(%+v) succeeded", cfg)
		}
	}
}

func TestRingGeometry(t *testing.T) {
	for _, ring := range []int{MinRingBytes, DefaultRingBytes, 1<<20 + 12345, MaxRingBytes} {
		size, nr := ringGeometry(ring)
		if size > maxBlockBytes || size%os.Getpagesize() != 0 || nr < 4 || size*nr > ring {
			t.Errorf("ringGeometry(%d) = %d blocks of %d", ring, nr, size)
		}
	}
}

// TestMinRingFor: the smallest ring for a snaplen has blocks that hold it
// (Open's check), and a ring a page per block smaller would not.
func TestMinRingFor(t *testing.T) {
	page := os.Getpagesize()
	fits := func(ring, snaplen int) bool {
		size, _ := ringGeometry(ring)
		return snaplen <= size-blockDescLen-128
	}
	for _, snaplen := range []int{64, DefaultSnaplen, 1500, 9000, 65535} {
		ring := MinRingFor(snaplen)
		if ring < MinRingBytes || !fits(ring, snaplen) {
			t.Errorf("MinRingFor(%d) = %d: its blocks do not hold the frame", snaplen, ring)
		}
		if smaller := ring - 4*page; smaller >= MinRingBytes && fits(smaller, snaplen) {
			t.Errorf("MinRingFor(%d) = %d, but %d holds the frame too", snaplen, ring, smaller)
		}
	}
}

func needRoot(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: the tests that need root are left out")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates network namespaces, veths and AF_PACKET sockets")
	}
}

// newNetns creates a named netns (removed at cleanup) and returns its path.
func newNetns(t *testing.T, name string) string {
	t.Helper()
	t.Cleanup(func() { _ = netns.DeleteNamed(name) })
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("current netns: %v", err)
	}
	defer orig.Close()
	created, err := netns.NewNamed(name)
	if serr := netns.Set(orig); serr != nil {
		t.Fatalf("return to the original netns: %v", serr) // the thread stays locked and dies
	}
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatalf("create netns %s: %v", name, err)
	}
	created.Close()
	return "/run/netns/" + name
}

// lab is two netns joined by a veth pair: "pta" in a, "ptb" in b, with
// 192.0.2.1/24 + 198.51.100.1/24 on pta and .2 on ptb.
type lab struct{ a, b string }

func newLab(t *testing.T) lab {
	t.Helper()
	id := make([]byte, 4)
	_, _ = rand.Read(id)
	prefix := "pttest-capture-" + hex.EncodeToString(id)
	l := lab{a: newNetns(t, prefix+"-a"), b: newNetns(t, prefix+"-b")}
	handles := map[string]*netlink.Handle{}
	for _, p := range []string{l.a, l.b} {
		ns, err := netns.GetFromPath(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ns.Close() })
		h, err := netlink.NewHandleAt(ns)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.Close)
		handles[p] = h
	}
	nsB, _ := netns.GetFromPath(l.b)
	defer nsB.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pta"}, PeerName: "ptb", PeerNamespace: netlink.NsFd(nsB)}
	if err := handles[l.a].LinkAdd(veth); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	for p, name := range map[string]string{l.a: "pta", l.b: "ptb"} {
		h := handles[p]
		link, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		host := "1"
		if p == l.b {
			host = "2"
		}
		for _, cidr := range []string{"192.0.2." + host + "/24", "198.51.100." + host + "/24"} {
			addr, _ := netlink.ParseAddr(cidr)
			if err := h.AddrAdd(link, addr); err != nil {
				t.Fatalf("add %s on %s: %v", cidr, name, err)
			}
		}
		if err := h.LinkSetUp(link); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

func udpListen(t *testing.T, nsPath, addr string) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	err := nsutil.Do(nsPath, func() error {
		var err error
		c, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr)))
		return err
	})
	if err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// send sends n datagrams from c to the address of to and waits until to has
// read them all, so they have crossed the veth.
func send(t *testing.T, from, to *net.UDPConn, n int) {
	t.Helper()
	buf := make([]byte, 64)
	for range n {
		if _, err := from.WriteToUDP([]byte("pathtrace"), to.LocalAddr().(*net.UDPAddr)); err != nil {
			t.Fatalf("send: %v", err)
		}
		_ = to.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, _, err := to.ReadFromUDP(buf); err != nil {
			t.Fatalf("receive on %v: %v", to.LocalAddr(), err)
		}
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// recorder collects what a running tap delivers.
type recorder struct {
	mu   sync.Mutex
	pkts []*Packet
}

func (r *recorder) add(p *Packet) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pkts = append(r.pkts, p.Clone())
}

func (r *recorder) snapshot() []*Packet {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*Packet(nil), r.pkts...)
}

// matching returns the observations of UDP datagrams from src to dst.
func (r *recorder) matching(t *testing.T, src, dst string) []obs.Observation {
	var out []obs.Observation
	for _, p := range r.snapshot() {
		o, ok := p.Observation(obs.PointPod)
		if !ok {
			t.Errorf("delivered a frame that is not IPv4 TCP/UDP: %x", p.Data)
			continue
		}
		if o.Proto == obs.UDP && o.Src.String() == src && o.Dst.String() == dst {
			out = append(out, o)
		}
	}
	return out
}

func startRun(t *testing.T, tap *Tap, fn func(*Packet)) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tap.Run(ctx, fn) }()
	t.Cleanup(cancel)
	return func() error {
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(5 * time.Second):
			t.Fatalf("Run did not return after cancel")
			return nil
		}
	}
}

// packetSockets counts the AF_PACKET sockets bound to ifindex in a netns.
func packetSockets(t *testing.T, nsPath string, ifindex int) int {
	t.Helper()
	var text []byte
	err := nsutil.Do(nsPath, func() error {
		var err error
		text, err = os.ReadFile("/proc/thread-self/net/packet")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(text), "\n")[1:] {
		// sk RefCnt Type Proto Iface R Rmem User Inode
		if f := strings.Fields(line); len(f) > 4 && f[4] == strconv.Itoa(ifindex) {
			n++
		}
	}
	return n
}

func TestTapDirectionsFilterStatsClose(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	a2, b2 := udpListen(t, l.a, "198.51.100.1:4003"), udpListen(t, l.b, "198.51.100.2:4004")

	start := time.Now()
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "pod", Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2")})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	if n := packetSockets(t, l.a, tap.Ifindex()); n != 1 {
		t.Fatalf("%d packet sockets on pta after Open, want 1", n)
	}
	var rec recorder
	stop := startRun(t, tap, rec.add)

	// Filtered-out traffic goes first: once the later, accepted traffic has
	// been delivered, anything of it that slipped through would have been too.
	send(t, a2, b2, 3)
	send(t, b2, a2, 3)
	send(t, a1, b1, 3)
	send(t, b1, a1, 3)
	waitFor(t, "6 datagrams on 192.0.2.0/24", func() bool {
		return len(rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")) == 3 &&
			len(rec.matching(t, "192.0.2.2:4002", "192.0.2.1:4001")) == 3
	})
	for _, o := range rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002") {
		if o.Dir != obs.DirOut || o.Ifindex != tap.Ifindex() || o.Time.Before(start) || o.Time.After(time.Now()) {
			t.Errorf("sent datagram: dir %v ifindex %d time %v", o.Dir, o.Ifindex, o.Time)
		}
	}
	for _, o := range rec.matching(t, "192.0.2.2:4002", "192.0.2.1:4001") {
		if o.Dir != obs.DirIn {
			t.Errorf("received datagram: dir %v", o.Dir)
		}
	}
	for _, p := range rec.snapshot() {
		if p.Dir == obs.DirOut && (p.PktType != unix.PACKET_OUTGOING || !p.CsumNotReady) {
			t.Errorf("veth TX frame: pkttype %d csumNotReady %v, want OUTGOING and true (CHECKSUM_PARTIAL)", p.PktType, p.CsumNotReady)
		}
		if p.VLANOutOfBand || p.TPID != 0 {
			t.Errorf("untagged traffic reported with a tag: %+v", p)
		}
	}
	if got := rec.matching(t, "198.51.100.1:4003", "198.51.100.2:4004"); len(got) != 0 {
		t.Errorf("filtered-out traffic delivered: %v", got)
	}
	if n := len(rec.snapshot()); n != 6 {
		t.Errorf("%d frames delivered, want exactly the 6 datagrams (no ARP, IPv6 or other traffic)", n)
	}
	waitFor(t, "every accepted frame delivered", func() bool {
		s := tap.Stats()
		return s.KernelPackets == s.Packets+s.KernelDrops && s.Packets == uint64(len(rec.snapshot()))
	})
	if s := tap.Stats(); s.Packets != 6 || s.KernelDrops != 0 || s.DecodeErrors != 0 {
		t.Errorf("stats %+v, want 6 packets, no drops, no decode errors", s)
	}

	// A new filter takes effect on the running tap.
	if err := tap.SetFilter(mustFilter(t, DefaultSnaplen, "192.0.2.2", "198.51.100.2")); err != nil {
		t.Fatalf("SetFilter: %v", err)
	}
	send(t, a2, b2, 2)
	waitFor(t, "datagrams after SetFilter", func() bool {
		return len(rec.matching(t, "198.51.100.1:4003", "198.51.100.2:4004")) == 2
	})

	if err := tap.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := stop(); err != nil {
		t.Errorf("Run after Close: %v", err)
	}
	if err := tap.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if n := packetSockets(t, l.a, tap.Ifindex()); n != 0 {
		t.Errorf("%d packet sockets on pta after Close", n)
	}
	if s := tap.Stats(); s.Packets != 8 || s.KernelPackets != 8 {
		t.Errorf("stats after Close %+v, want 8 packets", s)
	}
	if err := tap.SetFilter(mustFilter(t, 96)); !errors.Is(err, ErrClosed) {
		t.Errorf("SetFilter after Close: %v", err)
	}
	if err := tap.Run(context.Background(), func(*Packet) {}); !errors.Is(err, ErrClosed) {
		t.Errorf("Run after Close: %v", err)
	}
}

func TestTapCountsRingDrops(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	send(t, a1, b1, 1) // resolve the neighbour before capturing

	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", RingBytes: MinRingBytes, Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2")})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	const sent = 400 // far more than 4 blocks of 4 KiB hold
	send(t, a1, b1, sent)
	s := tap.Stats()
	if s.KernelPackets != sent || s.KernelDrops == 0 || s.QueueFreezes == 0 || s.Packets != 0 {
		t.Fatalf("stats before Run %+v, want %d kernel packets, drops and freezes", s, sent)
	}

	var delivered int
	stop := startRun(t, tap, func(p *Packet) {
		if p.Dir != obs.DirOut {
			t.Errorf("dir %v, want out", p.Dir)
		}
		delivered++
	})
	waitFor(t, "the ring to drain", func() bool {
		s := tap.Stats()
		return s.Packets+s.KernelDrops == s.KernelPackets
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	s = tap.Stats()
	if s.KernelPackets != sent || s.Packets != uint64(delivered) || s.Packets+s.KernelDrops != sent || s.DecodeErrors != 0 {
		t.Errorf("stats %+v, delivered %d: want every one of %d packets delivered or counted as dropped", s, delivered, sent)
	}
	t.Logf("ring of %d bytes: %+v", MinRingBytes, s)
}

// A reader that finds a quarter of the ring waiting hears of it while the
// backlog lasts (Config.Behind), not once it caught up; one that keeps up
// never does.
func TestTapSaysWhenItFallsBehind(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	send(t, a1, b1, 1) // resolve the neighbour before capturing

	var behind atomic.Int32
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", RingBytes: MinRingBytes, Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2"),
		Behind: func() { behind.Add(1) }})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	drained := func() bool { s := tap.Stats(); return s.Packets+s.KernelDrops == s.KernelPackets }

	// Every block full before Run reads the first: it is behind.
	send(t, a1, b1, 400)
	var stall atomic.Pointer[chan struct{}] // when set, the reader waits for it to close
	stop := startRun(t, tap, func(*Packet) {
		if gate := stall.Swap(nil); gate != nil {
			<-*gate
		}
	})
	waitFor(t, "the ring to drain", drained)
	first := behind.Load()
	if first == 0 {
		t.Fatal("Behind not called for a full ring read once")
	}
	// A datagram at a time, each block handed over alone at its retire
	// timeout: never behind.
	for range 3 {
		send(t, a1, b1, 1)
		time.Sleep(2 * retireTimeoutMs * time.Millisecond)
	}
	waitFor(t, "the ring to drain", drained)
	if n := behind.Load(); n != first {
		t.Errorf("Behind called %d times in all, want the %d of the full ring: once caught up, the reader kept up", n, first)
	}
	// The reader stalls on a frame while the ring fills: behind again.
	gate := make(chan struct{})
	stall.Store(&gate)
	send(t, a1, b1, 1)
	waitFor(t, "the reader to stall", func() bool { return stall.Load() == nil })
	send(t, a1, b1, 400)
	close(gate)
	waitFor(t, "Behind again", func() bool { return behind.Load() > first })
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// A run that ends right after traffic still delivers it: the kernel hands
// over a partly filled block only at its retire timeout, long after the end.
func TestTapDeliversWhatCameBeforeTheEnd(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	send(t, a1, b1, 1) // resolve the neighbour before capturing

	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2")})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	var r recorder
	stop := startRun(t, tap, r.add)
	const sent = 20 // a fraction of a block: only the retire timeout hands it over
	send(t, a1, b1, sent)
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if got := len(r.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")); got != sent {
		t.Errorf("Run delivered %d of the %d datagrams sent before it was stopped", got, sent)
	}
	if s := tap.Stats(); s.Packets != s.KernelPackets || s.KernelDrops != 0 {
		t.Errorf("stats %+v: every packet the filter accepted should have been delivered", s)
	}
}

func TestTapMaxFilterAndMissingInterface(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	if _, err := Open(Config{NetNS: l.a, Ifname: "nosuchif"}); err == nil || !strings.Contains(err.Error(), "nosuchif") {
		t.Errorf("Open of a missing interface: %v", err)
	}
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta"})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	addrs := make([]netip.Addr, MaxFilterAddrs)
	for i := range addrs {
		addrs[i] = netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})
	}
	prog, err := FilterFor(watchAll(addrs), DefaultSnaplen)
	if err != nil {
		t.Fatal(err)
	}
	if err := tap.SetFilter(prog); err != nil {
		t.Errorf("kernel refused a filter for %d addresses (%d instructions): %v", MaxFilterAddrs, len(prog), err)
	}
	// Endpoints: the port compares the kernel must take too (scratch
	// memory, jumps over each address's block), near its limit.
	var ws []obs.Watch
	for i := range 90 {
		for p := range 3 {
			ws = append(ws, obs.Watch{Addr: netip.AddrFrom4([4]byte{10, 3, 0, byte(i)}), Port: uint16(80 + p), Proto: obs.TCP})
		}
	}
	ws = append(ws, obs.WatchAddr(netip.MustParseAddr("10.4.0.1")), obs.Watch{Addr: netip.MustParseAddr("10.4.0.2"), Port: 53})
	prog, err = FilterFor(ws, DefaultSnaplen)
	if err != nil {
		t.Fatal(err)
	}
	if err := tap.SetFilter(prog); err != nil {
		t.Errorf("kernel refused a filter of %d endpoints (%d instructions): %v", len(ws), len(prog), err)
	}
	if err := tap.SetFilter([]bpf.RawInstruction{}); err == nil {
		t.Errorf("empty filter accepted")
	}
}

// inject sends a raw Ethernet frame out of ifname in the netns at nsPath.
func inject(t *testing.T, nsPath, ifname string, frame []byte) {
	t.Helper()
	err := nsutil.Do(nsPath, func() error {
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ifi, err := net.InterfaceByName(ifname)
		if err != nil {
			return err
		}
		return unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: ifi.Index})
	})
	if err != nil {
		t.Fatalf("inject on %s: %v", ifname, err)
	}
}

// TestTapVLANTags sends a QinQ frame over the veth: the sender's TX tap sees
// both tags in band; on the receiving side the kernel moves the outer tag out
// of band (skb_vlan_untag runs before the RX taps), and AppendFrame must give
// back the frame that was sent.
func TestTapVLANTags(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	filter := mustFilter(t, DefaultSnaplen, "192.0.2.2")
	tx, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "host", Filter: filter})
	if err != nil {
		t.Fatalf("Open pta: %v", err)
	}
	t.Cleanup(func() { tx.Close() })
	rx, err := Open(Config{NetNS: l.b, Ifname: "ptb", Role: "uplink", Filter: filter})
	if err != nil {
		t.Fatalf("Open ptb: %v", err)
	}
	t.Cleanup(func() { rx.Close() })
	var txRec, rxRec recorder
	stopTX, stopRX := startRun(t, tx, txRec.add), startRun(t, rx, rxRec.add)

	frame := udpFrame(t, "192.0.2.1", "192.0.2.2", 4001, 4002,
		tag{tpid: etherTypeDot1AD, vid: 100, pcp: 5}, tag{tpid: etherTypeDot1Q, vid: 200})
	inject(t, l.a, "pta", frame)
	waitFor(t, "the QinQ frame on both taps", func() bool {
		return len(txRec.snapshot()) == 1 && len(rxRec.snapshot()) == 1
	})
	if err := errors.Join(stopTX(), stopRX()); err != nil {
		t.Fatalf("Run: %v", err)
	}

	sent := txRec.snapshot()[0]
	if sent.Dir != obs.DirOut || sent.VLANOutOfBand || sent.TPID != etherTypeDot1AD || sent.VLAN != 100 {
		t.Errorf("TX tap: dir %v oob %v tpid %#x vlan %d, want out, in band, 0x88a8, 100", sent.Dir, sent.VLANOutOfBand, sent.TPID, sent.VLAN)
	}
	got := rxRec.snapshot()[0]
	if got.Dir != obs.DirIn || !got.VLANOutOfBand || got.TPID != etherTypeDot1AD || got.VLAN != 100 || got.TCI != 5<<13|100 {
		t.Errorf("RX tap: dir %v oob %v tpid %#x tci %#x, want in, out of band, 0x88a8, 0xa064", got.Dir, got.VLANOutOfBand, got.TPID, got.TCI)
	}
	if got.Len != len(frame)-4 || len(got.Data) != len(frame)-4 {
		t.Errorf("RX frame of %d bytes (len %d), want the sent %d minus the 4-byte outer tag", len(got.Data), got.Len, len(frame))
	}
	if o, ok := got.Observation(obs.PointUplink); !ok || o.VLAN != 100 || o.TPID != etherTypeDot1AD || o.Dst.String() != "192.0.2.2:4002" {
		t.Errorf("RX observation %+v (decoded %v)", o, ok)
	}
	if back := got.AppendFrame(nil); string(back) != string(frame) {
		t.Errorf("AppendFrame\n%x\nwant the frame sent\n%x", back, frame)
	}
}

// TestTapReportsInterfaceGone: when the captured interface disappears (a Pod
// deleted mid-session), Run ends with ENETDOWN instead of idling silently:
// whether it went while Run was parked, or before Run looked (the wake-up
// then came before Run's wait, which the runtime forgets: CI once caught
// Run parked for good that way).
func TestTapReportsInterfaceGone(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		name        string
		deleteFirst bool
	}{{"while Run waits", false}, {"before Run", true}} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLab(t)
			tap, err := Open(Config{NetNS: l.a, Ifname: "pta"})
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			t.Cleanup(func() { tap.Close() })
			done := make(chan error, 1)
			run := func() { go func() { done <- tap.Run(context.Background(), func(*Packet) {}) }() }
			if !tc.deleteFirst {
				run()
				// Let Run reach its wait: a frame it hands over proves
				// it is in its loop; the ring's 100 ms retire then parks it.
				inject(t, l.a, "pta", udpFrame(t, "192.0.2.1", "192.0.2.2", 4001, 4002))
				time.Sleep(300 * time.Millisecond)
			}
			deleteLink(t, l.a, "pta")
			if tc.deleteFirst {
				run()
			}
			select {
			case err := <-done:
				if !errors.Is(err, unix.ENETDOWN) {
					t.Errorf("Run returned %v, want ENETDOWN", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("Run kept running after its interface was deleted")
			}
		})
	}
}

// TestTapSurvivesLinkFlap: an interface that goes down and comes back up
// (a bond or NIC that flaps) does not end its capture: frames after it are
// captured again, and the time it was down is counted. Deleted while down,
// it ends Run as a deletion does.
func TestTapSurvivesLinkFlap(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "uplink", Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2")})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	var rec recorder
	done := make(chan error, 1)
	go func() { done <- tap.Run(context.Background(), rec.add) }()
	send(t, a1, b1, 2)
	waitFor(t, "2 datagrams before the flap", func() bool { return len(rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")) == 2 })

	setLinkUp(t, l.a, "pta", false)
	waitFor(t, "the link counted down", func() bool { return tap.Stats().LinkDowns == 1 })
	time.Sleep(300 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Run ended while the link was down: %v", err)
	default:
	}
	setLinkUp(t, l.a, "pta", true)
	setLinkUp(t, l.b, "ptb", true) // a veth's peer loses its carrier, not its state
	waitFor(t, "the datagrams after the flap", func() bool {
		send(t, a1, b1, 1)
		return len(rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")) >= 3
	})
	if st := tap.Stats(); st.LinkDowns != 1 || st.LinkDown < 300*time.Millisecond || st.FirstDown.IsZero() {
		t.Errorf("stats after the flap: %d downs, %s down, first at %v; want 1, at least 300ms", st.LinkDowns, st.LinkDown, st.FirstDown)
	}
	waitFor(t, "the flap's end noted", func() bool {
		d1 := tap.Stats().LinkDown
		time.Sleep(50 * time.Millisecond)
		return tap.Stats().LinkDown == d1 // no longer growing: up again
	})

	setLinkUp(t, l.a, "pta", false)
	waitFor(t, "the second down", func() bool { return tap.Stats().LinkDowns == 2 })
	deleteLink(t, l.a, "pta")
	select {
	case err := <-done:
		if !errors.Is(err, unix.ENETDOWN) {
			t.Errorf("Run returned %v, want ENETDOWN", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("Run kept running after its interface was deleted while down")
	}
	// Closed, as the session closes a tap whose Run ended: the time after
	// is no gap of its capture.
	tap.Close()
	if d1, d2 := tap.Stats().LinkDown, tap.Stats().LinkDown; d1 != d2 {
		t.Errorf("the down time still grows after Close: %s, then %s", d1, d2)
	}
}

// setLinkUp sets the interface ifname in the netns at nsPath up or down.
func setLinkUp(t *testing.T, nsPath, ifname string, up bool) {
	t.Helper()
	withLink(t, nsPath, ifname, func(h *netlink.Handle, link netlink.Link) error {
		if up {
			return h.LinkSetUp(link)
		}
		return h.LinkSetDown(link)
	})
}

// deleteLink deletes the interface ifname in the netns at nsPath.
func deleteLink(t *testing.T, nsPath, ifname string) {
	t.Helper()
	withLink(t, nsPath, ifname, func(h *netlink.Handle, link netlink.Link) error { return h.LinkDel(link) })
}

// withLink applies change to the interface ifname in the netns at nsPath.
func withLink(t *testing.T, nsPath, ifname string, change func(*netlink.Handle, netlink.Link) error) {
	t.Helper()
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	link, err := h.LinkByName(ifname)
	if err != nil {
		t.Fatal(err)
	}
	if err := change(h, link); err != nil {
		t.Fatalf("%s in %s: %v", ifname, nsPath, err)
	}
}

// TestTapRunAgain: a Run that ended with its context leaves the tap usable:
// the next Run waits for frames again (not spinning on the expired wake-up)
// and receives them.
func TestTapRunAgain(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "pod", Filter: mustFilter(t, DefaultSnaplen, "192.0.2.2")})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	var first recorder
	if err := startRun(t, tap, first.add)(); err != nil {
		t.Fatalf("first Run: %v", err)
	}
	var rec recorder
	stop := startRun(t, tap, rec.add)
	cpu0 := processCPU(t)
	time.Sleep(300 * time.Millisecond) // idle: the second Run must park
	if busy := processCPU(t) - cpu0; busy > 150*time.Millisecond {
		t.Errorf("the second Run used %s of CPU in 300 ms without traffic: it spins", busy)
	}
	send(t, a1, b1, 3)
	waitFor(t, "3 datagrams in the second Run", func() bool {
		return len(rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")) == 3
	})
	if err := stop(); err != nil {
		t.Fatalf("second Run: %v", err)
	}
}

// processCPU is the CPU time this process used so far.
func processCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestTapClassicFilterKeepsICMPErrors: the classic filter keeps the net
// unreachable a router sends about a datagram to a listed address, though
// neither the router nor the sender is listed (the lab's nowhere mode).
func TestTapClassicFilterKeepsICMPErrors(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	// b routes (in its own netns) but has no route to 203.0.113.0/24: it
	// answers a datagram a sends there through it with a net unreachable.
	if err := nsutil.Do(l.b, func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644)
	}); err != nil {
		t.Fatal(err)
	}
	nsA, err := netns.GetFromPath(l.a)
	if err != nil {
		t.Fatal(err)
	}
	defer nsA.Close()
	h, err := netlink.NewHandleAt(nsA)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	pta, err := h.LinkByName("pta")
	if err != nil {
		t.Fatal(err)
	}
	_, dst, _ := net.ParseCIDR("203.0.113.0/24")
	if err := h.RouteAdd(&netlink.Route{LinkIndex: pta.Attrs().Index, Dst: dst, Gw: net.ParseIP("192.0.2.2")}); err != nil {
		t.Fatalf("route: %v", err)
	}

	const listed = "203.0.113.5"
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "pod", Filter: mustFilter(t, DefaultSnaplen, listed)})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	var rec recorder
	stop := startRun(t, tap, rec.add)

	other, client := udpListen(t, l.a, "192.0.2.1:4005"), udpListen(t, l.a, "192.0.2.1:4006")
	if _, err := other.WriteToUDPAddrPort([]byte("x"), netip.MustParseAddrPort("203.0.113.6:53")); err != nil {
		t.Fatal(err)
	}
	if _, err := client.WriteToUDPAddrPort([]byte("x"), netip.MustParseAddrPort(listed+":53")); err != nil {
		t.Fatal(err)
	}
	errorsAbout := func() (n int, unrelated []string) {
		for _, p := range rec.snapshot() {
			if e, ok := p.ICMPError(); ok {
				if e.Type == ICMPDestUnreachable && e.Code == 0 && e.From.String() == "192.0.2.2" &&
					e.Src.String() == "192.0.2.1:4006" && e.Dst.String() == listed+":53" && p.Dir == obs.DirIn {
					n++
					continue
				}
				unrelated = append(unrelated, e.Kind()+" about "+e.QuotedString())
			} else if o, ok := p.Observation(obs.PointPod); !ok || o.Dst.Addr().String() != listed {
				unrelated = append(unrelated, hex.EncodeToString(p.Data))
			}
		}
		return n, unrelated
	}
	waitFor(t, "the net unreachable about the datagram to "+listed, func() bool {
		n, _ := errorsAbout()
		return n == 1
	})
	if _, unrelated := errorsAbout(); len(unrelated) > 0 {
		t.Errorf("delivered frames about other traffic: %v", unrelated)
	}
	if err := stop(); err != nil {
		t.Error(err)
	}
}
