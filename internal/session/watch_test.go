package session

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// initialWatch watches the VIPs on every port, and each backend of the NAT
// rules and IPVS services on the endpoint it serves when its port is known:
// the DNAT target's, or the Service port a DNAT without a port keeps; on
// every port when it is not (a rule of any port without a target port, a
// DNAT to a port range, IPVS without a port).
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
	want := []obs.Watch{w("10.120.0.80", 0), w("10.244.20.31:3000", obs.TCP), w("10.244.20.32:80", obs.TCP),
		w("10.244.20.33", 0), w("10.244.20.34", 0), w("10.244.20.35", 0), w("10.244.20.36:53", obs.UDP)}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("initialWatch:\n got %v\nwant %v", got, want)
	}
}
