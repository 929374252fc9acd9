package flow

import (
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestAbsorbKeepsResetOnly: merging two sightings of one flow (a socket's
// before its port was known, and its packets') keeps a checkpoint's
// backend "seen only in the client's resets" only when neither saw a
// request to a backend there (sawBackend), whichever absorbs the other.
func TestAbsorbKeepsResetOnly(t *testing.T) {
	svc := netip.MustParseAddrPort("10.96.0.50:80")
	be := netip.MustParseAddrPort("10.244.1.11:8080")
	mk := func(vip, backend, reset bool) *flowState {
		f := &flowState{service: svc}
		if vip {
			f.cps[cpPod].see(true, endpoint{}, obs.PointPod, 1)
		}
		if backend {
			f.cps[cpPod].see(false, endpointOf(be), obs.PointPod, 2)
			if reset {
				f.resetOnly |= 1 << cpPod
			}
		}
		return f
	}
	for _, tc := range []struct {
		name       string
		f, o       *flowState
		sawBackend bool
	}{
		{"resets into VIP only", mk(true, false, false), mk(false, true, true), false},
		{"VIP only into resets", mk(false, true, true), mk(true, false, false), false},
		{"resets into request", mk(true, true, false), mk(true, true, true), true},
		{"request into resets", mk(true, true, true), mk(true, true, false), true},
		{"resets into resets", mk(true, true, true), mk(false, true, true), false},
	} {
		tc.f.absorb(tc.o)
		if got := tc.f.sawBackend(cpPod); got != tc.sawBackend || !tc.f.cps[cpPod].vip {
			t.Errorf("%s: sawBackend %v (vip %v), want %v (vip true)", tc.name, got, tc.f.cps[cpPod].vip, tc.sawBackend)
		}
	}
}
