// Package flowtest loads recorded observation sequences (testdata/flows/*.json)
// with the verdicts they must produce, for the flow engine's tests and the
// report's golden tests.
//
// A file holds one scenario: the Services, the active points, what the node
// has (attribution), the observations in arrival order (times in milliseconds
// from a fixed base) and the wanted flows. Addresses are "IP:port", protocols
// "tcp"/"udp", points and hooks by their obs names, MACs as "02:00:...".
package flowtest

import (
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// At returns the time of a scenario's "ms" offset.
func At(ms float64) time.Time {
	return time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(ms * float64(time.Millisecond)))
}

// Scenario is one recorded sequence and what it must yield.
type Scenario struct {
	Name        string // file name without .json
	Description string
	// Ordered: the expected result depends on arrival order (MaxFlows decides
	// which flows are kept), so tests must not permute the observations.
	Ordered bool
	// SocketOrdered: the result depends on the order of the socket
	// observers' events, which come from one ring buffer in the order
	// the kernel made them; tests permute the rest around them.
	SocketOrdered bool
	Config        flow.Config
	Observations  []obs.Observation
	Want          Want
}

// Want is the expected outcome: exactly these flows (matched by proto, client,
// service) and, when given, these drop counters and this many observations
// no flow claimed.
type Want struct {
	Flows     []WantFlow        `json:"flows"`
	Drops     map[string]uint64 `json:"drops"`
	Unmatched *uint64           `json:"unmatched"`
	// RepliesWithoutRequest, RequestedAfterReplies: the summary's
	// connections seen by their replies alone, and those whose request
	// came after; compared when set.
	RepliesWithoutRequest *int `json:"replies_without_request"`
	RequestedAfterReplies *int `json:"requested_after_replies"`
}

// WantFlow is one expected flow. VLAN, Reply, Backend and RewrittenAt are always
// compared (VLAN null or absent: never at the uplink); the rest when set.
type WantFlow struct {
	Proto    string   `json:"proto"`
	Client   string   `json:"client"`
	Service  string   `json:"service"`
	Backend  string   `json:"backend"`
	Backends []string `json:"backends"` // compared when set: every backend seen, in order
	// Packets: the packets each point counted, requests by the point's
	// name, replies by "NAME reply"; compared for the names given.
	Packets            map[string]uint64 `json:"packets"`
	RewrittenAt        string            `json:"rewritten_at"`
	By                 string            `json:"by"` // the whole of it
	ByContains         string            `json:"by_contains"`
	ReasonContains     string            `json:"reason_contains"`
	ReasonLacks        string            `json:"reason_lacks"` // compared when set: the reason must not contain it
	VLAN               *uint16           `json:"vlan"`
	UplinkDstMAC       string            `json:"uplink_dst_mac"`
	UplinkDstIsGateway bool              `json:"uplink_dst_is_gateway"`
	Reply              bool              `json:"reply"`
	Refused            bool              `json:"refused"`
	StrayFrom          string            `json:"stray_from"`    // compared when set
	StrayPackets       uint64            `json:"stray_packets"` // compared with stray_from
	// UntranslatedFrom, UntranslatedPackets: the replies that entered the
	// client's Pod from a backend's address (untranslated_replies);
	// compared always (absent: none).
	UntranslatedFrom    string `json:"untranslated_from"`
	UntranslatedPackets uint64 `json:"untranslated_packets"`
	// RepliesLostOnNode: reply packets the uplink received of which none
	// reached the client's Pod (replies_lost_on_node); compared always.
	RepliesLostOnNode uint64 `json:"replies_lost_on_node"`
	// LostOnNode: request packets lost on the node (lost_on_node) and
	// NotSent (not_sent); compared when set.
	LostOnNode *uint64 `json:"lost_on_node"`
	NotSent    *bool   `json:"not_sent"`
	// KernelDrops: the flow's packets the kernel dropped (kernel_drops, as
	// "DIRECTION COUNT REASON FUNCTION" each); compared always (absent:
	// none).
	KernelDrops []string `json:"kernel_drops"`
	// ProxyUpstreams: the ids of the flows that can be a redirected
	// connection's proxy upstream (proxy_upstreams); compared always
	// (absent: none).
	ProxyUpstreams []int `json:"proxy_upstreams"`
	// ICMPError: the flow's ICMP error as "MESSAGE from SENDER", with
	// " (from the rule)" when no point captured it (ICMPError.FromRule);
	// compared when set.
	ICMPError string `json:"icmp_error"`
	// NodeClient: compared when set (a node process's flow, or not).
	NodeClient *bool `json:"node_client"`
	// BeganBeforeRun: compared when set.
	BeganBeforeRun *bool  `json:"began_before_run"`
	PID            uint32 `json:"pid"`
	Comm           string `json:"comm"`
}

