package incident

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// maxOVSBridges bounds the per-bridge flow dumps.
const maxOVSBridges = 16

// bridges lists the node's Linux bridges with their ports, the VLANs of every
// port (`bridge vlan`) and the forwarding database (`bridge fdb`).
func (s *snapshot) bridges(_ context.Context, w *topicWriter) error {
	return nsutil.Netlink(s.hostPath, func(h *netlink.Handle) error {
		links, err := h.LinkList()
		if err := dumpErr(w, "links", err); err != nil {
			return err
		}
		names := linkNames(links)
		vlans, err := h.BridgeVlanList()
		if err != nil {
			fmt.Fprintf(w, "# bridge VLANs not read: %v\n", err)
			w.notef("bridge VLANs not read: %v", err)
		}
		found := false
		for _, br := range links {
			if br.Type() != "bridge" {
				continue
			}
			found = true
			fmt.Fprintf(w, "## bridge %s\n%s\n", br.Attrs().Name, describeLink(br, names))
			fmt.Fprintf(w, "  vlans on the bridge itself: %s\n", vlanList(vlans[int32(br.Attrs().Index)]))
			for _, p := range links {
				if p.Attrs().MasterIndex != br.Attrs().Index {
					continue
				}
				fmt.Fprintf(w, "  port %s (ifindex %d, %s) state %s vlans: %s; %s\n", p.Attrs().Name, p.Attrs().Index,
					p.Type(), p.Attrs().OperState, vlanList(vlans[int32(p.Attrs().Index)]), hairpinMode(h, p))
			}
			fmt.Fprintln(w)
		}
		if !found {
			fmt.Fprintln(w, "no Linux bridge in the node netns")
		}

		fdb, err := h.NeighList(0, unix.AF_BRIDGE)
		if err := dumpErr(w, "bridge fdb", err); err != nil {
			return err
		}
		fmt.Fprintln(w, "## forwarding database (bridge fdb)")
		for _, n := range fdb {
			fmt.Fprintln(w, describeFDB(n, names))
		}
		return nil
	})
}

// hairpinMode says whether the bridge port p has hairpin mode on: off, the
// bridge never sends a frame back out the port it came in by (an outside
// client's request rewritten to a backend behind that port).
func hairpinMode(h *netlink.Handle, p netlink.Link) string {
	pi, err := h.LinkGetProtinfo(p)
	switch {
	case err != nil && !errors.Is(err, netlink.ErrDumpInterrupted):
		return fmt.Sprintf("hairpin not read: %v", err)
	case pi.Hairpin:
		return "hairpin on"
	}
	return "hairpin off"
}

// vlanList renders a port's VLANs like `bridge vlan`: "1 PVID untagged, 200".
func vlanList(infos []*nl.BridgeVlanInfo) string {
	if len(infos) == 0 {
		return "none"
	}
	parts := make([]string, 0, len(infos))
	for _, v := range infos {
		p := fmt.Sprint(v.Vid)
		if v.PortVID() {
			p += " PVID"
		}
		if v.EngressUntag() {
			p += " untagged"
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, ", ")
}

func describeFDB(n netlink.Neigh, names ifNames) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s dev %s", macOrNone(n.HardwareAddr), names.of(n.LinkIndex))
	if n.Vlan != 0 {
		fmt.Fprintf(&b, " vlan %d", n.Vlan)
	}
	if n.MasterIndex != 0 {
		fmt.Fprintf(&b, " master %s", names.of(n.MasterIndex))
	}
	if n.Flags&unix.NTF_SELF != 0 {
		b.WriteString(" self")
	}
	if n.Flags&unix.NTF_EXT_LEARNED != 0 {
		b.WriteString(" extern_learn")
	}
	switch {
	case n.State&unix.NUD_PERMANENT != 0:
		b.WriteString(" permanent")
	case n.State&unix.NUD_NOARP != 0:
		b.WriteString(" static")
	}
	return b.String()
}

// ovs reads Open vSwitch with read-only ovs-vsctl/ovs-ofctl commands that
// give up after 5 s when ovsdb does not answer.
func (s *snapshot) ovs(ctx context.Context, w *topicWriter) error {
	vsctl, err := exec.LookPath("ovs-vsctl")
	if err != nil {
		fmt.Fprintln(w, "ovs-vsctl is not installed: Open vSwitch not read (a node without OVS, or one whose OVS tools live in a container)")
		return nil
	}
	fmt.Fprintln(w, "## ovs-vsctl show")
	if err := runCommand(ctx, "", w, vsctl, "--timeout=5", "show"); err != nil {
		return err
	}
	fmt.Fprintln(w, "\n## ports: VLAN tag, trunks, mode")
	if err := runCommand(ctx, "", w, vsctl, "--timeout=5", "--columns=name,tag,trunks,vlan_mode", "list", "Port"); err != nil {
		return err
	}
	var brs bytes.Buffer
	if err := runCommand(ctx, "", &brs, vsctl, "--timeout=5", "list-br"); err != nil {
		return err
	}
	ofctl, err := exec.LookPath("ovs-ofctl")
	if err != nil {
		fmt.Fprintln(w, "\novs-ofctl is not installed: flows not read")
		return nil
	}
	bridges := strings.Fields(brs.String())
	slices.Sort(bridges)
	for i, br := range bridges {
		if i == maxOVSBridges {
			fmt.Fprintf(w, "\n# flows of %d more bridges not read\n", len(bridges)-i)
			w.notef("flows of %d OVS bridges not read (at most %d)", len(bridges)-i, maxOVSBridges)
			break
		}
		fmt.Fprintf(w, "\n## ovs-ofctl dump-flows %s\n", br)
		if err := runCommand(ctx, "", w, ofctl, "--timeout=5", "dump-flows", br); err != nil {
			fmt.Fprintf(w, "not read: %v\n", err)
			w.notef("flows of OVS bridge %s not read: %v", br, err)
		}
	}
	return nil
}
