package incident

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"net/netip"
	"reflect"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// nftLister is the read side of an nftables connection.
type nftLister interface {
	ListTables() ([]*nftables.Table, error)
	ListChains() ([]*nftables.Chain, error)
	// Rules gives fn the handle and expressions of each rule of a chain as
	// they are read.
	Rules(t *nftables.Table, c *nftables.Chain, fn func(handle uint64, exprs []expr.Any) error) error
	GetSets(*nftables.Table) ([]*nftables.Set, error)
	// SetElements gives fn the elements of a set as they are read.
	SetElements(set *nftables.Set, fn func(nftables.SetElement) error) error
}

// renderRuleset writes tables, sets, chains (type, hook, priority, policy) and
// rules as their expressions, for nodes without the nft binary. Not nft's
// syntax: the low-level expressions nft would decompile, one rule a line.
// With focus, a ruleset of more than focusAboveChains chains (or any, when
// focus.always) is written narrowed to what the traced Services need (see
// nftFocus), and a smaller one whole until it outgrows half of focus.room,
// narrowed from there on.
func renderRuleset(w io.Writer, conn nftLister, focus *nftFocus, devices map[string][]string) error {
	tables, err := conn.ListTables()
	if err != nil {
		return fmt.Errorf("list nftables tables: %w", err)
	}
	chains, err := conn.ListChains()
	if err != nil {
		return fmt.Errorf("list nftables chains: %w", err)
	}
	o := &nftOut{w: w, focus: focus, focused: focus != nil && (focus.always || len(chains) > focusAboveChains)}
	if focus != nil && !o.focused {
		o.half = focus.room / 2
	}
	w = o
	if o.focused {
		fmt.Fprintf(w, "# %d chains: written narrowed to the traced Services (%s): every base chain, the chains on their NAT paths\n", len(chains), strings.Join(focus.vipNames(), ", "))
		fmt.Fprintf(w, "# as discovery found them, and in long chains and sets only the rules and elements naming a VIP or leading to those chains\n")
	}
	if len(tables) == 0 {
		fmt.Fprintln(w, "no nftables tables")
	}
	for _, t := range tables {
		table := discover.NFTFamilyName(t.Family) + " " + t.Name
		fmt.Fprintf(w, "table %s {\n", table)
		used := map[string]bool{} // the sets that written rules look up
		writeSets := func() {
			sets, err := conn.GetSets(t)
			if err != nil {
				fmt.Fprintf(w, "\t# sets not read: %v\n", err)
			}
			unused := 0
			for _, set := range sets {
				if o.focused && set.Anonymous && !used[set.Name] {
					unused++
					continue
				}
				renderSet(w, conn, set, o)
			}
			if unused > 0 {
				fmt.Fprintf(w, "\t# %d more anonymous sets, of rules not written, not written\n", unused)
			}
		}
		// A focused rendering writes only the anonymous sets (a rule's
		// inline map, one per kube-proxy Service: a netlink request each)
		// that the rules it keeps look up: its chains first, into a
		// buffer. A whole one writes its chains as their rules come.
		var body strings.Builder
		out := io.Writer(w)
		if o.focused {
			out = &body
		} else {
			writeSets()
		}
		skipped := 0
		for _, c := range chains {
			if c.Table.Name != t.Name || c.Table.Family != t.Family {
				continue
			}
			if o.narrowed() && c.Hooknum == nil && !focus.chains[table+" "+c.Name] {
				skipped++
				continue
			}
			fmt.Fprintf(out, "\tchain %s {%s\n", c.Name, chainHeader(c, devices[table+" "+c.Name]))
			renderRules(out, conn, t, c, table, o, used)
			fmt.Fprintln(out, "\t}")
		}
		if o.focused {
			writeSets()
			io.WriteString(w, body.String())
		}
		if skipped > 0 {
			fmt.Fprintf(w, "\t# %d more chains, on no traced Service's path, not written\n", skipped)
		}
		fmt.Fprintln(w, "}")
	}
	if !o.focused && o.narrowed() {
		fmt.Fprintf(w, "# written whole up to %d bytes, half of what this file keeps: narrowed from there on to the traced Services (%s), as on a ruleset of more than %d chains\n",
			o.half, strings.Join(focus.vipNames(), ", "), focusAboveChains)
	}
	return nil
}

