package incident

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// dumpErr keeps the partial result of an interrupted dump (the table changed
// while it was read) and says so.
func dumpErr(w *topicWriter, what string, err error) error {
	if errors.Is(err, netlink.ErrDumpInterrupted) {
		fmt.Fprintf(w, "# %s changed while being read: the list may be incomplete\n", what)
		return nil
	}
	if err != nil {
		return fmt.Errorf("list %s: %w", what, err)
	}
	return nil
}

// podNetState is netState of a Pod's netns, unless the Pod went during the
// incident (a rollout, a crash loop): its netns path then opens nothing, or
// another netns (a /proc/PID path whose PID was given to another process),
// whose state is no Pod's: said so, not read, and not taken for a failure
// to collect.
func (s *snapshot) podNetState(p discover.Pod) func(context.Context, *topicWriter) error {
	collect := s.netState(p.NetNS.Path)
	return func(ctx context.Context, w *topicWriter) error {
		if podGone(p) {
			now := netnsAfterPod(p.NetNS.Path)
			fmt.Fprintf(w, "# netns %s: the Pod went during the incident (the report's capture_ended says when): %s\n", p.NetNS.Path, now)
			w.notef("the Pod went during the incident: %s", now)
			return nil
		}
		return collect(ctx, w)
	}
}

// podGone tells whether p's netns path opens nothing now, or another netns.
func podGone(p discover.Pod) bool {
	ino, err := nsutil.Inode(p.NetNS.Path)
	return errors.Is(err, fs.ErrNotExist) || err == nil && p.NetNS.Inode != 0 && ino != p.NetNS.Inode
}

// netnsAfterPod says what the netns path of a Pod that went opens now:
// nothing, or another netns (a StatefulSet's Pod made again, a /proc/PID
// path whose PID another process has), which is no longer the Pod's.
func netnsAfterPod(path string) string {
	if _, err := nsutil.Inode(path); err == nil {
		return fmt.Sprintf("another netns holds its path %s now, not read", path)
	}
	return fmt.Sprintf("its netns %s is gone", path)
}

// netState dumps what `ip -d link; ip addr; ip route show table all; ip
// rule; ip neigh` would show for the netns at path.
func (s *snapshot) netState(path string) func(context.Context, *topicWriter) error {
	return func(_ context.Context, w *topicWriter) error {
		fmt.Fprintf(w, "# netns %s\n", path)
		return nsutil.Netlink(path, func(h *netlink.Handle) error {
			links, err := h.LinkList()
			if err := dumpErr(w, "links", err); err != nil {
				return err
			}
			names := linkNames(links)
			fmt.Fprintln(w, "\n## links")
			for _, l := range links {
				fmt.Fprintln(w, describeLink(l, names))
			}

			addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
			if err := dumpErr(w, "addresses", err); err != nil {
				return err
			}
			fmt.Fprintln(w, "\n## addresses")
			for _, a := range addrs {
				fmt.Fprintf(w, "%s %s scope %s\n", names.of(a.LinkIndex), a.IPNet, scopeName(a.Scope))
			}

			routes, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
			if err := dumpErr(w, "routes", err); err != nil {
				return err
			}
			fmt.Fprintln(w, "\n## routes (all tables)")
			for _, r := range routes {
				fmt.Fprintln(w, describeRoute(r, names))
			}

			rules, err := h.RuleList(netlink.FAMILY_ALL)
			if err := dumpErr(w, "rules", err); err != nil {
				return err
			}
			fmt.Fprintln(w, "\n## policy routing rules")
			for _, r := range rules {
				fmt.Fprintf(w, "%s %s\n", familyWord(r.Family), strings.TrimSpace(r.String()))
			}

			neighs, err := h.NeighList(0, netlink.FAMILY_ALL)
			if err := dumpErr(w, "neighbours", err); err != nil {
				return err
			}
			fmt.Fprintln(w, "\n## neighbours")
			for _, n := range neighs {
				fmt.Fprintf(w, "%s dev %s lladdr %s %s\n", n.IP, names.of(n.LinkIndex), macOrNone(n.HardwareAddr), neighState(n.State))
			}
			return nil
		})
	}
}

// ifNames maps ifindex to name within one netns.
type ifNames map[int]string

func linkNames(links []netlink.Link) ifNames {
	names := ifNames{}
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
	}
	return names
}

func (n ifNames) of(index int) string {
	if name, ok := n[index]; ok {
		return name
	}
	return fmt.Sprintf("if%d", index)
}