// LoadDir loads every *.json scenario in dir, sorted by name.
func LoadDir(dir string) ([]Scenario, error) {
	paths, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, fmt.Errorf("list scenarios in %s: %w", dir, err)
	}
	sort.Strings(paths)
	out := make([]Scenario, 0, len(paths))
	for _, p := range paths {
		s, err := Load(p)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// Load reads one scenario file.
func Load(path string) (Scenario, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Scenario{}, fmt.Errorf("read scenario: %w", err)
	}
	var f file
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return Scenario{}, fmt.Errorf("parse scenario %s: %w", path, err)
	}
	s, err := f.scenario()
	if err != nil {
		return Scenario{}, fmt.Errorf("scenario %s: %w", path, err)
	}
	s.Name = strings.TrimSuffix(filepath.Base(path), ".json")
	return s, nil
}

// Run feeds the observations to a new engine in the given order (indices into
// Observations; nil for the recorded order).
func (s Scenario) Run(order []int) *flow.Engine {
	e := flow.NewEngine(s.Config)
	if order == nil {
		for _, o := range s.Observations {
			e.Add(o)
		}
		return e
	}
	for _, i := range order {
		e.Add(s.Observations[i])
	}
	return e
}

// Check compares the engine's flows and summary (its drops, its unmatched
// observations) with the wanted ones and returns every mismatch.
func (w Want) Check(got []flow.Flow, sum flow.Summary) []string {
	drops := sum.Drops
	var errs []string
	if len(got) != len(w.Flows) {
		errs = append(errs, fmt.Sprintf("got %d flows, want %d:%s", len(got), len(w.Flows), describe(got)))
	}
	for _, wf := range w.Flows {
		g, ok := find(got, wf)
		if !ok {
			errs = append(errs, fmt.Sprintf("no flow %s %s -> %s", wf.Proto, wf.Client, wf.Service))
			continue
		}
		errs = append(errs, wf.check(g)...)
	}
	for name, n := range w.Drops {
		if drops[name] != n {
			errs = append(errs, fmt.Sprintf("drop %s = %d, want %d", name, drops[name], n))
		}
	}
	if w.Unmatched != nil && sum.Unmatched != *w.Unmatched {
		errs = append(errs, fmt.Sprintf("unmatched = %d, want %d", sum.Unmatched, *w.Unmatched))
	}
	if w.RepliesWithoutRequest != nil && sum.RepliesWithoutRequest != *w.RepliesWithoutRequest {
		errs = append(errs, fmt.Sprintf("replies_without_request = %d, want %d", sum.RepliesWithoutRequest, *w.RepliesWithoutRequest))
	}
	if w.RequestedAfterReplies != nil && sum.RequestedAfterReplies != *w.RequestedAfterReplies {
		errs = append(errs, fmt.Sprintf("requested_after_replies = %d, want %d", sum.RequestedAfterReplies, *w.RequestedAfterReplies))
	}
	return errs
}

func find(got []flow.Flow, wf WantFlow) (flow.Flow, bool) {
	for _, g := range got {
		if g.Proto == wf.Proto && g.Client.String() == wf.Client && g.Service.String() == wf.Service {
			return g, true
		}
	}
	return flow.Flow{}, false
}

