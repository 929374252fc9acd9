package session

import (
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestLBWatchSince: a sock_addr program is loaded after the last look that
// had not seen its ID (IDs grow); one every look had seen was there from the
// start.
func TestLBWatchSince(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	w := &lbWatch{loads: []sockLoad{{at: t0.Add(time.Second), after: 10}, {at: t0.Add(5 * time.Second), after: 20}}}
	for id, want := range map[uint32]time.Time{5: {}, 10: {}, 11: t0.Add(time.Second), 20: t0.Add(time.Second), 21: t0.Add(5 * time.Second)} {
		if got := w.since(ebpf.ProgramID(id)); !got.Equal(want) {
			t.Errorf("since(%d) = %v, want %v", id, got, want)
		}
	}
	if got := (*lbWatch)(nil).since(30); !got.IsZero() {
		t.Errorf("no watch: since = %v, want zero", got)
	}
}

// TestLBUnread: a socket's connect or send on a client cgroup whose last
// read, a second ago or more, found no socket LB has it read again while
// another sock_addr program is on the node; not sooner, nor for a cgroup
// that had one, nor for other points, nor on a node without such programs.
func TestLBUnread(t *testing.T) {
	vip, be := netip.MustParseAddrPort("10.120.0.80:80"), netip.MustParseAddrPort("10.244.20.31:3000")
	tr := &tracer{lb: &lbWatch{reading: true}, cgroupNoLB: map[uint64]time.Time{1: time.Now().Add(-2 * time.Second), 2: time.Now()}}
	rewrite := obs.Observation{Point: obs.PointSockAddr, ReqDst: vip, Dst: be}
	left := obs.Observation{Point: obs.PointSockAddr, ReqDst: vip, Dst: vip} // an LB after the observers
	for _, c := range []struct {
		cgroup uint64
		o      obs.Observation
		want   bool
	}{
		{1, rewrite, true},
		{1, left, true},
		{2, rewrite, false}, // read just now
		{3, rewrite, false}, // a socket LB found there
		{1, obs.Observation{Point: obs.PointSockState, Dst: be}, false},
	} {
		c.o.Cgroup = c.cgroup
		if got := tr.lbUnread(c.o); got != c.want {
			t.Errorf("cgroup %d, %+v: %v, want %v", c.cgroup, c.o, got, c.want)
		}
	}
	tr.lb.reading = false
	if o := (obs.Observation{Point: obs.PointSockAddr, ReqDst: vip, Dst: vip, Cgroup: 1}); tr.lbUnread(o) {
		t.Errorf("no other sock_addr program on the node: %+v read again", o)
	}
}
