package discover

import (
	"net/netip"
	"slices"

	"github.com/google/nftables"
)

// nftSet is what a rule's lookup needs of a set: its elements, whether
// they are intervals (which this reader does not decode), and whether the
// packet path changes them (kube-proxy's session affinity sets of client
// addresses: what they hold now is not what they held for a flow).
type nftSet struct {
	elems    []nftables.SetElement
	interval bool
	dynamic  bool
}

// setLookup returns a set of the rule's table by name; ok false when unreadable.
type setLookup func(name string) (nftSet, bool)

type nftSets struct {
	conn  *nftables.Conn
	table *nftables.Table
	cache map[string]nftSet
}

func (s *nftSets) lookup(name string) (nftSet, bool) {
	if set, ok := s.cache[name]; ok {
		return set, true
	}
	set, err := s.conn.GetSetByName(s.table, name)
	if err != nil {
		return nftSet{}, false
	}
	elems, err := s.conn.GetSetElements(set)
	if err != nil {
		return nftSet{}, false
	}
	s.cache[name] = nftSet{elems: elems, interval: set.Interval, dynamic: set.Dynamic || set.HasTimeout}
	return s.cache[name], true
}

// srcSetMatch is the condition of `ip saddr @set` (f: the source address):
// in one of the set's addresses, or ranges for an interval set (kube-proxy's
// `ip saddr != { RANGES } drop` of a LoadBalancer's loadBalancerSourceRanges,
// which without them would read as a drop of every client). A set the
// packet path changes, or one whose keys are not addresses alone, is no
// condition the reader can hold to.
func srcSetMatch(f nftField, set nftSet, neg bool) (SourceMatch, bool) {
	if f.kind != fieldSaddr || (f.size != 4 && f.size != 16) || f.mask != nil || set.dynamic {
		return SourceMatch{}, false
	}
	m := SourceMatch{Not: neg}
	if set.interval {
		var ok bool
		m.Prefixes, ok = intervalPrefixes(set.elems, f.size)
		return m, ok && len(m.Prefixes) > 0
	}
	for _, el := range set.elems {
		a, ok := netip.AddrFromSlice(el.Key)
		if !ok || len(el.Key) != f.size {
			return SourceMatch{}, false
		}
		m.Prefixes = append(m.Prefixes, netip.PrefixFrom(a, a.BitLen()))
	}
	return m, true
}

// intervalPrefixes are the addresses an interval set of addresses holds, as
// prefixes. The kernel keeps each range as its first address and, flagged
// as an interval end, the address after its last (none: to the end of the
// address space), in any order.
func intervalPrefixes(elems []nftables.SetElement, size int) ([]netip.Prefix, bool) {
	type bound struct {
		addr netip.Addr
		end  bool
	}
	bounds := make([]bound, 0, len(elems))
	for _, el := range elems {
		a, ok := netip.AddrFromSlice(el.Key)
		if !ok || len(el.Key) != size {
			return nil, false
		}
		bounds = append(bounds, bound{a, el.IntervalEnd})
	}
	slices.SortFunc(bounds, func(x, y bound) int { return x.addr.Compare(y.addr) })
	var out []netip.Prefix
	for i, b := range bounds {
		if b.end {
			continue
		}
		var last netip.Addr // no end: the rest of the space
		if size == 4 {
			last = netip.AddrFrom4([4]byte{255, 255, 255, 255})
		} else {
			last = netip.AddrFrom16([16]byte{0: 0xff, 1: 0xff, 2: 0xff, 3: 0xff, 4: 0xff, 5: 0xff, 6: 0xff, 7: 0xff, 8: 0xff, 9: 0xff, 10: 0xff, 11: 0xff, 12: 0xff, 13: 0xff, 14: 0xff, 15: 0xff})
		}
		if i+1 < len(bounds) && bounds[i+1].end {
			last = bounds[i+1].addr.Prev()
		}
		out = append(out, rangePrefixes(b.addr, last)...)
	}
	return out, true
}

// rangePrefixes covers the addresses first..last with the fewest prefixes.
func rangePrefixes(first, last netip.Addr) []netip.Prefix {
	var out []netip.Prefix
	for first.IsValid() && first.Compare(last) <= 0 {
		bits := first.BitLen()
		// The widest prefix that starts at first and ends by last.
		for bits > 0 {
			p := netip.PrefixFrom(first, bits-1)
			if p.Masked().Addr() != first || lastOf(p).Compare(last) > 0 {
				break
			}
			bits--
		}
		p := netip.PrefixFrom(first, bits)
		out = append(out, p)
		first = lastOf(p).Next()
	}
	return out
}

// lastOf is the last address of p (p masked).
func lastOf(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}
