package discover

import (
	"fmt"
	"net/netip"
	"slices"
)

// natGraph is a NAT ruleset reduced to what attribution needs, whatever its
// source (nftables or iptables-save): chains of rules that may be limited to
// destinations, ports, protocols and sources, jump to other chains, and DNAT.
type natGraph struct {
	source string // nftables or iptables-legacy
	table  string // "ip kube-proxy", "nat"
	// family is an nftables table's ("ip", "ip6", "inet", ...); "" for
	// iptables-legacy, which pathtrace reads for IPv4 only.
	family string
	bases  []natBase // chains hooked at NAT prerouting/output, the walk's entries
	chains map[string][]natRule
	// load reads the rules of chain name (ok false: no such chain) the
	// first time a walk reaches it; nil when chains holds every chain's
	// rules already. chains then holds the chains read so far: a big
	// node's tens of thousands (kube-proxy's chain per Service and per
	// endpoint) are never all held, their names included.
	load func(name string) (rules []natRule, ok bool, err error)
	err  error // the first load that failed: the graph is not read in full
	// ending caches ends: by chain and protocol.
	ending map[[2]string]bool
	// markers are the nat tables whose rules mark the packets this
	// table's filter rules match by mark (linkMarkers); marks caches a nat
	// table's marksOf.
	markers []*natGraph
	marks   map[markKey][]natMark
}

type markKey struct {
	vip   netip.Addr
	local bool
}

// natMark is a path of a nat table on which a VIP's packets get bits of
// their mark set (kube-proxy's KUBE-MARK-DROP), with its conditions.
type natMark struct {
	hook    string // the NAT hook: prerouting or output
	bits    uint32
	port    uint16
	proto   string
	chains  []string
	comment string
	src     []SourceMatch
}

// rules returns the rules of chain name, read now if not yet; ok false
// when the graph has no such chain.
func (g *natGraph) rules(name string) (rules []natRule, ok bool) {
	if rules, ok = g.chains[name]; ok || g.load == nil {
		return rules, ok
	}
	rules, ok, err := g.load(name)
	if err != nil && g.err == nil {
		g.err = err
	}
	if ok {
		g.chains[name] = rules
	}
	return rules, ok
}

// has tells whether the graph has chain name.
func (g *natGraph) has(name string) bool {
	_, ok := g.rules(name)
	return ok
}

// isBase tells whether chain name is one of g's base chains.
func (g *natGraph) isBase(name string) bool {
	return slices.ContainsFunc(g.bases, func(b natBase) bool { return b.chain == name })
}

// idleInBase tells whether r, a rule of a base chain, matters to no walk:
// a walk enters a base chain having matched nothing, so a rule that neither
// jumps, DNATs nor rewrites matters only if it rejects or drops by its
// destination (a VIP, a backend, the node's own addresses). A host
// firewall's input chain of tens of thousands of rules on sources and
// ports (`ip saddr X tcp dport 22 drop`) was held whole at each read.
func (r *natRule) idleInBase() bool {
	return len(r.targets) == 0 && !r.dnat && !r.setDst && (r.verdict == "" || len(r.dst) == 0 && !r.localDst)
}

// natBase is a base chain and its netfilter hook: prerouting or output for
// a NAT chain, forward, input or output for a filter chain.
type natBase struct {
	chain    string
	hook     string
	nat      bool // a NAT chain's hook, not a filter one's
	priority int  // its priority at the hook (iptables' filter: 0)
}

// natDstPriority is the priority of destination NAT at prerouting and
// output (NF_IP_PRI_NAT_DST).
const natDstPriority = -100

// afterNAT tells whether a filter chain sees packets after destination NAT:
// forward and input always do, prerouting and output when its priority is
// above NAT's (kube-proxy's filter-output-post-dnat, iptables' filter
// OUTPUT; not its filter-prerouting and filter-output, at -110). A packet
// to a VIP that a DNAT rewrote meets it with its backend's address.
func (b natBase) afterNAT() bool {
	return !b.nat && (b.hook == "forward" || b.hook == "input" || b.priority > natDstPriority)
}

