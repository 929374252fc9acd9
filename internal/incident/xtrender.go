package incident

import (
	"encoding/binary"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/google/nftables/expr"
	"github.com/google/nftables/xt"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// xtString renders an xtables match or target inside nftables (nft_compat:
// what iptables-nft, as kube-proxy's iptables mode on most nodes, writes)
// as iptables-save spells it: what kube-proxy's rules say is there (the
// Service in `-m comment`, the endpoint in `-j DNAT --to-destination`, an
// endpoint's weight in `-m statistic`). Extensions not decoded show their
// name, revision and bytes.
func xtString(e expr.Any) string {
	switch e := e.(type) {
	case *expr.Match:
		if s, ok := xtMatchString(e.Name, e.Info); ok {
			return "xt -m " + e.Name + s
		}
		return fmt.Sprintf("xt -m %s (revision %d, not decoded: %s)", e.Name, e.Rev, xtBytes(e.Info))
	case *expr.Target:
		if s, ok := xtTargetString(e.Name, e.Info); ok {
			return "xt -j " + e.Name + s
		}
		return fmt.Sprintf("xt -j %s (revision %d, not decoded: %s)", e.Name, e.Rev, xtBytes(e.Info))
	}
	return ""
}

// xtMatchString is a match's options, false when not decoded.
func xtMatchString(name string, info xt.InfoAny) (string, bool) {
	switch m := info.(type) {
	case *xt.Comment:
		return " --comment " + strconv.Quote(string(*m)), true
	case *xt.Tcp:
		s := xtPorts(" --sport", m.SrcPorts, m.InvFlags&xt.TcpInvSrcPorts != 0) + xtPorts(" --dport", m.DstPorts, m.InvFlags&xt.TcpInvDestPorts != 0)
		if m.FlagsMask != 0 {
			s += fmt.Sprintf("%s --tcp-flags 0x%02x 0x%02x", not(m.InvFlags&xt.TcpInvFlags != 0), m.FlagsMask, m.FlagsCmp)
		}
		return s, true
	case *xt.Udp:
		return xtPorts(" --sport", m.SrcPorts, m.InvFlags&xt.UdpInvSrcPorts != 0) + xtPorts(" --dport", m.DstPorts, m.InvFlags&xt.UdpInvDestPorts != 0), true
	case *xt.AddrType:
		return addrTypeString(" --src-type", m.Source, m.InvertSource) + addrTypeString(" --dst-type", m.Dest, m.InvertDest), true
	case *xt.AddrTypeV1:
		s := addrTypeString(" --src-type", m.Source, m.Flags&0x1 != 0) + addrTypeString(" --dst-type", m.Dest, m.Flags&0x2 != 0)
		if m.Flags&0x4 != 0 {
			s += " --limit-iface-in"
		}
		if m.Flags&0x8 != 0 {
			s += " --limit-iface-out"
		}
		return s, true
	case *xt.Unknown:
		if name == "statistic" {
			return statisticString(*m)
		}
	}
	return "", false
}

// statisticString reads struct xt_statistic_info (host order): mode,
// flags, then the random mode's probability (of 2^31) or the nth mode's
// every and packet.
func statisticString(b []byte) (string, bool) {
	if len(b) < 12 {
		return "", false
	}
	mode, flags := binary.NativeEndian.Uint16(b[0:]), binary.NativeEndian.Uint16(b[2:])
	inv := not(flags&0x1 != 0)
	switch mode {
	case 0:
		return fmt.Sprintf(" --mode random%s --probability %.11f", inv, float64(binary.NativeEndian.Uint32(b[4:]))/0x80000000), true
	case 1:
		return fmt.Sprintf(" --mode nth%s --every %d --packet %d", inv, binary.NativeEndian.Uint32(b[4:])+1, binary.NativeEndian.Uint32(b[8:])), true
	}
	return "", false
}

// xtTargetString is a target's options, false when not decoded.
func xtTargetString(name string, info xt.InfoAny) (string, bool) {
	switch name {
	case "DNAT", "SNAT":
		if to := natRangeString(info); to != "" {
			return " --to-" + map[string]string{"DNAT": "destination", "SNAT": "source"}[name] + " " + to, true
		}
	case "MASQUERADE", "REDIRECT":
		if r, ok := info.(*xt.NatIPv4MultiRangeCompat); ok && len(*r) == 1 {
			s := ""
			if xt.NatRangeFlags((*r)[0].Flags)&xt.NatRangeProtoSpecified != 0 {
				s += " --to-ports " + portRange((*r)[0].MinPort, (*r)[0].MaxPort, "-")
			}
			return s + natFlags((*r)[0].Flags), true
		}
	case "REJECT":
		if with := discover.XTRejectWith(info); with != "" {
			return " --reject-with " + with, true
		}
	case "MARK":
		// struct xt_mark_tginfo2 (revision 2): mark, mask.
		if b, ok := info.(*xt.Unknown); ok && len(*b) == 8 {
			return fmt.Sprintf(" --set-xmark 0x%x/0x%x", binary.NativeEndian.Uint32((*b)[0:]), binary.NativeEndian.Uint32((*b)[4:])), true
		}
	}
	return "", false
}

// natRangeString is a NAT target's range as iptables-save writes it:
// 10.244.1.5:8080, 10.0.0.1-10.0.0.9:1000-2000; "" when not decoded.
func natRangeString(info xt.InfoAny) string {
	var flags uint
	var minIP, maxIP net.IP
	var minPort, maxPort uint16
	switch r := info.(type) {
	case *xt.NatIPv4MultiRangeCompat:
		if len(*r) != 1 {
			return ""
		}
		flags, minIP, maxIP, minPort, maxPort = (*r)[0].Flags, (*r)[0].MinIP, (*r)[0].MaxIP, (*r)[0].MinPort, (*r)[0].MaxPort
	case *xt.NatRange:
		flags, minIP, maxIP, minPort, maxPort = r.Flags, r.MinIP, r.MaxIP, r.MinPort, r.MaxPort
	case *xt.NatRange2:
		flags, minIP, maxIP, minPort, maxPort = r.Flags, r.MinIP, r.MaxIP, r.MinPort, r.MaxPort
	default:
		return ""
	}
	s := ""
	if xt.NatRangeFlags(flags)&xt.NatRangeMapIPs != 0 {
		s = addrString(minIP)
		if !minIP.Equal(maxIP) {
			s += "-" + addrString(maxIP)
		}
	}
	if xt.NatRangeFlags(flags)&xt.NatRangeProtoSpecified != 0 {
		s += ":" + portRange(minPort, maxPort, "-")
	}
	if s == "" {
		return ""
	}
	return s + natFlags(flags)
}

func addrString(ip net.IP) string {
	if v4 := ip.To4(); v4 != nil {
		return v4.String()
	}
	return "[" + ip.String() + "]"
}

func natFlags(flags uint) string {
	f, s := xt.NatRangeFlags(flags), ""
	if f&xt.NatRangeProtoRandom != 0 {
		s += " --random"
	}
	if f&xt.NatRangeProtoRandomFully != 0 {
		s += " --random-fully"
	}
	if f&xt.NatRangePersistent != 0 {
		s += " --persistent"
	}
	return s
}

// xtPorts is a tcp or udp match's port range, "" when it is every port.
func xtPorts(opt string, r [2]uint16, inv bool) string {
	if r[0] == 0 && r[1] == 0xffff {
		return ""
	}
	return not(inv) + opt + " " + portRange(r[0], r[1], ":")
}

// portRange is lo, or lo and hi joined by sep: a match's 80:90, a NAT
// target's 80-90.
func portRange(lo, hi uint16, sep string) string {
	if lo == hi {
		return strconv.Itoa(int(lo))
	}
	return fmt.Sprintf("%d%s%d", lo, sep, hi)
}

// addrTypeNames are the XT_ADDRTYPE_* bits, lowest first.
var addrTypeNames = []string{"UNSPEC", "UNICAST", "LOCAL", "BROADCAST", "ANYCAST", "MULTICAST", "BLACKHOLE", "UNREACHABLE", "PROHIBIT", "THROW", "NAT", "XRESOLVE"}

func addrTypeString(opt string, types uint16, inv bool) string {
	if types == 0 {
		return ""
	}
	var names []string
	for i, n := range addrTypeNames {
		if types&(1<<i) != 0 {
			names = append(names, n)
		}
	}
	return not(inv) + opt + " " + strings.Join(names, ",")
}

func not(inv bool) string {
	if inv {
		return " !"
	}
	return ""
}

// xtBytes shows an extension's info not decoded: its bytes when they are
// raw, its fields otherwise (never a pointer).
func xtBytes(info xt.InfoAny) string {
	if b, ok := info.(*xt.Unknown); ok {
		return fmt.Sprintf("%x", []byte(*b))
	}
	if info == nil {
		return "none"
	}
	return fmt.Sprintf("%+v", info)
}
