package incident

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/report"
)

// Ended is what stopped before the capture did, each with when and why.
type Ended struct {
	Captures map[string]string // per capture point: its interface went down or away
	// Gaps: per capture point whose interface went down and the capture
	// went on (a link that flapped), how often and how long.
	Gaps      map[string]string
	Observers string // the observers' event reader ("" when it ran to the end)
	// NATRules: the NAT rules changed during the run and were read again
	// (session.Result.NATRulesReread); "" when they were not.
	NATRules string
	// TCPrograms: the tc programs that appeared and went during the run
	// (session.Result.TCProgramsChanged).
	TCPrograms []string
	// PodsStarted: the Pods that started during the run and were followed
	// from then on (session.Result.PodsStarted).
	PodsStarted []string
	// ObserversAdded: tcx observers attached during the run
	// (session.Result.ObserversAdded).
	ObserversAdded []string
	// File: the capture file filled its share of the budget and ended
	// while the run went on; nil when it holds the whole run.
	File *FileEnded
	// CPUWait: how long pathtrace's threads waited for a CPU during the
	// run (session.Result.CPUWait), said with the rings' losses; nil when
	// unknown.
	CPUWait *report.CPUWait
}

// FileEnded says when the capture file ended and what it left out.
type FileEnded struct {
	Share  int64 // bytes: the file's part of Budget
	Budget int64 // bytes: the bundle's --max-bytes, as run
	// LoweredToFitDisk: Budget is half of what the disk had free, below
	// the --max-bytes given; a larger one would not have helped.
	LoweredToFitDisk bool
	After, Run       time.Duration // into the run; the run's length
	Written          uint64        // frames in the file
	Captured         uint64        // frames captured in the whole run
}

// Taken says what took the bundle: pathtrace's version and its command
// line, for whoever reads the ticket later.
type Taken struct {
	Version string
	Command string
}

// SummaryFile is the bundle's plain-words summary.
const SummaryFile = "SUMMARY.md"

// Bounds that keep SUMMARY.md readable whatever the number of flows.
const (
	maxSummaryGroups = 50
	maxListedIDs     = 10
)

// WriteSummary writes SUMMARY.md into dir: the verdicts in plain words, one
// sentence per group of flows that share them, then where pathtrace looked,
// what it captured and lost, and notes (the node's: what discovery could not
// read or decided by a fallback; those of the bundle's manifest, when
// Snapshot wrote one). stop is why the capture ended; ended, what ended
// before it; taken, what took it.
func WriteSummary(dir string, flows []flow.Flow, s flow.Summary, node *discover.NodeInfo, stop string, ended Ended, taken Taken) error {
	var b strings.Builder
	b.WriteString("# pathtrace incident summary\n\n")
	if taken.Command != "" {
		fmt.Fprintf(&b, "Taken by %s: `%s`.  \n", orDash(taken.Version), taken.Command)
	}
	vips := serviceAddrs(flows)
	if node != nil && len(node.Services) > 0 {
		vips = node.Services // as --svc gave them, with or without flows
	}
	if len(vips) > 0 {
		fmt.Fprintf(&b, "Services traced: %s.  \n", strings.Join(vips, ", "))
	}
	if node != nil {
		fmt.Fprintf(&b, "Node: kernel %s, network namespace %s.  \n", orDash(node.Kernel), orDash(node.HostNetNS.Path))
	}
	if ended.File != nil {
		fmt.Fprintf(&b, "Capture stopped: %s; the capture file filled after %s (see What was captured).\n", orDash(stop), seconds(ended.File.After))
	} else {
		fmt.Fprintf(&b, "Capture stopped: %s.\n", orDash(stop))
	}

	writeVerdicts(&b, flows, s, podAddrs(node), uplinkNames(node))
	if node != nil {
		writeWhereLooked(&b, node)
	}
	writeCaptured(&b, s, ended)
	notes, err := manifestNotes(dir)
	if err != nil {
		notes = append(notes, fmt.Sprintf("the bundle's manifest: %v", err))
	}
	if node != nil {
		notes = append(slices.Clone(node.Notes), notes...)
	}
	b.WriteString("\n## Notes\n\n")
	if len(notes) == 0 {
		b.WriteString("None: every source was read.\n")
	}
	for _, n := range notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	fmt.Fprintf(&b, "\n%s lists every file of this bundle and what it holds.\n", ManifestText)

	if err := os.WriteFile(filepath.Join(dir, SummaryFile), []byte(b.String()), 0o600); err != nil {
		return fmt.Errorf("incident summary: %w", err)
	}
	return nil
}

