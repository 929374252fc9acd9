package discover

import (
	"encoding/binary"
	"net/netip"
	"slices"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// setDaddr is `ip daddr set ADDR` as nft(8) compiles it (the checksum
// fix-up fields left out: the reader ignores them).
func setDaddr(addr string) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: ip4(addr)},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
	}
}

func setDport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: port(p)},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
	}
}

func TestNFTRuleSetsDestination(t *testing.T) {
	// ip daddr 10.120.0.80 tcp dport 80 ip daddr set 10.244.20.31 tcp dport set 3000
	exprs := []expr.Any{loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...), loadProto(1), cmpEq(1, unix.IPPROTO_TCP), loadDport(1), cmpEq(1, port(80)...)}
	exprs = append(append(exprs, setDaddr("10.244.20.31")...), setDport(3000)...)
	r := nftNATRules(exprs, noSets)[0]
	if !r.setDst || r.setAddr != netip.MustParseAddr("10.244.20.31") || r.setPort != 3000 || r.dnat {
		t.Fatalf("got %+v, want a set of 10.244.20.31:3000 (no DNAT before asRewrite)", r)
	}
	r.asRewrite()
	if !r.dnat || r.backend != netip.MustParseAddrPort("10.244.20.31:3000") || r.note != "" {
		t.Fatalf("as rewrite: %+v, want a DNAT to 10.244.20.31:3000", r)
	}

	// ip daddr 10.120.0.80 ip daddr set numgen random mod 2 map { ... }:
	// a value from a map not read, not decoded.
	r = nftNATRules([]expr.Any{loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...),
		&expr.Numgen{Register: 1, Modulus: 2}, &expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: "__map%d"},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}}, noSets)[0]
	r.asRewrite()
	if !r.dnat || r.backend.IsValid() || r.note != unknownRewrite {
		t.Fatalf("map-valued set: %+v, want a DNAT to ? (%q)", r, unknownRewrite)
	}

	// ip daddr 10.120.0.80 ip daddr set ip daddr map { 10.120.0.80 :
	// 10.244.20.31, 10.120.0.81 : 10.244.20.32 } tcp dport set 3000: the
	// element of the VIP alone (the rule's own condition excludes .81).
	maps := func(string) (nftSet, bool) {
		return nftSet{elems: []nftables.SetElement{{Key: ip4("10.120.0.80"), Val: ip4("10.244.20.31")}, {Key: ip4("10.120.0.81"), Val: ip4("10.244.20.32")}}}, true
	}
	rs := nftNATRules(append([]expr.Any{loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...),
		loadDaddr(1), &expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: "__map%d"},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}},
		setDport(3000)...), maps)
	if len(rs) != 1 || rs[0].setAddr != netip.MustParseAddr("10.244.20.31") || rs[0].setPort != 3000 ||
		!slices.Equal(rs[0].dst, []netip.Prefix{netip.MustParsePrefix("10.120.0.80/32")}) {
		t.Fatalf("map by destination: %+v, want one rewrite of 10.120.0.80 to 10.244.20.31:3000", rs)
	}
	// The same map looked up by numgen: each element a possible backend.
	rs = nftNATRules([]expr.Any{loadDaddr(1), cmpEq(1, ip4("10.120.0.80")...),
		&expr.Numgen{Register: 1, Modulus: 2}, &expr.Lookup{SourceRegister: 1, DestRegister: 1, IsDestRegSet: true, SetName: "__map%d"},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4}}, maps)
	if len(rs) != 2 || rs[0].setAddr != netip.MustParseAddr("10.244.20.31") || rs[1].setAddr != netip.MustParseAddr("10.244.20.32") ||
		!slices.Equal(rs[1].dst, []netip.Prefix{netip.MustParsePrefix("10.120.0.80/32")}) {
		t.Fatalf("numgen map: %+v, want rewrites of 10.120.0.80 to each of its values", rs)
	}

	// Setting the source, or only the port, is no rewrite of the VIP.
	r = nftNATRules([]expr.Any{&expr.Immediate{Register: 1, Data: ip4("10.0.0.1")},
		&expr.Payload{OperationType: expr.PayloadWrite, SourceRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4}}, noSets)[0]
	r.asRewrite()
	if r.dnat || r.setDst {
		t.Fatalf("ip saddr set: %+v, want no rewrite", r)
	}
}