func describe(flows []flow.Flow) string {
	var b strings.Builder
	for _, f := range flows {
		fmt.Fprintf(&b, "\n  %s %s -> %s: %s backend=%s reason=%q", f.Proto, f.Client, f.Service, f.RewrittenAt, f.Backend, f.Reason)
	}
	return b.String()
}

func (wf WantFlow) check(g flow.Flow) []string {
	var errs []string
	bad := func(field string, got, want any) {
		errs = append(errs, fmt.Sprintf("flow %s %s -> %s: %s = %v, want %v (reason %q)",
			wf.Proto, wf.Client, wf.Service, field, got, want, g.Reason))
	}
	backend := ""
	if g.Backend.IsValid() {
		backend = g.Backend.String()
	}
	if backend != wf.Backend {
		bad("backend", backend, wf.Backend)
	}
	if wf.Backends != nil {
		var got []string
		for _, b := range g.Backends {
			got = append(got, b.String())
		}
		if !slices.Equal(got, wf.Backends) {
			bad("backends", got, wf.Backends)
		}
	}
	if wf.Packets != nil {
		got := map[string]uint64{}
		for _, p := range g.Points {
			name := p.Point
			if p.Reply {
				name += " reply"
			}
			got[name] += p.Packets
		}
		for name, n := range wf.Packets {
			if got[name] != n {
				bad("packets at "+name, got[name], n)
			}
		}
	}
	if string(g.RewrittenAt) != wf.RewrittenAt {
		bad("rewritten_at", g.RewrittenAt, wf.RewrittenAt)
	}
	if g.RewrittenAt == flow.PlaceUnknown && g.Reason == "" {
		bad("reason", `""`, "a reason for unknown")
	}
	if wf.By != "" && g.By != wf.By {
		bad("by", g.By, wf.By)
	}
	if !strings.Contains(g.By, wf.ByContains) {
		bad("by", g.By, "containing "+wf.ByContains)
	}
	if !strings.Contains(g.Reason, wf.ReasonContains) {
		bad("reason", g.Reason, "containing "+wf.ReasonContains)
	}
	if wf.ReasonLacks != "" && strings.Contains(g.Reason, wf.ReasonLacks) {
		bad("reason", g.Reason, "not containing "+wf.ReasonLacks)
	}
	if wf.LostOnNode != nil && g.LostOnNode != *wf.LostOnNode {
		bad("lost_on_node", g.LostOnNode, *wf.LostOnNode)
	}
	if wf.NotSent != nil && g.NotSent != *wf.NotSent {
		bad("not_sent", g.NotSent, *wf.NotSent)
	}
	if wf.NodeClient != nil && g.NodeClient != *wf.NodeClient {
		bad("node_client", fmt.Sprint(g.NodeClient), fmt.Sprint(*wf.NodeClient))
	}
	if wf.BeganBeforeRun != nil && g.BeganBeforeRun != *wf.BeganBeforeRun {
		bad("began_before_run", g.BeganBeforeRun, *wf.BeganBeforeRun)
	}
	if vlanString(g.VLAN) != vlanString(wf.VLAN) {
		bad("vlan", vlanString(g.VLAN), vlanString(wf.VLAN))
	}
	if wf.UplinkDstMAC != "" && g.UplinkDstMAC != wf.UplinkDstMAC {
		bad("uplink_dst_mac", g.UplinkDstMAC, wf.UplinkDstMAC)
	}
	if g.UplinkDstIsGateway != wf.UplinkDstIsGateway {
		bad("uplink_dst_is_gateway", g.UplinkDstIsGateway, wf.UplinkDstIsGateway)
	}
	if g.Reply != wf.Reply {
		bad("reply", g.Reply, wf.Reply)
	}
	if g.Refused != wf.Refused {
		bad("refused", g.Refused, wf.Refused)
	}
	if wf.ICMPError != "" {
		got := "none"
		if e := g.ICMPError; e != nil {
			got = e.Message + " from " + e.From.String()
			if e.FromRule {
				got += " (from the rule)"
			}
		}
		if got != wf.ICMPError {
			bad("icmp_error", got, wf.ICMPError)
		}
	}
	if wf.StrayFrom != "" {
		switch s := g.StrayReplies; {
		case s == nil:
			bad("stray_from", "none", wf.StrayFrom)
		case s.From.String() != wf.StrayFrom || s.Packets != wf.StrayPackets:
			bad("stray_replies", fmt.Sprintf("%d from %s", s.Packets, s.From), fmt.Sprintf("%d from %s", wf.StrayPackets, wf.StrayFrom))
		}
	} else if g.StrayReplies != nil {
		bad("stray_replies", g.StrayReplies.From, "none")
	}
	if wf.UntranslatedFrom != "" {
		switch u := g.UntranslatedReplies; {
		case u == nil:
			bad("untranslated_from", "none", wf.UntranslatedFrom)
		case u.From.String() != wf.UntranslatedFrom || u.Packets != wf.UntranslatedPackets:
			bad("untranslated_replies", fmt.Sprintf("%d from %s", u.Packets, u.From), fmt.Sprintf("%d from %s", wf.UntranslatedPackets, wf.UntranslatedFrom))
		}
	} else if g.UntranslatedReplies != nil {
		bad("untranslated_replies", g.UntranslatedReplies.From, "none")
	}
	if g.RepliesLostOnNode != wf.RepliesLostOnNode {
		bad("replies_lost_on_node", g.RepliesLostOnNode, wf.RepliesLostOnNode)
	}
	var drops []string
	for _, d := range g.KernelDrops {
		drops = append(drops, fmt.Sprintf("%s %d %s %s", d.Direction, d.Count, d.Reason, d.Function))
	}
	if fmt.Sprint(drops) != fmt.Sprint(wf.KernelDrops) {
		bad("kernel_drops", drops, wf.KernelDrops)
	}
	if fmt.Sprint(g.ProxyUpstreams) != fmt.Sprint(wf.ProxyUpstreams) {
		bad("proxy_upstreams", g.ProxyUpstreams, wf.ProxyUpstreams)
	}
	if wf.PID != 0 && g.PID != wf.PID {
		bad("pid", g.PID, wf.PID)
	}
	if wf.Comm != "" && g.Comm != wf.Comm {
		bad("comm", g.Comm, wf.Comm)
	}
	return errs
}

