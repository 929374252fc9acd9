package session

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

// TestTCWatchUpdate: a program seen gone is ended at that look, a new one
// begins then; a look that finds the same programs changes nothing; the
// programs gone are bounded.
func TestTCWatchUpdate(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	old := flow.TCProgram{Direction: "ingress", Kind: "tcx", Name: "cil_from_container", ID: 52, Ifindex: 7}
	repl := flow.TCProgram{Direction: "ingress", Kind: "tcx", Name: "cil_from_container", ID: 60, Ifindex: 7}
	w := &tcWatch{progs: []flow.TCProgram{old}}
	if w.update([]flow.TCProgram{old}, t0) {
		t.Error("the same programs counted as a change")
	}
	if !w.update([]flow.TCProgram{repl}, t0.Add(5*time.Second)) {
		t.Fatal("a replaced program not counted as a change")
	}
	if len(w.progs) != 2 || !w.progs[0].Until.Equal(t0.Add(5*time.Second)) || !w.progs[1].Since.Equal(t0.Add(5*time.Second)) || !w.progs[1].Until.IsZero() {
		t.Fatalf("programs %+v, want the old one ended and the new one begun at the second look", w.progs)
	}
	if w.update([]flow.TCProgram{repl}, t0.Add(10*time.Second)) {
		t.Error("the same programs counted as a change")
	}
	// An agent that keeps replacing its program: what is gone stays bounded.
	for i := range 2 * maxGoneTCPrograms {
		p := repl
		p.ID = uint32(100 + i)
		w.update([]flow.TCProgram{p}, t0.Add(time.Duration(15+i)*time.Second))
	}
	if len(w.progs) > maxGoneTCPrograms+1 {
		t.Errorf("%d programs kept, want at most %d", len(w.progs), maxGoneTCPrograms+1)
	}
	if last := w.progs[len(w.progs)-1]; last.ID != uint32(100+2*maxGoneTCPrograms-1) || !last.Until.IsZero() {
		t.Errorf("the program there now is %+v", last)
	}
}

// TestNewVethsForgetObservers: a new Pod's host veth that got the ifindex
// of a veth that had tcx observers (a Pod deleted and made again) is
// observed anew once a tc program is there; the observers of the node's
// other veths stay known, also one whose ifindex a Pod's eth0 has in the
// Pod's own netns.
func TestNewVethsForgetObservers(t *testing.T) {
	l := &tcLate{observed: map[int]tcDirs{3: tcBoth, 4: tcIngress}}
	l.newVeths([]discover.CapturePoint{
		{Role: discover.RolePod, Ifindex: 4, Ifname: "eth0"},
		{Role: discover.RoleHost, Ifindex: 3, Ifname: "cali1234abcd567"},
	})
	if l.observed[3] != 0 || l.observed[4] == 0 {
		t.Errorf("observed after a new Pod behind ifindex 3 (its eth0 #4): %v, want only 4", l.observed)
	}
}

// TestTCWatchGoneBoundedManyVeths: an agent that keeps replacing the
// programs of several veths at once (a Cilium restart replaces every
// endpoint's): what is gone stays bounded too, not only when one program
// goes per look.
func TestTCWatchGoneBoundedManyVeths(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	const veths = 3
	w := &tcWatch{}
	for i := range 2 * maxGoneTCPrograms {
		var cur []flow.TCProgram
		for v := range veths {
			cur = append(cur, flow.TCProgram{Direction: "ingress", Kind: "tcx", Name: "cil_from_container", ID: uint32(1000*v + i), Ifindex: 7 + v})
		}
		w.update(cur, t0.Add(time.Duration(i)*time.Second))
	}
	gone := 0
	for _, p := range w.progs {
		if !p.Until.IsZero() {
			gone++
		}
	}
	if gone > maxGoneTCPrograms {
		t.Errorf("%d programs kept after they went, want at most %d", gone, maxGoneTCPrograms)
	}
}