// chainMessage is an NFT_MSG_NEWCHAIN message's data as the kernel sends
// it for a base chain: nfgenmsg, table, name, hook (number, priority,
// devices as NFTA_HOOK_DEV or NFTA_HOOK_DEVS), type.
func chainMessage(t *testing.T, family uint8, table, chain string, hooknum uint32, prio int32, dev string, devs []string) []byte {
	t.Helper()
	e := netlink.NewAttributeEncoder()
	e.ByteOrder = binary.BigEndian
	e.String(unix.NFTA_CHAIN_TABLE, table)
	e.String(unix.NFTA_CHAIN_NAME, chain)
	e.Nested(unix.NFTA_CHAIN_HOOK, func(he *netlink.AttributeEncoder) error {
		he.Uint32(unix.NFTA_HOOK_HOOKNUM, hooknum)
		he.Uint32(unix.NFTA_HOOK_PRIORITY, uint32(prio))
		if dev != "" {
			he.String(unix.NFTA_HOOK_DEV, dev)
		}
		if devs != nil {
			he.Nested(nftaHookDevs, func(de *netlink.AttributeEncoder) error {
				for _, d := range devs {
					de.String(nftaDeviceName, d)
				}
				return nil
			})
		}
		return nil
	})
	e.String(unix.NFTA_CHAIN_TYPE, "filter")
	b, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return append([]byte{family, unix.NFNETLINK_V0, 0, 0}, b...)
}

func TestParseDeviceChain(t *testing.T) {
	for _, tc := range []struct {
		name   string
		msg    []byte
		want   DeviceChain
		device bool
	}{
		{"netdev ingress, one device", chainMessage(t, unix.NFPROTO_NETDEV, "t", "c", 0, -500, "veth-a", nil),
			DeviceChain{Family: "netdev", Table: "t", Chain: "c", Hook: "ingress", Devices: []string{"veth-a"}, Priority: -500}, true},
		{"netdev egress, devices", chainMessage(t, unix.NFPROTO_NETDEV, "t", "e", 1, 0, "", []string{"eth1", "eth0"}),
			DeviceChain{Family: "netdev", Table: "t", Chain: "e", Hook: "egress", Devices: []string{"eth0", "eth1"}}, true},
		{"inet ingress", chainMessage(t, unix.NFPROTO_INET, "t", "i", 5, 10, "eth0", nil),
			DeviceChain{Family: "inet", Table: "t", Chain: "i", Hook: "ingress", Devices: []string{"eth0"}, Priority: 10}, true},
		// Hook 0 of an inet or ip chain is prerouting, no device's.
		{"inet prerouting", chainMessage(t, unix.NFPROTO_INET, "t", "p", 0, -100, "", nil), DeviceChain{}, false},
		{"ip prerouting", chainMessage(t, unix.NFPROTO_IPV4, "t", "p", 0, -100, "", nil), DeviceChain{}, false},
		{"inet input", chainMessage(t, unix.NFPROTO_INET, "t", "p", 1, 0, "", nil), DeviceChain{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := parseDeviceChain(tc.msg)
			if err != nil || ok != tc.device {
				t.Fatalf("ok %v err %v, want ok %v", ok, err, tc.device)
			}
			if ok && (got.String() != tc.want.String() || got.Hook != tc.want.Hook || got.Priority != tc.want.Priority || !slices.Equal(got.Devices, tc.want.Devices)) {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
	// A regular chain (no hook) is none.
	e := netlink.NewAttributeEncoder()
	e.String(unix.NFTA_CHAIN_TABLE, "t")
	e.String(unix.NFTA_CHAIN_NAME, "rw")
	b, _ := e.Encode()
	if _, ok, err := parseDeviceChain(append([]byte{unix.NFPROTO_NETDEV, 0, 0, 0}, b...)); ok || err != nil {
		t.Errorf("a chain without hook: ok %v err %v, want neither", ok, err)
	}
}

// A netdev chain's hook numbers are its device's: ingress (0) is no
// prerouting, egress (1) no input.
func TestDeviceChainsAreNoIPHooks(t *testing.T) {
	for _, tc := range []struct {
		family nftables.TableFamily
		hook   *nftables.ChainHook
		want   string
	}{
		{nftables.TableFamilyNetdev, nftables.ChainHookIngress, ""},
		{nftables.TableFamilyNetdev, nftables.ChainHookEgress, ""},
		{nftables.TableFamilyIPv4, nftables.ChainHookPrerouting, "prerouting"},
		{nftables.TableFamilyINet, nftables.ChainHookInput, "input"},
	} {
		c := &nftables.Chain{Table: &nftables.Table{Family: tc.family}, Type: nftables.ChainTypeFilter, Hooknum: tc.hook}
		if got := filterHook(c); got != tc.want {
			t.Errorf("%s chain at hook %d: filter hook %q, want %q", NFTFamilyName(tc.family), *tc.hook, got, tc.want)
		}
	}
}