// describeLink is one line in the spirit of `ip -d link`.
func describeLink(l netlink.Link, names ifNames) string {
	a := l.Attrs()
	var b strings.Builder
	fmt.Fprintf(&b, "%d: %s kind %s mtu %d state %s mac %s", a.Index, a.Name, l.Type(), a.MTU, a.OperState, macOrNone(a.HardwareAddr))
	if a.Flags&net.FlagUp == 0 {
		b.WriteString(" admin-down")
	}
	if a.MasterIndex != 0 {
		fmt.Fprintf(&b, " master %s", names.of(a.MasterIndex))
	}
	switch v := l.(type) {
	case *netlink.Veth:
		// IFLA_LINK of a veth is the peer's ifindex, in the netns with that id.
		fmt.Fprintf(&b, " peer-ifindex %d", a.ParentIndex)
		if a.NetNsID >= 0 {
			fmt.Fprintf(&b, " peer-netnsid %d", a.NetNsID)
		}
	case *netlink.Vlan:
		fmt.Fprintf(&b, " vlan-id %d protocol %s parent %s", v.VlanId, v.VlanProtocol, names.of(a.ParentIndex))
	case *netlink.Bridge:
		if v.VlanFiltering != nil {
			fmt.Fprintf(&b, " vlan_filtering %t", *v.VlanFiltering)
		}
		if v.VlanDefaultPVID != nil {
			fmt.Fprintf(&b, " default_pvid %d", *v.VlanDefaultPVID)
		}
	case *netlink.Bond:
		fmt.Fprintf(&b, " mode %s", v.Mode)
	default:
		if a.ParentIndex != 0 {
			fmt.Fprintf(&b, " link %s", names.of(a.ParentIndex))
		}
	}
	if a.Xdp != nil && a.Xdp.Attached {
		fmt.Fprintf(&b, " xdp prog-id %d", a.Xdp.ProgId)
	}
	if a.Alias != "" {
		fmt.Fprintf(&b, " alias %q", a.Alias)
	}
	return b.String()
}

func describeRoute(r netlink.Route, names ifNames) string {
	var b strings.Builder
	dst := "default"
	if r.Dst != nil {
		if ones, _ := r.Dst.Mask.Size(); ones != 0 || !r.Dst.IP.IsUnspecified() {
			dst = r.Dst.String()
		}
	}
	b.WriteString(dst)
	if r.Family == unix.AF_INET6 {
		b.WriteString(" (ipv6)")
	}
	if r.Gw != nil {
		fmt.Fprintf(&b, " via %s", r.Gw)
	}
	if r.LinkIndex != 0 {
		fmt.Fprintf(&b, " dev %s", names.of(r.LinkIndex))
	}
	for _, nh := range r.MultiPath {
		fmt.Fprintf(&b, " nexthop via %s dev %s", nh.Gw, names.of(nh.LinkIndex))
	}
	if r.Src != nil {
		fmt.Fprintf(&b, " src %s", r.Src)
	}
	fmt.Fprintf(&b, " table %s type %s proto %s scope %s", tableName(r.Table), routeType(r.Type), r.Protocol, scopeName(int(r.Scope)))
	if r.Priority != 0 {
		fmt.Fprintf(&b, " metric %d", r.Priority)
	}
	return b.String()
}

// Multicast routing rule families (RTNL_FAMILY_IPMR, RTNL_FAMILY_IP6MR).
const (
	rtnlFamilyIPMR  = 128
	rtnlFamilyIP6MR = 129
)

func familyWord(f int) string {
	switch f {
	case unix.AF_INET:
		return "ipv4"
	case unix.AF_INET6:
		return "ipv6"
	case rtnlFamilyIPMR:
		return "ipv4-multicast"
	case rtnlFamilyIP6MR:
		return "ipv6-multicast"
	}
	return fmt.Sprintf("family%d", f)
}

func tableName(t int) string {
	switch t {
	case unix.RT_TABLE_MAIN:
		return "main"
	case unix.RT_TABLE_LOCAL:
		return "local"
	case unix.RT_TABLE_DEFAULT:
		return "default"
	}
	return fmt.Sprint(t)
}

func routeType(t int) string {
	switch t {
	case unix.RTN_UNICAST:
		return "unicast"
	case unix.RTN_LOCAL:
		return "local"
	case unix.RTN_BROADCAST:
		return "broadcast"
	case unix.RTN_MULTICAST:
		return "multicast"
	case unix.RTN_BLACKHOLE:
		return "blackhole"
	case unix.RTN_UNREACHABLE:
		return "unreachable"
	case unix.RTN_PROHIBIT:
		return "prohibit"
	case unix.RTN_ANYCAST:
		return "anycast"
	}
	return fmt.Sprint(t)
}

func scopeName(s int) string {
	switch s {
	case unix.RT_SCOPE_UNIVERSE:
		return "global"
	case unix.RT_SCOPE_SITE:
		return "site"
	case unix.RT_SCOPE_LINK:
		return "link"
	case unix.RT_SCOPE_HOST:
		return "host"
	case unix.RT_SCOPE_NOWHERE:
		return "nowhere"
	}
	return fmt.Sprint(s)
}

// neighState names NUD_* flags the way `ip neigh` does.
func neighState(state int) string {
	var out []string
	for _, s := range []struct {
		bit  int
		name string
	}{
		{unix.NUD_INCOMPLETE, "INCOMPLETE"}, {unix.NUD_REACHABLE, "REACHABLE"}, {unix.NUD_STALE, "STALE"},
		{unix.NUD_DELAY, "DELAY"}, {unix.NUD_PROBE, "PROBE"}, {unix.NUD_FAILED, "FAILED"},
		{unix.NUD_NOARP, "NOARP"}, {unix.NUD_PERMANENT, "PERMANENT"},
	} {
		if state&s.bit != 0 {
			out = append(out, s.name)
		}
	}
	if len(out) == 0 {
		return "NONE"
	}
	return strings.Join(out, ",")
}

func macOrNone(mac net.HardwareAddr) string {
	if len(mac) == 0 {
		return "none"
	}
	return mac.String()
}
