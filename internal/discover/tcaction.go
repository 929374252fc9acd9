package discover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// A tc filter that is not BPF (u32, flower, matchall) rewrites addresses by
// its actions, on older and hand-built nodes: act_nat (tc-nat(8),
// stateless), act_pedit (tc-pedit(8), `munge ip dst set`) and act_ct's NAT
// (tc-ct(8), `ct commit nat dst addr`, as OVS's TC offload writes it).
// vishvananda/netlink drops the actions it does not know and decodes no
// pedit key, so the filters are dumped again and their actions decoded here.

// Attributes and values of the kernel's uapi (pkt_cls.h, tc_act/tc_nat.h,
// tc_pedit.h, tc_ct.h) that x/sys/unix lacks.
const (
	tcaU32Sel         = 5  // TCA_U32_SEL: struct tc_u32_sel
	tcaU32Act         = 7  // TCA_U32_ACT
	tcaFlowerAct      = 3  // TCA_FLOWER_ACT
	tcaFlowerIPv4Dst  = 12 // TCA_FLOWER_KEY_IPV4_DST
	tcaFlowerIPv4DstM = 13 // TCA_FLOWER_KEY_IPV4_DST_MASK
	tcaFlowerTCPDst   = 19 // TCA_FLOWER_KEY_TCP_DST
	tcaFlowerUDPDst   = 21 // TCA_FLOWER_KEY_UDP_DST
	tcaFlowerTCPDstM  = 36 // TCA_FLOWER_KEY_TCP_DST_MASK
	tcaFlowerUDPDstM  = 38 // TCA_FLOWER_KEY_UDP_DST_MASK
	tcaMatchallAct    = 2  // TCA_MATCHALL_ACT
	tcaBpfName        = 7  // TCA_BPF_NAME
	tcaBpfFlags       = 8  // TCA_BPF_FLAGS
	tcaBpfID          = 11 // TCA_BPF_ID
	tcaBpfActDirect   = 1  // TCA_BPF_FLAG_ACT_DIRECT
	tcaMirredParms    = 2  // TCA_MIRRED_PARMS: struct tc_mirred
	tcaActKind        = 1  // TCA_ACT_KIND
	tcaActOptions     = 2  // TCA_ACT_OPTIONS
	tcaNatParms       = 1  // TCA_NAT_PARMS: struct tc_nat
	tcNatEgress       = 1  // TCA_NAT_FLAG_EGRESS: rewrite the source
	tcaPeditParms     = 2  // TCA_PEDIT_PARMS: struct tc_pedit_sel
	tcaPeditParmsEx   = 4  // TCA_PEDIT_PARMS_EX: the same, with TCA_PEDIT_KEYS_EX
	tcaPeditKeysEx    = 5  // TCA_PEDIT_KEYS_EX
	tcaPeditKeyEx     = 6  // TCA_PEDIT_KEY_EX
	tcaPeditKeyHtype  = 1  // TCA_PEDIT_KEY_EX_HTYPE
	tcaPeditKeyCmd    = 2  // TCA_PEDIT_KEY_EX_CMD
	peditHtypeNetwork = 0  // TCA_PEDIT_KEY_EX_HDR_TYPE_NETWORK: a legacy key's
	peditHtypeIP4     = 2  // TCA_PEDIT_KEY_EX_HDR_TYPE_IP4
	peditCmdSet       = 0  // TCA_PEDIT_KEY_EX_CMD_SET
	tcaCtAction       = 3  // TCA_CT_ACTION: flags
	tcaCtNatIPv4Min   = 9  // TCA_CT_NAT_IPV4_MIN
	tcaCtNatIPv4Max   = 10 // TCA_CT_NAT_IPV4_MAX
	tcaCtNatPortMin   = 13 // TCA_CT_NAT_PORT_MIN
	tcaCtNatPortMax   = 14 // TCA_CT_NAT_PORT_MAX
	tcaCtActCommit    = 1 << 0
	tcaCtActNatDst    = 1 << 5 // with TCA_CT_ACT_NAT: a DNAT of its own
	tcGenLen          = 20     // struct tc_gen
	tcMsgLen          = 20     // struct tcmsg
	ipDstOff          = 16     // the destination's offset in an IPv4 header
	ipPortsOff        = 20     // the ports' (tc's `match ip dport`: no IP options)
)