func serviceAddrs(flows []flow.Flow) []string {
	var out []string
	for _, f := range flows {
		if a := f.Service.Addr().String(); !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// verdictGroup is flows that one sentence describes: same verdict, same
// client address, Service, backend(s), reply and uplink facts.
type verdictGroup struct {
	key   string
	first flow.Flow
	ids   []int
}

func groupKey(f flow.Flow) string {
	vlan := "none"
	if f.VLAN != nil {
		vlan = fmt.Sprintf("%d %s", *f.VLAN, f.VLANProto)
	}
	reason := ""
	if f.RewrittenAt == flow.PlaceUnknown {
		reason = f.Reason // an unknown verdict is explained per cause
	}
	return strings.Join([]string{string(f.RewrittenAt), f.By, f.Proto, clientAddr(f), f.Service.String(),
		backends(f), fmt.Sprint(f.Reply), fmt.Sprint(f.Refused), fmt.Sprint(f.RequestLeftUplink()), fmt.Sprint(f.LostOnNode > 0), fmt.Sprint(f.NotSent), fmt.Sprint(f.RepliesLostOnNode > 0), icmpKey(f), strayKey(f), untranslatedKey(f), kernelDropsKey(f), vlan, f.UplinkDstMAC, fmt.Sprint(f.UplinkDstIsGateway), fmt.Sprint(f.UplinkIfindex), reason}, "|")
}

// kernelDropsKey is what of a flow's kernel drops the summary says: their
// directions, reasons and functions.
func kernelDropsKey(f flow.Flow) string {
	var parts []string
	for _, d := range f.KernelDrops {
		parts = append(parts, d.Direction+" "+d.Reason+" "+d.Function)
	}
	return strings.Join(parts, ",")
}

// repliesDropped is the first of f's replies the kernel dropped for a
// reason (not NOT_SPECIFIED, which may be a packet sent and freed), nil
// when none.
func repliesDropped(f flow.Flow) *flow.KernelDrop {
	for i, d := range f.KernelDrops {
		if d.Direction == "reply" && d.Reason != "NOT_SPECIFIED" {
			return &f.KernelDrops[i]
		}
	}
	return nil
}

// icmpKey is what of an ICMP error the summary says, "" without one.
func icmpKey(f flow.Flow) string {
	if f.ICMPError == nil {
		return ""
	}
	return f.ICMPError.Message + " " + f.ICMPError.From.String() + " " + fmt.Sprint(f.ICMPError.FromRule)
}

// strayKey is the source of a flow's stray replies, "" without them.
func strayKey(f flow.Flow) string {
	if f.Reply || f.StrayReplies == nil {
		return ""
	}
	return f.StrayReplies.From.String()
}

// untranslatedKey is the source of the replies that entered a flow's
// client untranslated, "" without them.
func untranslatedKey(f flow.Flow) string {
	if f.UntranslatedReplies == nil {
		return ""
	}
	return f.UntranslatedReplies.From.String()
}

func groupFlows(flows []flow.Flow) []*verdictGroup {
	byKey := map[string]*verdictGroup{}
	var groups []*verdictGroup
	for _, f := range flows {
		k := groupKey(f)
		g, ok := byKey[k]
		if !ok {
			g = &verdictGroup{key: k, first: f}
			byKey[k] = g
			groups = append(groups, g)
		}
		g.ids = append(g.ids, f.ID)
	}
	order := map[flow.Place]int{}
	for i, p := range flow.Places() {
		order[p] = i
	}
	slices.SortStableFunc(groups, func(a, b *verdictGroup) int {
		return order[a.first.RewrittenAt] - order[b.first.RewrittenAt]
	})
	return groups
}

// podAddrs are the Pods' addresses, nil when the node is unknown, each
// true when the node routes that Pod's packets: its host veth is on no
// bridge (Calico's, Cilium's), its gateway is the node itself.
func podAddrs(node *discover.NodeInfo) map[netip.Addr]bool {
	if node == nil {
		return nil
	}
	addrs := map[netip.Addr]bool{}
	for _, p := range node.Pods {
		routed := p.HostPeer != nil && p.HostPeer.MasterKind == "none"
		for _, ifc := range append([]discover.Iface{p.Eth0}, p.OtherIfaces...) {
			for _, pfx := range ifc.Addrs {
				addrs[pfx.Addr()] = routed
			}
		}
	}
	return addrs
}

// uplinkNames are the node's uplinks by ifindex when it has several (nil
// otherwise): which one a flow's frames left by is then worth its name.
func uplinkNames(node *discover.NodeInfo) map[int]string {
	if node == nil {
		return nil
	}
	names := map[int]string{}
	for _, cp := range node.CapturePoints {
		if cp.Role == discover.RoleUplink {
			names[cp.Ifindex] = cp.Ifname
		}
	}
	if len(names) < 2 {
		return nil
	}
	return names
}

// writeVerdicts states the flows' verdicts; pods are the Pods' addresses
// (podAddrs), uplinks the uplinks' names (uplinkNames).
func writeVerdicts(b *strings.Builder, flows []flow.Flow, s flow.Summary, pods map[netip.Addr]bool, uplinks map[int]string) {
	b.WriteString("\n## What happened\n\n")
	if len(flows) == 0 {
		b.WriteString("No flow to a Service VIP was seen during the capture.\n")
		return
	}
	groups := groupFlows(flows)
	for i, g := range groups {
		if i == maxSummaryGroups {
			fmt.Fprintf(b, "- ... and %d more groups of flows: see the JSON report.\n", len(groups)-i)
			break
		}
		fmt.Fprintf(b, "- %s\n", sentence(g, pods, uplinks[g.first.UplinkIfindex]))
		if len(g.first.KernelDrops) > 0 {
			var drops []string
			for _, d := range g.first.KernelDrops {
				drops = append(drops, fmt.Sprintf("%d %s %s, %s", d.Count, d.Direction, pick(d.Count == 1, "packet", "packets"), d))
			}
			fmt.Fprintf(b, "  - Dropped by the kernel (flow %d): %s\n", g.first.ID, strings.Join(drops, "; "))
		}
		if g.first.Reason != "" {
			fmt.Fprintf(b, "  - Evidence (flow %d): %s\n", g.first.ID, g.first.Reason)
		}
	}
	var counts []string
	for _, p := range flow.Places() {
		if n := s.RewrittenAt[p]; n > 0 {
			counts = append(counts, fmt.Sprintf("%d %s", n, p))
		}
	}
	fmt.Fprintf(b, "\nIn all %s: %s.", plural(s.Flows, "flow", "flows"), strings.Join(counts, ", "))
	// In a long busy run most flows can be beyond --max-flows: the counts
	// above are then a small part of what happened, which must be said
	// where they are read.
	if n := s.Drops[flow.DropFlowsOverMax]; n > 0 {
		fmt.Fprintf(b, " %s more %s not followed (beyond --max-flows): no verdict, in no count above.", grouped(n), pick(n == 1, "was", "were"))
	}
	var before []int
	for _, f := range flows {
		if f.BeganBeforeRun {
			before = append(before, f.ID)
		}
	}
	if n := len(before); n > 0 {
		fmt.Fprintf(b, " %s (%s) began before the capture: %s handshake and connect() were not seen, and %s on %s packets alone.",
			plural(n, "connection", "connections"), idList(before), pick(n == 1, "its", "their"), pick(n == 1, "its verdict rests", "their verdicts rest"), pick(n == 1, "its", "their"))
	}
	b.WriteString("\n")
}

// clientAddr is the flow's client address, "an unknown address" when no
// source was seen (a connect that failed before the kernel chose one).
func clientAddr(f flow.Flow) string {
	if !f.Client.IsValid() {
		return "an unknown address"
	}
	return f.Client.Addr().String()
}

// sentence states one group's verdict for a ticket; pods are the Pods'
// addresses (podAddrs), uplink the name of the uplink its frames left by
// on a node of several ("" otherwise).
func sentence(g *verdictGroup, pods map[netip.Addr]bool, uplink string) string {
	f, n := g.first, len(g.ids)
	one := n == 1
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s from %s to %s (%s) ", countWord(n), pick(one, strings.ToUpper(f.Proto)+" flow", strings.ToUpper(f.Proto)+" flows"),
		clientAddr(f), f.Service, idList(g.ids))
	rewritten := pick(one, "was rewritten", "were rewritten")
	switch f.RewrittenAt {
	case flow.PlaceSocket:
		fmt.Fprintf(&b, "%s at the socket layer (a cgroup sock_addr hook, before any packet existed)", rewritten)
	case flow.PlaceTC:
		fmt.Fprintf(&b, "%s in tc%s", rewritten, tcWhere(f.By))
	case flow.PlaceNetfilter:
		if f.By == flow.ByClientNetfilter {
			fmt.Fprintf(&b, "%s in netfilter inside the client's own netns (its OUTPUT NAT, as a sidecar proxy's redirect does)", rewritten)
			break
		}
		fmt.Fprintf(&b, "%s in netfilter (DNAT) on the node", rewritten)
	case flow.PlaceIPVS:
		fmt.Fprintf(&b, "%s in IPVS on the node", rewritten)
	case flow.PlaceNowhere:
		fmt.Fprintf(&b, "%s anywhere on this node", pick(one, "was not rewritten", "were not rewritten"))
		// Not rewritten also when the node kept it: its own address (a node
		// cache), or its filter rejected it; the evidence says which.
		if f.RequestLeftUplink() {
			fmt.Fprintf(&b, ": %s %s with the VIP still as destination", pick(one, "it left", "they left"), theUplink(uplink))
		}
	default:
		if bs := backends(f); bs != "" {
			fmt.Fprintf(&b, "could not be placed: pathtrace cannot tell where %s rewritten to %s", pick(one, "it was", "they were"), bs)
			break
		}
		// Seen only with the VIP: not known to be rewritten at all (a
		// request the node dropped first).
		fmt.Fprintf(&b, "could not be placed: no point saw %s go to a backend, and pathtrace cannot tell whether or where %s rewritten",
			pick(one, "it", "them"), pick(one, "it was", "they were"))
	}
	if placed(f.RewrittenAt) {
		if bs := backends(f); bs != "" {
			fmt.Fprintf(&b, " to %s", bs)
		} else {
			b.WriteString(" (no backend was seen)")
		}
		switch f.By {
		case flow.ByClientNetfilter: // said above
		case "":
			b.WriteString(" by a program or rule pathtrace could not name")
		default:
			fmt.Fprintf(&b, " by %s", f.By)
		}
	}
	switch {
	case f.Refused && backends(f) == "":
		// No backend: what refused it is where the VIP led (the node's
		// own stack, for a local VIP no rule rewrote).
		b.WriteString(pick(one, "; the connection was refused (a TCP RST came back instead of a SYN-ACK: nothing listened on the VIP's port, or a firewall rejected it)",
			"; the connections were refused (a TCP RST came back instead of a SYN-ACK: nothing listened on the VIP's port, or a firewall rejected it)"))
	case f.Refused && f.By == flow.ByClientNetfilter && f.Backend.Addr().IsLoopback():
		// Its Pod's kernel refused it (a NO_SOCKET drop, in its reason): it
		// never left the Pod. The Pod's NAT to a backend out of it is
		// refused there, by a reset that came back, as any other.
		b.WriteString(pick(one, "; nothing listened on the proxy's port in the client's Pod: its kernel refused the connection (known from its drop, not captured), so the sidecar proxy was not running or not ready.",
			"; nothing listened on the proxy's port in the client's Pod: its kernel refused the connections (known from their drops, not captured), so the sidecar proxy was not running or not ready."))
		return b.String()
	case f.Refused:
		b.WriteString(pick(one, "; the backend refused the connection (a TCP RST came back instead of a SYN-ACK: nothing listened on its port, or a firewall rejected it)",
			"; the backend refused the connections (a TCP RST came back instead of a SYN-ACK: nothing listened on its port, or a firewall rejected it)"))
	case f.UntranslatedReplies != nil && !f.Reply:
		// Before the drops: the client's kernel drops them (NO_SOCKET)
		// once they reached it.
		fmt.Fprintf(&b, "; no reply came back translated: %s answered, but its replies entered the client's Pod from %s, not from the VIP (nothing translated them back: see the evidence), which the client does not take", f.UntranslatedReplies.From.Addr(), f.UntranslatedReplies.From)
	case !f.Reply && repliesDropped(f) != nil:
		d := repliesDropped(f)
		fmt.Fprintf(&b, "; %s, but the kernel dropped %s before any reached the client: %s in %s", pick(one, "its backend answered", "their backends answered"),
			pick(one, "the replies", "their replies"), d.Reason, orDash(d.Function))
	case f.RepliesLostOnNode > 0:
		b.WriteString(pick(one, "; its backend answered, but none of the replies that came in on the uplink reached the client's Pod: the node dropped or altered them on the way in (a tc program or a filter rule at the uplink's ingress, rp_filter, conntrack)",
			"; their backends answered, but none of the replies that came in on the uplink reached the clients' Pods: the node dropped or altered them on the way in (a tc program or a filter rule at the uplink's ingress, rp_filter, conntrack) (replies_lost_on_node in report.json)"))
	case f.Reply:
		b.WriteString("; replies came back")
	case f.By == flow.ByClientNetfilter && f.VLAN == nil:
		b.WriteString(pick(one, "; it never left the client's netns, where pathtrace does not capture: its reply could not be seen.", "; they never left the client's netns, where pathtrace does not capture: their replies could not be seen."))
		return b.String()
	case f.ICMPError != nil && f.ICMPError.FromRule:
		// Known from the rule, not seen: loopback is not captured, and
		// the kernel may not have sent it at all (it rate-limits ICMP
		// errors).
		fmt.Fprintf(&b, "; no reply came back, and no answer was seen: the node's reject rule answers with %s through loopback, which pathtrace does not capture (not known to have been sent: the kernel rate-limits ICMP errors)", f.ICMPError.Message)
	case f.ICMPError != nil:
		fmt.Fprintf(&b, "; no reply came back, but %s from %s", f.ICMPError.Message, f.ICMPError.From)
	case f.StrayReplies != nil:
		fmt.Fprintf(&b, "; no reply came back, but %s answered from another port (%s), which the client's socket does not take", f.StrayReplies.From.Addr(), f.StrayReplies.From)
	default:
		b.WriteString("; no reply came back")
	}
	b.WriteString(uplinkWords(f, one, podClient(f, pods) && !pods[f.Client.Addr()], uplink))
	switch {
	case f.NotSent && f.LostOnNode == 0:
		// Dropped before the uplink's capture saw any (a tc program's
		// drop after its rewrite, a filter rule).
		b.WriteString(pick(one, "; none of its requests left the node: the kernel dropped every one on the node after its rewrite (see the kernel drops), so none reached the backend",
			"; none of their requests left the node: the kernel dropped every one on the node after its rewrite (see the kernel drops), so none reached the backends (not_sent in report.json)"))
	case f.NotSent:
		b.WriteString(pick(one, "; none of its requests left the node: the kernel dropped every one the uplink's capture saw at the uplink device, after the capture (in its transmit: an overlay without a forwarding entry for the remote VTEP, a driver), so none reached the backend",
			"; none of their requests left the node: the kernel dropped every one the uplink's capture saw at the uplink device, after the capture (in its transmit: an overlay without a forwarding entry for the remote VTEP, a driver), so none reached the backends (not_sent in report.json)"))
	case f.LostOnNode > 0:
		lost := fmt.Sprintf("%d of its request packets that reached the host veth", f.LostOnNode)
		if !one {
			lost = "some of their request packets that reached the host veth (lost_on_node in report.json)"
		}
		fmt.Fprintf(&b, "; %s never left the uplink: dropped on the node on the way out (the uplink's qdisc, a filter rule) or lost by the capture", lost)
	}
	b.WriteString(".")
	return b.String()
}

// tcWhere says where the tc programs that by names run: a flow placed at tc
// was rewritten by a program of the host side of its Pod's veth, or of the
// uplink (an outside client's NodePort, a BPF load balancer's egress), or of
// the Pod's own eth0 (flow.Engine names those "... on the uplink", "... on
// the Pod's eth0"), or of its netkit pair.
func tcWhere(by string) string {
	const hostSide = " on the host side of the pod's veth"
	if by == "" {
		return hostSide
	}
	cands := strings.Split(by, "; ")
	if rest, ok := strings.CutPrefix(cands[0], "one of "); ok {
		if _, first, ok := strings.Cut(rest, ": "); ok {
			cands[0] = first
		}
	}
	where := ""
	for i, c := range cands {
		w := hostSide
		switch {
		case strings.HasSuffix(c, " on the uplink"):
			w = " on the uplink"
		case strings.HasSuffix(c, " on the Pod's eth0"):
			w = " on the egress of the Pod's own eth0"
		case strings.HasPrefix(c, "netkit peer "):
			w = " in the Pod's netkit pair"
		}
		if i > 0 && w != where {
			return "" // by names each and where it runs
		}
		where = w
	}
	return where
}

// theUplink names the uplink a flow's frames left by, "uplink NAME" on a
// node of several (uplinkNames), "the uplink" otherwise.
func theUplink(name string) string {
	if name == "" {
		return "the uplink"
	}
	return "uplink " + name
}

func placed(p flow.Place) bool {
	return p == flow.PlaceSocket || p == flow.PlaceTC || p == flow.PlaceNetfilter || p == flow.PlaceIPVS
}

// podClient tells whether f's client is a Pod (as far as pods, the Pods'
// addresses, tell: all but a node process's flow when unknown). A node
// process's or an outside client's (a NodePort's, in on the uplink)
// request has no Pod's gateway to go to.
func podClient(f flow.Flow, pods map[netip.Addr]bool) bool {
	_, ok := pods[f.Client.Addr()]
	return !f.NodeClient && (pods == nil || ok)
}

// uplinkWords says what the frames looked like leaving the node; toGateway:
// they were to go to the client's Pod's gateway, past the uplink (a Pod
// podClient tells, which the node does not route: its gateway is the node).
func uplinkWords(f flow.Flow, one, toGateway bool, uplink string) string {
	if f.VLAN == nil {
		return pick(one, "; it was never seen on the uplink", "; they were never seen on the uplink")
	}
	var s string
	if *f.VLAN == 0 && f.VLANProto == "" {
		s = fmt.Sprintf("; on %s the frames were untagged", theUplink(uplink))
	} else {
		s = fmt.Sprintf("; on %s the frames carried VLAN %d", theUplink(uplink), *f.VLAN)
		if f.VLANProto != "" { // a service tag's VLAN is not the 802.1Q one of that number, a priority tag's 0 no VLAN
			s += " (" + f.VLANProto + ")"
		}
	}
	switch {
	case f.UplinkDstMAC == "":
	case f.UplinkDstIsGateway:
		s += fmt.Sprintf(" and went to the gateway's MAC %s", f.UplinkDstMAC)
	case f.UplinkDstNeighbor != "":
		// A routed node's next hop (its Pods' gateway is the node itself),
		// or a VXLAN uplink's remote VTEP: whose MAC it is, as the table says.
		s += fmt.Sprintf(" and went to MAC %s, which the node's neighbour table gives to %s", f.UplinkDstMAC, f.UplinkDstNeighbor)
	case toGateway:
		s += fmt.Sprintf(" and went to MAC %s, which is not the pod's gateway", f.UplinkDstMAC)
	default:
		s += fmt.Sprintf(" and went to MAC %s, which no neighbour entry of the node names", f.UplinkDstMAC)
	}
	return s
}

func backends(f flow.Flow) string {
	if len(f.Backends) > 1 {
		parts := make([]string, len(f.Backends))
		for i, b := range f.Backends {
			parts[i] = b.String()
		}
		return "one of " + strings.Join(parts, ", ")
	}
	if f.Backend.IsValid() {
		return f.Backend.String()
	}
	return ""
}

func idList(ids []int) string {
	word := pick(len(ids) == 1, "flow ", "flows ")
	parts := make([]string, 0, min(len(ids), maxListedIDs))
	for i, id := range ids {
		if i == maxListedIDs {
			parts = append(parts, fmt.Sprintf("and %d more", len(ids)-i))
			break
		}
		parts = append(parts, fmt.Sprint(id))
	}
	return word + strings.Join(parts, ", ")
}

// countWord spells small counts, as a sentence in a ticket would.
func countWord(n int) string {
	words := []string{"No", "One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten"}
	if n < len(words) {
		return words[n]
	}
	return fmt.Sprint(n)
}

func plural(n int, one, many string) string {
	return fmt.Sprintf("%d %s", n, pick(n == 1, one, many))
}

func pick(cond bool, a, b string) string {
	if cond {
		return a
	}
	return b
}

func writeWhereLooked(b *strings.Builder, node *discover.NodeInfo) {
	b.WriteString("\n## Where pathtrace looked\n\n")
	for _, p := range node.Pods {
		fmt.Fprintf(b, "- Pod %s: %s %s", podLabel(p), p.Eth0.Name, prefixes(p.Eth0.Addrs))
		if p.Gateway.IsValid() {
			fmt.Fprintf(b, ", default gateway %s", p.Gateway)
			if p.GatewayMAC != "" {
				fmt.Fprintf(b, " (MAC %s)", p.GatewayMAC)
			}
		}
		if p.HostPeer != nil {
			fmt.Fprintf(b, "; host side %s", p.HostPeer.Name)
			if p.HostPeer.Master != "" {
				fmt.Fprintf(b, " on %s %s", p.HostPeer.MasterKind, p.HostPeer.Master)
			}
		}
		if len(p.Uplinks) > 0 {
			fmt.Fprintf(b, "; uplink %s (%s)", strings.Join(p.Uplinks, ", "), p.UplinkHow)
		}
		b.WriteString(".\n")
	}
	if node.PodsSkipped > 0 {
		fmt.Fprintf(b, "- %d more pod network namespaces were not examined", node.PodsSkipped)
		if len(node.PodsSkippedVeths) > 0 {
			fmt.Fprintf(b, " (behind the host veths %s)", strings.Join(node.PodsSkippedVeths, ", "))
		}
		b.WriteString(".\n")
	}
	var points []string
	for _, cp := range node.CapturePoints {
		name := cp.Ifname
		i := slices.IndexFunc(node.Pods, func(p discover.Pod) bool { return p.NetNS.Path == cp.NetNS })
		if cp.Role == discover.RolePod && i >= 0 && len(node.Pods) > 1 {
			// Every Pod's is an eth0: say whose.
			name += " of " + podLabel(node.Pods[i])
		}
		points = append(points, fmt.Sprintf("%s %s (%s)", cp.Role, name, orDash(cp.Kind)))
	}
	fmt.Fprintf(b, "- Capture points: %s.\n", orNone(points))

	var sock []string
	for _, p := range node.SockPrograms {
		sock = append(sock, fmt.Sprintf("%s %s (id %d) on %s", p.Attach, orDash(p.Name), p.ID, orDash(p.Cgroup)))
	}
	fmt.Fprintf(b, "- Socket-layer programs effective on the cgroup %s: %s (a client's own cgroup may add some: the verdicts above name them).\n",
		orDash(node.SockCgroup), orNone(sock))
	var tc []string
	for _, p := range node.TCPrograms {
		if p.Action != "" {
			tc = append(tc, p.FilterText())
			continue
		}
		tc = append(tc, fmt.Sprintf("%s %s %s %s (id %d)", p.Ifname, p.Via, p.Dir, orDash(p.Name), p.ID))
	}
	fmt.Fprintf(b, "- tc programs on the host veths, the uplinks and the Pods' eth0: %s.\n", orNone(tc))
	var xdp []string
	for _, p := range node.XDPPrograms {
		xdp = append(xdp, fmt.Sprintf("%s %s %s (id %d)", p.Ifname, p.Mode, orDash(p.Name), p.ID))
	}
	if len(xdp) > 0 {
		// They run before the taps: what they rewrote no capture shows.
		fmt.Fprintf(b, "- XDP programs on the host veths and the uplinks (they run before the device's capture): %s.\n", strings.Join(xdp, ", "))
	}
	var nat []string
	for _, r := range node.Netfilter.Rules {
		s := fmt.Sprintf("%s %s %s: %s", r.Source, r.Table, r.Hook, strings.Join(r.Chains, " -> "))
		if r.Backend.IsValid() {
			s += " dnat to " + r.Backend.String()
		}
		nat = append(nat, s)
	}
	fmt.Fprintf(b, "- NAT rules for the VIPs: %s.\n", orNone(nat))
	if without := node.ServicesWithoutNAT; len(without) > 0 && len(node.Netfilter.Rules) > 0 {
		// A Service of none while others have some: kube-proxy never
		// programmed it, or it has no endpoints.
		fmt.Fprintf(b, "- No DNAT rule for %s.\n", strings.Join(without, ", "))
	}
	if rejects := node.Netfilter.Rejects; len(rejects) > 0 {
		// kube-proxy's for a Service without endpoints: what its flows met.
		var rules []string
		for _, r := range rejects {
			rules = append(rules, fmt.Sprintf("%s for %s", filterRuleString(r), r.RejectedString(node.Netfilter.Rules)))
		}
		fmt.Fprintf(b, "- Filter rules that reject or drop the VIPs' packets: %s.\n", strings.Join(rules, "; "))
	}
	if chains := node.Netfilter.DeviceChains; len(chains) > 0 {
		// Stateless rewrites on a device, before netfilter's IP hooks.
		var dev []string
		for _, c := range chains {
			s := fmt.Sprintf("%s %s on %s (priority %d)", c, c.Hook, orDash(strings.Join(c.Devices, ",")), c.Priority)
			for _, r := range c.Rewrites {
				to := r.Note
				if r.Backend.IsValid() {
					to = r.Backend.String()
				}
				s += fmt.Sprintf("; sets %s to %s", r.Service, to)
			}
			dev = append(dev, s)
		}
		fmt.Fprintf(b, "- nftables chains on device hooks (netdev ingress and egress, inet ingress): %s.\n", strings.Join(dev, "; "))
	}
	if drops := node.Netfilter.BackendDrops; len(drops) > 0 {
		// A NetworkPolicy's rules on a Pod's address, after NAT.
		var rules []string
		for _, r := range drops {
			rules = append(rules, fmt.Sprintf("%s for backend %s", filterRuleString(r), r.Service))
		}
		fmt.Fprintf(b, "- Filter rules after NAT that drop or reject packets to the backends' addresses: %s.\n", strings.Join(rules, "; "))
	}
	writeBridgeNF(b, node)
	if node.IPVS.Present {
		fmt.Fprintf(b, "- IPVS is present with %d virtual service(s) for the VIPs.\n", len(node.IPVS.Services))
	}
}

// writeBridgeNF says whether the Pods' traffic meets netfilter: a bridge
// hands its frames there only with bridge-nf-call-iptables, while the
// node routes a Pod whose host veth has no master (Calico's, Cilium's),
// whose packets meet netfilter whatever that sysctl says.
func writeBridgeNF(b *strings.Builder, node *discover.NodeInfo) {
	var routed, bridged []string
	for _, p := range node.Pods {
		switch {
		case p.HostPeer == nil: // a macvlan's: on neither
		case p.HostPeer.Master == "":
			routed = append(routed, podLabel(p))
		default:
			bridged = append(bridged, podLabel(p))
		}
	}
	call, fwd := boolWords(node.Netfilter.BridgeNFCallIPTables), boolWords(node.Netfilter.IPForward)
	switch {
	case len(routed) == 0:
		fmt.Fprintf(b, "- Bridged traffic meets netfilter (bridge-nf-call-iptables): %s; IP forwarding: %s.\n", call, fwd)
	case len(bridged) == 0:
		fmt.Fprintf(b, "- The node routes its Pods' traffic (their host veths are on no bridge): it meets netfilter whatever bridge-nf-call-iptables says; IP forwarding, which routing needs: %s.\n", fwd)
	default:
		fmt.Fprintf(b, "- Bridged traffic meets netfilter (bridge-nf-call-iptables): %s, that of the Pods on a bridge (%s); the node routes that of the Pods whose host veth is on no bridge (%s), which meets netfilter whatever that says; IP forwarding, which routing needs: %s.\n",
			call, someNames(bridged), someNames(routed), fwd)
	}
}

// someNames lists the first few of names, counting the others.
func someNames(names []string) string {
	const few = 3
	if len(names) <= few {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:few], ", "), len(names)-few)
}

