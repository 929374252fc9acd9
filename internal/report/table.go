package report

import (
	"fmt"
	"io"
	"maps"
	"path"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// maxByWidth keeps the flow table readable, yet holds a NAT rule's table
// and kube-proxy's Service chain ("nftables ip kube-proxy …
// service-SUSTUHLJ-default/web/tcp/http"); the summary shows "by" in full.
const maxByWidth = 64

func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// writeFlowTable writes one row per flow, then why the flows that reached no
// backend (nowhere, unknown) did so.
func writeFlowTable(w io.Writer, flows []flow.Flow) error {
	if len(flows) == 0 {
		_, err := fmt.Fprint(w, "No flow to the watched Service VIPs was seen. pathtrace follows the clients of this node\n"+
			"only (its Pods, its own processes): have one reach the VIP while it runs. Check the VIP,\n"+
			"port and protocol given to --svc (kubectl get svc -o wide), that --host-netns is the node's\n"+
			"netns (a kind or k3d node's container's), and under Captured: below whether the Pods'\n"+
			"points saw packets of the Service at all.\n\n")
		return err
	}
	return writeFlowRows(w, flows, true, nil, 0)
}

// flowHeader names the flow table's columns.
var flowHeader = []string{"ID", "PROTO", "CLIENT", "SERVICE", "BACKEND", "REWRITTEN AT", "BY", "VLAN", "UPLINK DST MAC", "REPLY"}

// flowCells is a flow's row: a cell per column of flowHeader.
func flowCells(f flow.Flow) []string {
	return []string{fmt.Sprint(f.ID), orDash(f.Proto), clientOrDash(f), f.Service.String(),
		addrOrDash(f), string(f.RewrittenAt), orDash(shortBy(f.By, maxByWidth)), vlan(f.VLAN, f.VLANProto), uplinkMAC(f), reply(f)}
}

// minFixedWidths are the columns' widths of rows written a few at a time
// (a run until stopped): wide enough for an IPv4 address and port, a MAC
// and "gw", a short "by". A wider cell widens its column from then on
// (fixedWidths.fit), under a new header.
var minFixedWidths = []int{6, 5, 21, 21, 21, 12, 30, 9, 20, 5}

// fixedWidths are the widths the rows written so far were aligned to.
type fixedWidths []int

// fit widens the columns to hold every cell of rows, and tells whether
// one grew: the rows no longer line up under the last header.
func (fw fixedWidths) fit(rows [][]string) bool {
	grew := false
	for _, r := range rows {
		for i, c := range r {
			if n := utf8.RuneCountInString(c); n > fw[i] {
				fw[i], grew = n, true
			}
		}
	}
	return grew
}

// writeFlowRows writes flows as table rows, under the header when asked
// (and again every `every` rows when every > 0), and their notes. fixed:
// in columns of the widths it gives (rows written a few at a time as flows
// end line up under one header), else as wide as the rows need.
func writeFlowRows(w io.Writer, flows []flow.Flow, header bool, fixed fixedWidths, every int) error {
	rows := make([][]string, 0, len(flows)+1)
	for i, f := range flows {
		if header && (i == 0 || every > 0 && i%every == 0) {
			rows = append(rows, flowHeader)
		}
		rows = append(rows, flowCells(f))
	}
	if fixed != nil {
		var b strings.Builder
		for _, r := range rows {
			for i, c := range r {
				if i == len(r)-1 {
					b.WriteString(c)
					break
				}
				b.WriteString(c)
				b.WriteString(strings.Repeat(" ", fixed[i]-utf8.RuneCountInString(c)+1))
			}
			b.WriteByte('\n')
		}
		if _, err := io.WriteString(w, b.String()); err != nil {
			return fmt.Errorf("write flow table: %w", err)
		}
	} else {
		tw := newTable(w)
		for _, r := range rows {
			fmt.Fprintln(tw, strings.Join(r, "\t"))
		}
		if err := tw.Flush(); err != nil {
			return fmt.Errorf("write flow table: %w", err)
		}
	}
	writeNodeClients(w, flows)
	writeBeganBeforeRun(w, flows)
	writeReasons(w, flows)
	writeProxyRedirects(w, flows)
	writeICMPErrors(w, flows)
	writeStrayReplies(w, flows)
	writeUntranslatedReplies(w, flows)
	writeKernelDrops(w, flows)
	_, err := fmt.Fprintln(w)
	return err
}

// writeSummaryTable writes the flows per verdict with their rewriters, then
// every drop counter and why the run stopped.
func writeSummaryTable(w io.Writer, s flow.Summary, byPlace map[flow.Place][]*rewriter, backends backendCounts, run Run) error {
	tw := newTable(w)
	fmt.Fprintln(tw, "REWRITTEN AT\tFLOWS\tBY")
	for _, p := range flow.Places() {
		by := byPlace[p]
		if len(by) == 0 {
			// The FLOWS cell ends with a tab as in the rows with a BY:
			// tabwriter aligns a column over consecutive lines having it.
			fmt.Fprintf(tw, "%s\t%d\t\n", p, s.RewrittenAt[p])
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%s  %s\n", p, s.RewrittenAt[p], by[0].by, by[0].flows())
		for _, r := range by[1:] {
			fmt.Fprintf(tw, "\t\t%s  %s\n", r.by, r.flows())
		}
	}
	fmt.Fprintf(tw, "total\t%d\t\n", s.Flows)
	// Beyond --max-flows most flows of a long busy run are in no row and
	// no count above: say so where the counts are read, not only among
	// the drops.
	if n := s.Drops[flow.DropFlowsOverMax]; n > 0 {
		fmt.Fprintf(tw, "not followed\t%d\tbeyond --max-flows: in no row or count above (no verdict)\n", n)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write summary table: %w", err)
	}
	if s.Retired > 0 {
		fmt.Fprintf(w, "Of the %d flows, %d %s reported above as %s ended, %d %s still open at the end.\n", s.Flows, s.Retired, wasWere(s.Retired), itThey(s.Retired), s.Flows-s.Retired, wasWere(s.Flows-s.Retired))
	}
	if s.UnknownBeforeReady > 0 {
		fmt.Fprintf(w, "Of the unknown, %d began while pathtrace was still attaching: points not yet there missed their first packets.\n", s.UnknownBeforeReady)
	}
	if s.UnknownAfterStop > 0 {
		fmt.Fprintf(w, "Of the unknown, %d began after the capture was asked to stop: its points were closing.\n", s.UnknownAfterStop)
	}
	if err := backends.write(w); err != nil {
		return err
	}

	fmt.Fprintln(w)
	tw = newTable(w)
	fmt.Fprintln(tw, "DROPS\tCOUNT")
	rows := dropRows(s.Drops)
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\n", r.name, r.count)
	}
	if len(rows) == 0 {
		fmt.Fprintln(tw, "(no counters)")
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write drops table: %w", err)
	}
	// kernel_drops reads as the node's drops on that interface: it is what
	// pathtrace's capture ring lost, and a qdisc's drops are no counter here.
	fmt.Fprintln(w, "(pathtrace's own losses: its capture rings and event readers. Packets the node dropped are not counted here;\n a rewritten flow whose request never reached the uplink says so under the flows.)")
	for _, h := range DropHints(s.Drops) {
		fmt.Fprintln(w, h)
	}
	if note := CPUWaitNote(s.Drops, run.CPUWait); note != "" {
		fmt.Fprintln(w, note)
	}
	fmt.Fprintf(w, "\nObservations not matched to any flow: %d\n", s.Unmatched)
	if s.WithoutPorts > 0 {
		fmt.Fprintf(w, "Observations without TCP/UDP ports (ICMP, IP fragments after the first; no flow's): %d\n", s.WithoutPorts)
	}
	if s.RepliesWithoutRequest > 0 || s.RequestedAfterReplies > 0 {
		fmt.Fprintf(w, "Replies without request (connections seen by their replies alone, none of their requests: began before the run?; no flows): %d", s.RepliesWithoutRequest)
		if n := s.RequestedAfterReplies; n > 0 {
			fmt.Fprintf(w, "; %d more until a request came (flows since)", n)
		}
		fmt.Fprintln(w)
	}
	if s.OutOfScope > 0 {
		fmt.Fprintf(w, "Observations of clients outside the traced Pods (left out): %d\n", s.OutOfScope)
	}
	if run.Summarized > 0 {
		fmt.Fprintf(w, "Observer events summarized (busy flows past their first packets; the taps saw every packet): %d\n", run.Summarized)
	}
	if len(run.Packets) > 0 {
		fmt.Fprintf(w, "Captured: %s\n", countList(run.Packets))
	}
	for _, point := range slices.Sorted(maps.Keys(run.CaptureEnded)) {
		fmt.Fprintf(w, "Capture at %s %s: later frames there are missing\n", point, run.CaptureEnded[point])
	}
	for _, point := range slices.Sorted(maps.Keys(run.CaptureGaps)) {
		fmt.Fprintf(w, "Interface of %s %s: nothing crossed it meanwhile (its capture went on)\n", point, run.CaptureGaps[point])
	}
	if len(run.PodsStarted) > 0 {
		fmt.Fprintf(w, "Pods that started during the run, followed from then on: %s\n", strings.Join(run.PodsStarted, "; "))
	}
	if len(run.ObserversAdded) > 0 {
		fmt.Fprintf(w, "Observers attached during the run: %s\n", strings.Join(run.ObserversAdded, "; "))
	}
	if run.NATRulesReread != "" {
		fmt.Fprintf(w, "NAT rules %s\n", run.NATRulesReread)
	}
	if len(run.TCProgramsChanged) > 0 {
		fmt.Fprintf(w, "tc programs that changed during the run (each flow's \"by\" names those of its time): %s\n", strings.Join(run.TCProgramsChanged, "; "))
	}
	if run.ObserversEnded != "" {
		fmt.Fprintf(w, "Observer events %s: later flows lack their socket, tc and netfilter evidence (verdicts unknown)\n", run.ObserversEnded)
	}
	if p := run.Pcap; p != nil {
		fmt.Fprintf(w, "Pcapng: %s, %d packets, %d bytes (%s)", p.Path, p.Packets, p.Bytes, countList(p.PerInterface))
		if p.StopReason != "" {
			fmt.Fprintf(w, "; ended by %s", p.StopReason)
			if !p.EndedAt.IsZero() {
				fmt.Fprintf(w, " at %s", p.EndedAt.Format("15:04:05.000"))
			}
			if p.FramesNotWritten > 0 {
				fmt.Fprintf(w, ": %d of the %d frames captured are not in it", p.FramesNotWritten, p.Packets+p.FramesNotWritten)
			}
		}
		if p.Error != "" {
			fmt.Fprintf(w, "; WRITE ERROR: %s", p.Error)
		}
		fmt.Fprintln(w)
	}
	if run.Stop != "" {
		fmt.Fprintf(w, "Stopped: %s\n", run.Stop)
	}
	return nil
}

// countList formats counters by name, sorted: "host:veth-a 12, pod:eth0 10".
func countList(m map[string]uint64) string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	slices.Sort(names)
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s %d", n, m[n])
	}
	return strings.Join(parts, ", ")
}