// natRule is one rule of a natGraph.
type natRule struct {
	dst     []netip.Prefix // destinations the rule is limited to; empty = any
	dstNeg  bool           // the rule applies to destinations NOT in dst
	proto   string         // required protocol, "" = any
	port    uint16         // required destination port, 0 = any
	targets []string       // chains jumped or gone to
	dnat    bool
	backend netip.AddrPort // dnat target; invalid when not decodable
	// portRange: the target is a range of ports, backend's the first.
	portRange bool
	note      string // why backend is invalid
	// localDst: the rule is limited to the node's own addresses (iptables
	// `-m addrtype --dst-type LOCAL`, nftables `fib daddr type local`: how
	// kube-proxy and Docker select NodePorts); localNeg: to other ones.
	localDst, localNeg bool
	// verdict is "reject" or "drop" for a rule that ends the packets it
	// matches (kube-proxy rejects a Service without endpoints so).
	verdict string
	// rejectWith: what a reject answers with (NATRule.RejectWith).
	rejectWith string
	// gotos: the rule's targets are gone to, not jumped to: the rest of
	// its chain never sees the packets it matched.
	gotos   bool
	comment string // the rule's own (-m comment, nft comment, a map element's)
	// src are the rule's conditions on the packet's source, all required:
	// kube-proxy sends Pods' and the node's own traffic to a NodePort of
	// an externalTrafficPolicy: Local Service to the cluster-wide chain
	// and only the rest to the local one.
	src []SourceMatch
	// setDst: the rule sets the destination address (a payload
	// statement, not NAT) to setAddr (invalid: not a constant), and
	// setPort the destination port (0: kept). Only a device hook's graph
	// takes them for rewrites (deviceGraph).
	setDst  bool
	setAddr netip.Addr
	setPort uint16
	// setMark: the bits of the packet's mark the rule sets (kube-proxy's
	// KUBE-MARK-DROP sets 0x8000); mark, markMask: its condition on the
	// mark (KUBE-FIREWALL's drop of the packets with 0x8000), markMask 0
	// for none.
	setMark, mark, markMask uint32
	// partial: the rule has a condition this reader does not read (a
	// random pick, a recent match): packets may pass it.
	partial bool
	// dstAddrs holds dst when it is many addresses (kube-proxy's set of
	// every ClusterIP): a walk looks each address up once (limitDst).
	dstAddrs map[netip.Addr]bool
}

// maxChainDepth bounds a walk (rulesets are DAGs; this only stops bad loops).
const maxChainDepth = 32

// match returns every DNAT a packet to one of vips can reach: a rule that
// names the VIP as its destination marks the walk from there on as being about
// that VIP, and a DNAT reached that way is reported with its chain path.
// Rules without a destination condition are followed without marking, so a
// kube-proxy masquerade chain never counts as the VIP's.
func (g *natGraph) match(vips []netip.Addr) []NATRule { return g.matchLocal(vips, nil) }

// matchLocal is match where the VIPs in local are addresses of the node (a
// NodePort traced as NODE-IP:PORT): a rule limited to the node's addresses
// names them, so kube-proxy's nodeports chain counts as theirs, and only
// as theirs.
func (g *natGraph) matchLocal(vips []netip.Addr, local map[netip.Addr]bool) []NATRule {
	return g.matchFrom(g.bases, vips, local)
}

// matchFrom is matchLocal walking from bases only.
func (g *natGraph) matchFrom(bases []natBase, vips []netip.Addr, local map[netip.Addr]bool) []NATRule {
	var out []NATRule
	seen := map[string]bool{} // a Service may have thousands of endpoints
	for i, vip := range vips {
		if slices.Contains(vips[:i], vip) || !g.carries(vip) {
			continue // given twice (two ports of one Service): its rules once; or never in this table
		}
		for _, base := range bases {
			w := natWalk{g: g, vip: vip, local: local[vip], base: base, out: &out, seen: seen, onPath: map[string]bool{}}
			w.chain(base.chain, []string{base.chain}, false, "", 0, "", nil)
		}
	}
	return out
}

// carries tells whether packets to vip traverse g's table: the hooks of an
// nftables ip6 table (a dual-stack node's `ip6 kube-proxy`, iptables-nft's
// `ip6 nat`) see IPv6 packets only, an ip table's IPv4 ones. Their NodePort
// rules name no address (`fib daddr type local`, `ip6 daddr != ::1`): read
// for an IPv4 NODE-IP:PORT they gave it the IPv6 endpoints.
func (g *natGraph) carries(vip netip.Addr) bool {
	v4 := vip.Unmap().Is4()
	return !(g.family == "ip6" && v4 || g.family == "ip" && !v4)
}

