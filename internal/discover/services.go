package discover

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// ServicePort is a VIP with the port and protocol a Service was given with.
type ServicePort struct {
	Addr  netip.Addr
	Port  uint16 // 0 = any port
	Proto string // tcp, udp, ...; "" = any protocol
}

// String is the Service as --svc takes it: VIP[:PORT][/PROTO].
func (p ServicePort) String() string {
	s := p.Addr.String()
	if p.Port != 0 {
		s += ":" + strconv.Itoa(int(p.Port))
	}
	if p.Proto != "" {
		s += "/" + strings.ToLower(p.Proto)
	}
	return s
}

// traced lists the Services as --svc gave them, each once.
func traced(addrs []netip.Addr, ports []ServicePort) []string {
	var out []string
	add := func(s string) {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	for _, p := range ports {
		add(p.String())
	}
	for _, a := range addrs {
		if !slices.ContainsFunc(ports, func(p ServicePort) bool { return p.Addr == a }) {
			add(a.String())
		}
	}
	return out
}

// untranslated lists the traced Services (as traced names them) that no
// NAT rule, nftables device rewrite nor IPVS virtual service translates:
// kube-proxy never programmed them, while it may have the others.
func untranslated(addrs []netip.Addr, ports []ServicePort, nf Netfilter, ipvs IPVS) []string {
	specs := slices.Clone(ports)
	for _, a := range addrs {
		if !slices.ContainsFunc(ports, func(p ServicePort) bool { return p.Addr == a }) {
			specs = append(specs, ServicePort{Addr: a})
		}
	}
	var out []string
	for _, sp := range specs {
		rule := func(r NATRule) bool { return sp.covers(r.Service, r.Port, r.Proto) }
		translated := slices.ContainsFunc(nf.Rules, rule) ||
			slices.ContainsFunc(ipvs.Services, func(v IPVSService) bool {
				return sp.covers(v.Service.Addr(), v.Service.Port(), v.Proto)
			}) ||
			slices.ContainsFunc(nf.DeviceChains, func(c DeviceChain) bool { return slices.ContainsFunc(c.Rewrites, rule) })
		if s := sp.String(); !translated && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// covers tells whether a translation of vip limited to port and proto (0
// and "" when it requires none) applies to some packets of the Service.
func (p ServicePort) covers(vip netip.Addr, port uint16, proto string) bool {
	return p.Addr == vip && (p.Port == 0 || port == 0 || p.Port == port) &&
		(p.Proto == "" || proto == "" || strings.EqualFold(p.Proto, proto))
}

// serviceSet is what discovery looks for: each VIP once, and the ports and
// protocols that narrow it.
type serviceSet struct {
	vips  []netip.Addr
	ports map[netip.Addr][]ServicePort // none for a VIP: any port
	any   map[netip.Addr]bool          // given without port or protocol
	// local are the VIPs that are addresses of the node (a NodePort traced
	// as NODE-IP:PORT), which rules limited to local addresses select.
	local map[netip.Addr]bool
}

func newServiceSet(addrs []netip.Addr, ports []ServicePort) serviceSet {
	s := serviceSet{ports: map[netip.Addr][]ServicePort{}, any: map[netip.Addr]bool{}}
	for _, a := range addrs {
		if !slices.Contains(s.vips, a) {
			s.vips = append(s.vips, a)
		}
	}
	for _, p := range ports {
		if !slices.Contains(s.vips, p.Addr) {
			s.vips = append(s.vips, p.Addr)
		}
		p.Proto = strings.ToLower(p.Proto)
		if p.Port == 0 && p.Proto == "" {
			s.any[p.Addr] = true
		}
		s.ports[p.Addr] = append(s.ports[p.Addr], p)
	}
	return s
}

// anyPort tells whether vip is traced on every port (given without one).
func (s serviceSet) anyPort(vip netip.Addr) bool {
	specs := s.ports[vip]
	return len(specs) == 0 || s.any[vip] || slices.ContainsFunc(specs, func(sp ServicePort) bool { return sp.Port == 0 })
}

// allows tells whether a translation of vip limited to port and proto (0
// and "" when it requires none) concerns the services.
func (s serviceSet) allows(vip netip.Addr, port uint16, proto string) bool {
	specs := s.ports[vip]
	if len(specs) == 0 || s.any[vip] {
		return slices.Contains(s.vips, vip)
	}
	return slices.ContainsFunc(specs, func(sp ServicePort) bool {
		return (sp.Port == 0 || port == 0 || sp.Port == port) && (sp.Proto == "" || proto == "" || sp.Proto == proto)
	})
}

// matchServices returns the DNATs reachable for the services' VIPs, each
// VIP once, keeping those of the services' ports and protocols: a path that
// requires no port (or protocol) applies to every one.
func (g *natGraph) matchServices(s serviceSet) []NATRule {
	return slices.DeleteFunc(g.matchLocal(s.vips, s.local), func(r NATRule) bool { return !s.allows(r.Service, r.Port, r.Proto) })
}

// ipvsServices keeps the IPVS virtual services of the services (an IPVS
// service on port 0 takes every port).
func ipvsServices(all []IPVSService, s serviceSet) []IPVSService {
	var out []IPVSService
	for _, v := range all {
		if s.allows(v.Service.Addr(), v.Service.Port(), v.Proto) {
			out = append(out, v)
		}
	}
	return out
}
