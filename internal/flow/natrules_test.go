package flow_test

import (
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestNATRulesOfTheFlowsTime: kube-proxy replaced the endpoint rule of the
// VIP while the trace ran (a rolling restart): a flow is attributed to the
// rule of its time that names its backend, and a flow whose backend no rule
// read names says so instead of naming a rule to another backend.
func TestNATRulesOfTheFlowsTime(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	backend := netip.MustParseAddrPort("10.244.20.31:3000")
	other := netip.MustParseAddrPort("10.244.20.77:3000")
	rule := func(endpoint string, b netip.AddrPort) flow.NATRule {
		return flow.NATRule{Source: "nftables", Table: "ip kube-proxy", Chain: "service-ULMVA6XW-default/web/tcp/http",
			VIP: netip.MustParseAddrPort("10.120.0.80:80"), Backends: []netip.AddrPort{b}, Rule: endpoint + " dnat to " + b.String()}
	}
	for _, c := range []struct {
		name  string
		rules func() []flow.NATRule
		want  []string
		not   string
	}{
		{"the flow's rule appeared later", func() []flow.NATRule {
			old, cur := rule("endpoint-OLD", backend), rule("endpoint-NEW", backend)
			old.Until, cur.Since = flowtest.At(-5000), flowtest.At(-10000)
			return []flow.NATRule{old, cur}
		}, []string{"endpoint-NEW dnat to 10.244.20.31:3000"}, "endpoint-OLD"},
		{"the flow's rule went later", func() []flow.NATRule {
			gone, cur := rule("endpoint-GONE", backend), rule("endpoint-NEW", backend)
			gone.Until, cur.Since = flowtest.At(60000), flowtest.At(55000)
			return []flow.NATRule{gone, cur}
		}, []string{"endpoint-GONE dnat to 10.244.20.31:3000"}, "endpoint-NEW"},
		{"a rule of another time names the backend", func() []flow.NATRule {
			later, cur := rule("endpoint-LATER", backend), rule("endpoint-NOW", other)
			later.Since = flowtest.At(60000)
			return []flow.NATRule{later, cur}
		}, []string{"no NAT rule read names backend 10.244.20.31:3000", "endpoint-NOW dnat to 10.244.20.77:3000"}, "endpoint-LATER"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := s.Config
			cfg.Attribution.NATRules = c.rules()
			e := flow.NewEngine(cfg)
			for _, o := range s.Observations {
				e.Add(o)
			}
			nf := 0
			for _, f := range e.Flows() {
				if f.RewrittenAt != flow.PlaceNetfilter || f.Service.Port() != 80 {
					continue
				}
				nf++
				for _, w := range c.want {
					if !strings.Contains(f.By, w) {
						t.Errorf("flow %s: by %q, want it to name %q", f.Client, f.By, w)
					}
				}
				if strings.Contains(f.By, c.not) {
					t.Errorf("flow %s: by %q names %s, a rule of another time", f.Client, f.By, c.not)
				}
			}
			if nf == 0 {
				t.Fatal("no TCP flow was rewritten in netfilter")
			}
		})
	}
}

// TestUnlistedBackends: a Service and backend pair that no NAT rule names
// is counted once, however many flows reach it; one a rule names is not;
// once the rules are replaced, a new pair is checked against the new ones.
func TestUnlistedBackends(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	listed := s.Config
	e := flow.NewEngine(listed)
	for _, o := range s.Observations {
		e.Add(o)
	}
	if n := e.UnlistedBackends(); n != 0 {
		t.Errorf("rules name every backend, yet %d pair(s) counted unlisted", n)
	}

	unlisted := s.Config
	unlisted.Attribution.NATRules = nil
	e = flow.NewEngine(unlisted)
	for _, o := range s.Observations {
		e.Add(o)
	}
	pairs := map[[2]netip.AddrPort]bool{}
	for _, f := range e.Flows() {
		if f.Backend.IsValid() {
			pairs[[2]netip.AddrPort{f.Service, f.Backend}] = true
		}
	}
	if len(pairs) == 0 {
		t.Fatal("no flow has a backend")
	}
	if n := e.UnlistedBackends(); n != uint64(len(pairs)) {
		t.Errorf("%d pair(s) counted unlisted, want %d (one per Service and backend)", n, len(pairs))
	}
	e.SetNATAttribution(s.Config.Attribution.NATRules, nil)
	for _, f := range e.Flows() {
		if f.RewrittenAt == flow.PlaceNetfilter && !strings.Contains(f.By, "dnat to") {
			t.Errorf("flow %s: by %q after the rules were set, want the rule", f.Client, f.By)
		}
	}
}

