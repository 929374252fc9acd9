package session

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

// TestNATWatchUpdate: a rule seen gone is ended at that look, a new one
// begins at the look before (it was not there then) and joins the node's
// list; a source that could not be read ends none of its rules; what is
// gone stays bounded.
func TestNATWatchUpdate(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	rule := func(source, ip string) discover.NATRule {
		return discover.NATRule{Source: source, Table: "ip kube-proxy", Hook: "prerouting", Service: netip.MustParseAddr("10.96.0.10"),
			Port: 53, Proto: "udp", Chains: []string{"nat-prerouting", "services"}, Backend: netip.AddrPortFrom(netip.MustParseAddr(ip), 53)}
	}
	old, repl, legacy := rule(discover.SourceNFTables, "10.244.1.5"), rule(discover.SourceNFTables, "10.244.2.9"), rule(discover.SourceIPTablesLegacy, "10.244.3.3")
	node := &discover.NodeInfo{Netfilter: discover.Netfilter{Rules: []discover.NATRule{old, legacy}}}
	w := newNATWatch(node, t0)
	if w.update([]discover.NATRule{old, legacy}, nil, nil, t0.Add(time.Second)) {
		t.Error("the same rules counted as a change")
	}
	w.last = t0.Add(time.Second)
	// The endpoint moved; iptables-legacy could not be read this time.
	if !w.update([]discover.NATRule{repl}, nil, []string{discover.SourceIPTablesLegacy}, t0.Add(6*time.Second)) {
		t.Fatal("a replaced rule not counted as a change")
	}
	if len(w.rules) != 3 {
		t.Fatalf("rules %+v, want the old, the legacy and the new one", w.rules)
	}
	if got := w.rules[0]; !got.Until.Equal(t0.Add(6 * time.Second)) {
		t.Errorf("old rule %+v: want it ended at the second look", got)
	}
	if got := w.rules[1]; !got.Until.IsZero() {
		t.Errorf("legacy rule %+v ended, though its source was not read", got)
	}
	if got := w.rules[2]; !got.Since.Equal(t0.Add(time.Second)) || !got.Until.IsZero() || got.Backends[0] != repl.Backend {
		t.Errorf("new rule %+v: want it begun at the look before", got)
	}
	if n := len(node.Netfilter.Rules); n != 3 || node.Netfilter.Rules[2].Backend != repl.Backend {
		t.Errorf("node lists %d rules, want the new one added", n)
	}
	// IPVS: a real server added makes a new service entry.
	vip := netip.MustParseAddrPort("10.96.0.10:53")
	svc := flow.IPVSService{VIP: vip, Scheduler: "rr", Backends: []netip.AddrPort{old.Backend}}
	grown := svc
	grown.Backends = append([]netip.AddrPort{}, old.Backend, repl.Backend)
	w.update([]discover.NATRule{repl, legacy}, []flow.IPVSService{svc}, nil, t0.Add(10*time.Second))
	if !w.update([]discover.NATRule{repl, legacy}, []flow.IPVSService{grown}, nil, t0.Add(15*time.Second)) || len(w.ipvs) != 2 || w.ipvs[0].Until.IsZero() {
		t.Errorf("IPVS %+v: want the old entry ended and the grown one added", w.ipvs)
	}
	// Endpoints that keep changing: what is gone stays bounded, and so
	// does the node's list.
	for i := range 2 * maxGoneNAT {
		r := rule(discover.SourceNFTables, "10.250.0.1")
		r.Backend = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 250, byte(i >> 8), byte(i)}), 53)
		w.update([]discover.NATRule{r}, nil, nil, t0.Add(time.Duration(20+i)*time.Second))
	}
	if len(w.rules) > maxGoneNAT+1 {
		t.Errorf("%d rules kept, want at most %d", len(w.rules), maxGoneNAT+1)
	}
	if last := w.rules[len(w.rules)-1]; !last.Until.IsZero() {
		t.Errorf("the rule there now is %+v", last)
	}
	if n := len(node.Netfilter.Rules); n > 2+maxGoneNAT {
		t.Errorf("node lists %d rules, want at most %d", n, 2+maxGoneNAT)
	}
}

// TestNATWatchSummary: looks that changed nothing (a node whose Services are
// rewritten outside netfilter) are not reported; a change is, with when.
func TestNATWatchSummary(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 3, 12, 7, 0, time.UTC)
	w := &natWatch{looks: 3, firstLook: t0, lastLook: t0.Add(10 * time.Second)}
	if s := w.summary(); s != "" {
		t.Errorf("looks without a change: %q, want nothing", s)
	}
	w.appeared, w.went = 2, 1
	if s := w.summary(); !strings.Contains(s, "read again 3 times, 03:12:07 to 03:12:17") || !strings.Contains(s, "2 rule(s) or IPVS service(s) appeared, 1 went") {
		t.Errorf("summary %q", s)
	}
}

// TestNATWatchInterrupted: a look the run's end cuts short (a source not
// read) leaves the backends that asked for it to the run's last look.
func TestNATWatchInterrupted(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.Config
	cfg.Attribution.NATRules = nil // no rule names the flow's backend
	eng := flow.NewEngine(cfg)
	for _, o := range s.Observations {
		eng.Add(o)
	}
	if eng.UnlistedBackends() == 0 {
		t.Fatal("no backend left unlisted")
	}
	t0 := time.Unix(1_700_000_000, 0)
	w := newNATWatch(&discover.NodeInfo{HostNetNS: discover.NetNS{Path: "/nonexistent/netns"}}, t0)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w.check(ctx, t0.Add(time.Second), eng, false)
	if w.looks != 1 || w.seen != 0 {
		t.Fatalf("interrupted look: %d looks, seen %d; want one look, the backends left to the next", w.looks, w.seen)
	}
	w.check(context.Background(), t0.Add(2*time.Second), eng, true)
	if w.looks != 2 || w.seen != eng.UnlistedBackends() {
		t.Errorf("the run's last look: %d looks, seen %d; want a second look that takes them", w.looks, w.seen)
	}
}