type natWalk struct {
	g      *natGraph
	vip    netip.Addr
	local  bool // vip is an address of the node
	base   natBase
	out    *[]NATRule
	seen   map[string]bool // what out holds (add)
	onPath map[string]bool
	// ended: a rule rejected or dropped every packet of the VIP; the rules
	// after it (kube-proxy's "Drop traffic to unallocated ClusterIPs"
	// after the reject of an active ClusterIP's other ports) never see one.
	ended bool
	// marks, when not nil, collects the paths that mark the VIP's packets.
	marks *[]natMark
}

// chain walks the rules of chain name; comment is the one of the rule that
// named the VIP on the way (a verdict map element's, in kube-proxy's
// nftables mode), which a verdict rule without one of its own keeps; src
// are the source conditions of the rules on the way, from the base chain
// on (a packet meets them all whether or not they named the VIP).
func (w *natWalk) chain(name string, path []string, matched bool, proto string, port uint16, comment string, src []SourceMatch) {
	if w.onPath[name] || len(path) > maxChainDepth {
		return
	}
	w.onPath[name] = true
	defer delete(w.onPath, name)
	rules, _ := w.g.rules(name)
	for i := range rules {
		r := &rules[i] // not copied: a chain can have thousands of rules, each walked once per address
		if w.ended {
			return
		}
		applies, names := r.appliesTo(w.vip, w.local)
		if !applies {
			continue
		}
		if r.dstNeg && w.local && w.base.hook == "input" {
			// At input every destination is an address of the node: a
			// rule on all of them but some (kube-proxy's
			// nodeport-endpoints-check, `ip daddr != 127.0.0.0/8`) names
			// a NodePort's, as `fib daddr type local` does before NAT.
			names = true
		}
		m, pr, po, cm, sm := matched, proto, port, comment, src
		if len(r.src) > 0 {
			sm = append(slices.Clone(src), r.src...)
		}
		if m && !names {
			// Conditions add up along the path: a later rule's port or
			// protocol narrows the VIP's (the nodeports chain picks the
			// port after the local-address rule), and one that contradicts
			// it is never met by the VIP's packets.
			if (r.port != 0 && po != 0 && r.port != po) || (r.proto != "" && pr != "" && r.proto != pr) {
				continue
			}
		}
		if names || m {
			m = true
			if r.comment != "" {
				cm = r.comment
			}
		}
		// Port and protocol add up along the path whether or not a rule
		// named the VIP yet: a port-only DNAT needs them (hostPorts below).
		if r.proto != "" {
			pr = r.proto
		}
		if r.port != 0 {
			po = r.port
		}
		if r.dnat && (m || w.hostPort(po)) {
			w.add(NATRule{Source: w.g.source, Table: w.g.table, Hook: w.base.hook, Service: w.vip,
				Port: po, Proto: pr, Chains: slices.Clone(path), Backend: r.backend, PortRange: r.portRange, Note: r.note, Sources: sm})
		}
		if m && r.setMark != 0 && w.marks != nil {
			*w.marks = append(*w.marks, natMark{w.base.hook, r.setMark, po, pr, slices.Clone(path), cm, sm})
		}
		if !m && r.mark != 0 && r.verdict != "" {
			w.markedVerdict(r, path, sm)
		}
		if m && r.verdict != "" {
			w.add(NATRule{Source: w.g.source, Table: w.g.table, Hook: w.base.hook, Service: w.vip,
				Port: po, Proto: pr, Chains: slices.Clone(path), Verdict: r.verdict, RejectWith: r.rejectWith, Comment: cm, Sources: sm,
				AfterNAT: w.base.afterNAT()})
			w.ended = po == 0 && pr == "" && len(sm) == 0
		}
		for _, t := range r.targets {
			if w.g.has(t) {
				w.chain(t, append(slices.Clone(path), t), m, pr, po, cm, sm)
			}
		}
		if not, ok := r.goneFrom(); ok && (r.gotos || len(r.targets) == 1 && w.g.ends(r.targets[0], pr, 0)) {
			src = append(slices.Clone(src), not)
		}
		if w.marks != nil && r.takesAll(w.g, pr) {
			// kube-proxy 1.20's KUBE-FW-* chain of a LoadBalancer
			// without source ranges jumps to its service chain, then
			// to KUBE-MARK-DROP, which no packet reaches.
			return
		}
	}
}

