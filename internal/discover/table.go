package discover

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Table writes the node block of the human report.
func (n *NodeInfo) Table(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	p := func(format string, args ...any) { fmt.Fprintf(tw, format, args...) }

	p("NODE\tkernel %s\tnetns %s (inode %d)\n", n.Kernel, n.HostNetNS.Path, n.HostNetNS.Inode)
	if len(n.Services) > 0 {
		svcs := make([]string, len(n.Services))
		for i, s := range n.Services {
			if svcs[i] = s; !strings.Contains(s, ":") {
				svcs[i] += " (any port)"
			}
		}
		p("TRACING\t%s\n", strings.Join(svcs, ", "))
	}
	p("\nPODS: %d found, %d skipped", len(n.Pods), n.PodsSkipped)
	if len(n.PodsSkippedVeths) > 0 {
		p(" (host veths %s)", strings.Join(n.PodsSkippedVeths, ", "))
	}
	p("\n")
	if len(n.Pods) > 0 {
		p("NETNS\tHELD BY\tETH0\tGATEWAY\tHOST VETH\tMASTER\tUPLINK\n")
		for _, pod := range n.Pods {
			host, master := "-", "-"
			if hp := pod.HostPeer; hp != nil {
				host = fmt.Sprintf("%s #%d %s", hp.Name, hp.Ifindex, hp.MAC)
				master = hp.MasterKind
				if hp.Master != "" {
					master = fmt.Sprintf("%s (%s)", hp.Master, hp.MasterKind)
				}
			}
			p("%s\t%s\t%s\t%s\t%s\t%s\t%s (%s)\n", orDash(pod.NetNS.Path), holder(pod), eth0(pod.Eth0),
				gateway(pod), host, master, orDash(strings.Join(pod.Uplinks, ",")), pod.UplinkHow)
		}
	}

	p("\nCAPTURE POINTS\nROLE\tNETNS\tIFNAME\tIFINDEX\tKIND\tMAC\tMASTER\tDETAIL\n")
	perRole := map[string]int{}
	for _, cp := range n.CapturePoints {
		perRole[cp.Role]++
	}
	folded := map[string]bool{}
	for _, cp := range n.CapturePoints {
		if perRole[cp.Role] > maxSameRows && cp.Role != RoleUplink {
			// The PODS table above names every Pod's eth0 and host veth.
			if !folded[cp.Role] {
				folded[cp.Role] = true
				p("%s\t%d points, one per Pod (see PODS)\t-\t-\t-\t-\t-\t-\n", cp.Role, perRole[cp.Role])
			}
			continue
		}
		master := "-"
		if cp.Master != "" {
			master = fmt.Sprintf("%s (%s)", cp.Master, cp.MasterKind)
		}
		var detail []string
		if len(cp.BondMembers) > 0 {
			detail = append(detail, "bond members "+strings.Join(cp.BondMembers, ","))
		}
		if cp.VLANParent != "" {
			detail = append(detail, fmt.Sprintf("vlan %d on %s", cp.VLANID, cp.VLANParent))
		}
		if cp.Tunnel != "" {
			detail = append(detail, cp.Tunnel+": its frames are the inner ones (their VLAN and MAC are not the wire's)")
		}
		switch {
		case cp.Hairpin == nil:
		case *cp.Hairpin:
			detail = append(detail, "hairpin on")
		default:
			detail = append(detail, "hairpin off: "+cp.Master+" never sends a frame that came in here back out here")
		}
		p("%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", cp.Role, cp.NetNS, cp.Ifname, cp.Ifindex, cp.Kind,
			orDash(cp.MAC), master, orDash(strings.Join(detail, "; ")))
	}

	p("\nMECHANISMS\n")
	if len(n.SockPrograms) == 0 {
		p("socket\tno cgroup sock_addr program effective on %s (a client's own cgroup may add some: its flows name them)\n", orDash(n.SockCgroup))
	}
	for _, s := range n.SockPrograms {
		p("socket\t%s\t%s (id %d)\tcgroup %s\n", s.Attach, orDash(s.Name), s.ID, s.Cgroup)
	}
	if len(n.TCPrograms) == 0 {
		p("tc\tno tcx, cls_bpf or netkit program on host veths and uplinks\n")
	}
	type progKind struct{ role, dir, via, name, action string }
	ids := map[progKind][]string{} // distinct, in order
	places := map[progKind]int{}   // how many interfaces have one
	for _, t := range n.TCPrograms {
		k := progKind{t.Role, t.Dir, t.Via, t.Name, t.Action}
		places[k]++
		if id := fmt.Sprint(t.ID); !slices.Contains(ids[k], id) {
			ids[k] = append(ids[k], id)
		}
	}
	printed := map[progKind]bool{}
	for _, t := range n.TCPrograms {
		k := progKind{t.Role, t.Dir, t.Via, t.Name, t.Action}
		switch same := ids[k]; {
		case t.Action != "" && places[k] > maxSameRows:
			// One per Pod, as a CNI's: one row.
			if !printed[k] {
				printed[k] = true
				p("tc\t%d %s interfaces %s %s %s\t%s (not BPF)\t%s\n", places[k], t.Role, t.Dir, t.Via, t.Name, t.Action, t.Role)
			}
		case t.Action != "":
			p("tc\t%s %s %s %s\t%s (not BPF)\t%s\n", t.Ifname, t.Dir, t.Via, t.Name, t.Action, t.Role)
		case places[k] > maxSameRows:
			// One program per Pod (Cilium loads one per endpoint), or one
			// program on every veth (an observer's): one row.
			if !printed[k] {
				printed[k] = true
				shown := "id " + same[0]
				if len(same) > 1 {
					shown = "ids " + strings.Join(same[:min(len(same), maxSameRows)], ", ")
				}
				if len(same) > maxSameRows {
					shown += ", …"
				}
				p("tc\t%d %s interfaces %s %s\t%s (%s)\t%s\n", places[k], t.Role, t.Dir, t.Via, orDash(t.Name), shown, t.Role)
			}
		default:
			da := ""
			if t.DirectAction {
				da = " direct-action"
			}
			p("tc\t%s %s %s\t%s%s (id %d)\t%s\n", t.Ifname, t.Dir, t.Via, orDash(t.Name), da, t.ID, t.Role)
		}
	}
	for _, x := range n.XDPPrograms {
		p("xdp\t%s %s\t%s (id %d)\t%s\n", x.Ifname, x.Mode, orDash(x.Name), x.ID, x.Role)
	}
	// One per Pod (a CNI that redirects every veth): one row per kind.
	type redirKind struct{ role, dir, action string }
	redirs := map[redirKind][]string{}
	for _, r := range n.TCRedirects {
		k := redirKind{r.Role, r.Dir, r.Action}
		redirs[k] = append(redirs[k], r.Ifname)
	}
	for _, r := range n.TCRedirects {
		k := redirKind{r.Role, r.Dir, r.Action}
		switch same := redirs[k]; {
		case len(same) > maxSameRows:
			p("tc\t%d %s interfaces %s\tmirred %s (not BPF) on %s, …\t%s\n", len(same), r.Role, r.Dir, r.Action, strings.Join(same[:maxSameRows], ", "), r.Role)
			delete(redirs, k)
		case same != nil:
			p("tc\t%s %s %s\tmirred %s to %s (not BPF)\t%s\n", r.Ifname, r.Dir, r.Filter, r.Action, r.To, r.Role)
		}
	}
	nf := n.Netfilter
	p("netfilter\tnftables: %s\n", nf.NFTables)
	p("netfilter\tiptables-legacy: %s\n", nf.IPTablesLegacy)
	p("netfilter\tbridge-nf-call-iptables %s, bridge-nf-filter-vlan-tagged %s, ip_forward %s\n", boolWord(nf.BridgeNFCallIPTables),
		boolWord(nf.BridgeNFFilterVLANTagged), boolWord(nf.IPForward))
	// A Service of none while others have some: kube-proxy never
	// programmed it (the whole list when none has a rule is the line above).
	without := strings.Join(n.ServicesWithoutNAT, ", ")
	if len(nf.Rules) == 0 {
		p("netfilter\tno DNAT rule for the services\n")
	} else if without != "" {
		p("netfilter\tno DNAT rule for %s\n", without)
	}
	// A Service of many endpoints (a big Deployment's: hundreds) has a DNAT
	// per endpoint at each hook, all on one path but for its last chain:
	// one row says how many and shows a few (the JSON lists every one).
	type natPath struct{ source, table, hook, svc, path, from string }
	pathOf := func(r NATRule) natPath {
		return natPath{r.Source, r.Table, r.Hook, r.serviceString(), strings.Join(r.Chains[:max(len(r.Chains)-1, 0)], " > "), r.fromString()}
	}
	perPath := map[natPath][]NATRule{}
	for _, r := range nf.Rules {
		k := pathOf(r)
		perPath[k] = append(perPath[k], r)
	}
	for _, r := range nf.Rules {
		k := pathOf(r)
		switch same := perPath[k]; {
		case len(same) > maxSameRows:
			// The first backends in address order: the rules' (an
			// nftables map's) says nothing, and differs between runs.
			same = slices.SortedStableFunc(slices.Values(same), func(a, b NATRule) int { return a.Backend.Compare(b.Backend) })
			var shown []string
			for _, o := range same[:maxSameRows] {
				shown = append(shown, natBackendString(o))
			}
			last := "its last chain"
			if n := len(same[0].Chains); n > 0 {
				last = "one of " + strconv.Itoa(len(same)) + " chains such as " + same[0].Chains[n-1]
			}
			p("netfilter\t%s %s (%s)\t%s -> %d backends: %s, …\t%s > %s%s\n", r.Source, r.Table, r.Hook, k.svc, len(same),
				strings.Join(shown, ", "), k.path, last, k.from)
			delete(perPath, k)
		case same != nil:
			p("netfilter\t%s %s (%s)\t%s -> %s\t%s%s\n", r.Source, r.Table, r.Hook, k.svc, natBackendString(r), strings.Join(r.Chains, " > "), k.from)
		}
	}
	for _, r := range nf.Rejects {
		what := r.Verdict
		if r.Comment != "" {
			what += fmt.Sprintf(" (%q)", r.Comment)
		}
		// A drop limited to sources (loadBalancerSourceRanges) says so:
		// the clients it spares reach the backend.
		p("netfilter\t%s %s (%s)\t%s %s\t%s%s\n", r.Source, r.Table, r.Hook, r.rejectedString(nf.Rules), what, strings.Join(r.Chains, " > "), r.fromString())
	}
	for _, r := range nf.BackendDrops {
		what := r.Verdict
		if r.Comment != "" {
			what += fmt.Sprintf(" (%q)", r.Comment)
		}
		p("netfilter\t%s %s (%s)\tbackend %s %s\t%s%s\n", r.Source, r.Table, r.Hook, r.serviceString(), what, strings.Join(r.Chains, " > "), r.fromString())
	}
	for _, c := range nf.DeviceChains {
		// A stateless rewrite on a device, before netfilter's IP hooks:
		// its rewrites of the VIPs, or that it has none.
		on := fmt.Sprintf("%s on %s priority %d", c.Hook, orDash(strings.Join(c.Devices, ",")), c.Priority)
		if len(c.Rewrites) == 0 {
			p("netfilter\tnftables %s (%s)\tno rewrite of the services' destination read\n", c, on)
		}
		for _, r := range c.Rewrites {
			p("netfilter\tnftables %s (%s)\t%s -> %s\t%s%s\n", c, on, r.serviceString(), natBackendString(r), strings.Join(r.Chains, " > "), r.fromString())
		}
	}
	for _, bp := range nf.BPFPrograms {
		where := "in the node netns, or another hook holds its priority there"
		if bp.Elsewhere {
			where = "in another netns"
		}
		p("netfilter\tBPF program (%s %s priority %d)\t%s (id %d)\tnetfilter link %d, %s\n", bp.Family, bp.Hook, bp.Priority, orDash(bp.Name), bp.ID, bp.LinkID, where)
	}
	if !n.IPVS.Present {
		p("ipvs\t%s\n", n.IPVS.Note)
	} else if len(n.IPVS.Services) == 0 {
		p("ipvs\tpresent, no virtual service on the services\n")
	} else if len(nf.Rules) == 0 && without != "" {
		p("ipvs\tno virtual service for %s\n", without)
	}
	for _, s := range n.IPVS.Services {
		var bs []string
		for _, b := range s.Backends {
			bs = append(bs, b.String())
		}
		p("ipvs\t%s %s %s\t-> %s\n", s.Proto, s.Service, s.Scheduler, orDash(strings.Join(bs, ", ")))
	}
	for _, lv := range n.LocalVIPs {
		on := "a local route"
		if lv.Device != "" {
			on = "on " + lv.Device
		}
		p("local VIP\t%s\t%s: an address of the node, delivered to its own listeners unless NAT or IPVS rewrites it\n", lv.Addr, on)
	}
	for _, note := range n.Notes {
		p("note\t%s\n", note)
	}
	return tw.Flush()
}

