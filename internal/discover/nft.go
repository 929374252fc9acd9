package discover

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/google/nftables/xt"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// nftGraphs reads every nftables table with a NAT base chain at prerouting or
// output, or a filter base chain at forward, input or output, into a
// natGraph: DNATs are the NAT chains', rejects and drops of a VIP the filter
// chains' (kube-proxy's for a Service without endpoints). Read-only: list
// requests only.
//
// The graphs read their chains' rules through raw (and their sets through
// conn) as walks reach them (natGraph.load): both must stay open until
// they are matched.
func nftGraphs(conn *nftables.Conn, raw *netlink.Conn) ([]*natGraph, error) {
	type tableKey struct {
		family nftables.TableFamily
		name   string
	}
	type tableChains struct {
		table *nftables.Table
		bases []natBase
	}
	byTable := map[tableKey]*tableChains{}
	var order []*tableChains
	err := NFTDump(raw, unix.NFT_MSG_GETCHAIN, unix.NFPROTO_UNSPEC, nil, func(b []byte) error {
		m, err := parseChainMsg(b)
		if err != nil {
			return err
		}
		k := tableKey{m.family, m.table}
		t := byTable[k]
		if t == nil {
			t = &tableChains{table: &nftables.Table{Name: m.table, Family: m.family}}
			byTable[k], order = t, append(order, t)
		}
		if !m.hooked {
			return nil
		}
		c := m.chain(t.table)
		if hook := natHook(c); hook != "" {
			t.bases = append(t.bases, natBase{c.Name, hook, true, chainPriority(c)})
		} else if hook := filterHook(c); hook != "" {
			t.bases = append(t.bases, natBase{c.Name, hook, false, chainPriority(c)})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list nftables chains: %w", err)
	}
	var graphs []*natGraph
	for _, t := range order {
		if len(t.bases) == 0 {
			continue // nothing for a VIP happens in a table without those hooks
		}
		family := NFTFamilyName(t.table.Family)
		g := &natGraph{source: SourceNFTables, table: family + " " + t.table.Name, family: family, chains: map[string][]natRule{}, bases: t.bases}
		// The kernel lists chains in their order of creation; a hook runs
		// them by priority, and the first rule that ends a packet decides.
		slices.SortStableFunc(g.bases, func(a, b natBase) int { return a.priority - b.priority })
		lazyLoad(conn, raw, g, t.table, false)
		graphs = append(graphs, g)
	}
	return graphs, nil
}

// lazyLoad makes g read the rules of the chains of table as its walks
// reach them. With rewrites, a rule that sets the
// destination address (a payload statement) counts as a DNAT to what it
// sets: a device hook's graph (deviceRewrites).
//
// A chain's rules are read when a walk first reaches it: kube-proxy's
// table has a chain per Service and one per endpoint, tens of thousands on
// a big cluster's node, of which the walk for the traced VIPs reaches a
// handful. Reading every chain (a netlink request each, and its verdict
// maps) took seconds and hundreds of MB there. Each rule is reduced to
// natRules as its message is read (NFTDump): KUBE-SERVICES has a rule
// per Service.
func lazyLoad(conn *nftables.Conn, raw *netlink.Conn, g *natGraph, table *nftables.Table, rewrites bool) {
	sets := &nftSets{conn: conn, table: table, cache: map[string]nftSet{}}
	// Every chain a rule jumps to is one: nftables refuses a jump to none.
	g.load = func(name string) ([]natRule, bool, error) {
		var out []natRule
		base := g.isBase(name)
		err := NFTDump(raw, unix.NFT_MSG_GETRULE, uint8(table.Family), []netlink.Attribute{
			{Type: unix.NFTA_RULE_TABLE, Data: []byte(table.Name + "\x00")},
			{Type: unix.NFTA_RULE_CHAIN, Data: []byte(name + "\x00")},
		}, func(b []byte) error {
			exprs, userData, err := ruleExprs(table.Family, b)
			if err != nil {
				return err
			}
			nrs := nftNATRules(exprs, sets.lookup)
			if comment, ok := userdata.GetString(userData, userdata.TypeComment); ok {
				for i := range nrs {
					if nrs[i].comment == "" {
						nrs[i].comment = comment
					}
				}
			}
			if rewrites {
				for i := range nrs {
					nrs[i].asRewrite()
				}
			}
			if base {
				nrs = slices.DeleteFunc(nrs, func(r natRule) bool { return r.idleInBase() })
			}
			out = append(out, nrs...)
			return nil
		})
		if err != nil {
			return nil, true, fmt.Errorf("list rules of %s chain %s: %w", g.table, name, err)
		}
		return out, true, nil
	}
}

// chainPriority is a base chain's priority at its hook.
func chainPriority(c *nftables.Chain) int {
	if c.Priority == nil {
		return 0
	}
	return int(*c.Priority)
}

// natHook names the hook of a NAT base chain where DNAT happens, "" otherwise.
func natHook(c *nftables.Chain) string {
	if c.Hooknum == nil || c.Type != nftables.ChainTypeNAT || !ipHooks(c) {
		return ""
	}
	switch *c.Hooknum {
	case *nftables.ChainHookPrerouting:
		return "prerouting"
	case *nftables.ChainHookOutput:
		return "output"
	}
	return ""
}

// filterHook names the hook of a filter base chain where a packet to a VIP
// can be rejected, "" otherwise.
func filterHook(c *nftables.Chain) string {
	if c.Hooknum == nil || c.Type != nftables.ChainTypeFilter || !ipHooks(c) {
		return ""
	}
	switch *c.Hooknum {
	case *nftables.ChainHookPrerouting: // kube-proxy's firewall-check (loadBalancerSourceRanges)
		return "prerouting"
	case *nftables.ChainHookForward:
		return "forward"
	case *nftables.ChainHookInput:
		return "input"
	case *nftables.ChainHookOutput:
		return "output"
	}
	return ""
}

// ipHooks tells whether the hook numbers of c's family's base chains are the
// IP stack's (NF_INET_PRE_ROUTING 0 ... NF_INET_POST_ROUTING 4; the bridge
// family's NF_BR_* count alike). A netdev chain's are its device's own
// (NF_NETDEV_INGRESS 0, NF_NETDEV_EGRESS 1), an arp chain's ARP's: read as
// prerouting and input they made a netdev ingress chain a filter chain at
// prerouting, and its drop of a VIP a reject there (deviceRewrites reads
// them).
func ipHooks(c *nftables.Chain) bool {
	return c.Table == nil || c.Table.Family != nftables.TableFamilyNetdev && c.Table.Family != nftables.TableFamilyARP
}

// hasNAT tells whether g has a NAT base chain.
func (g *natGraph) hasNAT() bool {
	return slices.ContainsFunc(g.bases, func(b natBase) bool { return b.nat })
}

// NFTFamilyName is nft's name of a table family (ip, ip6, inet, ...).
func NFTFamilyName(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyBridge:
		return "bridge"
	case nftables.TableFamilyARP:
		return "arp"
	case nftables.TableFamilyNetdev:
		return "netdev"
	}
	return "family" + strconv.Itoa(int(f))
}

// nftField is what the evaluator knows a register holds.
type nftField struct {
	kind  fieldKind
	size  int    // bytes the value occupies
	mask  []byte // daddr after a bitwise and
	value []byte // immediate data
	// mapped: a map lookup's value (fieldMapped), the map's elements;
	// byDaddr when its key was the destination address.
	mapped  []nftables.SetElement
	byDaddr bool
}

type fieldKind uint8

const (
	fieldOther       fieldKind = iota
	fieldDaddr                 // IP destination address
	fieldDport                 // transport destination port
	fieldProto                 // meta l4proto
	fieldImm                   // immediate data
	fieldAddrType              // fib daddr type: the route type of the destination
	fieldSaddr                 // IP source address, or its first bytes
	fieldSrcAddrType           // fib saddr type: the route type of the source
	fieldMapped                // the value a map lookup found (nftField.mapped)
	fieldMark                  // meta mark, or its bits after a bitwise and (mask)
)

// regSlot maps an nftables register to its 4-byte slot: NFT_REG_1..4 are 16
// bytes wide (4 slots each), NFT_REG32_00..15 one slot each. -1 for the
// verdict register or an unknown one.
func regSlot(reg uint32) int {
	switch {
	case reg >= unix.NFT_REG_1 && reg <= unix.NFT_REG_4:
		return int(reg-unix.NFT_REG_1) * 4
	case reg >= unix.NFT_REG32_00 && reg <= unix.NFT_REG32_15:
		return int(reg - unix.NFT_REG32_00)
	}
	return -1
}

// nftRuleEval follows one rule's expressions, tracking what each register
// slot holds, to build the natRule(s) the rule amounts to. A verdict map
// lookup expands into one natRule per element.
type nftRuleEval struct {
	regs map[int]nftField
	rule natRule
	out  []natRule // rules produced by verdict maps
}

// nftNATRules reduces one nftables rule to natRules.
func nftNATRules(exprs []expr.Any, sets setLookup) []natRule {
	ev := nftRuleEval{regs: map[int]nftField{}}
	for _, e := range exprs {
		ev.step(e, sets)
	}
	if ev.out != nil {
		return ev.out
	}
	return []natRule{ev.rule}
}

func (ev *nftRuleEval) set(reg uint32, f nftField) {
	if s := regSlot(reg); s >= 0 {
		ev.regs[s] = f
	}
}

func (ev *nftRuleEval) get(reg uint32) nftField {
	return ev.regs[regSlot(reg)]
}

func (ev *nftRuleEval) step(e expr.Any, sets setLookup) {
	switch e := e.(type) {
	case *expr.Payload:
		switch e.OperationType {
		case expr.PayloadLoad:
			ev.set(e.DestRegister, payloadField(e))
		case expr.PayloadWrite:
			ev.write(e)
		}
	case *expr.Meta:
		if !e.SourceRegister {
			f := nftField{kind: fieldOther, size: 4}
			switch e.Key {
			case expr.MetaKeyL4PROTO:
				f = nftField{kind: fieldProto, size: 1}
			case expr.MetaKeyMARK:
				f = nftField{kind: fieldMark, size: 4}
			}
			ev.set(e.Register, f)
		}
	case *expr.Bitwise:
		f := ev.get(e.SourceRegister)
		if (f.kind == fieldDaddr || f.kind == fieldSaddr || f.kind == fieldMark && isZero(e.Xor)) && int(e.Len) == f.size && len(e.Mask) == f.size {
			f.mask = e.Mask
		} else {
			f = nftField{kind: fieldOther, size: int(e.Len)}
		}
		ev.set(e.DestRegister, f)
	case *expr.Immediate:
		ev.set(e.Register, nftField{kind: fieldImm, size: len(e.Data), value: e.Data})
	case *expr.Numgen:
		ev.set(e.Register, nftField{kind: fieldOther, size: 4})
	case *expr.Hash:
		ev.set(e.DestRegister, nftField{kind: fieldOther, size: 4})
	case *expr.Ct:
		if !e.SourceRegister {
			ev.set(e.Register, nftField{kind: fieldOther, size: 4})
		}
	case *expr.Fib:
		f := nftField{kind: fieldOther, size: 4}
		switch {
		case e.FlagDADDR && e.ResultADDRTYPE:
			f.kind = fieldAddrType
		case e.FlagSADDR && e.ResultADDRTYPE && !e.FlagIIF && !e.FlagOIF:
			// With an interface, the type is the source's on that
			// interface, not the node's at large.
			f.kind = fieldSrcAddrType
		}
		ev.set(e.Register, f)
	case *expr.Cmp:
		ev.cmp(e)
	case *expr.Lookup:
		ev.lookup(e, sets)
	case *expr.Verdict:
		switch e.Kind {
		case expr.VerdictJump, expr.VerdictGoto:
			ev.rule.targets = append(ev.rule.targets, e.Chain)
			ev.rule.gotos = e.Kind == expr.VerdictGoto
		case expr.VerdictDrop:
			ev.rule.verdict = "drop"
		}
	case *expr.Reject:
		ev.rule.verdict, ev.rule.rejectWith = "reject", nftRejectWith(e)
	case *expr.NAT:
		if e.Type == expr.NATTypeDestNAT {
			ev.nat(e)
		}
	case *expr.Target:
		switch e.Name {
		case "DNAT":
			ev.rule.dnat = true
			ev.rule.backend, ev.rule.note = xtDNATBackend(e.Info)
			ev.rule.portRange = xtDNATPortRange(e.Info)
		case "REJECT": // iptables-nft's -j REJECT
			ev.rule.verdict, ev.rule.rejectWith = "reject", XTRejectWith(e.Info)
		case "MARK": // iptables-nft's -j MARK: struct xt_mark_tginfo2, in host order
			if b, ok := e.Info.(*xt.Unknown); ok && e.Rev == 2 && len(*b) >= 8 {
				ev.rule.setMark = binary.NativeEndian.Uint32((*b)[:4]) & binary.NativeEndian.Uint32((*b)[4:8])
			}
		}
	case *expr.Match:
		ev.xtMatch(e)
	}
}

// write reads a payload statement that sets the destination address (`ip
// daddr set 10.244.20.31`) or port (`tcp dport set 3000`): a stateless
// rewrite, as a device hook's chain can do before tc and netfilter's IP
// hooks see the packet (no NAT there). A value that is not a constant (a
// map's, numgen's) is not decoded.
func (ev *nftRuleEval) write(e *expr.Payload) {
	f, src := payloadField(e), ev.get(e.SourceRegister)
	switch {
	case f.kind == fieldDaddr && (f.size == 4 || f.size == 16):
		ev.rule.setDst = true
		if a, ok := netip.AddrFromSlice(src.value); ok && src.kind == fieldImm && len(src.value) == f.size {
			ev.rule.setAddr = a
		}
		if src.kind == fieldMapped {
			ev.mappedRewrites(src, f.size)
		}
	case f.kind == fieldDport && src.kind == fieldImm && len(src.value) >= 2:
		ev.rule.setPort = binary.BigEndian.Uint16(src.value)
		for i := range ev.out {
			ev.out[i].setPort = ev.rule.setPort
		}
	}
}

// mappedRewrites makes a rewrite of the destination to a map's value one
// rule per element of the map: each sets the element's value, and, when the
// map's key was the destination, only for that key (the lookup fails for
// any other destination, and the rule with it). An element whose value is
// no address leaves the rule's own, not known.
func (ev *nftRuleEval) mappedRewrites(m nftField, size int) {
	var out []natRule
	for _, el := range m.mapped {
		to, ok := netip.AddrFromSlice(el.Val)
		if !ok || len(el.Val) != size {
			return
		}
		r := ev.rule
		r.setAddr = to
		if m.byDaddr {
			key, ok := netip.AddrFromSlice(el.Key)
			if !ok || len(el.Key) != size {
				return
			}
			if len(r.dst) > 0 && !r.dstNeg && !slices.ContainsFunc(r.dst, func(p netip.Prefix) bool { return p.Contains(key) }) {
				continue // a key the rule's own condition on the destination never lets through
			}
			r.limitDst([]netip.Prefix{netip.PrefixFrom(key, key.BitLen())}, false)
		}
		out = append(out, r)
	}
	ev.out = append(ev.out, out...)
}

func payloadField(e *expr.Payload) nftField {
	switch {
	case e.Base == expr.PayloadBaseNetworkHeader && e.Offset == 16 && e.Len >= 1 && e.Len <= 4:
		// IPv4 daddr, or its first bytes, as for saddr below (kube-proxy's
		// `ip daddr 10.96.0.0/16 drop` of unallocated ClusterIPs).
		return nftField{kind: fieldDaddr, size: int(e.Len)}
	case e.Base == expr.PayloadBaseNetworkHeader && e.Offset == 24 && e.Len == 16: // IPv6 daddr
		return nftField{kind: fieldDaddr, size: 16}
	case e.Base == expr.PayloadBaseNetworkHeader && e.Offset == 12 && e.Len >= 1 && e.Len <= 4:
		// IPv4 saddr, or its first bytes: nft and iptables-nft load only
		// those a prefix on a byte boundary covers (ip saddr 10.0.0.0/8).
		return nftField{kind: fieldSaddr, size: int(e.Len)}
	case e.Base == expr.PayloadBaseNetworkHeader && e.Offset == 8 && e.Len == 16: // IPv6 saddr
		return nftField{kind: fieldSaddr, size: 16}
	case e.Base == expr.PayloadBaseTransportHeader && e.Offset == 2 && e.Len == 2:
		return nftField{kind: fieldDport, size: 2}
	}
	return nftField{kind: fieldOther, size: int(e.Len)}
}

func (ev *nftRuleEval) cmp(e *expr.Cmp) {
	f := ev.get(e.Register)
	neg := e.Op == expr.CmpOpNeq
	if e.Op != expr.CmpOpEq && !(neg && negatable(f.kind)) {
		ev.rule.partial = true
		return
	}
	switch f.kind {
	case fieldAddrType:
		if isLocalType(e.Data) {
			ev.rule.localDst, ev.rule.localNeg = true, neg
		}
	case fieldSrcAddrType:
		if isLocalType(e.Data) {
			ev.rule.src = append(ev.rule.src, SourceMatch{Local: true, Not: neg})
		}
	case fieldDaddr:
		if p, ok := loadedPrefix(f, e.Data); ok {
			ev.rule.limitDst([]netip.Prefix{p}, neg)
		}
	case fieldSaddr:
		if p, ok := loadedPrefix(f, e.Data); ok {
			ev.rule.src = append(ev.rule.src, SourceMatch{Prefixes: []netip.Prefix{p}, Not: neg})
		}
	case fieldDport:
		if len(e.Data) == 2 {
			ev.rule.port = binary.BigEndian.Uint16(e.Data)
		}
	case fieldProto:
		if len(e.Data) == 1 {
			ev.rule.proto = protoName(e.Data[0])
		}
	case fieldMark: // iptables-nft's -m mark --mark VALUE/MASK
		if len(e.Data) == 4 {
			mask := uint32(0xffffffff)
			if len(f.mask) == 4 {
				mask = binary.NativeEndian.Uint32(f.mask)
			}
			ev.rule.mark, ev.rule.markMask = binary.NativeEndian.Uint32(e.Data)&mask, mask
		}
	default:
		ev.rule.partial = true
	}
}

// isZero tells whether b is all zero bytes (a bitwise's xor that changes
// nothing: iptables-nft's mark match).
func isZero(b []byte) bool {
	return !slices.ContainsFunc(b, func(c byte) bool { return c != 0 })
}

// negatable are the fields whose != compare the reader understands.
func negatable(k fieldKind) bool {
	return k == fieldDaddr || k == fieldAddrType || k == fieldSaddr || k == fieldSrcAddrType
}

// isLocalType tells whether a fib type compare is against RTN_LOCAL, which
// the kernel stores as a u32 in host byte order.
func isLocalType(data []byte) bool {
	return len(data) == 4 && binary.NativeEndian.Uint32(data) == unix.RTN_LOCAL
}

// loadedPrefix is the prefix a compare of an address (f: its first f.size
// bytes, masked or not) tests.
func loadedPrefix(f nftField, data []byte) (netip.Prefix, bool) {
	if len(data) != f.size {
		return netip.Prefix{}, false
	}
	width := 4
	if f.size == 16 {
		width = 16
	}
	addr, mask := make([]byte, width), make([]byte, width)
	copy(addr, data)
	if f.mask != nil {
		copy(mask, f.mask)
	} else {
		for i := range f.size {
			mask[i] = 0xff
		}
	}
	return prefixFrom(addr, mask)
}

// lookup handles a set membership test on the destination or the source, and verdict maps
// (kube-proxy's `ip daddr . meta l4proto . th dport vmap @service-ips`): each
// element becomes a rule with the element's key as conditions.
func (ev *nftRuleEval) lookup(e *expr.Lookup, sets setLookup) {
	isVmap := e.IsDestRegSet && e.DestRegister == unix.NFT_REG_VERDICT
	if e.IsDestRegSet && !isVmap {
		ev.set(e.DestRegister, ev.mapValue(e, sets))
		return
	}
	set, ok := sets(e.SetName)
	if !ok {
		return // unknown condition: the rule may apply
	}
	start := regSlot(e.SourceRegister)
	if !isVmap {
		if m, ok := srcSetMatch(ev.regs[start], set, e.Invert); ok {
			ev.rule.src = append(ev.rule.src, m)
		}
	}
	if set.interval {
		// `ip daddr { 10.96.0.0/16 } drop`: kube-proxy's drop of the
		// unallocated ClusterIPs of its Service CIDRs.
		if f := ev.regs[start]; f.kind == fieldDaddr && !isVmap {
			if dst, ok := intervalPrefixes(set.elems, f.size); ok {
				ev.rule.limitDst(dst, e.Invert)
			}
		}
		return
	}
	if !isVmap {
		if f := ev.regs[start]; f.kind == fieldDaddr {
			var dst []netip.Prefix
			for _, el := range set.elems {
				if k := ev.decodeKey(start, el.Key); k.daddr.IsValid() {
					dst = append(dst, netip.PrefixFrom(k.daddr, k.daddr.BitLen()))
				}
			}
			ev.rule.limitDst(dst, e.Invert)
		}
		return
	}
	for _, el := range set.elems {
		v := ElementVerdict(el)
		r := ev.rule
		switch {
		case v == nil:
			continue
		case v.Kind == expr.VerdictJump || v.Kind == expr.VerdictGoto:
			r.targets = []string{v.Chain}
		case v.Kind == expr.VerdictDrop:
			// kube-proxy's drop of an externalTrafficPolicy: Local
			// Service's external traffic when it has no local endpoint.
			r.verdict = "drop"
		default:
			continue
		}
		r.comment = el.Comment
		k := ev.decodeKey(start, el.Key)
		if k.daddr.IsValid() {
			r.limitDst([]netip.Prefix{netip.PrefixFrom(k.daddr, k.daddr.BitLen())}, false)
		}
		if k.port != 0 {
			r.port = k.port
		}
		if k.proto != "" {
			r.proto = k.proto
		}
		ev.out = append(ev.out, r)
	}
}

// mapValue is what a map lookup (not a verdict map) puts in its
// register: the map's elements when it is read and the packet path does not
// change it, so that a rewrite of the destination from it (`ip daddr set ip
// daddr map { VIP : BACKEND }`, `ip daddr set numgen random mod 2 map { 0 :
// B1, 1 : B2 }`) reads as one rewrite per element; otherwise a value not
// known.
func (ev *nftRuleEval) mapValue(e *expr.Lookup, sets setLookup) nftField {
	set, ok := sets(e.SetName)
	if !ok || set.interval || set.dynamic {
		return nftField{kind: fieldOther, size: 4}
	}
	src := ev.regs[regSlot(e.SourceRegister)]
	return nftField{kind: fieldMapped, size: 4, mapped: set.elems,
		byDaddr: src.kind == fieldDaddr && (src.size == 4 || src.size == 16) && src.mask == nil}
}

// ElementVerdict is a verdict map element's verdict (nil for another
// element).
func ElementVerdict(el nftables.SetElement) *expr.Verdict {
	if el.VerdictData != nil {
		return el.VerdictData
	}
	return verdictFromData(el.Val)
}

// verdictFromData decodes a verdict map element's data as the kernel sends it
// (nested NFTA_VERDICT_CODE and NFTA_VERDICT_CHAIN): google/nftables v0.3.0
// leaves it undecoded in SetElement.Val when listing elements.
func verdictFromData(b []byte) *expr.Verdict {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil
	}
	ad.ByteOrder = binary.BigEndian
	var v expr.Verdict
	haveCode := false
	for ad.Next() {
		switch ad.Type() {
		case unix.NFTA_VERDICT_CODE:
			v.Kind, haveCode = expr.VerdictKind(int32(ad.Uint32())), true
		case unix.NFTA_VERDICT_CHAIN:
			v.Chain = ad.String()
		}
	}
	if ad.Err() != nil || !haveCode {
		return nil
	}
	return &v
}