// filterAction is one action of a tc filter that is not BPF.
type filterAction struct {
	kind, pref string // the filter's: "u32", "pref 10"
	action     string // the action's kind: "nat", "pedit", "ct", "mirred", ...
	// rewrite says what a rewriting action does, as tc(8) says it
	// briefly ("nat ingress 10.120.0.80/32 -> 10.244.20.31"); "" for
	// the others.
	rewrite string
	dst     netip.Prefix // the destinations it rewrites; invalid: none
	port    uint16       // and their port, its filter's match; 0: any
	// mirredAct, mirredTo: a mirred's (TCA_EGRESS_REDIR, ...) and the
	// ifindex it sends to; mirredTo 0 for the others.
	mirredAct uint32
	mirredTo  int
}

// filterActions decodes the actions of the filter of one RTM_NEWTFILTER
// message's data (struct tcmsg, then its attributes).
func filterActions(data []byte) ([]filterAction, error) {
	kind, prio, options, err := filterHead(data)
	if err != nil {
		return nil, err
	}
	actType := map[string]uint16{"u32": tcaU32Act, "flower": tcaFlowerAct, "matchall": tcaMatchallAct}[kind]
	if actType == 0 || options == nil {
		return nil, nil
	}
	ad, err := netlink.NewAttributeDecoder(options)
	if err != nil {
		return nil, err
	}
	// What a pedit or a ct action rewrites is what its filter matches:
	// every destination unless it matches one; an act_nat, within that.
	// So is its destination port.
	matched := netip.MustParsePrefix("0.0.0.0/0")
	var table []byte
	var dst, mask [4]byte
	var port uint16
	portMasked := false // a flower port match under a mask: not one port
	for ad.Next() {
		b := ad.Bytes()
		switch t := ad.Type(); {
		case t == actType:
			table = b
		case kind == "u32" && t == tcaU32Sel:
			if p, ok := u32Dst(b); ok {
				matched = p
			}
			port = u32DstPort(b)
		case kind == "flower" && t == tcaFlowerIPv4Dst && len(b) == 4:
			dst = [4]byte(b)
			mask = [4]byte{0xff, 0xff, 0xff, 0xff}
		case kind == "flower" && t == tcaFlowerIPv4DstM && len(b) == 4:
			mask = [4]byte(b)
		case kind == "flower" && (t == tcaFlowerTCPDst || t == tcaFlowerUDPDst) && len(b) == 2:
			port = binary.BigEndian.Uint16(b)
		case kind == "flower" && (t == tcaFlowerTCPDstM || t == tcaFlowerUDPDstM) && len(b) == 2:
			portMasked = binary.BigEndian.Uint16(b) != 0xffff
		}
	}
	if portMasked {
		port = 0
	}
	if err := ad.Err(); err != nil {
		return nil, err
	}
	if kind == "flower" && mask != [4]byte{} {
		matched = maskedPrefix(dst, mask)
	}
	if table == nil {
		return nil, nil
	}
	if ad, err = netlink.NewAttributeDecoder(table); err != nil {
		return nil, err
	}
	var out []filterAction
	for ad.Next() { // one per action, by its order
		a := filterAction{kind: kind, pref: fmt.Sprintf("pref %d", prio)}
		ad.Nested(func(act *netlink.AttributeDecoder) error {
			decodeAction(act, &a, matched)
			return nil
		})
		if a.dst.IsValid() {
			a.port = port
		}
		out = append(out, a)
	}
	return out, ad.Err()
}