// TestUnlistedBackendCameBack: a backend whose rule went at the last read
// (its endpoint replaced) and which flows reach again later (the rollout
// rolled back) is counted again: only another read names its rule, and
// the rule gone does not.
func TestUnlistedBackendCameBack(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	e := flow.NewEngine(s.Config)
	for _, o := range s.Observations {
		e.Add(o)
	}
	if n := e.UnlistedBackends(); n != 0 {
		t.Fatalf("rules name every backend, yet %d pair(s) counted unlisted", n)
	}
	// Read again: the backend's rules went (another backend's came, which
	// no flow reaches here).
	gone := slices.Clone(s.Config.Attribution.NATRules)
	for i := range gone {
		gone[i].Until = flowtest.At(1000)
	}
	e.SetNATAttribution(gone, nil)
	// The same clients again, later, from other ports: the old backend.
	clients := map[netip.AddrPort]bool{}
	for _, f := range e.Flows() {
		clients[f.Client] = true
	}
	later := func(a netip.AddrPort) netip.AddrPort {
		if !clients[a] {
			return a
		}
		return netip.AddrPortFrom(a.Addr(), a.Port()+10000)
	}
	for _, o := range s.Observations {
		o.Time = o.Time.Add(10 * time.Second)
		o.Src, o.Dst, o.NATSrc = later(o.Src), later(o.Dst), later(o.NATSrc)
		if o.Cookie != 0 {
			o.Cookie += 1 << 32
		}
		e.Add(o)
	}
	if n := e.UnlistedBackends(); n == 0 {
		t.Error("flows reached a backend whose rules went, and no pair was counted unlisted: the rules are not read again")
	}
}

// TestNATRulesOfTheFlowsClient: kube-proxy sends the Pods' and the node's
// own traffic to a NodePort of an externalTrafficPolicy: Local Service to
// the cluster-wide chain, and only the rest to the local one: an outside
// client's flow is attributed to the local chain alone, a Pod's and the
// node's keep the cluster-wide one (and the local one too: that their
// packets never fall through to it, the cluster-wide chain always ending
// in a DNAT, is not read). Without the node's addresses, whether a client
// is local is not guessed: the path stays a candidate.
func TestNATRulesOfTheFlowsClient(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-nodeport-external-client.json")
	if err != nil {
		t.Fatal(err)
	}
	vip, backend := netip.MustParseAddrPort("192.168.80.2:30080"), netip.MustParseAddrPort("10.81.0.7:8080")
	rule := func(chain string, sources ...flow.SourceMatch) flow.NATRule {
		return flow.NATRule{Source: "iptables-legacy", Table: "nat", Chain: "PREROUTING -> KUBE-SERVICES -> KUBE-NODEPORTS -> KUBE-EXT-LOCAL -> " + chain,
			Hook: "prerouting", VIP: vip, Backends: []netip.AddrPort{backend}, Rule: "KUBE-SEP-LOCAL0 -> dnat to 10.81.0.7:8080", Sources: sources}
	}
	podCIDR := flow.SourceMatch{Prefixes: []netip.Prefix{netip.MustParsePrefix("10.81.0.0/16")}}
	rules := []flow.NATRule{
		rule("KUBE-SVC-LOCAL", podCIDR),
		rule("KUBE-SVC-LOCAL", flow.SourceMatch{Local: true}),
		rule("KUBE-SVL-LOCAL"),
	}
	outside := netip.MustParseAddr("192.168.80.1")
	nodeAddrs := []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("192.168.80.2"), netip.MustParseAddr("192.168.80.3")}
	for _, c := range []struct {
		name      string
		client    netip.Addr
		nodeAddrs []netip.Addr
		want, not string
	}{
		{"outside client", outside, nodeAddrs, "KUBE-SVL-LOCAL", "KUBE-SVC-LOCAL"},
		{"Pod client", netip.MustParseAddr("10.81.0.9"), nodeAddrs, "KUBE-SVC-LOCAL", ""},
		{"node client", netip.MustParseAddr("192.168.80.3"), nodeAddrs, "KUBE-SVC-LOCAL", ""},
		{"node client on loopback", netip.MustParseAddr("127.0.0.2"), nodeAddrs, "KUBE-SVC-LOCAL", ""},
		{"node addresses unknown", outside, nil, "one of 2", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := s.Config
			cfg.Attribution.NATRules, cfg.Attribution.NodeAddrs = rules, c.nodeAddrs
			e := flow.NewEngine(cfg)
			for _, o := range s.Observations {
				e.Add(withClient(o, outside, c.client))
			}
			fs := e.Flows()
			if len(fs) != 1 || fs[0].RewrittenAt != flow.PlaceNetfilter {
				t.Fatalf("flows %+v, want one rewritten in netfilter", fs)
			}
			if by := fs[0].By; !strings.Contains(by, c.want) || (c.not != "" && strings.Contains(by, c.not)) {
				t.Errorf("by %q, want it to name %q and not %q", by, c.want, c.not)
			}
		})
	}
}

