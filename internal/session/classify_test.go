package session

import (
	"io"
	"maps"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// The table answers like a plain map whatever its recent-kinds cache holds:
// after puts, removals and the reset at maxClasses.
func TestClassTableActsAsMap(t *testing.T) {
	c := newClassTable()
	want := map[classKey]flow.Handle{}
	key := func(i int) classKey {
		return kindOf(i%3, obs.DirOut, capture.Tuple{Rest: uint64(i) << 48})
	}
	// check looks up first (the key just changed, while the cache may still
	// hold it), then every key.
	check := func(step string, first int) {
		t.Helper()
		for _, i := range append([]int{first}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11) {
			k := key(i)
			var h flow.Handle
			hp := c.get(k)
			ok := hp != nil
			if ok {
				h = *hp
			}
			wh, wok := want[k]
			if ok != wok || h != wh {
				t.Fatalf("%s: key %d: got %v/%v, want %v/%v", step, i, h, ok, wh, wok)
			}
		}
	}
	// Distinct handles: the first packets of 12 flows.
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}}})
	var handles []flow.Handle
	for i := range 12 {
		h, ok := eng.AddPacket(obs.Observation{Time: base, Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.UDP,
			Src: netip.AddrPortFrom(client.Addr(), uint16(1000+i)), Dst: vip, Len: 60})
		if !ok {
			t.Fatal("no handle for a packet to the VIP")
		}
		handles = append(handles, h)
	}
	for i := range 12 {
		c.put(key(i), handles[i])
		want[key(i)] = handles[i]
		check("put", i)
	}
	for _, i := range []int{11, 3, 10} {
		c.get(key(i)) // recently used
		c.remove(key(i))
		delete(want, key(i))
		check("remove", i)
	}
	c.put(key(3), handles[5])
	want[key(3)] = handles[5]
	check("put again", 3)
	last := 100
	for ; len(c.m) < maxClasses; last++ {
		c.put(key(last), handles[0])
	}
	c.put(key(1000000), handles[1]) // the table starts over
	clear(want)
	want[key(1000000)] = handles[1]
	check("reset", last-1)
}

// TestKindOfKeepsEveryField: packets that differ in any one field of their
// kind get different keys.
func TestKindOfKeepsEveryField(t *testing.T) {
	tuple := func(src, dst string, sport, dport uint16, proto obs.Proto) capture.Tuple {
		from, to := netip.AddrPortFrom(netip.MustParseAddr(src), sport), netip.AddrPortFrom(netip.MustParseAddr(dst), dport)
		p := capture.Packet{Data: tcpFrame(t, from, to)}
		if proto == obs.UDP {
			p.Data = udpFrame(t, from, to)
		}
		tu, _, ok := p.Tuple()
		if !ok {
			t.Fatalf("%s -> %s not decoded", src, dst)
		}
		return tu
	}
	base := tuple("10.244.8.23", "10.120.0.80", 40000, 80, obs.TCP)
	k := kindOf(2, obs.DirOut, base)
	vary := map[string]classKey{
		"tap":   kindOf(3, obs.DirOut, base),
		"dir":   kindOf(2, obs.DirIn, base),
		"src":   kindOf(2, obs.DirOut, tuple("10.244.8.24", "10.120.0.80", 40000, 80, obs.TCP)),
		"dst":   kindOf(2, obs.DirOut, tuple("10.244.8.23", "10.120.0.81", 40000, 80, obs.TCP)),
		"sport": kindOf(2, obs.DirOut, tuple("10.244.8.23", "10.120.0.80", 40001, 80, obs.TCP)),
		"dport": kindOf(2, obs.DirOut, tuple("10.244.8.23", "10.120.0.80", 40000, 81, obs.TCP)),
		"proto": kindOf(2, obs.DirOut, tuple("10.244.8.23", "10.120.0.80", 40000, 80, obs.UDP)),
		"swap":  kindOf(2, obs.DirOut, tuple("10.120.0.80", "10.244.8.23", 80, 40000, obs.TCP)),
	}
	for field, other := range vary {
		if other == k {
			t.Errorf("another %s, same kind key %x", field, k)
		}
	}
	if kindOf(2, obs.DirOut, base) != k {
		t.Error("the same packet kind gave another key")
	}
}

// TestReusedPortBeginsFlow: a tap's TCP SYN, FIN and RST reach the engine
// even for a kind of packet counted before, so a connection that reuses a
// closed one's client port is a flow of its own, not more packets of the
// old one.
func TestReusedPortBeginsFlow(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	tr := testTracer(t, io.Discard)
	tr.pcap = nil
	tr.eng = flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: svc.Port(), Proto: obs.TCP}}})
	send := func(at time.Duration, flags byte) {
		f := tcpFrame(t, client, svc)
		f[14+20+13] = flags
		b := tr.newBatch(0, false)
		b.add(&capture.Packet{Time: base.Add(at), Dir: obs.DirOut, Len: len(f), CapLen: len(f), Data: f})
		tr.consume(b)
	}
	const syn, rst, ack = 0x02, 0x04, 0x10
	send(0, syn)
	send(time.Millisecond, ack)
	send(2*time.Millisecond, rst|ack)
	send(5*time.Second, syn) // a new connection from the same port
	send(5*time.Second+time.Millisecond, ack)
	flows := tr.eng.Flows()
	if len(flows) != 2 {
		t.Fatalf("%d flows, want 2 (the second connection on its own):\n%+v", len(flows), flows)
	}
	for _, f := range flows {
		var n uint64
		for _, p := range f.Points {
			n += p.Packets
		}
		if n < 2 || n > 3 {
			t.Errorf("flow %d: %d packets, want its own 2 or 3: %+v", f.ID, n, f.Points)
		}
	}
}