// TestNATWatchDeviceChains: a chain on a device hook that appears while the
// run reads the rules again gives the engine its rule from the look before
// on, and joins the node's list; one gone ends its rule at that look. A
// chain listed at the start on the host veth of a Pod that starts later
// gives its rule once that Pod's capture points are the node's, as if there
// from the start.
func TestNATWatchDeviceChains(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	vip := netip.MustParseAddr("10.120.0.80")
	chainOn := func(name, dev string) discover.DeviceChain {
		return discover.DeviceChain{Family: "netdev", Table: "t", Chain: name, Hook: "ingress", Devices: []string{dev},
			Rewrites: []discover.NATRule{{Service: vip, Port: 80, Proto: "tcp", Chains: []string{name}, Backend: netip.MustParseAddrPort("10.244.20.31:3000")}}}
	}
	cps := []discover.CapturePoint{{Role: discover.RoleHost, Ifname: "veth-a", Ifindex: 7}, {Role: discover.RoleUplink, Ifname: "bond0", Ifindex: 3}}
	node := &discover.NodeInfo{CapturePoints: cps}
	w := newNATWatch(node, t0)
	if len(w.dev) != 0 {
		t.Fatalf("device rules %+v before any chain", w.dev)
	}
	w.last = t0.Add(time.Second)
	rw := chainOn("rw", "veth-a")
	if !w.updateDevices([]discover.DeviceChain{rw}, t0.Add(6*time.Second)) {
		t.Fatal("a new chain not counted as a change")
	}
	if len(w.dev) != 1 || !w.dev[0].Since.Equal(t0.Add(time.Second)) || !w.dev[0].Until.IsZero() || w.dev[0].Ifindex != 7 {
		t.Fatalf("device rules %+v: want the chain's rule on veth-a since the look before", w.dev)
	}
	if len(node.Netfilter.DeviceChains) != 1 || node.Netfilter.DeviceChains[0].Chain != "rw" {
		t.Errorf("node lists chains %+v, want the new one", node.Netfilter.DeviceChains)
	}
	w.last = t0.Add(6 * time.Second)
	if w.updateDevices([]discover.DeviceChain{rw}, t0.Add(8*time.Second)) || len(node.Netfilter.DeviceChains) != 1 {
		t.Errorf("the same chain again: counted as a change, or listed twice (%d)", len(node.Netfilter.DeviceChains))
	}
	w.last = t0.Add(8 * time.Second)
	if !w.updateDevices(nil, t0.Add(10*time.Second)) || !w.dev[0].Until.Equal(t0.Add(10*time.Second)) {
		t.Errorf("device rules %+v: want the rule ended when its chain went", w.dev)
	}

	// A chain on veth-b, whose Pod starts during the run.
	rwB := chainOn("rw-b", "veth-b")
	node = &discover.NodeInfo{CapturePoints: slices.Clone(cps), Netfilter: discover.Netfilter{DeviceChains: []discover.DeviceChain{rwB}}}
	w = newNATWatch(node, t0)
	if len(w.dev) != 0 {
		t.Fatalf("device rules %+v: veth-b is no capture point yet", w.dev)
	}
	eng := flow.NewEngine(flow.Config{})
	node.CapturePoints = append(node.CapturePoints, discover.CapturePoint{Role: discover.RoleHost, Ifname: "veth-b", Ifindex: 9})
	w.podsAdded(eng)
	w.podsAdded(eng)
	if len(w.dev) != 1 || !w.dev[0].Since.IsZero() || w.dev[0].Ifindex != 9 {
		t.Errorf("device rules %+v: want veth-b's rule once, from the start", w.dev)
	}
	var none *natWatch
	none.podsAdded(eng) // a run without the watch
}

// TestNATWatchUnreadLookIsNoLook: a look that could not read the rules (the
// run's end cut it short) says nothing of when a rule appeared: one found
// by the next look may have been there since the last look that read them,
// and the flows of that time reached their backends by it.
func TestNATWatchUnreadLookIsNoLook(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.Config
	cfg.Attribution.NATRules = nil // no rule names the flow's backend: the watch looks
	eng := flow.NewEngine(cfg)
	for _, o := range s.Observations {
		eng.Add(o)
	}
	t0 := time.Unix(1_700_000_000, 0)
	w := newNATWatch(&discover.NodeInfo{HostNetNS: discover.NetNS{Path: "/nonexistent/netns"}}, t0)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	w.check(ctx, t0.Add(5*time.Second), eng, false) // nothing read
	if w.looks != 1 {
		t.Fatalf("%d looks, want the interrupted one", w.looks)
	}
	// The run's last look reads a rule added at t0+3s (the flow's backend's).
	r := discover.NATRule{Source: discover.SourceNFTables, Table: "ip kube-proxy", Hook: "prerouting", Service: netip.MustParseAddr("10.96.0.10"),
		Port: 53, Proto: "udp", Chains: []string{"services"}, Backend: netip.MustParseAddrPort("10.244.1.5:53")}
	w.update([]discover.NATRule{r}, nil, nil, t0.Add(10*time.Second))
	if got := w.rules[len(w.rules)-1].Since; got.After(t0) {
		t.Errorf("new rule since %v, want since the last look that read the rules (t0): the look at t0+5s read nothing", got.Sub(t0))
	}
}