func vlanString(v *uint16) string {
	if v == nil {
		return "null"
	}
	return strconv.Itoa(int(*v))
}

// file is the JSON shape of a scenario.
type file struct {
	Description   string        `json:"description"`
	Ordered       bool          `json:"ordered"`
	SocketOrdered bool          `json:"socket_ordered"`
	Services      []string      `json:"services"`
	Points        []string      `json:"points"`
	MaxFlows      int           `json:"max_flows"`
	HostNetNS     uint64        `json:"host_netns"`
	Attribution   attribution   `json:"attribution"`
	Observations  []observation `json:"observations"`
	Want          Want          `json:"want"`
}

type attribution struct {
	SockPrograms []struct {
		AttachType string `json:"attach_type"`
		Name       string `json:"name"`
		ID         uint32 `json:"id"`
		Cgroup     string `json:"cgroup"`
	} `json:"sock_programs"`
	TCPrograms []struct {
		Direction string `json:"direction"`
		Kind      string `json:"kind"`
		Name      string `json:"name"`
		ID        uint32 `json:"id"`
		Ifindex   int    `json:"ifindex"`
		Uplink    bool   `json:"uplink"` // on the uplink, not a host veth
		Pod       bool   `json:"pod"`    // on a Pod's eth0 (ifindex: its host veth)
		// Action, Rewrites, RewritesPort, Conntrack: a filter's
		// rewriting action (flow.TCProgram's Action, Dst, DstPort,
		// Conntrack).
		Action       string       `json:"action"`
		Rewrites     netip.Prefix `json:"rewrites"`
		RewritesPort uint16       `json:"rewrites_port"`
		Conntrack    bool         `json:"conntrack"`
	} `json:"tc_programs"`
	// XDPPrograms: the uplinks' XDP programs, and with host those of the
	// host veth ifindex (flow.Attribution.UplinkXDPPrograms, HostXDPPrograms).
	XDPPrograms []struct {
		Mode    string `json:"mode"`
		Name    string `json:"name"`
		ID      uint32 `json:"id"`
		Host    bool   `json:"host"`
		Ifindex int    `json:"ifindex"`
	} `json:"xdp_programs"`
	NATRules []natRule `json:"nat_rules"`
	// DeviceRules: rules of nftables chains on device hooks that set a
	// VIP's destination (flow.DeviceRule).
	DeviceRules []struct {
		Chain    string           `json:"chain"`
		Hook     string           `json:"hook"`
		Device   string           `json:"device"`
		Ifindex  int              `json:"ifindex"`
		Uplink   bool             `json:"uplink"`
		VIP      netip.AddrPort   `json:"vip"`
		Proto    string           `json:"proto"`
		Backends []netip.AddrPort `json:"backends"`
		Rule     string           `json:"rule"`
	} `json:"device_rules"`
	// Rejects are rules that reject or drop a VIP's packets (no backends).
	Rejects []natRule `json:"rejects"`
	// BackendDrops are filter rules after NAT that drop or reject packets
	// to a backend's address ("vip" holds the backend).
	BackendDrops []natRule `json:"backend_drops"`
	// NetfilterPrograms are BPF programs on netfilter hooks.
	NetfilterPrograms []struct {
		Family   string `json:"family"`
		Hook     string `json:"hook"`
		Priority int32  `json:"priority"`
		Name     string `json:"name"`
		ID       uint32 `json:"id"`
	} `json:"netfilter_programs"`
	IPVS []struct {
		VIP       netip.AddrPort   `json:"vip"`
		Proto     string           `json:"proto"`
		Scheduler string           `json:"scheduler"`
		Backends  []netip.AddrPort `json:"backends"`
	} `json:"ipvs"`
	BridgeNFCallIPTables     *bool `json:"bridge_nf_call_iptables"`
	BridgeNFFilterVLANTagged *bool `json:"bridge_nf_filter_vlan_tagged"`
	// PodOtherIfaces: the Pods' other interfaces by address.
	PodOtherIfaces map[netip.Addr]string `json:"pod_other_ifaces"`
	// PodHostSides: the traced Pods' host veths (ifindex) by address.
	PodHostSides map[netip.Addr]int `json:"pod_host_sides"`
	// RoutedHostVeths: the ifindexes of host veths without a master.
	RoutedHostVeths []int `json:"routed_host_veths"`
	// HairpinOffUplinks: the uplinks that are bridge ports with hairpin
	// mode off.
	HairpinOffUplinks []struct {
		Ifindex int    `json:"ifindex"`
		Port    string `json:"port"`
		Bridge  string `json:"bridge"`
	} `json:"hairpin_off_uplinks"`
	GatewayMACs []string `json:"gateway_macs"`
	// NodeAddrs: the node netns's own addresses (flow.Attribution.NodeAddrs).
	NodeAddrs []netip.Addr `json:"node_addrs"`
	LocalVIPs []struct {
		Addr   netip.Addr `json:"addr"`
		Device string     `json:"device"`
	} `json:"local_vips"`
}

