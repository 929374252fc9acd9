package main

import (
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

func TestParseService(t *testing.T) {
	good := map[string]flow.Service{
		"10.120.0.80":        {Addr: netip.MustParseAddr("10.120.0.80")},
		"10.120.0.80:80":     {Addr: netip.MustParseAddr("10.120.0.80"), Port: 80},
		"10.120.0.80:80/tcp": {Addr: netip.MustParseAddr("10.120.0.80"), Port: 80, Proto: obs.TCP},
		"10.120.0.10/UDP":    {Addr: netip.MustParseAddr("10.120.0.10"), Proto: obs.UDP},
		"[10.96.7.7]:80":     {Addr: netip.MustParseAddr("10.96.7.7"), Port: 80},
		"[10.96.7.7]":        {Addr: netip.MustParseAddr("10.96.7.7")},
	}
	for in, want := range good {
		got, err := parseService(in)
		if err != nil || got != want {
			t.Errorf("parseService(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"999.1.1.1", "10.0.0.1:99999", "10.0.0.1:0", "10.0.0.1:80/sctp", "", "::1", "web:80", "10.0.0.1:",
		"0.0.0.0", "0.0.0.0:80", "224.0.0.251:5353/udp", "255.255.255.255", "[10.96.7.7]x", "[10.96.7.7"} {
		_, err := parseService(in)
		var ue usageError
		if !errors.As(err, &ue) {
			t.Errorf("parseService(%q) = %v; want a usage error", in, err)
		}
	}
	// An IPv6 VIP is named as such, whole, not cut at its first colon.
	for _, in := range []string{"fd00::10", "[fd00::10]:80/tcp", "::1"} {
		if _, err := parseService(in); err == nil || !strings.Contains(err.Error(), "IPv6") {
			t.Errorf("parseService(%q) = %v; want an error naming IPv6", in, err)
		}
	}
}

// TestParseServiceSaysWhatWasGiven: a CIDR or a Service's name is named as
// such, with how to get the VIP, not as a bad protocol or address.
func TestParseServiceSaysWhatWasGiven(t *testing.T) {
	for in, want := range map[string]string{
		"10.96.0.0/12":                     "a CIDR",
		"10.96.0.0/24/tcp":                 "a CIDR",
		"web":                              "is a name",
		"web.default.svc.cluster.local:80": "is a name",
		"kube-dns:53/udp":                  "is a name",
	} {
		_, err := parseService(in)
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "kubectl get svc") {
			t.Errorf("parseService(%q) = %v; want a usage error saying %q and how to find the ClusterIP", in, err, want)
		}
	}
	for _, in := range []string{"10.0.0.1/sctp", "999.1.1.1"} {
		if _, err := parseService(in); err == nil || strings.Contains(err.Error(), "a CIDR") || strings.Contains(err.Error(), "is a name") {
			t.Errorf("parseService(%q) = %v", in, err)
		}
	}
}
