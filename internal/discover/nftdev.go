package discover

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// DeviceChain is an nftables base chain on a device's own hook: a netdev
// chain at ingress or egress, an inet chain at ingress (Linux 5.10). An
// ingress chain runs after the device's tc ingress and before a bridge,
// OVS or the IP stack (PREROUTING) see the packet; an egress chain before
// the device's tc egress. Either can rewrite a VIP statelessly (`ip daddr
// set 10.244.20.31`), where netfilter's NAT and conntrack never hear of it.
type DeviceChain struct {
	Family   string   `json:"family"` // netdev or inet
	Table    string   `json:"table"`
	Chain    string   `json:"chain"`
	Hook     string   `json:"hook"` // ingress or egress
	Devices  []string `json:"devices"`
	Priority int      `json:"priority"`
	// Rewrites are the rules reachable from the chain that set a traced
	// VIP's destination, each as the DNAT it amounts to: Hook is the
	// chain's, Backend what the rule sets (port 0: kept), invalid (Note
	// says so) when that is not a constant (a map's, numgen's value).
	Rewrites []NATRule `json:"rewrites,omitempty"`
}

// String names the chain as verdicts and the report do.
func (c DeviceChain) String() string {
	return fmt.Sprintf("%s %s/%s", c.Family, c.Table, c.Chain)
}

// unknownRewrite is the Note of a rewrite to a value not decoded.
const unknownRewrite = "? (a map's or an expression's value: not decoded)"

// asRewrite makes a rule that sets the destination address a DNAT to what
// it sets, for a walk of a device hook's graph.
func (r *natRule) asRewrite() {
	if !r.setDst {
		return
	}
	r.dnat = true
	if r.setAddr.IsValid() {
		r.backend = netip.AddrPortFrom(r.setAddr, r.setPort)
	} else {
		r.note = unknownRewrite
	}
}

// Attributes of a chain's hook (linux/netfilter/nf_tables.h) that
// google/nftables v0.3.0 does not decode when listing: the device of a
// netdev chain (NFTA_HOOK_DEV), or its devices (NFTA_HOOK_DEVS, nested
// NFTA_DEVICE_NAMEs, Linux 5.5); and the inet family's ingress hook
// (NF_INET_INGRESS, Linux 5.10), which x/sys/unix does not name.
const (
	nftaHookDevs   = 4
	nftaDeviceName = 1
	nfInetIngress  = 5
)

// deviceHook names the device hook of a base chain of family at hooknum:
// netdev ingress (NF_NETDEV_INGRESS) and egress (NF_NETDEV_EGRESS), inet
// ingress (NF_INET_INGRESS); "" for any other.
func deviceHook(family nftables.TableFamily, hooknum uint32) string {
	switch {
	case family == nftables.TableFamilyNetdev && hooknum == unix.NF_NETDEV_INGRESS,
		family == nftables.TableFamilyINet && hooknum == nfInetIngress:
		return "ingress"
	case family == nftables.TableFamilyNetdev && hooknum == unix.NF_NETDEV_EGRESS:
		return "egress"
	}
	return ""
}

// listDeviceChains dumps the netns's netdev and inet chains
// (NFT_MSG_GETCHAIN, one family at a time: kube-proxy's thousands of ip
// chains are not listed again) over conn and keeps the base chains on
// device hooks, with their devices.
func listDeviceChains(conn *netlink.Conn) ([]DeviceChain, error) {
	var out []DeviceChain
	for _, family := range []uint8{unix.NFPROTO_NETDEV, unix.NFPROTO_INET} {
		req := netlink.Message{
			Header: netlink.Header{
				Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETCHAIN),
				Flags: netlink.Request | netlink.Dump,
			},
			Data: []byte{family, unix.NFNETLINK_V0, 0, 0}, // struct nfgenmsg
		}
		msgs, err := conn.Execute(req)
		if err != nil {
			return out, fmt.Errorf("list nftables chains: %w", err)
		}
		for _, m := range msgs {
			c, ok, err := parseDeviceChain(m.Data)
			if err != nil {
				return out, err
			}
			if ok {
				out = append(out, c)
			}
		}
	}
	return out, nil
}

// parseDeviceChain decodes one NFT_MSG_NEWCHAIN message (nfgenmsg, then
// its attributes); ok false for a chain not on a device hook.
func parseDeviceChain(b []byte) (c DeviceChain, ok bool, err error) {
	m, err := parseChainMsg(b)
	if err != nil {
		return c, false, err
	}
	c = DeviceChain{Family: NFTFamilyName(m.family), Table: m.table, Chain: m.name,
		Hook: deviceHook(m.family, m.hooknum), Devices: m.devices, Priority: m.priority}
	slices.Sort(c.Devices)
	c.Devices = slices.Compact(c.Devices)
	return c, m.hooked && c.Hook != "", nil
}

// deviceRewrites fills in the Rewrites of chains, each a base chain on a
// device hook: the rules reachable from it (jumps and gotos followed, as
// for NAT chains) that set a traced VIP's destination. Read-only: list
// requests only.
func deviceRewrites(conn *nftables.Conn, raw *netlink.Conn, chains []DeviceChain, svcs serviceSet) error {
	families := map[string]nftables.TableFamily{"netdev": nftables.TableFamilyNetdev, "inet": nftables.TableFamilyINet}
	listed := map[nftables.TableFamily][]*nftables.Chain{}
	var firstErr error
	for i := range chains {
		dc := &chains[i]
		family := families[dc.Family]
		all, ok := listed[family]
		if !ok {
			var err error
			if all, err = conn.ListChainsOfTableFamily(family); err != nil {
				return fmt.Errorf("list nftables %s chains: %w", dc.Family, err)
			}
			listed[family] = all
		}
		if !slices.ContainsFunc(all, func(c *nftables.Chain) bool { return c.Table.Name == dc.Table && c.Name == dc.Chain }) {
			continue // gone since the dump
		}
		g := &natGraph{source: SourceNFTables, table: dc.Family + " " + dc.Table, chains: map[string][]natRule{},
			bases: []natBase{{chain: dc.Chain, hook: dc.Hook, nat: true, priority: dc.Priority}}}
		lazyLoad(conn, raw, g, &nftables.Table{Name: dc.Table, Family: family}, true)
		for _, r := range g.matchServices(svcs) {
			if r.Verdict == "" {
				dc.Rewrites = append(dc.Rewrites, r)
			}
		}
		if g.err != nil && firstErr == nil {
			firstErr = g.err
		}
	}
	return firstErr
}