type natRule struct {
	Source   string           `json:"source"`
	Table    string           `json:"table"`
	Chain    string           `json:"chain"`
	Hook     string           `json:"hook"`
	VIP      netip.AddrPort   `json:"vip"`
	Proto    string           `json:"proto"`
	Backends []netip.AddrPort `json:"backends"`
	Rule     string           `json:"rule"`
	// BeforeNAT: a reject at output before NAT (flow.NATRule.BeforeNAT).
	BeforeNAT bool `json:"before_nat"`
	// ICMPAnswer: the ICMP error a reject answers with (flow.NATRule.ICMPAnswer).
	ICMPAnswer string `json:"icmp_answer"`
	// Sources: the rule's conditions on the client's address.
	Sources []sourceMatch `json:"sources"`
}

type sourceMatch struct {
	Prefixes []netip.Prefix `json:"prefixes"`
	Local    bool           `json:"local"`
	Not      bool           `json:"not"`
}

func (r natRule) convert() (flow.NATRule, error) {
	proto, err := parseProto(r.Proto)
	rule := flow.NATRule{Source: r.Source, Table: r.Table, Chain: r.Chain,
		Hook: r.Hook, VIP: r.VIP, Proto: proto, Backends: r.Backends, Rule: r.Rule, BeforeNAT: r.BeforeNAT, ICMPAnswer: r.ICMPAnswer}
	for _, m := range r.Sources {
		rule.Sources = append(rule.Sources, flow.SourceMatch(m))
	}
	return rule, err
}