// shortBy fits a "by" into n runes, giving up first what tells flows apart
// least: a program's cgroup (its name and id stay whole, for bpftool), then
// the chains of a NAT rule but its source and table and the one that names
// the Service (kube-proxy's service-… or KUBE-SVC-…, else the rule's own),
// and the rule's "dnat to …", which BACKEND shows.
func shortBy(s string, n int) string {
	fits := func(s string) bool { return utf8.RuneCountInString(s) <= n }
	if fits(s) {
		return s
	}
	if head, dir, ok := strings.Cut(s, " on /"); ok {
		if s = head + " on …/" + path.Base("/"+dir); fits(s) {
			return s
		}
		if s = head; fits(s) {
			return s
		}
	}
	if table, chains, _, ok := flow.SplitNATBy(s); ok {
		if svc := flow.ServiceChain(chains); svc > 0 {
			return shorten(table+" … "+chains[svc], n)
		}
		return shorten(table+" "+chains[0], n)
	}
	return shorten(s, n)
}

// shorten cuts s to n runes with an ellipsis.
func shorten(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return strings.TrimSpace(string(r[:n-1])) + "…"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// reply says whether a reply came back; "unseen" for a flow that never left
// its client's netns (a sidecar's redirect, a socket LB's pick of the
// client's own Pod), where no capture point is.
func reply(f flow.Flow) string {
	switch {
	case f.Refused:
		return "rst" // refused: no SYN-ACK, a RST came back
	case f.Reply:
		return "yes"
	case f.ICMPError != nil:
		return "icmp" // an ICMP error came back instead: writeICMPErrors says which
	case f.By == flow.ByClientNetfilter && f.VLAN == nil, socketToOwnPod(f):
		return "unseen"
	}
	return "no"
}

// socketToOwnPod tells whether the socket layer sent f, a Pod's flow, to
// an address of the Pod itself (loopback, or the client's own address):
// its packets went through the Pod's loopback and never reached a tap.
func socketToOwnPod(f flow.Flow) bool {
	b := f.Backend.Addr()
	return f.RewrittenAt == flow.PlaceSocket && !f.NodeClient && f.VLAN == nil && (b.IsLoopback() || b.IsValid() && b == f.Client.Addr())
}

// clientOrDash is the flow's client, "-" when no source address was seen
// (a connect that failed before the kernel chose one, e.g. no route).
func clientOrDash(f flow.Flow) string {
	if !f.Client.IsValid() {
		return "-"
	}
	return f.Client.String()
}

func addrOrDash(f flow.Flow) string {
	if !f.Backend.IsValid() {
		return "-"
	}
	return f.Backend.String()
}

type dropRow struct {
	name  string
	count uint64
}

// dropHints are the hints of the loss counters a flag helps with (and what
// the other traffic's waiting room dropped means), in the
// order DropHints gives them: each when one of its counters is not zero.
var dropHints = []struct {
	counters []string
	hint     string
}{
	{[]string{"flows_over_max"}, "More flows than --max-flows: their packets were captured, the flows not followed; " +
		"raise --max-flows (about 2.5 KiB each) or trace fewer with --pod-ip or a --svc port."},
	{[]string{"ringbuf_losses"}, "Observer events were lost (their ring buffer was full: new flows came faster than it is read); " +
		"the verdicts of some flows may be unknown: trace fewer with --pod-ip or a --svc port."},
	{[]string{"conntrack_drops", "conntrack_errors"}, "Conntrack events were lost (pathtrace read them slower than the node made them): " +
		"netfilter verdicts of some flows may be unknown; a lower --nice (e.g. -10) keeps up better, fewer --svc help too."},
	{[]string{"flows_joined"}, "Sockets that reused a client port were counted in the earlier socket's flow: their packets came " +
		"before their socket events, which pathtrace read late (its CPU was short); a lower --nice (e.g. -10) reads them in time."},
	{[]string{flow.DropRepliesForgotten}, "Connections seen by their replies alone were more than pathtrace remembers at once (two sets of " +
		"--max-flows, at least 4096 each): a later reply of one forgotten counted it again in replies_without_request."},
	{[]string{"unmatched_overflow"}, "Observations waiting for their flow were evicted (more out of order at once than pathtrace holds): " +
		"some flows may lack points; trace fewer with --pod-ip or a --svc port."},
	{[]string{"unrelated_overflow"}, "Other traffic to or from the backends' addresses, on ports no traced Service uses (the taps watch " +
		"those addresses on any port), was more than pathtrace holds while it waits: the excess was dropped from a waiting room of its own, " +
		"kept apart so that it cannot evict the traced flows' observations (only a socket LB's flow whose socket events came after its packets waits there)."},
}

// lossyRings names the capture points whose ring lost frames, sorted.
func lossyRings(drops map[string]uint64) []string {
	var rings []string
	for _, name := range slices.Sorted(maps.Keys(drops)) {
		if point, ok := strings.CutSuffix(name, " kernel_drops"); ok && drops[name] > 0 {
			rings = append(rings, point)
		}
	}
	return rings
}

// CPUWaitNote says, when a capture ring lost frames, how long pathtrace's
// threads waited for a CPU meanwhile: whether the CPUs held the capture
// back (a thread kept off them longer than its ring holds loses frames).
// "" without such losses or without the figures.
func CPUWaitNote(drops map[string]uint64, c *CPUWait) string {
	if c == nil || len(lossyRings(drops)) == 0 {
		return ""
	}
	return fmt.Sprintf("Meanwhile pathtrace's threads waited for a CPU while runnable (the kernel's run_delay): one of them %s within one second at most, %s in all.",
		msString(c.WorstSecondMs), msString(c.TotalMs))
}

// msString is a millisecond figure as a duration ("420ms", "1.3s").
func msString(ms float64) string {
	d := time.Duration(ms * 1e6)
	if d >= time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Millisecond).String()
}

