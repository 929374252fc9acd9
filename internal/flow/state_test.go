package flow

import (
	"net/netip"
	"testing"
	"unsafe"

	"github.com/pathtrace/pathtrace/internal/obs"
)

func ep(s string) endpoint { return endpointOf(netip.MustParseAddrPort(s)) }

// TestCountNumbersEndpoints: a point's entry is found again by its
// endpoints whatever order they were first seen in, the endpoints are
// numbered once each, and another endpoint makes another entry.
func TestCountNumbersEndpoints(t *testing.T) {
	var f flowState
	client, vip, be := ep("10.244.8.23:48582"), ep("10.120.0.80:80"), ep("10.244.20.31:3000")
	pod := pointKey{point: obs.PointPod, dir: obs.DirOut}
	up := pointKey{point: obs.PointUplink, dir: obs.DirOut}
	sa := pointKey{point: obs.PointSockAddr}
	first := f.count(pod, client, vip, endpoint{}, 1, 74)
	if f.count(up, client, be, endpoint{}, 1, 74) == first {
		t.Fatal("the uplink's entry is the Pod's")
	}
	sock := f.count(sa, endpoint{}, vip, vip, 1, 0)
	if again := f.count(pod, client, vip, endpoint{}, 2, 100); again != first {
		t.Fatalf("the Pod's packets counted at entry %d, then %d", first, again)
	}
	if f.count(pod, client, be, endpoint{}, 1, 74) == first {
		t.Error("a packet to the backend counted with those to the VIP")
	}
	if len(f.ends) != 3 {
		t.Errorf("%d endpoints numbered, want 3 (client, VIP, backend): %v", len(f.ends), f.ends)
	}
	p := f.points[first]
	if p.packets != 3 || p.bytes != 174 || f.end(p.src) != client || f.end(p.dst) != vip || f.end(p.far) != (endpoint{}) {
		t.Errorf("the Pod's entry: %d packets, %d bytes, %v -> %v far %v", p.packets, p.bytes, f.end(p.src), f.end(p.dst), f.end(p.far))
	}
	if s := f.points[sock]; f.end(s.src) != (endpoint{}) || f.end(s.far) != vip {
		t.Errorf("the socket's entry: src %v, far %v", f.end(s.src), f.end(s.far))
	}
}

// TestCountBounded: a flow spraying endpoints keeps maxPointsPerFlow
// entries and numbers only their endpoints, within what an endRef holds.
func TestCountBounded(t *testing.T) {
	var f flowState
	src := ep("10.244.8.23:5000")
	for i := range 3 * maxPointsPerFlow {
		dst := endpointOf(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), 53))
		far := endpointOf(netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 245, byte(i >> 8), byte(i)}), 53))
		slot := f.count(pointKey{point: obs.PointConntrack}, src, dst, far, 1, 0)
		if (slot < 0) != (i >= maxPointsPerFlow) {
			t.Fatalf("entry %d got slot %d", i, slot)
		}
	}
	if len(f.points) != maxPointsPerFlow || len(f.ends) != 1+2*maxPointsPerFlow {
		t.Errorf("%d entries, %d endpoints; want %d, %d", len(f.points), len(f.ends), maxPointsPerFlow, 1+2*maxPointsPerFlow)
	}
	if 3*maxPointsPerFlow > int(^endRef(0)) {
		t.Errorf("%d entries may name %d endpoints, more than an endRef numbers", maxPointsPerFlow, 3*maxPointsPerFlow)
	}
}

// TestMergeRenumbersEndpoints: a flow absorbing another counts the other's
// entries under its own numbers for the same endpoints.
func TestMergeRenumbersEndpoints(t *testing.T) {
	client, vip, be := ep("10.244.8.23:48582"), ep("10.120.0.80:80"), ep("10.244.20.31:3000")
	var f, o flowState
	f.count(pointKey{point: obs.PointPod, dir: obs.DirOut}, client, vip, endpoint{}, 1, 74)
	o.count(pointKey{point: obs.PointUplink, dir: obs.DirOut}, client, be, endpoint{}, 1, 74)
	o.count(pointKey{point: obs.PointPod, dir: obs.DirOut}, client, vip, endpoint{}, 2, 148)
	f.absorb(&o)
	if len(f.points) != 2 {
		t.Fatalf("%d entries after the merge, want 2", len(f.points))
	}
	for _, p := range f.points {
		src, dst := f.end(p.src), f.end(p.dst)
		switch {
		case p.point == obs.PointPod && src == client && dst == vip && p.packets == 3:
		case p.point == obs.PointUplink && src == client && dst == be && p.packets == 1:
		default:
			t.Errorf("entry %v: %v -> %v, %d packets", p.point, src, dst, p.packets)
		}
	}
}

// TestFlowStateSizes: a flow and its per-point entries fill size classes
// of the Go allocator (1408 and 384 bytes for initialPoints) exactly; a
// field more moves the flow to the next class, 128 bytes more per flow.
func TestFlowStateSizes(t *testing.T) {
	if n := unsafe.Sizeof(flowState{}); n > 1408 {
		t.Errorf("flowState is %d bytes, more than its size class (1408)", n)
	}
	if n := unsafe.Sizeof(pointStats{}) * initialPoints; n > 384 {
		t.Errorf("%d per-point entries take %d bytes, more than their size class (384)", initialPoints, n)
	}
	if n := unsafe.Sizeof(endpoint{}) * initialEnds; n > 128 {
		t.Errorf("%d endpoints take %d bytes, more than their size class (128)", initialEnds, n)
	}
}
