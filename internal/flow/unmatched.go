package flow

import (
	"net/netip"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// counted tells whether an observation no flow claimed counts as
// unmatched (Summary.Unmatched). A packet between two watched addresses
// (a Service's VIP, a backend's) on ports that are neither a Service's nor
// a backend's of its address is not: the observers watch those addresses
// on any port, and a backend that is a node address (an overlay node's)
// brings that node's other traffic with it, its VXLAN tunnel's to another
// watched node (UDP 8472 or 4789), which is no flow to a Service.
func (e *Engine) counted(o obs.Observation) bool {
	if o.Point == obs.PointConntrack || !hasPorts(o) {
		return true
	}
	return !e.watchedAddr(o.Src.Addr()) || !e.watchedAddr(o.Dst.Addr()) ||
		e.servedPort(o.Proto, o.Src) || e.servedPort(o.Proto, o.Dst)
}

// watchedAddr tells whether a is a watched Service's address or a backend's
// (learned, or listed by a NAT rule or IPVS service of a watched VIP).
func (e *Engine) watchedAddr(a netip.Addr) bool {
	if len(e.services[a]) > 0 || e.backends[a] {
		return true
	}
	_, ok := e.ruleBackendPorts()[a]
	return ok
}

// servedPort tells whether ap is a watched Service (one without a port
// serves every port) or a backend endpoint: learned, or listed by a NAT
// rule or IPVS service of a watched VIP (one listed without a port, a DNAT
// that keeps it, serves every port).
func (e *Engine) servedPort(proto obs.Proto, ap netip.AddrPort) bool {
	for _, s := range e.services[ap.Addr()] {
		if (s.Port == 0 || s.Port == ap.Port()) && (s.Proto == 0 || proto == 0 || s.Proto == proto) {
			return true
		}
	}
	if e.backendPorts[ap] {
		return true
	}
	for _, p := range e.ruleBackendPorts()[ap.Addr()] {
		if p == 0 || p == ap.Port() {
			return true
		}
	}
	return false
}

// ruleBackendPorts are the ports of the backends the NAT rules and IPVS
// services of the watched VIPs list, by address; made when first asked
// for after the attribution changed (SetNATAttribution).
func (e *Engine) ruleBackendPorts() map[netip.Addr][]uint16 {
	if e.ruleBackends != nil {
		return e.ruleBackends
	}
	m := map[netip.Addr][]uint16{}
	add := func(bs []netip.AddrPort) {
		for _, b := range bs {
			m[b.Addr()] = append(m[b.Addr()], b.Port())
		}
	}
	for _, r := range e.cfg.Attribution.NATRules {
		if e.watches(r.Proto, r.VIP) {
			add(r.Backends)
		}
	}
	for _, s := range e.cfg.Attribution.IPVS {
		if e.watches(s.Proto, s.VIP) {
			add(s.Backends)
		}
	}
	e.ruleBackends = m
	return m
}