// TestTCWatchUplinkProgramAppears: a tc program attached to the uplink's
// ingress during the run (a CNI agent that starts or restarts: Cilium's
// bpf_host, which translates NodePorts) is given to the engine at the look
// that finds it, so an outside client's NodePort flow after it names it
// (it was unknown: "no active observation point saw the VIP before it");
// one that goes is ended at the look that misses it.
func TestTCWatchUplinkProgramAppears(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/tc-uplink-ingress-nodeport.json")
	if err != nil {
		t.Fatal(err)
	}
	var uplink []flow.TCProgram
	s.Config.Attribution.UplinkTCPrograms, uplink = nil, s.Config.Attribution.UplinkTCPrograms
	if len(uplink) != 1 {
		t.Fatalf("scenario uplink programs %+v, want one", uplink)
	}
	p := uplink[0]
	found := []discover.TCProgram{{Ifname: "eth0", Ifindex: 2, Role: discover.RoleUplink, Dir: p.Direction, Via: p.Kind, Name: p.Name, ID: ebpf.ProgramID(p.ID)}}
	start := s.Observations[0].Time
	e := flow.NewEngine(s.Config)
	w := &tcWatch{}
	w.apply(nil, start.Add(-20*time.Second), e) // the start: none
	w.apply(found, start.Add(-time.Second), e)
	for _, o := range s.Observations {
		e.Add(o)
	}
	if errs := s.Want.Check(e.Flows(), e.Summary()); len(errs) > 0 {
		t.Errorf("program found at a look during the run:\n  %s", strings.Join(errs, "\n  "))
	}
	if w.apply(nil, start.Add(time.Second), e); len(w.uplinkProgs) != 1 || !w.uplinkProgs[0].Until.Equal(start.Add(time.Second)) {
		t.Errorf("uplink programs %+v after a look without it, want it ended then", w.uplinkProgs)
	}
}

// TestTCWatchReplacementNotBeforeItsLook: a program that replaced another
// (a CNI agent restarted) is not offered for a flow the old one rewrote
// before a look that found neither: it was attached after that look,
// however far back the slack of its first sighting reaches.
func TestTCWatchReplacementNotBeforeItsLook(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/tc-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	start := s.Observations[0].Time
	prog := func(id ebpf.ProgramID) discover.TCProgram {
		return discover.TCProgram{Ifname: "cali2f0e9d8c7b6", Ifindex: 5, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "lab_lb_ingress", ID: id}
	}
	s.Config.Attribution.TCPrograms = nil
	e := flow.NewEngine(s.Config)
	w := &tcWatch{}
	w.apply([]discover.TCProgram{prog(52)}, start.Add(-2*time.Second), e)
	for _, o := range s.Observations {
		e.Add(o)
	}
	w.apply(nil, start.Add(time.Second), e)                              // the agent detached it
	w.apply([]discover.TCProgram{prog(60)}, start.Add(3*time.Second), e) // and attached its new one
	for _, f := range e.Flows() {
		if f.Service.Port() == 80 && f.By != "tcx ingress lab_lb_ingress (id 52)" {
			t.Errorf("flow %d by %q, want the program there before the agent restarted", f.ID, f.By)
		}
	}
}

// TestTCWatchChangesSaid: a program replaced on a host veth and one that
// appeared on an uplink during the run are said, where and when, for the
// report, one that went with its veth (a Pod deleted) is counted; a look
// that changes nothing adds nothing, and the lines are bounded, the
// earlier counted.
func TestTCWatchChangesSaid(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 12, 5, 0, time.Local)
	eng := flow.NewEngine(flow.Config{})
	old := discover.TCProgram{Ifname: "lxc12ab", Ifindex: 7, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "cil_from_container", ID: 52}
	// A deleted Pod's veth, no longer watched: its program went with it.
	deleted := discover.TCProgram{Ifname: "lxc99ff", Ifindex: 9, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "cil_from_container", ID: 53}
	look := discover.NewTCWatch("", []discover.CapturePoint{{Role: discover.RoleHost, Ifindex: 7, Ifname: "lxc12ab"}, {Role: discover.RoleUplink, Ifindex: 2, Ifname: "eth0"}}, nil)
	w := &tcWatch{look: look, progs: hostTCPrograms([]discover.TCProgram{old, deleted})}
	w.learnNames([]discover.TCProgram{old, deleted})
	if got := w.summary(); got != nil {
		t.Fatalf("nothing changed yet, summary %q", got)
	}
	repl := old
	repl.ID = 60
	nodePort := discover.TCProgram{Ifname: "eth0", Ifindex: 2, Role: discover.RoleUplink, Dir: "ingress", Via: "tcx", Name: "cil_from_netdev", ID: 61}
	w.apply([]discover.TCProgram{repl, nodePort}, t0.Add(2*time.Second), eng)
	w.apply([]discover.TCProgram{repl, nodePort}, t0.Add(4*time.Second), eng)
	want := []string{
		"at 03:12:07 on lxc12ab (host veth #7): tcx ingress cil_from_container (id 52) went, tcx ingress cil_from_container (id 60) appeared",
		"at 03:12:07 on eth0 (uplink #2): tcx ingress cil_from_netdev (id 61) appeared",
		"1 went with their interface (a Pod deleted)",
	}
	if got := w.summary(); !slices.Equal(got, want) {
		t.Fatalf("summary\n%q\nwant\n%q", got, want)
	}
	// An agent that keeps replacing its program.
	for i := range maxTCChanges + 3 {
		p := repl
		p.ID = ebpf.ProgramID(100 + i)
		w.apply([]discover.TCProgram{p, nodePort}, t0.Add(time.Duration(6+2*i)*time.Second), eng)
	}
	got := w.summary()
	if len(got) != maxTCChanges+2 || got[0] != fmt.Sprintf("%d earlier (the last %d listed)", 5, maxTCChanges) ||
		!strings.Contains(got[len(got)-2], fmt.Sprintf("(id %d) appeared", 100+maxTCChanges+2)) {
		t.Errorf("bounded summary: %d lines, first %q, last %q", len(got), got[0], got[len(got)-2])
	}
}