// takesAll tells whether every packet of protocol proto that meets r leaves
// its chain for good: r has no condition and goes or jumps to one chain that
// ends every packet (natGraph.ends).
func (r *natRule) takesAll(g *natGraph, proto string) bool {
	return len(r.dst) == 0 && r.port == 0 && !r.localDst && len(r.src) == 0 && (r.proto == "" || r.proto == proto) &&
		r.markMask == 0 && !r.partial && len(r.targets) == 1 && g.ends(r.targets[0], proto, 0)
}

// markedVerdict adds what a filter rule r that rejects or drops packets by
// their mark does to the VIP's, for each path of the nat tables (markers)
// that sets that mark on them: kube-proxy before 1.25 marks at NAT with
// KUBE-MARK-DROP the packets of a LoadBalancer's client outside its source
// ranges (and, before 1.24, those to a NodePort of an
// externalTrafficPolicy: Local Service without a local endpoint), and
// kubelet's KUBE-FIREWALL, at input and output, drops them. The path is the nat one followed by the filter one,
// with the nat path's comment (the Service's) and conditions.
func (w *natWalk) markedVerdict(r *natRule, path []string, src []SourceMatch) {
	var marks []natMark
	for _, g := range w.g.markers {
		marks = append(marks, g.marksOf(w.vip, w.local)...)
	}
	for _, mk := range marks {
		if r.mark&r.markMask&^mk.bits != 0 || (r.port != 0 && mk.port != 0 && r.port != mk.port) || !markSeen(mk.hook, w.base) {
			continue
		}
		sm := append(slices.Clone(mk.src), src...)
		notLocal := func(m SourceMatch) bool { return m.Local && m.Not }
		if mk.hook == "prerouting" && !slices.ContainsFunc(sm, notLocal) {
			// The node's own connections meet NAT at output: their
			// packets that loop back to input were never marked at
			// prerouting.
			sm = append(sm, SourceMatch{Local: true, Not: true})
		}
		w.add(NATRule{Source: w.g.source, Table: w.g.table, Hook: w.base.hook, Service: w.vip, Port: mk.port, Proto: mk.proto,
			Chains: append(slices.Clone(mk.chains), path...), Verdict: r.verdict, RejectWith: r.rejectWith, Comment: mk.comment,
			Sources: sm, AfterNAT: w.base.afterNAT()})
	}
}

// markSeen tells whether a filter chain at base sees the packets a nat
// chain at natHook marked: those of prerouting go on to forward or input,
// those of output to output's filter.
func markSeen(natHook string, base natBase) bool {
	if !base.afterNAT() {
		return false
	}
	if natHook == "output" {
		return base.hook == "output" || base.hook == "postrouting"
	}
	return base.hook != "output"
}

// marksOf are the paths of g, a nat table, on which packets to vip (local:
// an address of the node) get a mark set.
func (g *natGraph) marksOf(vip netip.Addr, local bool) []natMark {
	k := markKey{vip, local}
	if marks, ok := g.marks[k]; ok {
		return marks
	}
	var out []NATRule
	var marks []natMark
	if g.carries(vip) {
		for _, base := range g.bases {
			w := natWalk{g: g, vip: vip, local: local, base: base, out: &out, seen: map[string]bool{}, onPath: map[string]bool{}, marks: &marks}
			w.chain(base.chain, []string{base.chain}, false, "", 0, "", nil)
		}
	}
	if g.marks == nil {
		g.marks = map[markKey][]natMark{}
	}
	g.marks[k] = marks
	return marks
}

