package lab

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// buildTopology makes the namespaces, links, addresses and routes of the lab,
// the VLAN uplink and the gateway's policy (see the package doc).
func (l *Lab) buildTopology() error {
	for _, role := range roles() {
		if err := createNetNS(l.netnsPath(role)); err != nil {
			return fmt.Errorf("%s netns: %w", role, err)
		}
		// No IPv6: keeps router solicitations out of the lab's captures.
		if err := setSysctls(l.netnsPath(role), map[string]string{
			"net.ipv6.conf.all.disable_ipv6":     "1",
			"net.ipv6.conf.default.disable_ipv6": "1",
		}); err != nil {
			return err
		}
	}
	// The node and the gateway forward (see addBridgedDNATRoute for the node).
	// Set before the links exist, so "default" applies to them.
	for _, router := range []string{l.NodeNetNS(), l.GatewayNetNS()} {
		if err := setSysctls(router, map[string]string{
			"net.ipv4.ip_forward":             "1",
			"net.ipv4.conf.all.rp_filter":     "0",
			"net.ipv4.conf.default.rp_filter": "0",
		}); err != nil {
			return err
		}
	}
	// Every failing request gets its ICMP error at once.
	if err := setSysctls(l.GatewayNetNS(), map[string]string{"net.ipv4.icmp_ratelimit": "0"}); err != nil {
		return err
	}
	if err := l.setBridgeNFCallIPTables(false); err != nil {
		return err
	}
	steps := []struct {
		what string
		fn   func() error
	}{
		{"node links", l.buildNode},
		{"node route", l.addBridgedDNATRoute},
		{"pod", func() error {
			return configureHost(l.PodNetNS(), PodIface, netip.PrefixFrom(PodIP, subnetBits), GatewayIP)
		}},
		{"gateway links", l.buildGateway},
		{"backend", func() error {
			return configureHost(l.BackendNetNS(), BackendIface, netip.PrefixFrom(BackendIP, subnetBits), GatewayBackendIP)
		}},
		{"uplink VLAN", l.attachUplinkVLAN},
		{"gateway reject rule", func() error { return installGatewayReject(l.GatewayNetNS()) }},
	}
	for _, s := range steps {
		if err := s.fn(); err != nil {
			return fmt.Errorf("%s: %w", s.what, err)
		}
	}
	return nil
}

// buildNode makes the node: the Pod's veth pair, the bridge and the uplink veth
// pair to the gateway, both host-side ends enslaved to the bridge.
func (l *Lab) buildNode() error {
	pod, err := openNetNS(l.PodNetNS())
	if err != nil {
		return err
	}
	defer pod.Close()
	gw, err := openNetNS(l.GatewayNetNS())
	if err != nil {
		return err
	}
	defer gw.Close()

	return nsutil.Netlink(l.NodeNetNS(), func(h *netlink.Handle) error {
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: HostVeth},
			PeerName: PodIface, PeerNamespace: netlink.NsFd(pod.Fd())}); err != nil {
			return fmt.Errorf("veth %s/%s: %w", HostVeth, PodIface, err)
		}
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: Uplink},
			PeerName: GatewayPort, PeerNamespace: netlink.NsFd(gw.Fd())}); err != nil {
			return fmt.Errorf("veth %s/%s: %w", Uplink, GatewayPort, err)
		}
		if err := h.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: Bridge}}); err != nil {
			return fmt.Errorf("bridge %s: %w", Bridge, err)
		}
		br, err := h.LinkByName(Bridge)
		if err != nil {
			return err
		}
		for _, port := range []string{HostVeth, Uplink} {
			link, err := h.LinkByName(port)
			if err != nil {
				return err
			}
			if err := h.LinkSetMaster(link, br); err != nil {
				return fmt.Errorf("enslave %s to %s: %w", port, Bridge, err)
			}
		}
		return linksUp(h, "lo", HostVeth, Uplink, Bridge)
	})
}