// DropHints says how to avoid the losses a rerun with other flags can
// avoid: a full capture ring, flows beyond --max-flows, a full event ring,
// conntrack events or socket events read late, a full waiting room; and
// what the other traffic's own waiting room dropped means.
func DropHints(drops map[string]uint64) []string {
	rings := lossyRings(drops)
	var hints []string
	if len(rings) > 0 {
		hints = append(hints, fmt.Sprintf("Frames were lost at %s: the kernel found the capture ring full (pathtrace fell behind the traffic); "+
			"a larger --buffer-size (e.g. 16M) loses fewer; a lower --nice (e.g. -10) helps against the processes that share pathtrace's CPU cgroup (or session) only.", strings.Join(rings, ", ")))
	}
	for _, h := range dropHints {
		var n uint64
		for _, c := range h.counters {
			n += drops[c]
		}
		if n > 0 {
			hints = append(hints, h.hint)
		}
	}
	return hints
}

// maxZeroRows is how many zero rows of one per-point counter the drops table
// lists by name; beyond (a node of many Pods has two points per Pod), they
// take one row, so the counters that are not zero stand out.
const maxZeroRows = 3

// dropRows sorts the drop counters by name. Per-point counters are named
// "POINT COUNTER"; the zero ones of a counter, when many, fold into one row
// "COUNTER at N points".
func dropRows(drops map[string]uint64) []dropRow {
	names := slices.Sorted(maps.Keys(drops))
	zeros := map[string]int{}
	for _, name := range names {
		if _, counter, perPoint := strings.Cut(name, " "); perPoint && drops[name] == 0 {
			zeros[counter]++
		}
	}
	var rows []dropRow
	folded := map[string]bool{}
	for _, name := range names {
		_, counter, perPoint := strings.Cut(name, " ")
		switch {
		case !perPoint || drops[name] != 0 || zeros[counter] <= maxZeroRows:
			rows = append(rows, dropRow{name, drops[name]})
		case !folded[counter]:
			folded[counter] = true
			rows = append(rows, dropRow{fmt.Sprintf("%s at %d points", counter, zeros[counter]), 0})
		}
	}
	return rows
}