// TestPointsNameTheirTap: with several Pods, each flow's per-point counts
// say which tap saw the packets (the label the pcapng names its interface
// by), not only the role every Pod's tap shares.
func TestPointsNameTheirTap(t *testing.T) {
	tr := testTracerOf(t, io.Discard, []tap{
		{label: "pod:eth0@10.244.8.23", point: obs.PointPod},
		{label: "pod:eth0@10.244.8.24", point: obs.PointPod},
	})
	for tapIdx := range 2 {
		if reason := frames(t, tr, tapIdx, time.Millisecond, 2*time.Millisecond); reason != "" {
			t.Fatal(reason)
		}
	}
	flows := tr.eng.Flows()
	if len(flows) != 1 {
		t.Fatalf("%d flows, want 1", len(flows))
	}
	got := map[string]uint64{}
	for _, p := range flows[0].Points {
		got[p.Point+" "+p.Iface] += p.Packets
	}
	want := map[string]uint64{"pod pod:eth0@10.244.8.23": 2, "pod pod:eth0@10.244.8.24": 2}
	if !maps.Equal(got, want) {
		t.Errorf("points %v, want %v", got, want)
	}
}

// TestClassTableCacheCollisions: whatever kinds share a cache slot, the
// table answers like a plain map through puts, gets and removals.
func TestClassTableCacheCollisions(t *testing.T) {
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: vip.Addr(), Port: vip.Port(), Proto: obs.UDP}}})
	var handles []flow.Handle
	for i := range 8 {
		h, ok := eng.AddPacket(obs.Observation{Time: base, Point: obs.PointPod, Dir: obs.DirOut, Proto: obs.UDP,
			Src: netip.AddrPortFrom(client.Addr(), uint16(1000+i)), Dst: vip, Len: 60})
		if !ok {
			t.Fatal("no handle for a packet to the VIP")
		}
		handles = append(handles, h)
	}
	c := newClassTable()
	want := map[classKey]flow.Handle{}
	rng := rand.New(rand.NewPCG(7, 7))
	keys := make([]classKey, 3*recentSlots) // more kinds than slots: collisions
	for i := range keys {
		keys[i] = kindOf(i%5, obs.Dir(1+i%2), capture.Tuple{Addrs: rng.Uint64(), Rest: rng.Uint64() &^ (1<<24 - 1)})
	}
	collided := false
	seen := map[int]classKey{}
	for _, k := range keys {
		if o, ok := seen[slotOf(k)]; ok && o != k {
			collided = true
		}
		seen[slotOf(k)] = k
	}
	if !collided {
		t.Fatal("no two kinds share a slot: the test tests nothing")
	}
	for step := range 20000 {
		k := keys[rng.IntN(len(keys))]
		switch op := rng.IntN(10); {
		case op < 3:
			h := handles[rng.IntN(len(handles))]
			c.put(k, h)
			want[k] = h
		case op < 4:
			c.remove(k)
			delete(want, k)
		default:
			got := c.get(k)
			wh, wok := want[k]
			if (got != nil) != wok || got != nil && *got != wh {
				t.Fatalf("step %d: get %v: %v, want %v/%v", step, k, got, wh, wok)
			}
		}
	}
}

// TestOtherPodsSNATFramesComment: with a Pod selected, another Pod's frames
// that the node masqueraded carry the node's address, which is in scope:
// their pcapng comment says whose they are (conntrack gave that source to an
// out-of-scope client's flow), not "no Service flow known", which reads as
// a frame pathtrace failed to correlate.
func TestOtherPodsSNATFramesComment(t *testing.T) {
	tr := testTracer(t, io.Discard)
	node := netip.MustParseAddr("198.18.5.2")
	other := netip.MustParseAddrPort("172.18.9.66:41000")
	snat := netip.AddrPortFrom(node, 40000)
	backend := netip.MustParseAddrPort("100.64.99.21:5353")
	tr.clients = map[netip.Addr]bool{client.Addr(): true, node: true}
	tr.add(obs.Observation{Time: base, Point: obs.PointConntrack, Proto: obs.UDP, Src: other, Dst: vip, NATDst: backend, NATSrc: snat})
	if tr.outOfScope != 1 {
		t.Fatalf("out of scope %d, want 1: the other Pod's conntrack entry", tr.outOfScope)
	}
	raw := udpFrame(t, snat, backend)
	f := &frame{pkt: capture.Packet{Time: base.Add(time.Millisecond), Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw}}
	got := tr.comment(1, f)
	if want := "another client's packet, with the source the node's SNAT gave it (conntrack), not traced: a Pod is selected"; got != want {
		t.Errorf("comment %q, want %q", got, want)
	}
	raw = udpFrame(t, netip.AddrPortFrom(node, 40001), backend)
	f = &frame{pkt: capture.Packet{Time: base.Add(time.Millisecond), Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw}}
	if got := tr.comment(1, f); got != "no Service flow known for this packet" {
		t.Errorf("a frame of no known SNAT source: comment %q", got)
	}
}