// ends tells whether every packet of protocol proto ("" any) that enters
// chain name leaves it rewritten or ended: one of its rules without a
// condition read (on destination, port, source or the node's addresses; a
// protocol only when proto is it) DNATs, rejects or drops, or jumps to one
// chain that ends so. kube-proxy's iptables service chains end with their
// last endpoint's unconditional jump, whose chain DNATs every tcp packet.
// A condition the graph does not read (statistic, recent) counts as none,
// which a service chain's last rule makes harmless.
func (g *natGraph) ends(name, proto string, depth int) bool {
	if depth > maxChainDepth {
		return false
	}
	key := [2]string{name, proto}
	if v, ok := g.ending[key]; ok {
		return v
	}
	if g.ending == nil {
		g.ending = map[[2]string]bool{}
	}
	g.ending[key] = false // a loop ends nothing
	rules, ok := g.rules(name)
	end := false
	for _, r := range rules {
		if !ok || end {
			break
		}
		if len(r.dst) > 0 || r.port != 0 || r.localDst || len(r.src) > 0 || (r.proto != "" && r.proto != proto) {
			continue
		}
		end = r.dnat || r.verdict != "" || len(r.targets) == 1 && g.ends(r.targets[0], proto, depth+1)
	}
	g.ending[key] = end
	return end
}

// hostPort tells whether a DNAT reached on a path that never named the
// VIP still concerns it: one limited to a port only, on a path without any
// destination condition, catches that port on every address, the node's
// included. The CNI portmap plugin's nftables hostPorts are so (its
// prerouting chain jumps to `tcp dport 8080 dnat to POD:80` with no
// destination condition); only a VIP that is an address of the node (a
// NODE-IP:PORT trace) takes them, so a ClusterIP traced without port is
// not given every hostPort of the node.
func (w *natWalk) hostPort(port uint16) bool {
	return w.local && port != 0
}

// goneFrom is the condition the rules after r in its chain add: a rule that
// goes to another chain for one condition on the source, and nothing else
// (kube-proxy's "short-circuit pod traffic" and "short-circuit local
// traffic" of an externalTrafficPolicy: Local Service), leaves the rest of
// the chain the packets that do not meet it. The walk takes it so for a
// goto (nftables), and for a jump to a chain that ends every packet
// (natGraph.ends: iptables' -j KUBE-SVC-X, whose last endpoint takes what
// the others leave).
func (r *natRule) goneFrom() (SourceMatch, bool) {
	if len(r.src) != 1 || len(r.dst) > 0 || r.localDst || r.port != 0 || r.proto != "" {
		return SourceMatch{}, false
	}
	not := r.src[0]
	not.Not = !not.Not
	return not, true
}

// add records a DNAT the walk reached, once: a chain that two rules of one
// chain jump to (kube-proxy's session affinity: `ip saddr @affinity goto
// endpoint-X` next to the random pick of the same endpoint) is one path to
// that DNAT, not two candidates. Two rules with different source conditions
// (kube-proxy's pod and node-local traffic to the cluster-wide chain of a
// NodePort) make two: a client may take it meeting either's, and one list
// of conditions, all required, cannot say so.
func (w *natWalk) add(r NATRule) {
	k := fmt.Sprint(r.Service, r.Hook, r.Port, r.Proto, r.Chains, r.Backend, r.Note, r.Verdict, r.RejectWith, r.Sources)
	if !w.seen[k] {
		w.seen[k] = true
		*w.out = append(*w.out, r)
	}
}

// limitDst limits r to the destinations in dst (neg: to the others).
func (r *natRule) limitDst(dst []netip.Prefix, neg bool) {
	r.dst, r.dstNeg, r.dstAddrs = dst, neg, nil
	if len(dst) < 16 {
		return
	}
	addrs := make(map[netip.Addr]bool, len(dst))
	for _, p := range dst {
		if !p.IsSingleIP() {
			return // a walk then looks at every prefix
		}
		addrs[p.Addr()] = true
	}
	r.dstAddrs = addrs
}

// appliesTo tells whether a packet to vip (local: an address of the node)
// can match the rule, and whether the rule names vip as its destination.
func (r *natRule) appliesTo(vip netip.Addr, local bool) (applies, names bool) {
	if r.localDst && local == r.localNeg {
		return false, false
	}
	byLocal := r.localDst && !r.localNeg
	if len(r.dst) == 0 {
		return true, byLocal
	}
	in := r.dstAddrs[vip]
	if r.dstAddrs == nil {
		in = slices.ContainsFunc(r.dst, func(p netip.Prefix) bool { return p.Contains(vip) })
	}
	if r.dstNeg {
		return !in, byLocal && !in
	}
	return in, in
}