// nftOut is a rendering's output, which counts what it writes: a whole
// rendering is narrowed once it outgrows half of its file, so that a long
// set or chain (a blocklist of 200,000 addresses, one line of megabytes)
// cannot push what comes after it (the traced Services' chains) out of the
// file, nor be cut whole at the file's last newline.
type nftOut struct {
	w       io.Writer
	focus   *nftFocus
	focused bool // narrowed from the start
	n, half int  // bytes written; a whole rendering's bound (0: none)
}

func (o *nftOut) Write(p []byte) (int, error) {
	o.n += len(p)
	return o.w.Write(p)
}

// narrowed tells whether what is written now is narrowed to o.focus.
func (o *nftOut) narrowed() bool { return o.focused || o.half > 0 && o.n > o.half }

// renderRules writes the rules of chain c of table t as they are read; a
// focused rendering narrows a chain once it is known to be long, holding
// its first rules until then, a whole one from where it outgrows its bound.
// used gets the sets that written rules look up.
func renderRules(w io.Writer, conn nftLister, t *nftables.Table, c *nftables.Chain, table string, o *nftOut, used map[string]bool) {
	type rule struct {
		handle uint64
		exprs  []expr.Any
	}
	written, left := 0, 0
	add, end := heldUntilLong(o, func(r rule, narrow bool) {
		line := ruleString(r.exprs)
		if narrow && !o.focus.keepRule(table, line) {
			left++
			return
		}
		for _, e := range r.exprs {
			if l, ok := e.(*expr.Lookup); ok {
				used[l.SetName] = true
			}
		}
		written++
		fmt.Fprintf(w, "\t\t%s # handle %d\n", line, r.handle)
	})
	err := conn.Rules(t, c, func(handle uint64, exprs []expr.Any) error {
		add(rule{handle, exprs})
		return nil
	})
	end()
	switch {
	case err != nil && written+left == 0:
		fmt.Fprintf(w, "\t\t# rules not read: %v\n", err)
	case err != nil:
		fmt.Fprintf(w, "\t\t# the rules after these not read: %v\n", err)
	}
	if left > 0 {
		fmt.Fprintf(w, "\t\t# %d more rules, naming no traced VIP nor leading to their chains, not written\n", left)
	}
}

// heldUntilLong feeds write the items of a listing as they are read, with
// whether it is narrowed: a listing begun narrowed (o) is narrowed once it
// is known to be long (focusLongerThan), holding its first items until
// then, and a short one not at all; one begun whole from the item at which
// the rendering outgrows its bound. end writes what is still held when the
// listing ends.
func heldUntilLong[T any](o *nftOut, write func(item T, narrow bool)) (add func(T), end func()) {
	focused := o.narrowed()
	var held []T
	narrow := false
	add = func(x T) {
		if !focused || narrow {
			write(x, narrow || o.narrowed())
			return
		}
		if held = append(held, x); len(held) > focusLongerThan {
			narrow = true
			for _, h := range held {
				write(h, true)
			}
			held = nil
		}
	}
	end = func() {
		for _, h := range held {
			write(h, false)
		}
	}
	return add, end
}

// Above these sizes a focused rendering writes only what names the traced
// Services: kube-proxy's tables on a big cluster's node hold a chain per
// Service and per endpoint (tens of thousands) and a verdict map with an
// element per Service.
const (
	focusAboveChains = 2000
	focusLongerThan  = 200 // rules of a chain, elements of a set
)