type setKey struct {
	daddr netip.Addr
	port  uint16
	proto string
}

// decodeKey reads a (possibly concatenated) set key whose parts were loaded
// into consecutive register slots from start; each part is padded to 4 bytes.
func (ev *nftRuleEval) decodeKey(start int, key []byte) setKey {
	var k setKey
	slot := start
	for len(key) > 0 {
		f, ok := ev.regs[slot]
		if !ok || f.size <= 0 {
			break
		}
		width := (f.size + 3) &^ 3
		if width > len(key) {
			break
		}
		part := key[:f.size]
		switch f.kind {
		case fieldDaddr:
			if a, ok := netip.AddrFromSlice(part); ok {
				k.daddr = a
			}
		case fieldDport:
			k.port = binary.BigEndian.Uint16(part)
		case fieldProto:
			k.proto = protoName(part[0])
		}
		key, slot = key[width:], slot+width/4
	}
	return k
}

// nat decodes `dnat to ADDR[:PORT]` from the immediate values in its
// registers, and `dnat to numgen random mod 2 map { 0 : B1, 1 : B2 }[:PORT]`
// (or `ip daddr map { VIP : B }`) as one DNAT per element of the map.
func (ev *nftRuleEval) nat(e *expr.NAT) {
	ev.rule.dnat = true
	var port uint16
	if e.RegProtoMin != 0 {
		if p := ev.get(e.RegProtoMin); p.kind == fieldImm && len(p.value) >= 2 {
			port = binary.BigEndian.Uint16(p.value)
		}
	}
	if e.RegProtoMax != 0 && e.RegProtoMax != e.RegProtoMin {
		if p := ev.get(e.RegProtoMax); p.kind != fieldImm || len(p.value) < 2 || binary.BigEndian.Uint16(p.value) != port {
			ev.rule.portRange = true
		}
	}
	addr := ev.get(e.RegAddrMin)
	if addr.kind == fieldMapped && ev.mappedDNATs(addr, port) {
		return
	}
	ip, ok := netip.AddrFromSlice(addr.value)
	if addr.kind != fieldImm || !ok {
		ev.rule.note = "dnat target from a map or expression: not decoded"
		return
	}
	ev.rule.backend = netip.AddrPortFrom(ip, port)
}