type observation struct {
	MS       float64        `json:"ms"`
	Point    string         `json:"point"`
	Dir      string         `json:"dir"`
	Proto    string         `json:"proto"`
	Src      netip.AddrPort `json:"src"`
	Dst      netip.AddrPort `json:"dst"`
	Kind     string         `json:"kind"`
	ReqDst   netip.AddrPort `json:"req_dst"`
	Cookie   uint64         `json:"cookie"`
	PID      uint32         `json:"pid"`
	Comm     string         `json:"comm"`
	Cgroup   uint64         `json:"cgroup"`
	Ifname   string         `json:"ifname"`
	Ifindex  int            `json:"ifindex"`
	Hook     string         `json:"hook"`
	Prio     int32          `json:"prio"`
	Len      int            `json:"len"`
	VLAN     uint16         `json:"vlan"`
	SrcMAC   string         `json:"src_mac"`
	DstMAC   string         `json:"dst_mac"`
	TCPFlags uint8          `json:"tcp_flags"`
	NATDst   netip.AddrPort `json:"nat_dst"`
	NATSrc   netip.AddrPort `json:"nat_src"`
	NetNS    uint64         `json:"netns"`
	// DropReason, DropFunc: a drop's (point "drop") reason and function.
	DropReason string `json:"drop_reason"`
	DropFunc   string `json:"drop_func"`
	// PriorityTag: the frame has an 802.1Q tag of VLAN ID 0 (one with a
	// VLAN has an 802.1Q tag anyway).
	PriorityTag bool `json:"priority_tag"`
	// Unfollowed: a socket event held while its netns was out of scope.
	Unfollowed bool `json:"unfollowed"`
}

func (f file) scenario() (Scenario, error) {
	s := Scenario{Description: f.Description, Ordered: f.Ordered, SocketOrdered: f.SocketOrdered, Want: f.Want}
	cfg := flow.Config{Points: make(map[obs.Point]bool), MaxFlows: f.MaxFlows, HostNetNS: f.HostNetNS}
	for _, svc := range f.Services {
		v, err := ParseService(svc)
		if err != nil {
			return s, err
		}
		cfg.Services = append(cfg.Services, v)
	}
	for _, name := range f.Points {
		p, err := parsePoint(name)
		if err != nil {
			return s, err
		}
		cfg.Points[p] = true
	}
	a, err := f.Attribution.convert()
	if err != nil {
		return s, err
	}
	cfg.Attribution = a
	s.Config = cfg
	for i, o := range f.Observations {
		v, err := o.convert()
		if err != nil {
			return s, fmt.Errorf("observation %d: %w", i, err)
		}
		s.Observations = append(s.Observations, v)
	}
	return s, nil
}

