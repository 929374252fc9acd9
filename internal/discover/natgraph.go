package discover

import (
	"net/netip"
	"slices"
)

// natGraph is a NAT ruleset reduced to what attribution needs, whatever its
// source (nftables or iptables-save): chains of rules that may be limited to
// destinations, ports and protocols, jump to other chains, and DNAT.
type natGraph struct {
	source string    // nftables or iptables-legacy
	table  string    // "ip kube-proxy", "nat"
	bases  []natBase // chains hooked at NAT prerouting/output, the walk's entries
	chains map[string][]natRule
}

// natBase is a base chain and its netfilter hook (prerouting or output).
type natBase struct {
	chain string
	hook  string
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
	note    string         // why backend is invalid
}

// maxChainDepth bounds a walk (rulesets are DAGs; this only stops bad loops).
const maxChainDepth = 32

// match returns every DNAT a packet to one of vips can reach: a rule that
// names the VIP as its destination marks the walk from there on as being about
// that VIP, and a DNAT reached that way is reported with its chain path.
// Rules without a destination condition are followed without marking, so a
// kube-proxy nodeport or masquerade chain never counts as the VIP's.
func (g *natGraph) match(vips []netip.Addr) []NATRule {
	var out []NATRule
	for i, vip := range vips {
		if slices.Contains(vips[:i], vip) {
			continue // given twice (two ports of one Service): its rules once
		}
		for _, base := range g.bases {
			w := natWalk{g: g, vip: vip, hook: base.hook, out: &out, onPath: map[string]bool{}}
			w.chain(base.chain, []string{base.chain}, false, "", 0)
		}
	}
	return out
}

type natWalk struct {
	g      *natGraph
	vip    netip.Addr
	hook   string
	out    *[]NATRule
	onPath map[string]bool
}

func (w *natWalk) chain(name string, path []string, matched bool, proto string, port uint16) {
	if w.onPath[name] || len(path) > maxChainDepth {
		return
	}
	w.onPath[name] = true
	defer delete(w.onPath, name)
	for _, r := range w.g.chains[name] {
		applies, names := r.appliesTo(w.vip)
		if !applies {
			continue
		}
		m, pr, po := matched, proto, port
		if names {
			m = true
			if r.proto != "" {
				pr = r.proto
			}
			if r.port != 0 {
				po = r.port
			}
		}
		if m && r.dnat {
			*w.out = append(*w.out, NATRule{Source: w.g.source, Table: w.g.table, Hook: w.hook, Service: w.vip,
				Port: po, Proto: pr, Chains: slices.Clone(path), Backend: r.backend, Note: r.note})
		}
		for _, t := range r.targets {
			if _, ok := w.g.chains[t]; ok {
				w.chain(t, append(slices.Clone(path), t), m, pr, po)
			}
		}
	}
}

// appliesTo tells whether a packet to vip can match the rule, and whether the
// rule names vip as its destination.
func (r *natRule) appliesTo(vip netip.Addr) (applies, names bool) {
	if len(r.dst) == 0 {
		return true, false
	}
	in := slices.ContainsFunc(r.dst, func(p netip.Prefix) bool { return p.Contains(vip) })
	if r.dstNeg {
		return !in, false
	}
	return in, in
}
