package session

import (
	"net/netip"
	"testing"

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
		return kindOf(i%3, obs.DirOut, capture.Tuple{Sport: uint16(i)})
	}
	// check looks up first (the key just changed, while the cache may still
	// hold it), then every key.
	check := func(step string, first int) {
		t.Helper()
		for _, i := range append([]int{first}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11) {
			k := key(i)
			h, ok := c.get(k)
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
	base := capture.Tuple{Src: [4]byte{10, 244, 8, 23}, Dst: [4]byte{10, 120, 0, 80}, Sport: 40000, Dport: 80, Proto: obs.TCP}
	k := kindOf(2, obs.DirOut, base)
	vary := map[string]classKey{
		"tap":   kindOf(3, obs.DirOut, base),
		"dir":   kindOf(2, obs.DirIn, base),
		"src":   kindOf(2, obs.DirOut, capture.Tuple{Src: [4]byte{10, 244, 8, 24}, Dst: base.Dst, Sport: base.Sport, Dport: base.Dport, Proto: base.Proto}),
		"dst":   kindOf(2, obs.DirOut, capture.Tuple{Src: base.Src, Dst: [4]byte{10, 120, 0, 81}, Sport: base.Sport, Dport: base.Dport, Proto: base.Proto}),
		"sport": kindOf(2, obs.DirOut, capture.Tuple{Src: base.Src, Dst: base.Dst, Sport: 40001, Dport: base.Dport, Proto: base.Proto}),
		"dport": kindOf(2, obs.DirOut, capture.Tuple{Src: base.Src, Dst: base.Dst, Sport: base.Sport, Dport: 81, Proto: base.Proto}),
		"proto": kindOf(2, obs.DirOut, capture.Tuple{Src: base.Src, Dst: base.Dst, Sport: base.Sport, Dport: base.Dport, Proto: obs.UDP}),
		"swap":  kindOf(2, obs.DirOut, capture.Tuple{Src: base.Dst, Dst: base.Src, Sport: base.Dport, Dport: base.Sport, Proto: base.Proto}),
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