func vlan(v *uint16, proto string) string {
	switch {
	case v == nil:
		return "-"
	case *v == 0 && proto == "":
		return "untagged"
	case proto != "":
		return fmt.Sprintf("%d (%s)", *v, proto)
	}
	return fmt.Sprint(*v)
}

func uplinkMAC(f flow.Flow) string {
	switch {
	case f.UplinkDstMAC == "":
		return "-"
	case f.UplinkDstIsGateway:
		return f.UplinkDstMAC + " gw"
	case f.UplinkDstNeighbor != "":
		return f.UplinkDstMAC + " (" + f.UplinkDstNeighbor + ")"
	}
	return f.UplinkDstMAC
}

// writeReasons explains the nowhere and unknown verdicts, one line per
// distinct reason with the flows it applies to: these are the rows an SRE
// has to act on. So are the rewritten flows that got no answer and never
// left the uplink (REPLY no): their reason says whether the
// node lost them on the way out, which the row alone cannot tell from a
// backend that does not answer.
func writeReasons(w io.Writer, flows []flow.Flow) {
	for _, place := range []flow.Place{flow.PlaceNowhere, flow.PlaceUnknown, ""} {
		var g flowGroups
		for _, f := range flows {
			if place == "" && !unansweredOnNode(f) || place != "" && f.RewrittenAt != place {
				continue
			}
			g.add(f.ID, f.Reason)
		}
		if place == "" {
			g.write(w, "Rewritten, not all sent out or no reply:")
		} else {
			g.write(w, fmt.Sprintf("Why %s:", place))
		}
	}
}