// nftFocus narrows a rendering of a big ruleset to the traced Services: the
// chains of their NAT paths (discovery's walk) and every base chain whole,
// and in longer chains and sets, the rules and elements that name a VIP or
// lead to one of those chains. What is left out is counted.
type nftFocus struct {
	always bool            // narrow whatever the ruleset's size
	room   int             // the bytes the rendering's file keeps (0: no bound)
	chains map[string]bool // "FAMILY TABLE CHAIN": "ip kube-proxy services"
	vips   []netip.Addr
}

func newNFTFocus(node *discover.NodeInfo, vips []netip.Addr) *nftFocus {
	f := &nftFocus{chains: map[string]bool{}, vips: vips}
	if node != nil {
		for _, r := range append(append([]discover.NATRule(nil), node.Netfilter.Rules...), node.Netfilter.Rejects...) {
			if r.Source != discover.SourceNFTables {
				continue
			}
			for _, c := range r.Chains {
				f.chains[r.Table+" "+c] = true
			}
		}
		for _, dc := range node.Netfilter.DeviceChains {
			for _, r := range dc.Rewrites {
				for _, c := range r.Chains {
					f.chains[r.Table+" "+c] = true
				}
			}
		}
	}
	return f
}

// chainDevices are the devices of the chains on device hooks as discovery
// read them (google/nftables lists a chain without them), by "FAMILY TABLE
// CHAIN".
func chainDevices(node *discover.NodeInfo) map[string][]string {
	devs := map[string][]string{}
	if node != nil {
		for _, c := range node.Netfilter.DeviceChains {
			devs[c.Family+" "+c.Table+" "+c.Chain] = c.Devices
		}
	}
	return devs
}

func (f *nftFocus) vipNames() []string {
	names := make([]string, len(f.vips))
	for i, a := range f.vips {
		names[i] = a.String()
	}
	return names
}

// keepRule tells whether a rule of table (its rendering) names a VIP or
// jumps or goes to a chain on a traced Service's path.
func (f *nftFocus) keepRule(table, line string) bool {
	for _, a := range f.vips {
		if strings.Contains(line, "("+a.String()+")") {
			return true
		}
	}
	for _, word := range []string{"jump ", "goto "} {
		for rest := line; ; {
			i := strings.Index(rest, word)
			if i < 0 {
				break
			}
			rest = rest[i+len(word):]
			name, _, _ := strings.Cut(rest, ";")
			if f.chains[table+" "+strings.TrimSpace(name)] {
				return true
			}
		}
	}
	return false
}

// keepElement tells whether a set element's key or value holds a VIP, as a
// whole 4-byte field of it (a concatenated key pads each field to 4 bytes),
// or leads to a chain on a traced Service's path.
func (f *nftFocus) keepElement(table string, e nftables.SetElement) bool {
	if v := discover.ElementVerdict(e); v != nil && f.chains[table+" "+v.Chain] {
		return true
	}
	for _, b := range [][]byte{e.Key, e.Val} {
		for i := 0; i+4 <= len(b); i += 4 {
			if a := netip.AddrFrom4([4]byte(b[i : i+4])); slices.Contains(f.vips, a) {
				return true
			}
		}
	}
	return false
}