// filterHead is the kind, priority and options of the filter of one
// RTM_NEWTFILTER message's data.
func filterHead(data []byte) (kind string, prio uint32, options []byte, err error) {
	if len(data) < tcMsgLen {
		return "", 0, nil, errors.New("short tcmsg")
	}
	prio = binary.NativeEndian.Uint32(data[16:20]) >> 16 // tcm_info: priority, protocol
	ad, err := netlink.NewAttributeDecoder(data[tcMsgLen:])
	if err != nil {
		return "", 0, nil, err
	}
	for ad.Next() {
		switch ad.Type() {
		case unix.TCA_KIND:
			kind = ad.String()
		case unix.TCA_OPTIONS:
			options = ad.Bytes()
		}
	}
	return kind, prio, options, ad.Err()
}

// bpfFilter is the cls_bpf filter of one RTM_NEWTFILTER message's data,
// with the loader's name; false for another filter, and for the message
// without options that heads a priority's filters.
func bpfFilter(data []byte) (TCProgram, bool) {
	kind, _, options, err := filterHead(data)
	if err != nil || kind != "bpf" || options == nil {
		return TCProgram{}, false
	}
	od, err := netlink.NewAttributeDecoder(options)
	if err != nil {
		return TCProgram{}, false
	}
	p := TCProgram{Via: "cls_bpf"}
	for od.Next() {
		switch od.Type() {
		case tcaBpfName:
			p.Name = od.String()
		case tcaBpfID:
			p.ID = ebpf.ProgramID(od.Uint32())
		case tcaBpfFlags:
			p.DirectAction = od.Uint32()&tcaBpfActDirect != 0
		}
	}
	return p, true
}

// u32Dst is the destination a u32 selector (struct tc_u32_sel, then its
// struct tc_u32_key) matches: its key at the IPv4 header's destination.
func u32Dst(sel []byte) (netip.Prefix, bool) {
	const selLen, keyLen = 16, 16
	if len(sel) < selLen {
		return netip.Prefix{}, false
	}
	for k := sel[selLen:]; len(k) >= keyLen; k = k[keyLen:] {
		// mask, val (network order), off, offmask
		if int32(binary.NativeEndian.Uint32(k[8:12])) == ipDstOff && binary.NativeEndian.Uint32(k[12:16]) == 0 {
			return maskedPrefix([4]byte(k[4:8]), [4]byte(k[0:4])), true
		}
	}
	return netip.Prefix{}, false
}

// u32DstPort is the destination port a u32 selector matches (tc's `match
// ip dport P 0xffff`: its key at the ports of an IPv4 header without
// options); 0 for none.
func u32DstPort(sel []byte) uint16 {
	const selLen, keyLen = 16, 16
	if len(sel) < selLen {
		return 0
	}
	for k := sel[selLen:]; len(k) >= keyLen; k = k[keyLen:] {
		if int32(binary.NativeEndian.Uint32(k[8:12])) == ipPortsOff && binary.NativeEndian.Uint32(k[12:16]) == 0 &&
			binary.BigEndian.Uint16(k[2:4]) == 0xffff {
			return binary.BigEndian.Uint16(k[6:8])
		}
	}
	return 0
}

// maskedPrefix is addr under mask, as a prefix of mask's bits.
func maskedPrefix(addr, mask [4]byte) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4(addr), bits.OnesCount32(binary.BigEndian.Uint32(mask[:]))).Masked()
}

// overlap is the narrower of two prefixes when one holds the other (two
// prefixes are nested or disjoint); invalid when they are disjoint.
func overlap(a, b netip.Prefix) netip.Prefix {
	switch {
	case a.Bits() >= b.Bits() && b.Contains(a.Addr()):
		return a
	case b.Bits() > a.Bits() && a.Contains(b.Addr()):
		return b
	}
	return netip.Prefix{}
}

