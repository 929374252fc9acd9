package flow_test

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// labelledFlow is churnFlow with capture points of a Pod of their own
// every two flows: a run until stopped on a node whose Pods come and go.
func labelledFlow(i int, proto obs.Proto, svc, be netip.AddrPort, at time.Time) (seq []obs.Observation, pod, host string) {
	seq = churnFlow(i, proto, svc, be, at)
	pod, host = fmt.Sprintf("pod:eth0@p%d", i/2), fmt.Sprintf("host:v%d", i/2)
	for j := range seq {
		switch seq[j].Point {
		case obs.PointPod:
			seq[j].Ifname = pod
		case obs.PointHost:
			seq[j].Ifname = host
		}
	}
	return seq, pod, host
}

// TestRetireLabelsBounded: the capture points of 100,000 Pods, each for
// two flows, more than the 65,536 labels the engine can number at once:
// retiring flows as they end forgets the labels of the Pods gone, every
// flow reported names its own points, and the labels held stay bounded by
// those of the open flows.
func TestRetireLabelsBounded(t *testing.T) {
	const nflows = 200_000
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{
		Services:    []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}},
		MaxFlows:    4096,
		FlowTimeout: 5 * time.Second,
	})
	start := flowtest.At(0)
	type names struct{ pod, host string }
	want := map[netip.AddrPort]names{}
	reported, peak := 0, 0
	take := func(fs []flow.Flow) {
		for _, f := range fs {
			reported++
			w := want[f.Client]
			for _, p := range f.Points {
				if p.Point == obs.PointPod.String() && p.Iface != w.pod || p.Point == obs.PointHost.String() && p.Iface != w.host {
					t.Fatalf("flow %d of %s: %s point named %q, want %q / %q", f.ID, f.Client, p.Point, p.Iface, w.pod, w.host)
				}
			}
		}
	}
	for i := range nflows {
		// churnFlow's client is the same every 50,000 flows (200 s later):
		// it is this flow's until a later one takes it.
		seq, pod, host := labelledFlow(i, obs.UDP, svc, be, start.Add(time.Duration(i)*4*time.Millisecond))
		want[seq[3].Src] = names{pod, host}
		for _, o := range seq {
			e.Add(o)
		}
		if i%500 == 0 {
			take(e.Retire(time.Time{}))
			peak = max(peak, e.Sizes()["labels"])
		}
	}
	take(e.RetireAll())
	if reported != nflows {
		t.Errorf("%d flows reported, want %d", reported, nflows)
	}
	if n := e.UnnamedPoints(); n != 0 {
		t.Errorf("%d points counted unnamed", n)
	}
	// A flow timeout holds 1,250 flows of 2 labels a Pod; a sweep comes
	// once twice as many as the last one kept are held.
	if peak > 16384 {
		t.Errorf("%d labels at the peak, want at most 16384", peak)
	}
	t.Logf("labels at the peak: %d", peak)
}

// TestLabelsBeyondMax: more capture points at once than the engine can
// number are counted unnamed, never given another's label.
func TestLabelsBeyondMax(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}})
	e.SetMaxLabels(5) // "", uplink:bond0 and two Pods' pod and host (the second one's host left out)
	for i := range 4 {
		seq, _, _ := labelledFlow(2*i, obs.UDP, svc, be, flowtest.At(float64(i*10)))
		for _, o := range seq {
			e.Add(o)
		}
	}
	got := map[string]int{}
	for _, f := range e.Flows() {
		for _, p := range f.Points {
			if p.Point == obs.PointPod.String() || p.Point == obs.PointHost.String() {
				got[p.Iface]++
			}
		}
	}
	if got["pod:eth0@p0"] == 0 || got["host:v0"] == 0 || got["pod:eth0@p1"] == 0 || got["host:v1"] != 0 || got["pod:eth0@p2"] != 0 {
		t.Errorf("points named %v: want the first Pod's, the second's eth0, and the rest unnamed", got)
	}
	if e.UnnamedPoints() == 0 {
		t.Error("no point counted unnamed")
	}
}

// TestForgetCgroups: the sock_addr programs of cgroups no open flow is of
// are forgotten (the cgroups of Pods gone); an open flow's stay.
func TestForgetCgroups(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}})
	seq := churnFlow(0, obs.UDP, svc, be, flowtest.At(0))
	for i := range seq {
		if seq[i].Point == obs.PointSockAddr {
			seq[i].Cgroup, seq[i].PID = 7, 100
		}
	}
	for _, o := range seq {
		e.Add(o)
	}
	for cg := uint64(6); cg <= 9; cg++ {
		e.SetCgroupSockPrograms(cg, []flow.SockProgram{{Name: fmt.Sprintf("lb%d", cg)}})
	}
	e.ForgetCgroups()
	if n := e.Sizes()["cgroups"]; n != 1 {
		t.Errorf("%d cgroups' programs kept, want the open flow's", n)
	}
}

// TestPodsGone: the tc programs on a gone Pod's eth0 and the redirects on
// its host veth end when it went, and are forgotten once no open flow of
// that veth began before (and a flow timeout passed); the others stay.
func TestPodsGone(t *testing.T) {
	svc, be := netip.MustParseAddrPort("10.120.0.10:53"), netip.MustParseAddrPort("10.244.20.31:5353")
	e := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}, FlowTimeout: 10 * time.Second})
	t0 := flowtest.At(0)
	e.AddPodTCPrograms(t0, nil, []flow.TCProgram{{Direction: "egress", Name: "p5", Ifindex: 5}, {Direction: "egress", Name: "p6", Ifindex: 6}, {Direction: "egress", Name: "p7", Ifindex: 7}})
	e.AddHostRedirects(t0, []flow.TCRedirect{{Ifindex: 5, Text: "r5"}, {Ifindex: 7, Text: "r7"}})
	// A flow of veth 7 open from t0 on.
	seq := churnFlow(0, obs.UDP, svc, be, t0)
	for i := range seq {
		if seq[i].Point == obs.PointHost {
			seq[i].Ifindex = 7
		}
	}
	for _, o := range seq {
		e.Add(o)
	}
	e.PodsGone(t0.Add(time.Second), []int{5, 7})
	if s := e.Sizes(); s["podTCPrograms"] != 3 || s["hostRedirects"] != 2 {
		t.Errorf("right after the Pods went: %v; want every entry kept", s)
	}
	e.PodsGone(t0.Add(time.Minute), nil)
	if s := e.Sizes(); s["podTCPrograms"] != 2 || s["hostRedirects"] != 1 {
		t.Errorf("a minute later: %v; want veth 5's forgotten, 6's (there) and 7's (a flow open) kept", s)
	}
	e.RetireAll()
	e.PodsGone(t0.Add(2*time.Minute), nil)
	if s := e.Sizes(); s["podTCPrograms"] != 1 || s["hostRedirects"] != 0 {
		t.Errorf("once the flow of veth 7 is retired: %v; want veth 6's only", s)
	}
}