// mappedDNATs makes a DNAT to a map's value one rule per element of the
// map, each to the element's address and port (as mappedRewrites does for
// a stateless rewrite); false, adding none, when an element's value is no
// IPv4 address (an address and port concatenated, an IPv6 map).
func (ev *nftRuleEval) mappedDNATs(m nftField, port uint16) bool {
	var out []natRule
	for _, el := range m.mapped {
		to, ok := netip.AddrFromSlice(el.Val)
		if !ok || !to.Is4() {
			return false
		}
		r := ev.rule
		r.backend = netip.AddrPortFrom(to, port)
		if m.byDaddr {
			key, ok := netip.AddrFromSlice(el.Key)
			if !ok || !key.Is4() {
				return false
			}
			if len(r.dst) > 0 && !r.dstNeg && !slices.ContainsFunc(r.dst, func(p netip.Prefix) bool { return p.Contains(key) }) {
				continue // a key the rule's own condition on the destination never lets through
			}
			r.limitDst([]netip.Prefix{netip.PrefixFrom(key, key.BitLen())}, false)
		}
		out = append(out, r)
	}
	if len(out) == 0 {
		return false // an empty map, or none of its keys the rule lets through
	}
	ev.out = append(ev.out, out...)
	return true
}

// xtMatch reads the destination port of an iptables-nft `-m tcp/udp --dport`.
func (ev *nftRuleEval) xtMatch(e *expr.Match) {
	var ports [2]uint16
	switch m := e.Info.(type) {
	case *xt.Tcp:
		ports, ev.rule.proto = m.DstPorts, "tcp"
	case *xt.Udp:
		ports, ev.rule.proto = m.DstPorts, "udp"
	case *xt.AddrTypeV1: // -m addrtype --dst-type/--src-type LOCAL, as iptables-nft writes it
		ev.addrType(m.Dest, m.Flags&xtAddrTypeInvertDest != 0)
		if m.Flags&xtAddrTypeLimitIface == 0 {
			ev.srcAddrType(m.Source, m.Flags&xtAddrTypeInvertSource != 0)
		}
		return
	case *xt.AddrType:
		ev.addrType(m.Dest, m.InvertDest)
		ev.srcAddrType(m.Source, m.InvertSource)
		return
	case *xt.Comment: // -m comment --comment, as iptables-nft writes it
		ev.rule.comment = string(*m)
		return
	default:
		ev.rule.partial = true // -m statistic, -m recent, ...
		return
	}
	if ports[0] == ports[1] {
		ev.rule.port = ports[0]
	}
}

