package incident

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/netip"
	"strings"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// Listing styles vipLines reads.
const (
	styleNFT          = iota // nft list ruleset
	styleIPTablesSave        // iptables-save
)

// vipLines picks, from a ruleset listing written through it, the lines
// about the traced Services: the chains on their NAT paths as discovery
// found them (whole, for nft) and every line naming a VIP (a verdict map's
// element, a KUBE-SERVICES rule). On a node with thousands of Services the
// listing is megabytes, longer than its file's cap, and where the traced
// Service's chains fall in it is chance: these lines go first.
type vipLines struct {
	style  int
	chains map[string]bool // nft: "TABLE CHAIN" ("ip kube-proxy services"); iptables-save: the chain
	vips   []string
	limit  int
	out    bytes.Buffer
	more   int // lines left out beyond limit
	line   []byte
	// nft: where the listing is
	table     string // "ip kube-proxy"
	tableOut  bool   // its "table ... {" line is written
	chain     bool   // inside a chain block
	keepChain bool
}

func newVIPLines(style int, source string, node *discover.NodeInfo, vips []netip.Addr, limit int) *vipLines {
	v := &vipLines{style: style, chains: map[string]bool{}, limit: limit}
	for _, a := range vips {
		v.vips = append(v.vips, a.String())
	}
	if node != nil {
		for _, r := range append(append([]discover.NATRule(nil), node.Netfilter.Rules...), node.Netfilter.Rejects...) {
			if r.Source != source {
				continue
			}
			for _, c := range r.Chains {
				if style == styleNFT {
					c = r.Table + " " + c
				}
				v.chains[c] = true
			}
		}
	}
	return v
}

func (v *vipLines) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			v.line = append(v.line, p...)
			break
		}
		v.line = append(v.line, p[:i]...)
		v.take(string(v.line))
		v.line = v.line[:0]
		p = p[i+1:]
	}
	return n, nil
}

// finish ends the last line and the last table; the lines picked.
func (v *vipLines) finish() []byte {
	if len(v.line) > 0 {
		v.take(string(v.line))
		v.line = nil
	}
	v.endTable()
	if v.more > 0 {
		fmt.Fprintf(&v.out, "# ... %d more lines about the traced Services not kept\n", v.more)
	}
	return v.out.Bytes()
}

func (v *vipLines) emit(line string) {
	if v.out.Len()+len(line)+1 > v.limit {
		v.more++
		return
	}
	v.out.WriteString(line)
	v.out.WriteByte('\n')
}

func (v *vipLines) take(line string) {
	if v.style == styleIPTablesSave {
		if f := strings.Fields(line); len(f) > 1 && f[0] == "-A" && v.chains[f[1]] && !v.otherDst(f) || v.namesVIP(line) {
			v.emit(line)
		}
		return
	}
	trimmed := strings.TrimSpace(line)
	switch {
	case strings.HasPrefix(line, "table ") && strings.HasSuffix(trimmed, "{"):
		v.endTable()
		v.table = strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(trimmed, "table "), "{"))
		return
	case line == "}":
		v.endTable()
		v.table = ""
		return
	case !v.chain && strings.HasPrefix(trimmed, "chain ") && strings.HasSuffix(trimmed, "{"):
		name := strings.Trim(strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(trimmed, "chain "), "{")), `"`)
		v.chain, v.keepChain = true, v.chains[v.table+" "+name]
		if v.keepChain {
			v.emitInTable(line)
		}
		return
	case v.chain && line == "\t}":
		if v.keepChain {
			v.emitInTable(line)
		}
		v.chain, v.keepChain = false, false
		return
	}
	if v.keepChain && !v.otherDst(strings.Fields(line)) || v.namesVIP(line) {
		v.emitInTable(line)
	}
}

// otherDst tells whether a rule (its fields) is limited to a destination
// address that is no VIP (`-d 10.96.0.1/32`, `ip daddr 10.96.0.1`): one of
// the thousands of other Services' rules in a chain on the VIPs' path
// (KUBE-SERVICES).
func (v *vipLines) otherDst(fields []string) bool {
	for i := 0; i+1 < len(fields); i++ {
		if fields[i] != "-d" && fields[i] != "--destination" && fields[i] != "daddr" {
			continue
		}
		val := fields[i+1]
		if val == "!=" && i+2 < len(fields) {
			continue // a negation holds packets to the VIP too
		}
		if p, err := netip.ParsePrefix(val); err == nil {
			val = p.Addr().String()
		} else if _, err := netip.ParseAddr(val); err != nil {
			continue // a set, a map lookup, a concatenation
		}
		if !v.namesVIP(val) {
			return true
		}
	}
	return false
}

func (v *vipLines) emitInTable(line string) {
	if !v.tableOut && v.table != "" {
		v.emit("table " + v.table + " {")
		v.tableOut = true
	}
	v.emit(line)
}

func (v *vipLines) endTable() {
	if v.tableOut {
		v.emit("}")
	}
	v.tableOut = false
}

// namesVIP tells whether line holds one of the VIPs as an address (not as
// the start of a longer one: 10.0.0.1 is not in 10.0.0.10).
func (v *vipLines) namesVIP(line string) bool {
	for _, a := range v.vips {
		for i := 0; ; {
			j := strings.Index(line[i:], a)
			if j < 0 {
				break
			}
			j += i
			end := j + len(a)
			if (j == 0 || !addrByte(line[j-1])) && (end == len(line) || !addrByte(line[end])) {
				return true
			}
			i = j + 1
		}
	}
	return false
}

func addrByte(c byte) bool {
	return c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' || c == '.' || c == ':'
}

// listRuleset runs a ruleset listing (nft list ruleset, iptables-save) in
// the node netns into w. When it is longer than w has room for, the lines
// pick takes (at most a quarter of the room) come first, said so, and the
// listing after them is cut at w's cap as before.
func (s *snapshot) listRuleset(ctx context.Context, w *topicWriter, pick *vipLines, bin string, args ...string) error {
	room := max(w.limit-w.buf.Len(), 0)
	listing := newTopicWriter(room)
	pick.limit = room / 4
	err := runCommand(ctx, s.hostPath, io.MultiWriter(listing, pick), bin, args...)
	picked := pick.finish()
	if listing.dropped > 0 && len(picked) > 0 {
		fmt.Fprintf(w, "# The listing is longer than this file's cap (%d bytes). First, its lines about the traced Services\n", w.limit)
		fmt.Fprintf(w, "# (%s): the chains of their NAT paths and the lines naming them, in the listing's order:\n", strings.Join(pick.vips, ", "))
		w.Write(picked)
		fmt.Fprintf(w, "# End of the lines about the traced Services. The listing, cut at the cap:\n")
	}
	w.Write(listing.buf.Bytes())
	w.dropped += listing.dropped
	return err
}
