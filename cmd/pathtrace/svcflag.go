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
			if bits, _, _ := strings.Cut(proto, "/"); isDigits(bits) {
				return svc, usagef("--svc %q: a CIDR; --svc takes one Service VIP (its ClusterIP: kubectl get svc -A -o wide), repeat it for more: --svc 10.120.0.80 --svc 10.120.0.10", s)
			}
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
	if err != nil && isName(host) {
		return svc, usagef("--svc %q: %q is a name; --svc takes the Service's ClusterIP: kubectl get svc NAME -n NAMESPACE -o wide", s, host)
	}
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

// isName tells whether s reads as a host or Service name (web,
// web.default.svc.cluster.local) rather than a mistyped address: it has a
// letter, and only what DNS names are made of.
func isName(s string) bool {
	letter := false
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z':
			letter = true
		case r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_':
		default:
			return false
		}
	}
	return letter
}

// isDigits tells whether s is a decimal number (a CIDR's prefix length).
func isDigits(s string) bool {
	_, err := strconv.ParseUint(s, 10, 8)
	return err == nil
}
