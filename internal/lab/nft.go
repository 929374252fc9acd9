package lab

import (
	"crypto/sha256"
	"encoding/base32"
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// The netfilter modes install what kube-proxy's nftables mode would for the
// lab's two Services, in the node netns:
//
//	table ip kube-proxy {
//	  chain nat-prerouting { type nat hook prerouting priority dstnat; jump services }
//	  chain nat-output     { type nat hook output priority -100; jump services }
//	  chain services {
//	    ip daddr 10.120.0.80 tcp dport 80 goto service-HASH-default/web/tcp/http
//	    ip daddr 10.120.0.10 udp dport 53 goto service-HASH-default/dns/udp/dns
//	  }
//	  chain service-HASH-default/web/tcp/http { goto endpoint-HASH-default/web/tcp/http__10.244.20.31/3000 }
//	  chain endpoint-HASH-default/web/tcp/http__10.244.20.31/3000 { meta l4proto tcp dnat to 10.244.20.31:3000 }
//	  ... the same for dns
//	}
//
// (kube-proxy dispatches with a verdict map and picks endpoints with numgen;
// with one Service port and one endpoint each, plain rules say the same.)

const kubeProxyTable = "kube-proxy"

// labService is one Service port of the lab, named as kube-proxy names it.
type labService struct {
	namespace, name, portName string
	proto                     uint8 // IPPROTO_*
	vip, backend              netip.AddrPort
}

func labServices() []labService {
	return []labService{
		{"default", "web", "http", unix.IPPROTO_TCP, TCPVIP, TCPBackend},
		{"default", "dns", "dns", unix.IPPROTO_UDP, UDPVIP, UDPBackend},
	}
}

func protoName(proto uint8) string {
	if proto == unix.IPPROTO_TCP {
		return "tcp"
	}
	return "udp"
}

// hashAndTruncate prefixes a chain name base with a hash of itself, as
// kube-proxy's nftables mode does ("5OJB2KTY-ns1/svc1/tcp/p80"). The lab's
// names are far below kube-proxy's length limit, so nothing is truncated.
func hashAndTruncate(name string) string {
	sum := sha256.Sum256([]byte(name))
	return base32.StdEncoding.EncodeToString(sum[:])[:8] + "-" + name
}

func (s labService) portBase() string {
	return fmt.Sprintf("%s/%s/%s/%s", s.namespace, s.name, protoName(s.proto), s.portName)
}

// serviceChain is kube-proxy's "service-HASH-ns/name/proto/port" chain name.
func (s labService) serviceChain() string {
	return "service-" + hashAndTruncate(s.portBase())
}

// endpointChain is kube-proxy's "endpoint-HASH-ns/name/proto/port__ip/port" chain name.
func (s labService) endpointChain() string {
	return "endpoint-" + hashAndTruncate(fmt.Sprintf("%s__%s/%d", s.portBase(), s.backend.Addr(), s.backend.Port()))
}

// installKubeProxyRules replaces the node's kube-proxy table with the lab's rules.
func installKubeProxyRules(netnsPath string) error {
	return nftTransaction(netnsPath, func(c *nftables.Conn) {
		table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: kubeProxyTable}
		// add + delete + add: replaces the table whether or not it exists.
		c.AddTable(table)
		c.DelTable(table)
		c.AddTable(table)

		services := c.AddChain(&nftables.Chain{Name: "services", Table: table})
		for _, hook := range []struct {
			name string
			num  *nftables.ChainHook
		}{{"nat-prerouting", nftables.ChainHookPrerouting}, {"nat-output", nftables.ChainHookOutput}} {
			chain := c.AddChain(&nftables.Chain{
				Name: hook.name, Table: table, Type: nftables.ChainTypeNAT,
				Hooknum: hook.num, Priority: nftables.ChainPriorityNATDest,
			})
			c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: []expr.Any{
				&expr.Verdict{Kind: expr.VerdictJump, Chain: services.Name},
			}})
		}
		for _, svc := range labServices() {
			svcChain := c.AddChain(&nftables.Chain{Name: svc.serviceChain(), Table: table})
			epChain := c.AddChain(&nftables.Chain{Name: svc.endpointChain(), Table: table})
			match := append(matchDaddr(svc.vip.Addr()), matchDport(svc.proto, svc.vip.Port())...)
			c.AddRule(&nftables.Rule{Table: table, Chain: services, Exprs: append(match,
				&expr.Verdict{Kind: expr.VerdictGoto, Chain: svcChain.Name})})
			c.AddRule(&nftables.Rule{Table: table, Chain: svcChain, Exprs: []expr.Any{
				&expr.Verdict{Kind: expr.VerdictGoto, Chain: epChain.Name},
			}})
			c.AddRule(&nftables.Rule{Table: table, Chain: epChain, Exprs: append(matchL4Proto(svc.proto),
				dnatTo(svc.backend)...)})
		}
	})
}