func renderSet(w io.Writer, conn nftLister, set *nftables.Set, o *nftOut) {
	kind := "set"
	if set.IsMap {
		kind = "map"
	}
	keyType, dataType := set.KeyType.Name, set.DataType.Name
	if set.IsMap && dataType == "" && keyType == nftables.TypeVerdict.Name {
		// google/nftables v0.3.0 reads a verdict map's data type over its
		// key type (kube-proxy's service-ips came out "verdict :"): the
		// key's type is lost.
		keyType, dataType = "?", nftables.TypeVerdict.Name
	}
	fmt.Fprintf(w, "\t%s %s { type %s", kind, set.Name, keyType)
	if set.IsMap {
		fmt.Fprintf(w, " : %s", dataType)
	}
	if set.Interval {
		fmt.Fprint(w, "; flags interval")
	}
	table := discover.NFTFamilyName(set.Table.Family) + " " + set.Table.Name
	written, left := 0, 0
	add, end := heldUntilLong(o, func(e nftables.SetElement, narrow bool) {
		if narrow && !o.focus.keepElement(table, e) {
			left++
			return
		}
		if written == 0 {
			fmt.Fprint(w, "; elements = {")
		} else {
			fmt.Fprint(w, ",")
		}
		written++
		fmt.Fprintf(w, " %s", dataString(e.Key))
		v := e.VerdictData
		if set.IsMap {
			v = discover.ElementVerdict(e)
		}
		switch {
		case v != nil:
			fmt.Fprintf(w, " : %s", verdictString(v))
		case len(e.Val) > 0:
			fmt.Fprintf(w, " : %s", dataString(e.Val))
		}
		if e.IntervalEnd {
			fmt.Fprint(w, " (interval end)")
		}
	})
	err := conn.SetElements(set, func(e nftables.SetElement) error {
		add(e)
		return nil
	})
	end()
	switch {
	case err != nil && written+left == 0:
		fmt.Fprintf(w, " } # elements not read: %v\n", err)
		return
	case written == 0:
		fmt.Fprint(w, "; elements = {")
	}
	fmt.Fprint(w, " } }")
	if left > 0 {
		fmt.Fprintf(w, " # %d more elements, naming no traced VIP nor leading to their chains, not written", left)
	}
	if err != nil {
		fmt.Fprintf(w, " # the elements after these not read: %v", err)
	}
	fmt.Fprintln(w)
}

// chainHeader is "type nat hook prerouting priority -100 policy accept" for a
// base chain, "" for a regular one; devices are those of a chain on a
// device hook.
func chainHeader(c *nftables.Chain, devices []string) string {
	if c.Hooknum == nil {
		return ""
	}
	s := fmt.Sprintf(" # type %s hook %s", c.Type, hookName(c.Table.Family, *c.Hooknum))
	if len(devices) > 0 {
		s += " devices " + strings.Join(devices, ",")
	}
	if c.Priority != nil {
		s += fmt.Sprintf(" priority %d", *c.Priority)
	}
	if c.Policy != nil {
		s += " policy " + map[nftables.ChainPolicy]string{nftables.ChainPolicyDrop: "drop", nftables.ChainPolicyAccept: "accept"}[*c.Policy]
	}
	return s
}

func hookName(f nftables.TableFamily, h nftables.ChainHook) string {
	if f == nftables.TableFamilyNetdev {
		switch h {
		case 0:
			return "ingress"
		case 1:
			return "egress"
		}
	}
	names := []string{"prerouting", "input", "forward", "output", "postrouting", "ingress"}
	if int(h) < len(names) {
		return names[h]
	}
	return fmt.Sprintf("hook%d", h)
}

func ruleString(exprs []expr.Any) string {
	parts := make([]string, len(exprs))
	for i, e := range exprs {
		parts[i] = exprString(e)
	}
	return strings.Join(parts, "; ")
}

