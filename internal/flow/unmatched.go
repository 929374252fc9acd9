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
//
// Nor is a reply of a connection of which only replies were seen: it
// counts in Summary.RepliesWithoutRequest.
func (e *Engine) counted(o obs.Observation) bool {
	if o.Point == obs.PointConntrack || !hasPorts(o) {
		return true
	}
	if e.ReplyWithoutRequest(o) {
		return false
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

// ServesOtherClient tells whether a packet between server and peer is of
// a connection no flow may be of, in which server is a backend: server is
// a backend endpoint known with its port (learned, or a NAT rule's or IPVS
// service's target port; not one served on every port, which a client
// port of that address would match), and peer is no watched Service, no
// backend endpoint, and no flow's client endpoint nor SNAT source. With a
// Pod selected that is a Service's backend, that is another client's
// connection to it (the caller knows peer is no traced client's address).
func (e *Engine) ServesOtherClient(proto obs.Proto, server, peer netip.AddrPort) bool {
	if !e.backendPorts[server] && !e.ruleEndpoints()[server] {
		return false
	}
	k := clientKey{proto, peer}
	return !e.isService(proto, peer) && !e.servedPort(proto, peer) && len(e.clients[k]) == 0 && len(e.snat[k]) == 0
}

// ruleEndpoints are the backend endpoints the NAT rules and IPVS services
// of the watched VIPs name with their port (a DNAT that keeps the port, the
// VIP's); made when first asked for after the attribution changed.
func (e *Engine) ruleEndpoints() map[netip.AddrPort]bool {
	if e.ruleEnds != nil {
		return e.ruleEnds
	}
	m := map[netip.AddrPort]bool{}
	for _, w := range e.BackendWatches() {
		if w.Port != 0 {
			m[netip.AddrPortFrom(w.Addr, w.Port)] = true
		}
	}
	e.ruleEnds = m
	return m
}

// related tells whether an observation whose flow is not known yet may be
// a watched flow's by what is known now: an end of it (or of conntrack's
// reply tuple, or the destination its socket's application asked for) is
// a watched Service's, a served backend endpoint (servedPort), or a
// client endpoint (or SNAT source) of a flow. Those wait in the main
// waiting room; the others (traffic to or from a backend's address on
// other ports, which the taps and observers capture with the rest) wait
// in a room of their own (waiting), so that they cannot evict the traced
// flows' observations. A socket LB's flow whose backend port is not
// learned yet (its socket events come after its packets) is among the
// others until then: the other room keeps its first packets (otherPairCap).
func (e *Engine) related(o obs.Observation) bool {
	if o.Proto != obs.TCP && o.Proto != obs.UDP {
		return true
	}
	end := func(ap netip.AddrPort) bool {
		if !ap.IsValid() {
			return false
		}
		k := clientKey{o.Proto, ap}
		return e.isService(o.Proto, ap) || e.servedPort(o.Proto, ap) || len(e.clients[k]) > 0 || len(e.snat[k]) > 0
	}
	return end(o.Src) || end(o.Dst) || end(o.NATSrc) || end(o.NATDst) || end(o.ReqDst)
}