// natBackendString is a DNAT rule's backend as the table shows it.
func natBackendString(r NATRule) string {
	switch {
	case !r.Backend.IsValid():
		return r.Note
	case r.Backend.Port() == 0:
		return r.Backend.Addr().String() + " (port kept)"
	}
	return r.Backend.String()
}

// maxSameRows is how many capture points of a Pod-side role, or tc programs
// of one kind, the table lists one by one; a node of a hundred Pods folds
// them into one row each (the JSON lists every one).
const maxSameRows = 3

func holder(p Pod) string {
	var parts []string
	if p.PID != 0 {
		parts = append(parts, fmt.Sprintf("pid %d %s", p.PID, p.Comm))
	}
	if p.NSName != "" {
		parts = append(parts, p.NSName)
	}
	return orDash(strings.Join(parts, ", "))
}

func eth0(i Iface) string {
	if i.Name == "" {
		return "-"
	}
	var addrs []string
	for _, a := range i.Addrs {
		addrs = append(addrs, a.String())
	}
	return fmt.Sprintf("%s #%d %s %s", i.Name, i.Ifindex, i.MAC, strings.Join(addrs, ","))
}

func gateway(p Pod) string {
	if !p.Gateway.IsValid() {
		return "-"
	}
	return fmt.Sprintf("%s %s", p.Gateway, orDash(p.GatewayMAC))
}

