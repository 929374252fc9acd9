package flow

import "net/netip"

// endpoint is a netip.AddrPort without the pointer a netip.Addr carries, so
// that the per-point counters and sightings of thousands of flows live in
// memory the garbage collector does not scan. IPv6 zones are not kept (no
// observation point reports one).
type endpoint struct {
	ip   [16]byte
	port uint16
	bits uint8 // 0 = invalid, 32 = IPv4, 128 = IPv6
}

func endpointOf(ap netip.AddrPort) endpoint {
	a := ap.Addr()
	if !a.IsValid() {
		return endpoint{}
	}
	return endpoint{ip: a.As16(), port: ap.Port(), bits: uint8(a.BitLen())}
}

func (e endpoint) addrPort() netip.AddrPort {
	switch e.bits {
	case 32:
		return netip.AddrPortFrom(netip.AddrFrom16(e.ip).Unmap(), e.port)
	case 128:
		return netip.AddrPortFrom(netip.AddrFrom16(e.ip), e.port)
	}
	return netip.AddrPort{}
}
