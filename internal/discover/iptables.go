package discover

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// parseIPTablesSave reads the nat table of `iptables-save -t nat` output into
// a natGraph (kube-proxy's KUBE-SERVICES -> KUBE-SVC-* -> KUBE-SEP-* DNAT).
func parseIPTablesSave(r io.Reader, source string) (*natGraph, error) {
	return parseIPTablesSaveTable(r, source, "nat")
}

// iptablesBases are the base chains of the tables read, and their hooks.
var iptablesBases = map[string][]natBase{
	"nat":    {{"PREROUTING", "prerouting", true, natDstPriority}, {"OUTPUT", "output", true, natDstPriority}},
	"filter": {{"FORWARD", "forward", false, 0}, {"INPUT", "input", false, 0}, {"OUTPUT", "output", false, 0}},
}

// parseIPTablesSaveTable reads the table (nat or filter) of iptables-save
// output into a natGraph; filter's rules that reject or drop a VIP are
// kube-proxy's for a Service without endpoints (KUBE-SERVICES REJECT).
// A chain's rules are kept as their lines and parsed when a walk first
// reaches them (natGraph.load): a node of 10,000 kube-proxy Services has
// 110,000 nat rules, of which the walk for the traced VIPs reaches a few;
// all of them parsed took 90 MB. A line that does not parse is the graph's
// error once a walk reaches its chain.
func parseIPTablesSaveTable(r io.Reader, source, table string) (*natGraph, error) {
	g := &natGraph{source: source, table: table, chains: map[string][]natRule{}}
	lines := map[string][]string{} // every chain's, nil for one without rules
	inNAT := false
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for sc.Scan() {
		text := strings.TrimSpace(sc.Text())
		switch {
		case text == "" || strings.HasPrefix(text, "#"):
		case strings.HasPrefix(text, "*"):
			inNAT = text == "*"+table
		case !inNAT || text == "COMMIT":
		case strings.HasPrefix(text, ":"):
			name, _, _ := strings.Cut(text[1:], " ")
			if _, ok := lines[name]; !ok {
				lines[name] = nil
			}
		case strings.HasPrefix(text, "-A "):
			chain, _, _ := strings.Cut(strings.TrimLeft(text[3:], " "), " ")
			lines[chain] = append(lines[chain], text)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read iptables-save output: %w", err)
	}
	g.load = func(name string) ([]natRule, bool, error) {
		texts, ok := lines[name]
		if !ok {
			return nil, false, nil // a target (ACCEPT, MARK, ...), no chain
		}
		delete(lines, name)
		var out []natRule
		base := g.isBase(name)
		for _, text := range texts {
			_, rule, err := parseIPTablesRule(text)
			if err != nil {
				return out, true, fmt.Errorf("%s %s chain %s: %w", source, table, name, err)
			}
			if !base || !rule.idleInBase() {
				out = append(out, rule)
			}
		}
		return out, true, nil
	}
	for _, base := range iptablesBases[table] {
		if _, ok := lines[base.chain]; ok {
			g.bases = append(g.bases, base)
		}
	}
	return g, nil
}

// parseIPTablesRule parses one "-A CHAIN ..." line. Only what attribution
// needs is kept: -d, -s, -p, --dport, --dst-type and --src-type LOCAL, -j/-g
// and DNAT --to-destination.
func parseIPTablesRule(text string) (string, natRule, error) {
	args, err := splitIPTablesArgs(text)
	if err != nil {
		return "", natRule{}, err
	}
	var r natRule
	chain, module, target := "", "", ""
	neg, limited := false, false
	for i := 0; i < len(args); i++ {
		arg := args[i]
		next := func() string {
			if i+1 < len(args) {
				i++
				return args[i]
			}
			return ""
		}
		switch arg {
		case "!":
			neg = true
			continue
		case "-A", "--append":
			chain = next()
		case "-m", "--match":
			module = next()
			// A match not read (statistic, recent, conntrack, ...) may
			// leave packets to the rules after this one.
			r.partial = r.partial || !slices.Contains([]string{"comment", "tcp", "udp", "sctp", "addrtype", "mark"}, module)
		case "-d", "--destination":
			p, err := parseIPTablesPrefix(next())
			if err != nil {
				return "", r, err
			}
			r.limitDst([]netip.Prefix{p}, neg)
		case "-s", "--source":
			// One not read (a non-contiguous mask) is no condition: the
			// rule may apply to any source, as before sources were read.
			if p, err := parseIPTablesPrefix(next()); err == nil {
				r.src = append(r.src, SourceMatch{Prefixes: []netip.Prefix{p}, Not: neg})
			}
		case "-p", "--protocol":
			if v := next(); !neg {
				r.proto = v
			}
		case "--dport", "--destination-port":
			if v, err := strconv.ParseUint(next(), 10, 16); err == nil && !neg {
				r.port = uint16(v)
			}
		case "-j", "--jump", "-g", "--goto":
			target = next()
			switch t := target; t {
			case "DNAT":
				r.dnat = true
				r.note = "DNAT without --to-destination"
			case "REJECT", "DROP":
				r.verdict = strings.ToLower(t)
			default:
				r.targets = append(r.targets, t)
			}
		case "--dst-type": // -m addrtype; LOCAL alone is the node's addresses
			if next() == "LOCAL" {
				r.localDst, r.localNeg = true, neg
			}
		case "--src-type":
			if next() == "LOCAL" {
				r.src = append(r.src, SourceMatch{Local: true, Not: neg})
			}
		case "--reject-with":
			r.rejectWith = next()
		case "--mark": // -m mark
			v, m, ok := parseMark(next())
			switch {
			case module != "mark":
			case ok && !neg:
				r.mark, r.markMask = v&m, m
			default:
				r.partial = true
			}
		case "--set-xmark", "--set-mark", "--or-mark":
			if v, m, ok := parseMark(next()); ok && target == "MARK" {
				r.setMark = v & m
			}
		case "--limit-iface-in", "--limit-iface-out":
			limited = true
		case "--to-destination":
			target := next()
			r.backend, r.note = parseDNATTarget(target)
			r.portRange = dnatPortRange(target)
		case "--comment":
			r.comment = next()
		default:
			// Options this reader ignores (-i, -m mark --mark ...):
			// skip their value so it is never read as an option.
			if strings.HasPrefix(arg, "-") && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") && args[i+1] != "!" {
				i++
			}
		}
		neg = false
	}
	if chain == "" {
		return "", r, fmt.Errorf("rule without -A: %q", text)
	}
	if limited {
		// The source type on the packet's interface, not the node's
		// addresses at large: no condition read.
		r.src = slices.DeleteFunc(r.src, func(m SourceMatch) bool { return m.Local })
	}
	return chain, r, nil
}

