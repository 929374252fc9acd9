package incident

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// maxConntrackDump bounds the table size pathtrace dumps: a dump is decoded
// whole in memory (ctnetlink cannot filter by address on every kernel).
const maxConntrackDump = 262144

// conntrack writes the node netns's conntrack entries whose original
// destination is a VIP, in `conntrack -L` style. Counters are not reset.
func (s *snapshot) conntrack(ctx context.Context, w *topicWriter) error {
	fmt.Fprintf(w, "# conntrack entries with original destination in %s (netns %s)\n", joinAddrs(s.vips), s.hostPath)
	switch {
	case len(s.vips) == 0:
		fmt.Fprintln(w, "no VIPs given: nothing selected")
		return nil
	}
	switch m := kmod.FirstToLoad(kmod.Conntrack...); m {
	case "":
	case "nf_conntrack":
		fmt.Fprintln(w, "nf_conntrack is not loaded: no connection tracking, no entries")
		return nil
	default:
		fmt.Fprintf(w, "%s: entries not read (reading would load the module)\n", kmod.NotLoaded(m))
		w.notef("not read: %s", kmod.NotLoaded(m))
		return nil
	}
	if n, err := s.conntrackCount(); err == nil && n > maxConntrackDump {
		fmt.Fprintf(w, "the table holds %d entries, more than pathtrace dumps (%d): not read; `conntrack -L -d VIP` reads it with a kernel filter\n", n, maxConntrackDump)
		w.notef("not read: %d entries (at most %d are dumped)", n, maxConntrackDump)
		return nil
	}

	ns, err := netns.GetFromPath(s.hostPath)
	if err != nil {
		return fmt.Errorf("open node netns: %w", err)
	}
	defer ns.Close()
	conn, err := conntrack.Dial(&netlink.Config{NetNS: int(ns)})
	if err != nil {
		return fmt.Errorf("conntrack netlink: %w", err)
	}
	defer conn.Close()
	// Closing the socket is what unblocks a dump when the collector times out.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	flows, err := conn.Dump(nil)
	if err != nil {
		return fmt.Errorf("dump conntrack: %w", err)
	}
	matched := 0
	for _, f := range flows {
		if slices.Contains(s.vips, f.TupleOrig.IP.DestinationAddress.Unmap()) {
			matched++
			writeConntrackFlow(w, f)
		}
	}
	fmt.Fprintf(w, "# %d of %d entries matched\n", matched, len(flows))
	return nil
}

func (s *snapshot) conntrackCount() (int, error) {
	var v string
	err := nsutil.Do(s.hostPath, func() error {
		v = readSysctl("net.netfilter.nf_conntrack_count")
		return nil
	})
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(v)
}

// writeConntrackFlow writes one entry like `conntrack -L`.
func writeConntrackFlow(w io.Writer, f conntrack.Flow) {
	var b strings.Builder
	o, r := f.TupleOrig, f.TupleReply
	fmt.Fprintf(&b, "%s %d %d", protoName(o.Proto.Protocol), o.Proto.Protocol, f.Timeout)
	if f.ProtoInfo.TCP != nil {
		fmt.Fprintf(&b, " %s", tcpState(f.ProtoInfo.TCP.State))
	}
	writeTuple(&b, o)
	if f.Status&conntrack.StatusSeenReply == 0 {
		b.WriteString(" [UNREPLIED]")
	}
	writeTuple(&b, r)
	if f.Status&conntrack.StatusAssured != 0 {
		b.WriteString(" [ASSURED]")
	}
	fmt.Fprintf(&b, " mark=%d zone=%d status=%s", f.Mark, f.Zone, f.Status)
	if f.CountersOrig.Packets != 0 || f.CountersReply.Packets != 0 {
		fmt.Fprintf(&b, " packets=%d/%d bytes=%d/%d", f.CountersOrig.Packets, f.CountersReply.Packets,
			f.CountersOrig.Bytes, f.CountersReply.Bytes)
	}
	fmt.Fprintln(w, b.String())
}

func writeTuple(b *strings.Builder, t conntrack.Tuple) {
	fmt.Fprintf(b, " src=%s dst=%s", t.IP.SourceAddress, t.IP.DestinationAddress)
	if t.Proto.Protocol == 6 || t.Proto.Protocol == 17 || t.Proto.Protocol == 132 {
		fmt.Fprintf(b, " sport=%d dport=%d", t.Proto.SourcePort, t.Proto.DestinationPort)
	}
}

func protoName(p uint8) string {
	switch p {
	case 1:
		return "icmp"
	case 6:
		return "tcp"
	case 17:
		return "udp"
	case 58:
		return "icmpv6"
	case 132:
		return "sctp"
	}
	return "unknown"
}

// tcpState names conntrack's TCP states (enum tcp_conntrack).
func tcpState(s uint8) string {
	names := []string{"NONE", "SYN_SENT", "SYN_RECV", "ESTABLISHED", "FIN_WAIT", "CLOSE_WAIT", "LAST_ACK", "TIME_WAIT", "CLOSE", "SYN_SENT2"}
	if int(s) < len(names) {
		return names[s]
	}
	return fmt.Sprintf("STATE%d", s)
}

func joinAddrs(addrs []netip.Addr) string {
	if len(addrs) == 0 {
		return "(none)"
	}
	parts := make([]string, len(addrs))
	for i, a := range addrs {
		parts[i] = a.String()
	}
	return strings.Join(parts, ", ")
}