// flowGroups gathers lines about flows, the flows of one same text
// together (in the order each text came first): an incident's many flows
// that met one fate read in one line, "flows 1-40, 43: ...".
type flowGroups struct {
	order []string
	ids   map[string][]int
}

func (g *flowGroups) add(id int, text string) {
	if g.ids == nil {
		g.ids = map[string][]int{}
	}
	if _, ok := g.ids[text]; !ok {
		g.order = append(g.order, text)
	}
	g.ids[text] = append(g.ids[text], id)
}

// write writes the heading and the groups, after an empty line; nothing
// when there is none.
func (g *flowGroups) write(w io.Writer, heading string) {
	if len(g.order) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%s\n", heading)
	for _, text := range g.order {
		label := "flows"
		if len(g.ids[text]) == 1 {
			label = "flow"
		}
		fmt.Fprintf(w, "  %s %s: %s\n", label, idRanges(g.ids[text]), text)
	}
}

// idRanges names flow ids in order, three or more in a row as a range:
// "1-6, 9, 11, 12".
func idRanges(ids []int) string {
	slices.Sort(ids)
	ids = slices.Compact(ids) // a flow's two drops of one text
	var b strings.Builder
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		switch {
		case j-i >= 2:
			fmt.Fprintf(&b, "%d-%d", ids[i], ids[j])
		case j > i:
			fmt.Fprintf(&b, "%d, %d", ids[i], ids[j])
		default:
			fmt.Fprint(&b, ids[i])
		}
		i = j + 1
	}
	return b.String()
}