func (a attribution) convert() (flow.Attribution, error) {
	out := flow.Attribution{BridgeNFCallIPTables: a.BridgeNFCallIPTables, BridgeNFFilterVLANTagged: a.BridgeNFFilterVLANTagged,
		PodOtherIfaces: a.PodOtherIfaces, PodHostSides: a.PodHostSides, NodeAddrs: a.NodeAddrs}
	for _, i := range a.RoutedHostVeths {
		if out.RoutedHostVeths == nil {
			out.RoutedHostVeths = map[int]bool{}
		}
		out.RoutedHostVeths[i] = true
	}
	for _, u := range a.HairpinOffUplinks {
		if out.HairpinOffUplinks == nil {
			out.HairpinOffUplinks = map[int]flow.BridgePort{}
		}
		out.HairpinOffUplinks[u.Ifindex] = flow.BridgePort{Port: u.Port, Bridge: u.Bridge}
	}
	for _, p := range a.SockPrograms {
		out.SockPrograms = append(out.SockPrograms, flow.SockProgram{AttachType: p.AttachType, Name: p.Name, ID: p.ID, Cgroup: p.Cgroup})
	}
	for _, p := range a.TCPrograms {
		tp := flow.TCProgram{Direction: p.Direction, Kind: p.Kind, Name: p.Name, ID: p.ID, Ifindex: p.Ifindex, Action: p.Action, Dst: p.Rewrites, DstPort: p.RewritesPort, Conntrack: p.Conntrack}
		switch {
		case p.Uplink:
			out.UplinkTCPrograms = append(out.UplinkTCPrograms, tp)
		case p.Pod:
			out.PodTCPrograms = append(out.PodTCPrograms, tp)
		default:
			out.TCPrograms = append(out.TCPrograms, tp)
		}
	}
	for _, p := range a.XDPPrograms {
		xp := flow.TCProgram{Kind: p.Mode, Name: p.Name, ID: p.ID, Ifindex: p.Ifindex}
		if p.Host {
			out.HostXDPPrograms = append(out.HostXDPPrograms, xp)
		} else {
			out.UplinkXDPPrograms = append(out.UplinkXDPPrograms, xp)
		}
	}
	for _, r := range a.NATRules {
		nr, err := r.convert()
		if err != nil {
			return out, err
		}
		out.NATRules = append(out.NATRules, nr)
	}
	for _, r := range a.DeviceRules {
		proto, err := parseProto(r.Proto)
		if err != nil {
			return out, err
		}
		out.DeviceRules = append(out.DeviceRules, flow.DeviceRule{Chain: r.Chain, Hook: r.Hook, Device: r.Device, Ifindex: r.Ifindex,
			Uplink: r.Uplink, VIP: r.VIP, Proto: proto, Backends: r.Backends, Rule: r.Rule})
	}
	for _, r := range a.Rejects {
		nr, err := r.convert()
		if err != nil {
			return out, err
		}
		out.Rejects = append(out.Rejects, nr)
	}
	for _, r := range a.BackendDrops {
		nr, err := r.convert()
		if err != nil {
			return out, err
		}
		out.BackendDrops = append(out.BackendDrops, nr)
	}
	for _, p := range a.NetfilterPrograms {
		out.NetfilterPrograms = append(out.NetfilterPrograms, flow.NetfilterProgram(p))
	}
	for _, v := range a.IPVS {
		proto, err := parseProto(v.Proto)
		if err != nil {
			return out, err
		}
		out.IPVS = append(out.IPVS, flow.IPVSService{VIP: v.VIP, Proto: proto, Scheduler: v.Scheduler, Backends: v.Backends})
	}
	for _, lv := range a.LocalVIPs {
		if out.LocalVIPs == nil {
			out.LocalVIPs = map[netip.Addr]string{}
		}
		out.LocalVIPs[lv.Addr] = lv.Device
	}
	for _, m := range a.GatewayMACs {
		mac, err := net.ParseMAC(m)
		if err != nil {
			return out, fmt.Errorf("gateway mac: %w", err)
		}
		out.GatewayMACs = append(out.GatewayMACs, mac)
	}
	return out, nil
}