func boolWord(b *bool) string {
	switch {
	case b == nil:
		return "absent"
	case *b:
		return "1"
	}
	return "0"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// fromString says the path's source conditions, " from ..." ("" for any
// source): two paths of the same chains differ only by them.
func (r NATRule) fromString() string {
	if len(r.Sources) == 0 {
		return ""
	}
	conds := make([]string, len(r.Sources))
	for i, s := range r.Sources {
		conds[i] = s.String()
	}
	return " from " + strings.Join(conds, " and ")
}

// serviceString is the VIP[:PORT][/PROTO] a rule is for.
// rejectedString is what a reject or drop rule ends: after NAT, a rule for
// any port of the VIP never meets the ports a DNAT rule serves, which the
// node block says, lest a healthy Service read as rejected.
func (r NATRule) rejectedString(dnats []NATRule) string {
	svc := r.serviceString()
	if !r.AfterNAT || r.Port != 0 {
		return svc
	}
	var served []string
	for _, d := range dnats {
		if d.Service == r.Service && d.Port != 0 && (r.Proto == "" || d.Proto == r.Proto) {
			if s := fmt.Sprintf("%d/%s", d.Port, d.Proto); !slices.Contains(served, s) {
				served = append(served, s)
			}
		}
	}
	if len(served) == 0 {
		return svc
	}
	return svc + " except " + strings.Join(served, ", ") + " (DNATed before)"
}

// RejectedString is rejectedString with the sources the rule is limited
// to, for a summary that has no chain column to put them after.
func (r NATRule) RejectedString(dnats []NATRule) string {
	return r.rejectedString(dnats) + r.fromString()
}

func (r NATRule) serviceString() string {
	svc := r.Service.String()
	if r.Port != 0 {
		svc = fmt.Sprintf("%s:%d", svc, r.Port)
	}
	if r.Proto != "" {
		svc += "/" + r.Proto
	}
	return svc
}