// removeKubeProxyRules deletes the node's kube-proxy table if it exists.
func removeKubeProxyRules(netnsPath string) error {
	return nftTransaction(netnsPath, func(c *nftables.Conn) {
		table := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: kubeProxyTable}
		c.AddTable(table) // so that the delete never fails on a missing table
		c.DelTable(table)
	})
}

// hasKubeProxyRules tells whether the node has the kube-proxy table.
func hasKubeProxyRules(netnsPath string) (bool, error) {
	var found bool
	err := withNFT(netnsPath, func(c *nftables.Conn) error {
		tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
		for _, t := range tables {
			found = found || t.Name == kubeProxyTable
		}
		return err
	})
	return found, err
}

// installGatewayReject makes the gateway answer every packet it cannot route
// with an immediate ICMP net-unreachable. The kernel's own answer (ip_error) is
// rate-limited per source by the global net.ipv4.route.error_cost/burst (five,
// then one a second), which would make the lab's failing requests slow after
// the first few; nft's reject is limited only by the per-netns icmp_ratelimit.
//
//	table ip lab-gateway {
//	  chain prerouting { type filter hook prerouting priority 0;
//	    fib daddr type != local fib daddr oif 0 reject with icmp net-unreachable }
//	}
func installGatewayReject(netnsPath string) error {
	return nftTransaction(netnsPath, func(c *nftables.Conn) {
		table := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "lab-gateway"})
		chain := c.AddChain(&nftables.Chain{
			Name: "prerouting", Table: table, Type: nftables.ChainTypeFilter,
			Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityFilter,
		})
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: []expr.Any{
			&expr.Fib{Register: 1, FlagDADDR: true, ResultADDRTYPE: true},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: u32(unix.RTN_LOCAL)},
			&expr.Fib{Register: 1, FlagDADDR: true, ResultOIF: true},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: u32(0)},
			&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: icmpNetUnreachable},
		}})
	})
}

func matchDaddr(a netip.Addr) []expr.Any {
	b := a.As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: b[:]},
	}
}

func matchL4Proto(proto uint8) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

func matchDport(proto uint8, port uint16) []expr.Any {
	return append(matchL4Proto(proto),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, port)},
	)
}

func dnatTo(to netip.AddrPort) []expr.Any {
	b := to.Addr().As4()
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: b[:]},
		&expr.Immediate{Register: 2, Data: binary.BigEndian.AppendUint16(nil, to.Port())},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4,
			RegAddrMin: 1, RegProtoMin: 2, Specified: true},
	}
}

// u32 is a value as nftables registers hold it (host order).
func u32(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }

// withNFT runs fn with an nftables connection to the netns at path.
func withNFT(netnsPath string, fn func(c *nftables.Conn) error) error {
	ns, err := openNetNS(netnsPath)
	if err != nil {
		return err
	}
	defer ns.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		return fmt.Errorf("nftables in %s: %w", netnsPath, err)
	}
	return fn(c)
}

// nftTransaction applies the changes fn queues as one atomic batch.
func nftTransaction(netnsPath string, fn func(c *nftables.Conn)) error {
	return withNFT(netnsPath, func(c *nftables.Conn) error {
		fn(c)
		if err := c.Flush(); err != nil {
			return fmt.Errorf("nftables in %s: %w", netnsPath, err)
		}
		return nil
	})
}

// icmpNetUnreachable is ICMP destination-unreachable code 0 (RFC 792).
const icmpNetUnreachable = 0