// parseMark reads a mark "VALUE[/MASK]" (a mask of all ones without one).
func parseMark(s string) (value, mask uint32, ok bool) {
	v, m, hasMask := strings.Cut(s, "/")
	value64, err := strconv.ParseUint(v, 0, 32)
	if err != nil {
		return 0, 0, false
	}
	mask64 := uint64(0xffffffff)
	if hasMask {
		if mask64, err = strconv.ParseUint(m, 0, 32); err != nil {
			return 0, 0, false
		}
	}
	return uint32(value64), uint32(mask64), true
}

// splitIPTablesArgs splits a rule on blanks, keeping "double quoted" words
// (comments) together.
func splitIPTablesArgs(s string) ([]string, error) {
	var args []string
	var cur strings.Builder
	inQuote, have := false, false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\' && inQuote && i+1 < len(s):
			i++
			cur.WriteByte(s[i])
		case c == '"':
			inQuote, have = !inQuote, true
		case (c == ' ' || c == '\t') && !inQuote:
			if have {
				args = append(args, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteByte(c)
			have = true
		}
	}
	if inQuote {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if have {
		args = append(args, cur.String())
	}
	return args, nil
}

func parseIPTablesPrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, fmt.Errorf("bad address %q: %w", s, err)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("bad address %q: %w", s, err)
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// dnatPortRange tells whether a DNAT target "ADDR[-ADDR2][:PORT[-PORT2]]"
// names a range of ports.
func dnatPortRange(s string) bool {
	if strings.HasPrefix(s, "[") {
		_, s, _ = strings.Cut(s, "]")
	} else if strings.Count(s, ":") != 1 {
		return false
	}
	_, port, _ := strings.Cut(s, ":")
	lo, hi, ok := strings.Cut(port, "-")
	return ok && lo != hi
}

// parseDNATTarget reads "ADDR[-ADDR2][:PORT[-PORT2]]" (or "[V6]:PORT"), keeping
// the first address and port of a range.
func parseDNATTarget(s string) (netip.AddrPort, string) {
	host, port := s, ""
	if strings.HasPrefix(s, "[") {
		if end := strings.Index(s, "]"); end > 0 {
			host, port = s[1:end], strings.TrimPrefix(s[end+1:], ":")
		}
	} else if strings.Count(s, ":") == 1 {
		host, port, _ = strings.Cut(s, ":")
	}
	host, _, _ = strings.Cut(host, "-")
	port, _, _ = strings.Cut(port, "-")
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, fmt.Sprintf("DNAT target %q: not decoded", s)
	}
	var p uint64
	if port != "" {
		if p, err = strconv.ParseUint(port, 10, 16); err != nil {
			return netip.AddrPort{}, fmt.Sprintf("DNAT target %q: not decoded", s)
		}
	}
	return netip.AddrPortFrom(a, uint16(p)), ""
}
