package incident

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"strings"
	"syscall"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/kmod"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// conntrackReadBuffer is the socket read the dump is decoded from, one at a
// time: the kernel fills a dump's reads up to their size (32 KiB at most).
const conntrackReadBuffer = 64 << 10

// ipctnlMsgCtGet is IPCTNL_MSG_CT_GET (linux/netfilter/nfnetlink_conntrack.h).
const ipctnlMsgCtGet = 1

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
	matched := 0
	total, err := dumpConntrack(ctx, s.hostPath, func(dst netip.Addr) bool {
		return slices.Contains(s.vips, dst)
	}, func(f *conntrack.Flow) {
		matched++
		writeConntrackFlow(w, *f)
	})
	if err != nil {
		return fmt.Errorf("dump conntrack (%d entries read): %w", total, err)
	}
	fmt.Fprintf(w, "# %d of %d entries matched\n", matched, total)
	return nil
}

// dumpConntrack passes the conntrack entries of the netns at path whose
// original destination want takes to fn, one at a time, as the kernel dumps
// them, and returns how many entries there were. An entry is decoded only
// when want takes it. Only
// one socket read is held at a time: a node's table holds hundreds of
// thousands of entries (a UDP flood, a busy NodePort), which decoded whole
// (conntrack.Conn.Dump) took 0.5 KiB each, 150 MB for 180,000.
// (ctnetlink filters dumps by address only on recent kernels.)
func dumpConntrack(ctx context.Context, path string, want func(netip.Addr) bool, fn func(*conntrack.Flow)) (int, error) {
	fd := -1
	err := nsutil.Do(path, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("conntrack netlink socket: %w", err)
	}
	defer unix.Close(fd)
	// A read that waits returns now and then, so that the collector's end
	// (its timeout) is seen.
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1}); err != nil {
		return 0, fmt.Errorf("conntrack netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, fmt.Errorf("conntrack netlink socket: %w", err)
	}
	// nlmsghdr and nfgenmsg: a dump of every family's entries.
	const seq = 1
	req := make([]byte, unix.NLMSG_HDRLEN+4)
	binary.NativeEndian.PutUint32(req[0:4], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:6], unix.NFNL_SUBSYS_CTNETLINK<<8|ipctnlMsgCtGet)
	binary.NativeEndian.PutUint16(req[6:8], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:12], seq)
	req[16] = unix.AF_UNSPEC
	req[17] = unix.NFNETLINK_V0
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, fmt.Errorf("conntrack dump request: %w", err)
	}
	buf := make([]byte, conntrackReadBuffer)
	n := 0
	for {
		if ctx.Err() != nil {
			return n, context.Cause(ctx)
		}
		size, _, err := unix.Recvfrom(fd, buf, 0)
		switch {
		case err == unix.EINTR || err == unix.EAGAIN:
			continue
		case err != nil:
			return n, fmt.Errorf("conntrack dump: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:size])
		if err != nil {
			return n, fmt.Errorf("conntrack dump: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return n, nil
			case unix.NLMSG_ERROR:
				if len(m.Data) >= 4 {
					if errno := int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 {
						return n, fmt.Errorf("conntrack dump: %w", unix.Errno(-errno))
					}
				}
				return n, nil
			}
			n++
			if dst, ok := ctOrigDst(m.Data); ok && !want(dst) {
				continue
			}
			var ev conntrack.Event
			if err := ev.Unmarshal(netlink.Message{Header: netlink.Header{Length: m.Header.Len,
				Type: netlink.HeaderType(m.Header.Type), Flags: netlink.HeaderFlags(m.Header.Flags),
				Sequence: m.Header.Seq, PID: m.Header.Pid}, Data: m.Data}); err != nil || ev.Flow == nil {
				return n, fmt.Errorf("conntrack dump: decode entry: %v", err)
			}
			fn(ev.Flow)
		}
	}
}

// ctOrigDst reads the original destination address of a ctnetlink entry
// message (after its nfgenmsg) without decoding the rest; ok false when it
// has none.
func ctOrigDst(data []byte) (netip.Addr, bool) {
	const (
		ctaTupleOrig = 1 // CTA_TUPLE_ORIG
		ctaTupleIP   = 1 // CTA_TUPLE_IP
		ctaIPv4Dst   = 2 // CTA_IP_V4_DST
		ctaIPv6Dst   = 4 // CTA_IP_V6_DST
	)
	if len(data) < 4 {
		return netip.Addr{}, false
	}
	orig, ok := nlAttr(data[4:], ctaTupleOrig)
	if !ok {
		return netip.Addr{}, false
	}
	ip, ok := nlAttr(orig, ctaTupleIP)
	if !ok {
		return netip.Addr{}, false
	}
	if v4, ok := nlAttr(ip, ctaIPv4Dst); ok && len(v4) == 4 {
		return netip.AddrFrom4([4]byte(v4)), true
	}
	if v6, ok := nlAttr(ip, ctaIPv6Dst); ok && len(v6) == 16 {
		return netip.AddrFrom16([16]byte(v6)).Unmap(), true
	}
	return netip.Addr{}, false
}

// nlAttr returns the payload of the first netlink attribute of type typ
// (nested flag ignored) in b.
func nlAttr(b []byte, typ uint16) ([]byte, bool) {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		t := binary.NativeEndian.Uint16(b[2:4]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < 4 || l > len(b) {
			return nil, false
		}
		if t == typ {
			return b[4:l], true
		}
		next := (l + 3) &^ 3
		if next >= len(b) {
			return nil, false
		}
		b = b[next:]
	}
	return nil, false
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