// writeNodeClients names the flows whose client is a process of the node's
// own netns, not a Pod: its address is the node's (or the one its route
// gives), which the row alone does not tell from a Pod's, and they are
// traced whichever Pod is selected.
func writeNodeClients(w io.Writer, flows []flow.Flow) {
	var ids []int
	var comms []string
	for _, f := range flows {
		if !f.NodeClient {
			continue
		}
		ids = append(ids, f.ID)
		if f.Comm != "" && !slices.Contains(comms, f.Comm) {
			comms = append(comms, f.Comm)
		}
	}
	if len(ids) == 0 {
		return
	}
	label := "flows"
	if len(ids) == 1 {
		label = "flow"
	}
	by := ""
	if len(comms) > 0 {
		by = " (" + strings.Join(comms, ", ") + ")"
	}
	fmt.Fprintf(w, "\nClients in the node's own netns, not Pods (hostNetwork Pods, the kubelet, node processes): %s %s%s\n", label, idRanges(ids), by)
}

// writeBeganBeforeRun lists the TCP flows seen from the middle of their
// connection (began_before_run): their verdict rests on the packets seen,
// not on their connect() or handshake.
func writeBeganBeforeRun(w io.Writer, flows []flow.Flow) {
	var ids []int
	for _, f := range flows {
		if f.BeganBeforeRun {
			ids = append(ids, f.ID)
		}
	}
	if len(ids) == 0 {
		return
	}
	label := "flows"
	if len(ids) == 1 {
		label = "flow"
	}
	fmt.Fprintf(w, "\nConnections that began before the run (no SYN, SYN-ACK or connect() seen; verdict from their packets only): %s %s\n", label, idRanges(ids))
}

// unansweredOnNode tells whether f was rewritten (socket, tc, netfilter,
// ipvs) and got nothing back (REPLY no) and its requests were never seen
// leaving the uplink (an outside client's came in on it), or lost request packets on the node (LostOnNode), or its replies on the
// node (RepliesLostOnNode).
func unansweredOnNode(f flow.Flow) bool {
	switch f.RewrittenAt {
	case flow.PlaceSocket, flow.PlaceTC, flow.PlaceNetfilter, flow.PlaceIPVS:
	default:
		return false
	}
	return reply(f) == "no" && f.StrayReplies == nil && !f.RequestLeftUplink() || f.LostOnNode > 0 || f.RepliesLostOnNode > 0
}