// addrType reads an addrtype match's destination type: LOCAL alone is the
// node's addresses.
func (ev *nftRuleEval) addrType(dest uint16, neg bool) {
	if dest == uint16(xt.AddrTypeLocal) {
		ev.rule.localDst, ev.rule.localNeg = true, neg
	}
}

// srcAddrType reads an addrtype match's source type, as addrType.
func (ev *nftRuleEval) srcAddrType(source uint16, neg bool) {
	if source == uint16(xt.AddrTypeLocal) {
		ev.rule.src = append(ev.rule.src, SourceMatch{Local: true, Not: neg})
	}
}

// Flags of xt_addrtype_info_v1 (google/nftables names none):
// XT_ADDRTYPE_INVERT_SOURCE, XT_ADDRTYPE_INVERT_DEST, and
// XT_ADDRTYPE_LIMIT_IFACE_IN|OUT, which make the source type the one on the
// packet's interface, not the node's at large.
const (
	xtAddrTypeInvertSource = 0x1
	xtAddrTypeInvertDest   = 0x2
	xtAddrTypeLimitIface   = 0x4 | 0x8
)

// xtDNATPortRange tells whether an iptables-nft `-j DNAT` target names a
// range of ports.
func xtDNATPortRange(info xt.InfoAny) bool {
	switch r := info.(type) {
	case *xt.NatIPv4MultiRangeCompat:
		return len(*r) > 0 && (*r)[0].MaxPort != (*r)[0].MinPort
	case *xt.NatRange:
		return r.MaxPort != r.MinPort
	case *xt.NatRange2:
		return r.MaxPort != r.MinPort
	}
	return false
}