func prefixes(ps []netip.Prefix) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		parts[i] = p.String()
	}
	return orDash(strings.Join(parts, ", "))
}

func orNone(items []string) string {
	if len(items) == 0 {
		return "none"
	}
	return strings.Join(items, "; ")
}

func boolWords(b *bool) string {
	switch {
	case b == nil:
		return "absent"
	case *b:
		return "yes"
	}
	return "no"
}

func writeCaptured(b *strings.Builder, s flow.Summary, ended Ended) {
	b.WriteString("\n## What was captured\n\n")
	fmt.Fprintf(b, "- %s.\n", plural(s.Flows, "flow", "flows"))
	var obs []string
	for _, k := range sortedKeys(s.Observations) {
		obs = append(obs, fmt.Sprintf("%s %d", k, s.Observations[k]))
	}
	fmt.Fprintf(b, "- Observations per point: %s.\n", orNone(obs))
	var drops []string
	for _, k := range sortedKeys(s.Drops) {
		if s.Drops[k] > 0 {
			drops = append(drops, fmt.Sprintf("%s %d", k, s.Drops[k]))
		}
	}
	switch {
	case len(drops) > 0:
		fmt.Fprintf(b, "- Lost: %s. Flows may be missing or incomplete.\n", strings.Join(drops, ", "))
		for _, h := range report.DropHints(s.Drops) {
			fmt.Fprintf(b, "  - %s\n", h)
		}
		if note := report.CPUWaitNote(s.Drops, ended.CPUWait); note != "" {
			fmt.Fprintf(b, "  - %s\n", note)
		}
	case len(ended.Captures) == 0 && ended.Observers == "" && ended.File == nil:
		b.WriteString("- The capture lost nothing: every drop counter is zero (they count pathtrace's own losses; packets the node dropped are said with their flows).\n")
	default:
		b.WriteString("- Every drop counter is zero, but what follows ended early.\n")
	}
	if f := ended.File; f != nil {
		fmt.Fprintf(b, "- %s\n", f.sentence())
	}
	for _, point := range sortedKeys(ended.Captures) {
		fmt.Fprintf(b, "- The capture at %s %s: later frames there are missing.\n", point, ended.Captures[point])
	}
	for _, point := range sortedKeys(ended.Gaps) {
		fmt.Fprintf(b, "- The interface of %s %s: nothing crossed it meanwhile, and its capture went on.\n", point, ended.Gaps[point])
	}
	if ended.Observers != "" {
		fmt.Fprintf(b, "- The observers' events %s: later flows lack their socket, tc and netfilter evidence, and their verdicts are unknown.\n", ended.Observers)
	}
	for _, p := range ended.PodsStarted {
		fmt.Fprintf(b, "- A Pod started during the capture and was followed from then on: %s.\n", p)
	}
	for _, o := range ended.ObserversAdded {
		fmt.Fprintf(b, "- Attached during the capture: %s.\n", o)
	}
	if ended.NATRules != "" {
		fmt.Fprintf(b, "- The NAT rules changed during the capture: %s.\n", ended.NATRules)
	}
	for _, c := range ended.TCPrograms {
		fmt.Fprintf(b, "- The tc programs changed during the capture: %s.\n", c)
	}
	if s.Unmatched > 0 {
		fmt.Fprintf(b, "- %d observations matched no flow (e.g. traffic to a backend that did not go through a VIP).\n", s.Unmatched)
	}
	if n := s.RepliesWithoutRequest; n > 0 {
		fmt.Fprintf(b, "- %s %s seen by %s replies alone, none of %s requests (begun before the capture?): no verdict, in no flow (replies_without_request).\n",
			plural(n, "connection", "connections"), pick(n == 1, "was", "were"), pick(n == 1, "its", "their"), pick(n == 1, "its", "their"))
	}
	if n := s.RequestedAfterReplies; n > 0 {
		fmt.Fprintf(b, "- %s %s seen by %s replies alone until a request came: %s (requested_after_replies).\n",
			plural(n, "connection", "connections"), pick(n == 1, "was", "were"), pick(n == 1, "its", "their"), pick(n == 1, "a flow since", "flows since"))
	}
}

