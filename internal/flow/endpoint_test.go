package flow

import (
	"net/netip"
	"testing"
)

func TestEndpointRoundTrip(t *testing.T) {
	for _, s := range []string{"10.120.0.80:80", "[::ffff:10.120.0.80]:80", "[fd00::1]:443", "0.0.0.0:0"} {
		ap := netip.MustParseAddrPort(s)
		if got := endpointOf(ap).addrPort(); got != ap {
			t.Errorf("%s came back as %s", ap, got)
		}
	}
	if got := endpointOf(netip.AddrPort{}).addrPort(); got.IsValid() {
		t.Errorf("the invalid AddrPort came back as %s", got)
	}
	if endpointOf(netip.MustParseAddrPort("10.0.0.1:1")) == endpointOf(netip.MustParseAddrPort("[::ffff:10.0.0.1]:1")) {
		t.Error("IPv4 and its IPv4-mapped IPv6 form are the same endpoint")
	}
}