// xtDNATBackend decodes the target of an iptables-nft `-j DNAT`.
// nftRejectWith is what an nftables reject answers with (RejectWith): its
// type NFT_REJECT_ICMP_UNREACH (the code is ICMP's), NFT_REJECT_TCP_RST or
// NFT_REJECT_ICMPX_UNREACH (a code of its own, for IPv4 as
// nft_reject_icmp_code maps it).
func nftRejectWith(e *expr.Reject) string {
	switch e.Type {
	case 0:
		return rejectWithICMPCode(e.Code)
	case 1:
		return "tcp-reset"
	case 2:
		if int(e.Code) < len(icmpxCodes) {
			return rejectWithICMPCode(icmpxCodes[e.Code])
		}
	}
	return ""
}

// icmpxCodes are the ICMP codes of NFT_REJECT_ICMPX_NO_ROUTE, _PORT_UNREACH,
// _HOST_UNREACH and _ADMIN_PROHIBITED.
var icmpxCodes = []uint8{0, 3, 1, 13}

// XTRejectWith is what an xtables REJECT target answers with (struct
// ipt_reject_info: the enum ipt_reject_with, in host order).
func XTRejectWith(info xt.InfoAny) string {
	b, ok := info.(*xt.Unknown)
	if !ok || len(*b) < 4 {
		return ""
	}
	with := binary.NativeEndian.Uint32((*b)[:4])
	names := []string{"icmp-net-unreachable", "icmp-host-unreachable", "icmp-proto-unreachable", "icmp-port-unreachable",
		"", "icmp-net-prohibited", "icmp-host-prohibited", "tcp-reset", "icmp-admin-prohibited"}
	if int(with) < len(names) {
		return names[with]
	}
	return ""
}