// sentence says in plain words that the file ended and what to change.
func (f *FileEnded) sentence() string {
	budget := fmt.Sprintf("%s bytes of --max-bytes %s", grouped(f.Share), grouped(f.Budget))
	more := "Raise --max-bytes to keep more."
	if f.LoweredToFitDisk {
		budget = fmt.Sprintf("%s bytes of --max-bytes, lowered to %s: half of what the disk had free", grouped(f.Share), grouped(f.Budget))
		more = "Give --out a filesystem with more free space to keep more."
	}
	return fmt.Sprintf("The capture file filled its share (%s) after %s of the %s run: it holds %s of the %s frames captured; the verdicts cover the whole run. %s",
		budget, seconds(f.After), seconds(f.Run), grouped(f.Written), grouped(f.Captured), more)
}

// seconds is d as "3.1 s".
func seconds(d time.Duration) string { return fmt.Sprintf("%.1f s", max(d, 0).Seconds()) }

// grouped writes n with thousands separators, as a ticket reads it: 5,403.
func grouped[N int64 | uint64](n N) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// filterRuleString names a filter rule whole: where it is, its chains, its
// verdict and kube-proxy's comment.
func filterRuleString(r discover.NATRule) string {
	s := fmt.Sprintf("%s %s %s: %s -> %s", r.Source, r.Table, r.Hook, strings.Join(r.Chains, " -> "), r.Verdict)
	if r.Comment != "" {
		s += fmt.Sprintf(" (%q)", r.Comment)
	}
	return s
}