// writeProxyRedirects lists the connections their Pod's own NAT redirected
// to a local proxy (a sidecar's), whose rows end at the proxy's port: the
// flows that can be the proxy's upstream connection, whose rows say where
// the VIP was rewritten, or why there is none.
func writeProxyRedirects(w io.Writer, flows []flow.Flow) {
	var g flowGroups
	for _, f := range flows {
		if f.By != flow.ByClientNetfilter || !f.Backend.Addr().IsLoopback() {
			continue
		}
		switch {
		case len(f.ProxyUpstreams) == 1:
			g.add(f.ID, fmt.Sprintf("to %s; the proxy's upstream can be flow %d", f.Backend, f.ProxyUpstreams[0]))
		case len(f.ProxyUpstreams) > 1:
			g.add(f.ID, fmt.Sprintf("to %s; the proxy's upstream can be one of flows %s", f.Backend, idRanges(f.ProxyUpstreams)))
		case slices.ContainsFunc(f.KernelDrops, func(d flow.KernelDrop) bool { return d.Direction == "request" && d.Reason == "NO_SOCKET" }):
			g.add(f.ID, fmt.Sprintf("to %s, where nothing listened: the Pod's kernel refused it (the proxy not running, or not ready)", f.Backend))
		default:
			g.add(f.ID, fmt.Sprintf("to %s; no connection of its Pod to %s by another process followed (a proxy that picks the endpoint itself connects to a backend's address, which no flow follows; one may reuse a connection it opened before, or answer itself, as Istio's DNS proxy does for the cluster's names)", f.Backend, f.Service))
		}
	}
	g.write(w, "Redirected to a proxy in the client's Pod (its own NAT; the row of the proxy's upstream says where the VIP was rewritten):")
}

// writeICMPErrors lists the ICMP errors that came back instead of replies
// (REPLY "icmp"), the flows of each message and sender together.
func writeICMPErrors(w io.Writer, flows []flow.Flow) {
	var g flowGroups
	for _, f := range flows {
		if f.Reply || f.ICMPError == nil {
			continue
		}
		what := f.ICMPError.Message + " from " + f.ICMPError.From.String()
		if f.ICMPError.FromRule {
			what += " (the node's filter rule's answer, through loopback: known from the rule, not captured)"
		}
		if q := f.ICMPError.QuotedDst; q.IsValid() {
			// Its reason says why it matters.
			what += fmt.Sprintf(", reaching the client quoting %s, not the Service %s: no reverse NAT of the quoted header", q, f.Service)
		}
		g.add(f.ID, what)
	}
	g.write(w, "ICMP errors instead of replies:")
}

// writeStrayReplies lists the flows without a reply to whose client the
// server's address answered from another port (flow.StrayReplies).
func writeStrayReplies(w io.Writer, flows []flow.Flow) {
	var g flowGroups
	for _, f := range flows {
		if f.Reply || f.StrayReplies == nil {
			continue
		}
		s := f.StrayReplies
		g.add(f.ID, fmt.Sprintf("%s from %s, not from %s", packets(s.Packets), s.From, expectedFrom(f)))
	}
	g.write(w, "Answers from another port (no flow took them; the client's socket drops them):")
}

// writeKernelDrops lists the flows' packets the kernel dropped
// (flow.KernelDrops), with its reason and the function that dropped them.
func writeKernelDrops(w io.Writer, flows []flow.Flow) {
	var g flowGroups
	for _, f := range flows {
		for _, d := range f.KernelDrops {
			unit := "packets"
			if d.Count == 1 {
				unit = "packet"
			}
			g.add(f.ID, fmt.Sprintf("%d %s %s, %s", d.Count, d.Direction, unit, d))
		}
	}
	g.write(w, "Dropped by the kernel (its reason, in the function that dropped them):")
}

// writeUntranslatedReplies lists the flows whose replies entered the
// client's Pod from a backend's address although the client sent to the
// VIP (flow.UntranslatedReplies): nothing translated them back.
func writeUntranslatedReplies(w io.Writer, flows []flow.Flow) {
	var g flowGroups
	for _, f := range flows {
		if u := f.UntranslatedReplies; u != nil {
			g.add(f.ID, fmt.Sprintf("%s from %s, not from %s", packets(u.Packets), u.From, f.Service))
		}
	}
	g.write(w, "Replies not translated back to the VIP (they entered the client's Pod from a backend's address; the client does not take them):")
}

// packets is "1 packet", "n packets".
func packets(n uint64) string {
	if n == 1 {
		return "1 packet"
	}
	return fmt.Sprintf("%d packets", n)
}

// expectedFrom is where a flow's replies were due from: its Service, and
// its backend when one was seen.
func expectedFrom(f flow.Flow) string {
	if f.Backend.IsValid() {
		return f.Service.String() + " or " + f.Backend.String()
	}
	return f.Service.String()
}

// wasWere is the verb for n things: "1 was", "2 were".
func wasWere(n int) string {
	if n == 1 {
		return "was"
	}
	return "were"
}

// itThey is the pronoun for n things.
func itThey(n int) string {
	if n == 1 {
		return "it"
	}
	return "they"
}