// buildGateway makes the gateway's backend-side veth pair and addresses both ports.
func (l *Lab) buildGateway() error {
	backend, err := openNetNS(l.BackendNetNS())
	if err != nil {
		return err
	}
	defer backend.Close()
	return nsutil.Netlink(l.GatewayNetNS(), func(h *netlink.Handle) error {
		if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: GatewayBackPort},
			PeerName: BackendIface, PeerNamespace: netlink.NsFd(backend.Fd())}); err != nil {
			return fmt.Errorf("veth %s/%s: %w", GatewayBackPort, BackendIface, err)
		}
		if err := addAddr(h, GatewayPort, netip.PrefixFrom(GatewayIP, subnetBits)); err != nil {
			return err
		}
		if err := addAddr(h, GatewayBackPort, netip.PrefixFrom(GatewayBackendIP, subnetBits)); err != nil {
			return err
		}
		return linksUp(h, "lo", GatewayPort, GatewayBackPort)
	})
}

// configureHost addresses an end host (Pod or backend) and gives it a default route.
func configureHost(netnsPath, iface string, addr netip.Prefix, gateway netip.Addr) error {
	return nsutil.Netlink(netnsPath, func(h *netlink.Handle) error {
		if err := addAddr(h, iface, addr); err != nil {
			return err
		}
		if err := linksUp(h, "lo", iface); err != nil {
			return err
		}
		link, err := h.LinkByName(iface)
		if err != nil {
			return err
		}
		route := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: net.IP(gateway.AsSlice())}
		if err := h.RouteAdd(route); err != nil {
			return fmt.Errorf("default route via %s: %w", gateway, err)
		}
		return nil
	})
}

func addAddr(h *netlink.Handle, iface string, p netip.Prefix) error {
	link, err := h.LinkByName(iface)
	if err != nil {
		return fmt.Errorf("link %s: %w", iface, err)
	}
	ipnet := &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), 32)}
	if err := h.AddrAdd(link, &netlink.Addr{IPNet: ipnet}); err != nil {
		return fmt.Errorf("address %s on %s: %w", p, iface, err)
	}
	return nil
}

func linksUp(h *netlink.Handle, names ...string) error {
	for _, name := range names {
		link, err := h.LinkByName(name)
		if err != nil {
			return fmt.Errorf("link %s: %w", name, err)
		}
		if err := h.LinkSetUp(link); err != nil {
			return fmt.Errorf("set %s up: %w", name, err)
		}
	}
	return nil
}

// addBridgedDNATRoute gives the node what lets a DNATed bridged frame stay
// bridged (netfilter mode). After PREROUTING changes the destination of a
// bridged IPv4 packet, br_netfilter (br_nf_pre_routing_finish) routes the new
// destination, keeps bridging only if the route's device is the bridge itself
// ("bridged_dnat"), and resolves the route's next hop for the frame's new
// destination MAC. Measured here: without a route the frame is dropped, and
// with ip_forward=0 it is dropped too (the input route fails with forwarding
// disabled), so the node forwards, like every Kubernetes node. The node has no
// address, so the route goes via the Pod's gateway, on-link on the bridge; the
// bridge ARPs for it from 0.0.0.0 and the gateway answers.
func (l *Lab) addBridgedDNATRoute() error {
	return nsutil.Netlink(l.NodeNetNS(), func(h *netlink.Handle) error {
		br, err := h.LinkByName(Bridge)
		if err != nil {
			return fmt.Errorf("bridge %s: %w", Bridge, err)
		}
		backendNet := netip.PrefixFrom(BackendIP, subnetBits).Masked()
		route := &netlink.Route{
			LinkIndex: br.Attrs().Index,
			Dst:       &net.IPNet{IP: net.IP(backendNet.Addr().AsSlice()), Mask: net.CIDRMask(subnetBits, 32)},
			Gw:        net.IP(GatewayIP.AsSlice()),
			Flags:     int(netlink.FLAG_ONLINK),
		}
		if err := h.RouteAdd(route); err != nil {
			return fmt.Errorf("route %s via %s dev %s: %w", backendNet, GatewayIP, Bridge, err)
		}
		return nil
	})
}