// TestTCFilterActionsInEngineTerms: a tc filter's rewriting action (act_nat
// on a u32 filter) reaches the engine named as a flow's "by" says it, with
// the destinations (and port) it rewrites, an act_ct's as one that makes
// conntrack entries; two filters on one veth are two, and a filter whose
// action changed (another backend) or whose match did is a change: none
// has a program ID to tell them apart.
func TestTCFilterActionsInEngineTerms(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	vip, other := netip.MustParsePrefix("10.120.0.80/32"), netip.MustParsePrefix("10.120.0.81/32")
	a := discover.TCProgram{Ifname: "hv0", Ifindex: 4, Role: discover.RoleHost, Dir: "ingress", Via: "u32", Name: "pref 10",
		Action: "nat ingress 10.120.0.80/32 -> 10.244.20.31", Rewrites: vip}
	b := a
	b.Name, b.Action, b.Rewrites = "pref 11", "nat ingress 10.120.0.81/32 -> 10.244.20.32", other
	ct := discover.TCProgram{Ifname: "hv0", Ifindex: 4, Role: discover.RoleHost, Dir: "ingress", Via: "flower", Name: "pref 12",
		Action: "ct commit nat dst addr 10.244.20.33 port 80", Rewrites: vip, RewritesPort: 80}
	got := hostTCPrograms([]discover.TCProgram{a, b, ct})
	want := []flow.TCProgram{
		{Direction: "ingress", Kind: "u32", Name: "pref 10", Ifindex: 4, Action: "u32 pref 10 on hv0 ingress: nat ingress 10.120.0.80/32 -> 10.244.20.31", Dst: vip},
		{Direction: "ingress", Kind: "u32", Name: "pref 11", Ifindex: 4, Action: "u32 pref 11 on hv0 ingress: nat ingress 10.120.0.81/32 -> 10.244.20.32", Dst: other},
		{Direction: "ingress", Kind: "flower", Name: "pref 12", Ifindex: 4, Action: "flower pref 12 on hv0 ingress: ct commit nat dst addr 10.244.20.33 port 80", Dst: vip, DstPort: 80, Conntrack: true},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("engine's programs\n got %+v\nwant %+v", got, want)
	}
	w := &tcWatch{progs: got}
	if w.update(hostTCPrograms([]discover.TCProgram{a, b, ct}), t0) {
		t.Error("the same filters counted as a change")
	}
	moved := a
	moved.Action = "nat ingress 10.120.0.80/32 -> 10.244.20.40"
	if !w.update(hostTCPrograms([]discover.TCProgram{moved, b, ct}), t0.Add(2*time.Second)) {
		t.Error("a filter whose action changed not counted as a change")
	}
	// A pedit rewrites what its filter matches: the same pedit on a
	// filter replaced for another VIP rewrites that one only.
	pedit := a
	pedit.Action = "pedit munge ip dst set 10.244.20.31"
	w = &tcWatch{progs: hostTCPrograms([]discover.TCProgram{pedit})}
	pedit.Rewrites = other
	if !w.update(hostTCPrograms([]discover.TCProgram{pedit}), t0) {
		t.Error("a filter whose match changed (its pedit the same) not counted as a change")
	}
}
