package session

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// initialWatch watches a VIP given with its port on that endpoint, one given
// without on every port, and each backend of the NAT rules (of the traced
// ports) and IPVS services on the endpoint it serves when its port is
// known: the DNAT target's, or the Service port a DNAT without a port
// keeps; on every port when it is not (a rule of any port without a target
// port, a DNAT to a port range, IPVS without a port).
func TestInitialWatchEndpoints(t *testing.T) {
	vip := netip.MustParseAddr("10.120.0.80")
	ap := netip.MustParseAddrPort
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{
		{Service: vip, Port: 80, Proto: "tcp", Backend: ap("10.244.20.31:3000")},
		{Service: vip, Port: 80, Proto: "tcp", Backend: ap("10.244.20.31:3000")}, // once
		{Service: vip, Port: 80, Proto: "tcp", Backend: ap("10.244.20.32:0")},
		{Service: vip, Proto: "tcp", Backend: ap("10.244.20.33:0")},
		{Service: vip, Port: 80, Proto: "tcp", Backend: ap("10.244.20.34:8000"), PortRange: true},
		{Service: vip, Port: 80, Proto: "tcp", Verdict: "reject"},
		{Service: vip, Port: 443, Proto: "tcp", Backend: netip.AddrPortFrom(vip, 8443)}, // the VIP: every port already
	}
	node.IPVS.Services = []discover.IPVSService{
		{Backends: []netip.AddrPort{ap("10.244.20.35:0"), ap("10.244.20.36:53")}, Proto: "udp"},
	}
	got := initialWatch([]flow.Service{{Addr: vip, Port: 80, Proto: obs.TCP}}, node)
	w := func(s string, proto obs.Proto) obs.Watch {
		if a, err := netip.ParseAddrPort(s); err == nil {
			return obs.Watch{Addr: a.Addr(), Port: a.Port(), Proto: proto}
		}
		return obs.WatchAddr(netip.MustParseAddr(s))
	}
	// The rule of port 443 serves no traced port: its backend (the VIP's
	// own address) is not watched.
	want := []obs.Watch{w("10.120.0.80:80", obs.TCP), w("10.244.20.31:3000", obs.TCP), w("10.244.20.32:80", obs.TCP),
		w("10.244.20.33", 0), w("10.244.20.34", 0), w("10.244.20.35", 0), w("10.244.20.36:53", obs.UDP)}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("initialWatch:\n got %v\nwant %v", got, want)
	}
	// Traced without a port: every port of the VIP, which covers the rule
	// of port 443's backend on the VIP's address.
	got = initialWatch([]flow.Service{{Addr: vip}}, node)
	want = []obs.Watch{w("10.120.0.80", 0), w("10.244.20.31:3000", obs.TCP), w("10.244.20.32:80", obs.TCP),
		w("10.244.20.33", 0), w("10.244.20.34", 0), w("10.244.20.35", 0), w("10.244.20.36:53", obs.UDP)}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("initialWatch of the VIP on every port:\n got %v\nwant %v", got, want)
	}
}

// TestInitialWatchNodePort: a NodePort traced as the node's address and
// port is watched on that endpoint only, not on every port of the node's
// address (its kubelet, ssh and API traffic would all pass the taps and
// observers, into the capture file), and its hostNetwork backend on the
// node's own address is watched on its endpoint.
func TestInitialWatchNodePort(t *testing.T) {
	nodeIP := netip.MustParseAddr("198.18.5.2")
	node := &discover.NodeInfo{}
	node.Netfilter.Rules = []discover.NATRule{
		{Service: nodeIP, Port: 30080, Proto: "tcp", Backend: netip.AddrPortFrom(nodeIP, 6443)},
		{Service: nodeIP, Port: 30080, Proto: "tcp", Backend: netip.MustParseAddrPort("100.64.99.21:8080")},
		{Service: nodeIP, Port: 30053, Proto: "udp", Backend: netip.MustParseAddrPort("100.64.99.24:5353")},
	}
	got := initialWatch([]flow.Service{{Addr: nodeIP, Port: 30080, Proto: obs.TCP}}, node)
	want := []obs.Watch{{Addr: nodeIP, Port: 30080, Proto: obs.TCP}, {Addr: nodeIP, Port: 6443, Proto: obs.TCP},
		{Addr: netip.MustParseAddr("100.64.99.21"), Port: 8080, Proto: obs.TCP}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("initialWatch:\n got %v\nwant %v", got, want)
	}
}

// The socket observers one protocol's flows need are left out when no traced
// Service can have that protocol; a Service without one can have either.
func TestSocketSkip(t *testing.T) {
	vip := netip.MustParseAddr("10.120.0.80")
	svc := func(proto obs.Proto) flow.Service { return flow.Service{Addr: vip, Port: 80, Proto: proto} }
	for _, c := range []struct {
		name     string
		svcs     []flow.Service
		tcp, udp bool // attached
	}{
		{"tcp only", []flow.Service{svc(obs.TCP), svc(obs.TCP)}, true, false},
		{"udp only", []flow.Service{svc(obs.UDP)}, false, true},
		{"both", []flow.Service{svc(obs.TCP), svc(obs.UDP)}, true, true},
		{"any protocol", []flow.Service{svc(obs.TCP), svc(0)}, true, true},
	} {
		skip := socketSkip(c.svcs)
		if (skip.TCP == nil) != c.tcp || (skip.UDP == nil) != c.udp {
			t.Errorf("%s: TCP observer skipped %v, UDP observer skipped %v; want attached %v, %v", c.name, skip.TCP, skip.UDP, c.tcp, c.udp)
		}
	}
}