// decodeAction fills a from the attributes of one action of a filter that
// matches the destinations matched.
func decodeAction(ad *netlink.AttributeDecoder, a *filterAction, matched netip.Prefix) {
	var options []byte
	for ad.Next() {
		switch ad.Type() {
		case tcaActKind:
			a.action = ad.String()
		case tcaActOptions:
			options = ad.Bytes()
		}
	}
	if options == nil {
		return
	}
	od, err := netlink.NewAttributeDecoder(options)
	if err != nil {
		return
	}
	switch a.action {
	case "nat":
		natAction(od, a, matched)
	case "pedit":
		peditAction(od, a, matched)
	case "ct":
		ctAction(od, a, matched)
	case "mirred":
		for od.Next() {
			// struct tc_mirred: tc_gen, then eaction and ifindex.
			if p := od.Bytes(); od.Type() == tcaMirredParms && len(p) >= tcGenLen+8 {
				a.mirredAct = binary.NativeEndian.Uint32(p[tcGenLen:])
				a.mirredTo = int(binary.NativeEndian.Uint32(p[tcGenLen+4:]))
			}
		}
	}
}

// natAction reads an act_nat: it rewrites the destinations of its old
// prefix that its filter matched (ingress), or the sources (egress).
func natAction(od *netlink.AttributeDecoder, a *filterAction, matched netip.Prefix) {
	for od.Next() {
		if p := od.Bytes(); od.Type() == tcaNatParms && len(p) >= tcGenLen+16 {
			// struct tc_nat: tc_gen, then old_addr, new_addr, mask (network
			// order) and flags.
			from := maskedPrefix([4]byte(p[tcGenLen:tcGenLen+4]), [4]byte(p[tcGenLen+8:tcGenLen+12]))
			to := netip.AddrFrom4([4]byte(p[tcGenLen+4 : tcGenLen+8]))
			dir := "ingress"
			if binary.NativeEndian.Uint32(p[tcGenLen+12:tcGenLen+16])&tcNatEgress != 0 {
				dir = "egress" // the source: no destination rewritten
			} else {
				a.dst = overlap(from, matched)
			}
			a.rewrite = fmt.Sprintf("nat %s %s -> %s", dir, from, to)
		}
	}
}

// peditAction reads an act_pedit: a key that sets the whole IPv4
// destination (`munge ip dst set`) rewrites what its filter matched.
func peditAction(od *netlink.AttributeDecoder, a *filterAction, matched netip.Prefix) {
	var sel []byte
	var htypes, cmds []uint16 // per key, from TCA_PEDIT_KEYS_EX
	for od.Next() {
		switch od.Type() {
		case tcaPeditParms, tcaPeditParmsEx:
			sel = od.Bytes()
		case tcaPeditKeysEx:
			od.Nested(func(keys *netlink.AttributeDecoder) error {
				for keys.Next() {
					if keys.Type() != tcaPeditKeyEx {
						continue
					}
					var htype, cmd uint16
					keys.Nested(func(k *netlink.AttributeDecoder) error {
						for k.Next() {
							switch k.Type() {
							case tcaPeditKeyHtype:
								htype = k.Uint16()
							case tcaPeditKeyCmd:
								cmd = k.Uint16()
							}
						}
						return nil
					})
					htypes, cmds = append(htypes, htype), append(cmds, cmd)
				}
				return nil
			})
		}
	}
	// struct tc_pedit_sel: tc_gen, nkeys, flags, then struct
	// tc_pedit_key {mask, val, off, at, offmask, shift} from offset 24.
	const keysAt, keyLen = tcGenLen + 4, 24
	if len(sel) < keysAt {
		return
	}
	for i := range int(sel[tcGenLen]) {
		k := sel[keysAt+i*keyLen:]
		if len(k) < keyLen {
			return
		}
		htype, cmd := uint16(peditHtypeNetwork), uint16(peditCmdSet)
		if i < len(htypes) {
			htype, cmd = htypes[i], cmds[i]
		}
		if (htype == peditHtypeNetwork || htype == peditHtypeIP4) && cmd == peditCmdSet &&
			binary.NativeEndian.Uint32(k[8:12]) == ipDstOff && binary.NativeEndian.Uint32(k[0:4]) == 0 {
			a.rewrite = fmt.Sprintf("pedit munge ip dst set %s", netip.AddrFrom4([4]byte(k[4:8])))
			a.dst = matched
		}
	}
}