func xtDNATBackend(info xt.InfoAny) (netip.AddrPort, string) {
	var ipb []byte
	var port uint16
	switch r := info.(type) {
	case *xt.NatIPv4MultiRangeCompat:
		if len(*r) > 0 {
			ipb, port = (*r)[0].MinIP, (*r)[0].MinPort
		}
	case *xt.NatRange:
		ipb, port = r.MinIP, r.MinPort
	case *xt.NatRange2:
		ipb, port = r.MinIP, r.MinPort
	}
	ip, ok := netip.AddrFromSlice(ipb)
	if !ok {
		return netip.AddrPort{}, "xt DNAT target: not decoded"
	}
	return netip.AddrPortFrom(ip.Unmap(), port), ""
}

// prefixFrom turns compared address bytes and an optional mask into a prefix.
func prefixFrom(data, mask []byte) (netip.Prefix, bool) {
	a, ok := netip.AddrFromSlice(data)
	if !ok {
		return netip.Prefix{}, false
	}
	bits := a.BitLen()
	if mask != nil {
		bits = 0
		for _, b := range mask {
			for ; b&0x80 != 0; b <<= 1 {
				bits++
			}
		}
	}
	return netip.PrefixFrom(a, bits).Masked(), true
}

func protoName(p byte) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	case unix.IPPROTO_SCTP:
		return "sctp"
	}
	return strconv.Itoa(int(p))
}
