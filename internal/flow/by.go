package flow

import (
	"path"
	"strings"
)

// SplitNATBy splits the "by" of a NAT rule ("SOURCE TABLE CHAIN -> ... ->
// RULE", NATRule.String) into its source and table ("nftables ip
// kube-proxy"), the chains it went through and the rule; false for any
// other "by".
func SplitNATBy(by string) (table string, chains []string, rule string, ok bool) {
	hops := strings.Split(by, " -> ")
	if len(hops) < 2 {
		return "", nil, "", false
	}
	i := strings.LastIndexByte(hops[0], ' ')
	if i < 0 {
		return "", nil, "", false
	}
	chains = append([]string{hops[0][i+1:]}, hops[1:len(hops)-1]...)
	return hops[0][:i], chains, hops[len(hops)-1], true
}

// ServiceChain is the index of the chain that names the Service among a
// NAT rule's chains (kube-proxy's last service-… or KUBE-SVC-…), else of
// the last one.
func ServiceChain(chains []string) int {
	for j := len(chains) - 1; j >= 0; j-- {
		if isServiceChain(chains[j]) {
			return j
		}
	}
	return len(chains) - 1
}

// isServiceChain tells a NAT chain of kube-proxy that names a Service:
// nftables mode's service-HASH-NAMESPACE/NAME/PROTO/PORT, iptables mode's
// KUBE-SVC-HASH (KUBE-SVL-HASH with a local traffic policy).
func isServiceChain(chain string) bool {
	return strings.HasPrefix(chain, "service-") || strings.HasPrefix(chain, "KUBE-SVC-") || strings.HasPrefix(chain, "KUBE-SVL-")
}

// maxCommentBy is the longest "by" a packet comment carries whole.
const maxCommentBy = 80

// CommentBy is a verdict's "by" as packet comments carry it: whole when
// short; otherwise without what every packet need not repeat and the
// report has in full. A NAT rule keeps its source and table, the chain
// that names the Service and the rule, "…" where chains were left out
// ("nftables ip kube-proxy … service-Z3XHB2ZZ-default/dns/udp/dns -> … ->
// dnat to 10.244.20.31:5353": 99 bytes against 178 with kube-proxy's
// chains); a program keeps its name and id and the last directory of its
// cgroup. In netfilter mode the whole comment was most of a packet block
// (409 bytes a packet for 74-byte frames in the lab, 315 shortened), and
// every byte of it is written, and read back, per packet.
func CommentBy(by string) string {
	if len(by) <= maxCommentBy {
		return by
	}
	if head, dir, ok := strings.Cut(by, " on /"); ok && !strings.Contains(head, " -> ") {
		return head + " on …/" + path.Base("/"+dir)
	}
	table, chains, rule, ok := SplitNATBy(by)
	if !ok || len(chains) == 1 {
		return by
	}
	var b strings.Builder
	b.WriteString(table)
	svc := ServiceChain(chains)
	if svc > 0 {
		b.WriteString(" …")
	}
	b.WriteString(" " + chains[svc] + " -> ")
	if svc < len(chains)-1 {
		b.WriteString("… -> ")
	}
	b.WriteString(rule)
	return b.String()
}