// ctAction reads an act_ct: one that commits with a NAT of the destination
// of its own (`ct commit nat dst addr`) rewrites what its filter matched.
// A bare `ct nat` applies what conntrack holds, set elsewhere: no rewrite
// of its own.
func ctAction(od *netlink.AttributeDecoder, a *filterAction, matched netip.Prefix) {
	var flags uint16
	var lo, hi netip.Addr
	var plo, phi uint16
	for od.Next() {
		switch b := od.Bytes(); od.Type() {
		case tcaCtAction:
			flags = od.Uint16()
		case tcaCtNatIPv4Min, tcaCtNatIPv4Max:
			if len(b) == 4 {
				if od.Type() == tcaCtNatIPv4Min {
					lo = netip.AddrFrom4([4]byte(b))
				} else {
					hi = netip.AddrFrom4([4]byte(b))
				}
			}
		case tcaCtNatPortMin, tcaCtNatPortMax:
			if len(b) == 2 {
				if od.Type() == tcaCtNatPortMin {
					plo = binary.BigEndian.Uint16(b)
				} else {
					phi = binary.BigEndian.Uint16(b)
				}
			}
		}
	}
	if flags&tcaCtActNatDst == 0 || !lo.IsValid() {
		return
	}
	s := "ct nat dst addr " + lo.String()
	if flags&tcaCtActCommit != 0 {
		s = "ct commit nat dst addr " + lo.String()
	}
	if hi.IsValid() && hi != lo {
		s += "-" + hi.String()
	}
	if plo != 0 {
		s += fmt.Sprintf(" port %d", plo)
		if phi != 0 && phi != plo {
			s += fmt.Sprintf("-%d", phi)
		}
	}
	a.rewrite, a.dst = s, matched
}

// dialRoute opens a route netlink socket in the netns ns.
func dialRoute(ns netns.NsHandle) (*nl.SocketHandle, error) {
	s, err := nl.GetNetlinkSocketAt(ns, netns.None(), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return &nl.SocketHandle{Socket: s}, nil
}

// dumpFilters dumps the filters on parent p of the interface ifindex of
// c's netns: each message's data.
func dumpFilters(c *nl.SocketHandle, ifindex int, p TCParent) ([][]byte, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETTFILTER, unix.NLM_F_DUMP)
	req.Sockets = map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: c}
	req.AddData(&nl.TcMsg{Family: nl.FAMILY_ALL, Ifindex: int32(ifindex), Parent: p.Handle})
	msgs, err := req.Execute(unix.NETLINK_ROUTE, unix.RTM_NEWTFILTER)
	if err != nil {
		return nil, fmt.Errorf("dump %s filters: %w", p.Dir, err)
	}
	return msgs, nil
}

// program is a rewriting action as the program of its filter (it runs
// where a cls_bpf filter does) on parent p, unnamed.
func (a filterAction) program(p TCParent) TCProgram {
	return TCProgram{Dir: p.Dir, Via: a.kind, Name: a.pref, Action: a.rewrite, Rewrites: a.dst, RewritesPort: a.port}
}

// filterRewrites lists the rewriting actions of the filters that are not
// BPF on parent p of the interface ifindex of c's netns.
func filterRewrites(c *nl.SocketHandle, ifindex int, p TCParent) ([]TCProgram, error) {
	msgs, err := dumpFilters(c, ifindex, p)
	if err != nil {
		return nil, err
	}
	var out []TCProgram
	for _, m := range msgs {
		actions, err := filterActions(m)
		if err != nil {
			return out, fmt.Errorf("decode %s filters: %w", p.Dir, err)
		}
		for _, a := range actions {
			if a.rewrite != "" {
				out = append(out, a.program(p))
			}
		}
	}
	return out, nil
}

// FilterRewrites is filterRewrites in the netns at path.
func FilterRewrites(path string, ifindex int, p TCParent) ([]TCProgram, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	c, err := dialRoute(ns)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return filterRewrites(c, ifindex, p)
}