// withClient is o with the client address from replaced by to.
func withClient(o obs.Observation, from, to netip.Addr) obs.Observation {
	for _, ap := range []*netip.AddrPort{&o.Src, &o.Dst} {
		if ap.Addr() == from {
			*ap = netip.AddrPortFrom(to, ap.Port())
		}
	}
	return o
}

// TestBackendWatches: a backend is watched on the endpoint it serves when
// its port is known (learned from a flow, a DNAT target's, the Service port
// a DNAT without a port keeps), on every port otherwise (a DNAT to a port
// range, a rule of any port without a target port, IPVS without a port);
// rules of Services not traced add nothing.
func TestBackendWatches(t *testing.T) {
	e := replayWithoutNATRules(t, "netfilter-tcp.json", nil)
	ws := func(a ...obs.Watch) []obs.Watch { return a }
	w := func(s string, proto obs.Proto) obs.Watch {
		if ap, err := netip.ParseAddrPort(s); err == nil {
			return obs.Watch{Addr: ap.Addr(), Port: ap.Port(), Proto: proto}
		}
		return obs.Watch{Addr: netip.MustParseAddr(s)}
	}
	if got, want := e.BackendWatches(), ws(w("10.244.20.31:3000", obs.TCP)); !reflect.DeepEqual(got, want) {
		t.Errorf("learned from the flows: %v, want %v", got, want)
	}
	vip := netip.MustParseAddrPort("10.120.0.80:80")
	e.SetNATAttribution([]flow.NATRule{
		{VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.32:8080")}},
		{VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.33:0")}},
		{VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.34:8000")}, PortRange: true},
		{VIP: netip.AddrPortFrom(vip.Addr(), 0), Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.35:0")}},
		{VIP: netip.MustParseAddrPort("10.120.0.99:80"), Proto: obs.TCP, Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.36:80")}},
	}, []flow.IPVSService{
		{VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{netip.MustParseAddrPort("10.244.20.37:0"), netip.MustParseAddrPort("10.244.20.38:3000")}},
	})
	want := ws(w("10.244.20.31:3000", obs.TCP), w("10.244.20.32:8080", obs.TCP), w("10.244.20.33:80", obs.TCP),
		w("10.244.20.34", 0), w("10.244.20.35", 0), w("10.244.20.37", 0), w("10.244.20.38:3000", obs.TCP))
	if got := e.BackendWatches(); !reflect.DeepEqual(got, want) {
		t.Errorf("with the rules:\n got %v\nwant %v", got, want)
	}
}

// TestDeviceRewriteListed: a backend a device chain's rule sets (netdev
// ingress on the host veth) is listed: no NAT rule names it, and reading
// the NAT rules again would not either. Without the device rules it counts.
func TestDeviceRewriteListed(t *testing.T) {
	const scenario = "netdev-ingress-host-veth.json"
	if n := replayWithoutNATRules(t, scenario, nil).UnlistedBackends(); n != 0 {
		t.Errorf("the device rule sets the backend, yet %d pair(s) counted unlisted", n)
	}
	noDeviceRules := func(cfg *flow.Config) { cfg.Attribution.DeviceRules = nil }
	if n := replayWithoutNATRules(t, scenario, noDeviceRules).UnlistedBackends(); n != 1 {
		t.Errorf("without the device rules %d pair(s) counted unlisted, want 1", n)
	}
}

// replayWithoutNATRules replays a scenario of testdata/flows into an engine
// that has no NAT rules (and what change makes of its config).
func replayWithoutNATRules(t *testing.T, scenario string, change func(*flow.Config)) *flow.Engine {
	t.Helper()
	s, err := flowtest.Load(filepath.Join(scenarioDir, scenario))
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.Config
	cfg.Attribution.NATRules = nil
	if change != nil {
		change(&cfg)
	}
	e := flow.NewEngine(cfg)
	for _, o := range s.Observations {
		e.Add(o)
	}
	return e
}

// TestDeviceRulesOfTheirTime: a device chain's rule names the flows of its
// time only (Since, Until, as the session reads the chains again while it
// runs), and a rule gone no longer lists the backend it set.
func TestDeviceRulesOfTheirTime(t *testing.T) {
	const scenario = "netdev-ingress-host-veth.json"
	s, err := flowtest.Load(filepath.Join(scenarioDir, scenario))
	if err != nil {
		t.Fatal(err)
	}
	start := s.Observations[0].Time // the first flow's first packet; the second's is 10 ms later
	byChain := func(e *flow.Engine) bool {
		for _, f := range e.Flows() {
			if f.Client.Port() == 41000 {
				return strings.Contains(f.By, "netdev pt/rw ingress")
			}
		}
		t.Fatal("no flow of client port 41000")
		return false
	}
	timed := func(since, until time.Time) func(*flow.Config) {
		return func(cfg *flow.Config) {
			rules := slices.Clone(cfg.Attribution.DeviceRules)
			for i := range rules {
				rules[i].Since, rules[i].Until = since, until
			}
			cfg.Attribution.DeviceRules = rules
		}
	}
	for _, c := range []struct {
		name         string
		since, until time.Time
		named        bool
		unlisted     uint64
	}{
		{"there from the start", time.Time{}, time.Time{}, true, 0},
		{"made after the flow began", start.Add(5 * time.Millisecond), time.Time{}, false, 0},
		{"gone after the flow began", time.Time{}, start.Add(5 * time.Millisecond), true, 1},
		{"gone before the flow began", time.Time{}, start.Add(-time.Millisecond), false, 1},
	} {
		e := replayWithoutNATRules(t, scenario, timed(c.since, c.until))
		if got := byChain(e); got != c.named {
			t.Errorf("%s: flow named by the chain's rule: %v, want %v", c.name, got, c.named)
		}
		if n := e.UnlistedBackends(); n != c.unlisted {
			t.Errorf("%s: %d pair(s) counted unlisted, want %d", c.name, n, c.unlisted)
		}
	}
	// Rules given after the flows were seen (a chain read again) count for
	// them at once: the verdicts are not kept from before.
	e := replayWithoutNATRules(t, scenario, func(cfg *flow.Config) { cfg.Attribution.DeviceRules = nil })
	if byChain(e) {
		t.Fatal("named by the chain's rule without any rule")
	}
	e.SetDeviceRules(s.Config.Attribution.DeviceRules)
	if !byChain(e) {
		t.Error("after SetDeviceRules, the flow is not named by the chain's rule")
	}
}

// TestNodePortExternalClientConntrackOnly: the NodePort scenario of an
// outside client on a node whose netfilter observers could not attach (the
// conntrack fallback): its request came in on the uplink, so kube-proxy's
// DNAT happened at PREROUTING, and the rule named is that hook's, not the
// node's own clients' OUTPUT path.
func TestNodePortExternalClientConntrackOnly(t *testing.T) {
	s, err := flowtest.Load(filepath.Join(scenarioDir, "netfilter-nodeport-external-client.json"))
	if err != nil {
		t.Fatal(err)
	}
	delete(s.Config.Points, obs.PointNFBefore)
	delete(s.Config.Points, obs.PointNFAfter)
	var kept []obs.Observation
	for _, o := range s.Observations {
		if o.Point != obs.PointNFBefore && o.Point != obs.PointNFAfter {
			kept = append(kept, o)
		}
	}
	s.Observations = kept
	fs := s.Run(nil).Flows()
	if len(fs) != 1 {
		t.Fatalf("got %d flows, want 1: %+v", len(fs), fs)
	}
	f := fs[0]
	if f.RewrittenAt != "netfilter" || !strings.Contains(f.By, "PREROUTING") || strings.Contains(f.By, "OUTPUT") {
		t.Errorf("got %s by %q, want netfilter by the PREROUTING path; reason %q", f.RewrittenAt, f.By, f.Reason)
	}
}
