package discover

import (
	"bytes"
	"cmp"
	"errors"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// MaxUplinkNeighbors bounds the entries (addresses and fdb remotes, so the
// MACs too) kept from the uplinks' neighbour tables: a node on a large L2
// segment may know thousands.
const MaxUplinkNeighbors = 4096

// UplinkNeighbor is what the node's tables map a MAC to on an uplink: the
// IPv4 addresses of its neighbour entries there (the next hop a routed
// node's frames go to), and on a vxlan uplink the remote underlay address
// its fdb sends that MAC to (the remote VTEP).
type UplinkNeighbor struct {
	Ifindex int
	MAC     net.HardwareAddr
	Addrs   []netip.Addr // sorted; none when only the fdb names the MAC
	VTEP    netip.Addr   // vxlan only; invalid when the fdb has no entry
}

// RefreshUplinkNeighbors reads the uplinks' neighbour tables again (entries
// appear as traffic flows: ARP on the first packet). On an error the
// entries read before stay.
func RefreshUplinkNeighbors(node *NodeInfo) error {
	if node.HostNetNS.Path == "" {
		return nil
	}
	return nsutil.Netlink(node.HostNetNS.Path, func(nl *netlink.Handle) error {
		ns, err := readUplinkNeighbors(nl, node.CapturePoints)
		if ns != nil || err == nil {
			node.UplinkNeighbors = ns
		}
		return err
	})
}

// readUplinkNeighbors reads, for each uplink capture point, the IPv4
// neighbour entries that are not FAILED or INCOMPLETE, and for a vxlan
// uplink the fdb's remote addresses, at most MaxUplinkNeighbors entries in
// all (past that, the addresses of a MAC are some of them), sorted by
// device and MAC.
func readUplinkNeighbors(nl *netlink.Handle, cps []CapturePoint) ([]UplinkNeighbor, error) {
	type key struct {
		ifindex int
		mac     string
	}
	byKey := map[key]*UplinkNeighbor{}
	var errs []error
	entries := 0 // addresses and VTEPs kept
	get := func(ifindex int, mac net.HardwareAddr) *UplinkNeighbor {
		if entries >= MaxUplinkNeighbors || len(mac) != 6 || bytes.Equal(mac, make(net.HardwareAddr, 6)) {
			return nil
		}
		k := key{ifindex, string(mac)}
		if n := byKey[k]; n != nil {
			return n
		}
		n := &UplinkNeighbor{Ifindex: ifindex, MAC: slices.Clone(mac)}
		byKey[k] = n
		return n
	}
	seen := map[int]bool{}
	for _, cp := range cps {
		if cp.Role != RoleUplink || cp.Ifindex == 0 || seen[cp.Ifindex] {
			continue
		}
		seen[cp.Ifindex] = true
		neighs, err := nl.NeighList(cp.Ifindex, netlink.FAMILY_V4)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			errs = append(errs, err)
		}
		// A bridge port has no neighbour entries of its own: the node's
		// address, and the entries of the next hop its frames go to, are
		// the bridge's (a NIC enslaved to br0).
		if cp.MasterKind == "bridge" {
			more, err := masterNeighbors(nl, cp.Master)
			if err != nil {
				errs = append(errs, err)
			}
			neighs = append(neighs, more...)
		}
		for _, ne := range neighs {
			a, ok := netip.AddrFromSlice(ne.IP)
			if !ok || ne.State&(unix.NUD_INCOMPLETE|unix.NUD_FAILED) != 0 {
				continue
			}
			if n := get(cp.Ifindex, ne.HardwareAddr); n != nil && !slices.Contains(n.Addrs, a.Unmap()) {
				n.Addrs = append(n.Addrs, a.Unmap())
				entries++
			}
		}
		if cp.Kind != "vxlan" {
			continue
		}
		fdb, err := nl.NeighList(cp.Ifindex, unix.AF_BRIDGE)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			errs = append(errs, err)
		}
		for _, ne := range fdb {
			a, ok := netip.AddrFromSlice(ne.IP)
			if !ok || !a.IsValid() || a.IsUnspecified() {
				continue
			}
			if n := get(cp.Ifindex, ne.HardwareAddr); n != nil && (!n.VTEP.IsValid() || a.Unmap().Less(n.VTEP)) {
				if !n.VTEP.IsValid() {
					entries++
				}
				n.VTEP = a.Unmap()
			}
		}
	}
	out := make([]UplinkNeighbor, 0, len(byKey))
	for _, n := range byKey {
		slices.SortFunc(n.Addrs, netip.Addr.Compare)
		out = append(out, *n)
	}
	slices.SortFunc(out, func(a, b UplinkNeighbor) int {
		return cmp.Or(a.Ifindex-b.Ifindex, bytes.Compare(a.MAC, b.MAC))
	})
	return out, errors.Join(errs...)
}

// masterNeighbors lists the IPv4 neighbour entries of the bridge named
// master.
func masterNeighbors(nl *netlink.Handle, master string) ([]netlink.Neigh, error) {
	br, err := nl.LinkByName(master)
	if err != nil {
		return nil, err
	}
	neighs, err := nl.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
	if errors.Is(err, netlink.ErrDumpInterrupted) {
		err = nil
	}
	return neighs, err
}
