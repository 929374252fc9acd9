package session

import (
	"fmt"
	"testing"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestRingSizes: one or two Pods keep whole rings; beyond, the Pods' points
// share podRingShare rings, never below a ring that holds a snaplen frame,
// never above --buffer-size; the uplinks always keep whole rings. Pods that
// start later get the share of a node with the points open before them.
func TestRingSizes(t *testing.T) {
	node := func(pods, uplinks int) []discover.CapturePoint {
		var cps []discover.CapturePoint
		for i := range pods {
			cps = append(cps,
				discover.CapturePoint{Role: discover.RolePod, NetNS: fmt.Sprintf("/run/netns/p%d", i), Ifname: "eth0"},
				discover.CapturePoint{Role: discover.RoleHost, Ifname: fmt.Sprintf("veth%d", i)})
		}
		for i := range uplinks {
			cps = append(cps, discover.CapturePoint{Role: discover.RoleUplink, Ifname: fmt.Sprintf("up%d", i)})
		}
		return cps
	}
	const mib = 1 << 20
	for _, tc := range []struct {
		pods, uplinks, ring, snaplen int
		open                         int // Pod points open before (Pods that start later)
		wantPod                      int // ring of each Pod-side point
		shared                       bool
	}{
		{1, 1, 4 * mib, 96, 0, 4 * mib, false},
		{2, 1, 4 * mib, 96, 0, 4 * mib, false},
		{1, 1, 0, 96, 0, capture.DefaultRingBytes, false},
		{3, 2, 4 * mib, 96, 0, 2720 << 10, true}, // 16 MiB / 6, in 16 KiB steps
		{110, 1, 4 * mib, 96, 0, 64 << 10, true},
		{2000, 1, 4 * mib, 96, 0, capture.MinRingFor(96), true},
		{110, 1, 4 * mib, 65535, 0, capture.MinRingFor(65535), true},
		{110, 1, 16 << 10, 96, 0, 16 << 10, false},
		// 20 Pods start at once beside the one of the start: the share
		// of a node of 21 Pods, 16 MiB / 42.
		{20, 0, 4 * mib, 96, 2, 384 << 10, true},
		{1, 0, 4 * mib, 96, 2, 4 * mib, false},
		{1, 0, 4 * mib, 96, 4, 2720 << 10, true},
	} {
		cps := node(tc.pods, tc.uplinks)
		rings, note := ringSizes(cps, tc.open, tc.ring, tc.snaplen)
		name := fmt.Sprintf("%d pods (%d points open), ring %d, snaplen %d", tc.pods, tc.open, tc.ring, tc.snaplen)
		if (note != "") != tc.shared {
			t.Errorf("%s: note %q, want shared %v", name, note, tc.shared)
		}
		whole := tc.ring
		if whole == 0 {
			whole = capture.DefaultRingBytes
		}
		podTotal := 0
		for i, cp := range cps {
			want := tc.wantPod
			if cp.Role == discover.RoleUplink {
				want = whole
			} else {
				podTotal += rings[i]
			}
			if rings[i] != want {
				t.Errorf("%s: %s %s ring %d, want %d", name, cp.Role, cp.Ifname, rings[i], want)
				break
			}
		}
		if limit := max(podRingShare*whole, (2*tc.pods+tc.open)*capture.MinRingFor(tc.snaplen)); podTotal > limit {
			t.Errorf("%s: the Pods' rings take %d bytes, over %d", name, podTotal, limit)
		}
	}
}