func (o observation) convert() (obs.Observation, error) {
	v := obs.Observation{
		Time: At(o.MS),
		Src:  o.Src, Dst: o.Dst, ReqDst: o.ReqDst, NATDst: o.NATDst, NATSrc: o.NATSrc,
		Cookie: o.Cookie, PID: o.PID, Comm: o.Comm, Cgroup: o.Cgroup, NetNS: o.NetNS,
		Ifname: o.Ifname, Ifindex: o.Ifindex, Prio: o.Prio, Len: o.Len, VLAN: o.VLAN, TCPFlags: o.TCPFlags, Unfollowed: o.Unfollowed,
	}
	if o.VLAN != 0 || o.PriorityTag {
		v.TPID = 0x8100
	}
	var err error
	if v.Point, err = parsePoint(o.Point); err != nil {
		return v, err
	}
	if v.Point == obs.PointDrop {
		v.Drop = &obs.KernelDrop{Reason: o.DropReason, Func: o.DropFunc}
	}
	if v.Proto, err = parseProto(o.Proto); err != nil {
		return v, err
	}
	switch o.Dir {
	case "":
	case "in":
		v.Dir = obs.DirIn
	case "out":
		v.Dir = obs.DirOut
	default:
		return v, fmt.Errorf("dir %q: want in or out", o.Dir)
	}
	switch o.Kind {
	case "":
	case "connect":
		v.Kind = obs.SockConnect
	case "connect6":
		v.Kind = obs.SockConnect6
	case "sendmsg":
		v.Kind = obs.SockSendmsg
	case "closed":
		v.Kind = obs.SockClosed
	default:
		return v, fmt.Errorf("kind %q: want connect, connect6, sendmsg or closed", o.Kind)
	}
	if o.Hook != "" {
		if v.Hook, err = parseHook(o.Hook); err != nil {
			return v, err
		}
	}
	for _, m := range []struct {
		text string
		dst  *obs.MAC
	}{{o.SrcMAC, &v.SrcMAC}, {o.DstMAC, &v.DstMAC}} {
		if m.text == "" {
			continue
		}
		mac, err := net.ParseMAC(m.text)
		if err != nil || len(mac) != len(m.dst) {
			return v, fmt.Errorf("mac %q: want 6 bytes (%v)", m.text, err)
		}
		*m.dst = obs.MAC(mac)
	}
	return v, nil
}

// ParseService parses "IP[:PORT][/tcp|udp]".
func ParseService(s string) (flow.Service, error) {
	var svc flow.Service
	hostport, proto, hasProto := strings.Cut(s, "/")
	if hasProto {
		p, err := parseProto(proto)
		if err != nil {
			return svc, err
		}
		svc.Proto = p
	}
	if ap, err := netip.ParseAddrPort(hostport); err == nil {
		svc.Addr, svc.Port = ap.Addr(), ap.Port()
		return svc, nil
	}
	addr, err := netip.ParseAddr(hostport)
	if err != nil {
		return svc, fmt.Errorf("service %q: %w", s, err)
	}
	svc.Addr = addr
	return svc, nil
}

func parseProto(s string) (obs.Proto, error) {
	switch s {
	case "":
		return 0, nil
	case "tcp":
		return obs.TCP, nil
	case "udp":
		return obs.UDP, nil
	}
	return 0, fmt.Errorf("proto %q: want tcp or udp", s)
}

func parsePoint(s string) (obs.Point, error) {
	for p := obs.PointSockAddr; p <= obs.PointDrop; p++ {
		if p.String() == s {
			return p, nil
		}
	}
	return 0, fmt.Errorf("unknown point %q", s)
}

func parseHook(s string) (obs.Hook, error) {
	for h := obs.HookPrerouting; h <= obs.HookPostrouting; h++ {
		if h.String() == s {
			return h, nil
		}
	}
	return 0, fmt.Errorf("unknown hook %q", s)
}
