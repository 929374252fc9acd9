package main

import (
	"net/netip"
	"strconv"
	"strings"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// parseService parses --svc IP[:PORT][/tcp|udp].
func parseService(s string) (flow.Service, error) {
	var svc flow.Service
	if strings.Contains(s, ",") {
		return svc, usagef("--svc %q: one Service per --svc: repeat the flag (--svc 10.120.0.80:80/tcp --svc 10.120.0.10:53/udp)", s)
	}
	spec, proto, hasProto := strings.Cut(s, "/")
	if hasProto {
		switch strings.ToLower(proto) {
		case "tcp":
			svc.Proto = obs.TCP
		case "udp":
			svc.Proto = obs.UDP
		default:
			return svc, usagef("--svc %q: protocol %q is not tcp or udp (example: --svc 10.120.0.80:80/tcp)", s, proto)
		}
	}
	// An IPv4 address in brackets ("[10.96.0.10]:53", as some tools print
	// an address and port) is taken as written without them.
	if inner, rest, ok := strings.Cut(strings.TrimPrefix(spec, "["), "]"); ok && strings.HasPrefix(spec, "[") {
		if a, err := netip.ParseAddr(inner); err == nil && a.Is4() && (rest == "" || strings.HasPrefix(rest, ":")) {
			spec = inner + rest
		}
	}
	if strings.Count(spec, ":") > 1 || strings.HasPrefix(spec, "[") {
		inner, _, _ := strings.Cut(strings.TrimPrefix(spec, "["), "]")
		if a, err := netip.ParseAddr(inner); err == nil && a.Is6() {
			return svc, usagef("--svc %q: an IPv6 VIP; pathtrace traces IPv4 Services only (a dual-stack Service has an IPv4 ClusterIP too: kubectl get svc -o wide)", s)
		}
		return svc, usagef("--svc %q: %q is not an IPv4 address (example: --svc 10.120.0.80:80/tcp)", s, spec)
	}
	host, port, hasPort := spec, "", false
	if i := strings.LastIndexByte(spec, ':'); i >= 0 {
		host, port, hasPort = spec[:i], spec[i+1:], true
	}
	addr, err := netip.ParseAddr(host)
	if err != nil || !addr.Is4() {
		return svc, usagef("--svc %q: %q is not an IPv4 address (example: --svc 10.120.0.80:80/tcp)", s, host)
	}
	if addr.IsUnspecified() || addr.IsMulticast() || addr == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return svc, usagef("--svc %q: %s cannot be a Service VIP; give the Service's ClusterIP (kubectl get svc NAME -o wide)", s, addr)
	}
	svc.Addr = addr
	if hasPort {
		p, err := strconv.ParseUint(port, 10, 16)
		if err != nil || p == 0 {
			return svc, usagef("--svc %q: port %q is not in 1-65535 (example: --svc 10.120.0.80:80)", s, port)
		}
		svc.Port = uint16(p)
	}
	return svc, nil
}