// exprString renders one expression; the ones NAT attribution turns on are
// spelled out, iptables-nft's xtables matches and targets as iptables-save
// writes them (xtString), the rest printed field by field.
func exprString(e expr.Any) string {
	switch e := e.(type) {
	case *expr.Meta:
		if e.SourceRegister {
			return fmt.Sprintf("meta set %s <= reg %d", metaKey(e.Key), e.Register)
		}
		return fmt.Sprintf("meta %s => reg %d", metaKey(e.Key), e.Register)
	case *expr.Payload:
		base := map[expr.PayloadBase]string{expr.PayloadBaseLLHeader: "link", expr.PayloadBaseNetworkHeader: "network",
			expr.PayloadBaseTransportHeader: "transport"}[e.Base]
		if e.OperationType == expr.PayloadWrite {
			return fmt.Sprintf("payload write reg %d => %s header +%d len %d", e.SourceRegister, base, e.Offset, e.Len)
		}
		return fmt.Sprintf("payload %s header +%d len %d => reg %d", base, e.Offset, e.Len, e.DestRegister)
	case *expr.Cmp:
		op := map[expr.CmpOp]string{expr.CmpOpEq: "==", expr.CmpOpNeq: "!=", expr.CmpOpLt: "<",
			expr.CmpOpLte: "<=", expr.CmpOpGt: ">", expr.CmpOpGte: ">="}[e.Op]
		return fmt.Sprintf("cmp reg %d %s %s", e.Register, op, dataString(e.Data))
	case *expr.Bitwise:
		return fmt.Sprintf("bitwise reg %d & %s ^ %s => reg %d", e.SourceRegister, dataString(e.Mask), dataString(e.Xor), e.DestRegister)
	case *expr.Immediate:
		return fmt.Sprintf("immediate %s => reg %d", dataString(e.Data), e.Register)
	case *expr.Verdict:
		return verdictString(e)
	case *expr.Lookup:
		s := fmt.Sprintf("lookup reg %d in @%s", e.SourceRegister, e.SetName)
		if e.Invert {
			s = fmt.Sprintf("lookup reg %d not in @%s", e.SourceRegister, e.SetName)
		}
		if e.IsDestRegSet {
			s += fmt.Sprintf(" => reg %d", e.DestRegister)
		}
		return s
	case *expr.NAT:
		kind := map[expr.NATType]string{expr.NATTypeDestNAT: "dnat", expr.NATTypeSourceNAT: "snat"}[e.Type]
		s := fmt.Sprintf("%s addr reg %d", orDash(kind), e.RegAddrMin)
		if e.RegProtoMin != 0 {
			s += fmt.Sprintf(" port reg %d", e.RegProtoMin)
		}
		return s
	case *expr.Counter:
		return fmt.Sprintf("counter packets %d bytes %d", e.Packets, e.Bytes)
	case *expr.Match, *expr.Target:
		return xtString(e)
	}
	v := reflect.ValueOf(e)
	if v.Kind() == reflect.Pointer && !v.IsNil() {
		v = v.Elem()
	}
	return fmt.Sprintf("%s %+v", strings.ToLower(v.Type().Name()), v.Interface())
}

func verdictString(v *expr.Verdict) string {
	switch v.Kind {
	case expr.VerdictAccept:
		return "accept"
	case expr.VerdictDrop:
		return "drop"
	case expr.VerdictReturn:
		return "return"
	case expr.VerdictContinue:
		return "continue"
	case expr.VerdictJump:
		return "jump " + v.Chain
	case expr.VerdictGoto:
		return "goto " + v.Chain
	case expr.VerdictQueue:
		return "queue"
	}
	return fmt.Sprintf("verdict %d %s", v.Kind, v.Chain)
}

// dataString shows register data in hex, with the reading a rule about
// Services most likely means: an IPv4 address for 4 bytes, a port (network
// byte order) for 2.
func dataString(b []byte) string {
	s := "0x" + hex.EncodeToString(b)
	switch len(b) {
	case 2:
		s += fmt.Sprintf(" (%d)", binary.BigEndian.Uint16(b))
	case 4:
		s += fmt.Sprintf(" (%s)", netip.AddrFrom4([4]byte(b)))
	case 16:
		s += fmt.Sprintf(" (%s)", netip.AddrFrom16([16]byte(b)))
	}
	return s
}

func metaKey(k expr.MetaKey) string {
	switch k {
	case unix.NFT_META_PROTOCOL:
		return "protocol"
	case unix.NFT_META_MARK:
		return "mark"
	case unix.NFT_META_IIF:
		return "iif"
	case unix.NFT_META_OIF:
		return "oif"
	case unix.NFT_META_IIFNAME:
		return "iifname"
	case unix.NFT_META_OIFNAME:
		return "oifname"
	case unix.NFT_META_NFPROTO:
		return "nfproto"
	case unix.NFT_META_L4PROTO:
		return "l4proto"
	}
	return fmt.Sprintf("key%d", k)
}
