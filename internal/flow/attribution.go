package flow

import (
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// bySocket names the sock_addr programs that can have rewritten the flow: the
// connect4 ones for a connect (connect6 for a dual-stack socket's to a
// v4-mapped address), the sendmsg4 ones for an unconnected send (which the
// kernel runs for a dual-stack socket's too).
func (e *Engine) bySocket(f *flowState) string {
	var hooks []string
	switch {
	case f.kind == obs.SockConnect, f.kind == obs.SockConnect6, f.kind == 0 && f.proto == obs.TCP:
		hooks = []string{"connect"}
	case f.kind == obs.SockSendmsg:
		hooks = []string{"sendmsg"}
	default:
		hooks = []string{"connect", "sendmsg"}
	}
	family := "4"
	if f.service.Addr().Is6() || f.kind == obs.SockConnect6 {
		family = "6"
	}
	progs := e.cfg.Attribution.SockPrograms
	if byCg, ok := e.cfg.Attribution.SockProgramsByCgroup[f.cgroup]; ok && f.cgroup != 0 {
		progs = byCg
	}
	// When the socket rewrote: an unconnected socket's flow may have
	// begun before the LB was loaded (socketLBChanged).
	rewroteAt := f.first
	if s := f.cps[cpSockAddr]; s.backend {
		rewroteAt = time.Unix(0, s.backendAt)
	}
	var cands []string
	for _, p := range progs {
		if rewroteAt.Before(p.Since) {
			continue
		}
		at := strings.ToLower(p.AttachType)
		for _, h := range hooks {
			if strings.Contains(at, h) && strings.Contains(at, family) {
				cands = append(cands, describeSock(p))
				break
			}
		}
	}
	return oneOf(cands)
}

func describeSock(p SockProgram) string {
	s := fmt.Sprintf("%s %s (id %d)", p.AttachType, p.Name, p.ID)
	if p.Cgroup != "" {
		s += " on " + p.Cgroup
	}
	return s
}

// hostIngressCands are what can have rewritten f at its host veth's
// ingress: its tc programs (tcCands), then its nftables ingress chains'
// rules (hostDeviceCands).
func (e *Engine) hostIngressCands(f *flowState) []string {
	return append(e.tcCands(f), e.hostDeviceCands(f)...)
}

// uplinkEgressCands are what can have rewritten f at the uplinks' egress,
// before their TX tap: their nftables egress chains' rules, then their tc
// egress programs.
func (e *Engine) uplinkEgressCands(f *flowState) []string {
	return append(e.uplinkDeviceCands(f), e.uplinkTCCands(f, "egress")...)
}

// onDevice places a rewrite at a device's hook, where a tc program (tc)
// or a rule of an nftables chain on the device (nft) can have done it:
// tc, or netfilter, when only those are there; unknown when both are
// (no point watches between them), by one of them all.
func onDevice(tc, nft []string) (Place, string) {
	switch {
	case len(nft) == 0:
		return PlaceTC, oneOf(tc)
	case len(tc) == 0:
		return PlaceNetfilter, oneOf(nft)
	}
	return PlaceUnknown, oneOf(append(slices.Clone(tc), nft...))
}

// hostDeviceCands are the rules of the nftables ingress chains of f's host
// veth (all host veths' when it is not known) that set f's VIP's
// destination. They run after the veth's whole tc ingress: when the tc
// tail saw the backend, a tcx program rewrote before them. A tcx program
// that ended the chain (the tail never saw it) may have passed the packet
// on to them.
func (e *Engine) hostDeviceCands(f *flowState) []string {
	if f.cps[cpTCTail].backend {
		return nil
	}
	return e.deviceCands(f, false, "ingress")
}

// uplinkDeviceCands are the rules of the uplinks' nftables egress chains
// that set f's VIP's destination.
func (e *Engine) uplinkDeviceCands(f *flowState) []string { return e.deviceCands(f, true, "egress") }

// deviceCands names the device rules at hook of the uplinks (uplink) or of
// f's host veth for f's VIP: those that set f's backend when some do, else
// every one (one that sets a map's value may have chosen it).
func (e *Engine) deviceCands(f *flowState, uplink bool, hook string) []string {
	var backend netip.AddrPort
	if bs := f.sortedBackends(); len(bs) > 0 {
		backend = bs[0]
	}
	var all, setting []string
	for _, r := range e.cfg.Attribution.DeviceRules {
		if r.Uplink != uplink || r.Hook != hook || !vipMatches(r.VIP, r.Proto, f) || !within(r.Since, r.Until, f.first) ||
			(!uplink && r.Ifindex != 0 && f.hostIfindex != 0 && r.Ifindex != f.hostIfindex) {
			continue
		}
		c := fmt.Sprintf("nftables %s %s on %s -> %s", r.Chain, r.Hook, r.Device, r.Rule)
		if !slices.Contains(all, c) {
			all = append(all, c)
		}
		if backend.IsValid() && listed(r.Backends, backend) && !slices.Contains(setting, c) {
			setting = append(setting, c)
		}
	}
	if len(setting) > 0 {
		return setting
	}
	return all
}

// tcCands are the ingress programs of the flow's host veth of its time. The
// tc tail observer runs after every tcx program the veth had when it was
// attached, before its cls_bpf filters: when it saw the backend, a tcx
// program rewrote; when it saw only the VIP, those tcx programs did not
// (they were there from the start, Since zero: one attached during the run
// may be past the tail), so a cls_bpf filter did. When the head saw the
// request and the tail, attached with it, never did, a tcx program ended the
// chain (a verdict other than TCX_NEXT: the kernel then runs no cls_bpf
// filter at all).
func (e *Engine) tcCands(f *flowState) []string {
	var cands []string
	for _, p := range e.tcCandPrograms(f) {
		c, _ := tcCand(p, f, fmt.Sprintf("%s ingress %s (id %d)", p.Kind, p.Name, p.ID))
		cands = append(cands, c)
	}
	return cands
}

// tcCandPrograms are the programs and filters tcCands names.
func (e *Engine) tcCandPrograms(f *flowState) []TCProgram {
	tcxOnly := f.cps[cpTCTail].backend || e.tcxChainEnded(f)
	pastTail := f.cps[cpTCTail].vip && !tcxOnly
	host := e.hostSide(f)
	var out []TCProgram
	for _, p := range e.cfg.Attribution.TCPrograms {
		if p.Direction != "ingress" || p.Kind == "netkit" || (tcxOnly && p.Kind != "tcx") || (pastTail && p.Kind == "tcx" && p.Since.IsZero()) ||
			(p.Ifindex != 0 && host != 0 && p.Ifindex != host) || !presentAt(p, f.first) {
			continue
		}
		if _, ok := tcCand(p, f, ""); ok {
			out = append(out, p)
		}
	}
	return out
}

// tcCand names p as a candidate for f's rewrite: as program when it is a
// program, else by its filter's action, which is one only when it rewrites
// f's VIP.
func tcCand(p TCProgram, f *flowState, program string) (string, bool) {
	if p.Action == "" {
		return program, true
	}
	return p.Action, p.Dst.Contains(f.service.Addr()) && (p.DstPort == 0 || p.DstPort == f.service.Port())
}

// hostSide is the ifindex of f's host veth (or netkit primary): where a
// point saw it, else its Pod's, when it is a traced Pod (one found after
// its first packets has no sighting there); 0 when not known.
func (e *Engine) hostSide(f *flowState) int {
	if f.hostIfindex != 0 {
		return f.hostIfindex
	}
	return e.cfg.Attribution.PodHostSides[f.client.Addr()]
}

// netkitCands are the programs of the flow's netkit pair (all pairs' when
// its host side is not known) that run on what the Pod sends: the peer's,
// attached on the primary, its host side.
func (e *Engine) netkitCands(f *flowState) []string {
	host := e.hostSide(f)
	var cands []string
	for _, p := range e.cfg.Attribution.TCPrograms {
		if p.Kind == "netkit" && p.Direction == "ingress" && (p.Ifindex == 0 || host == 0 || p.Ifindex == host) && presentAt(p, f.first) {
			cands = append(cands, fmt.Sprintf("netkit peer %s (id %d)", p.Name, p.ID))
		}
	}
	return cands
}

// bypassedHostSide tells whether the host-side points, from its RX tap to
// netfilter, all watching, never saw f's request.
func (e *Engine) bypassedHostSide(f *flowState) bool {
	for _, cp := range []checkpoint{cpHost, cpTCHead, cpTCTail, cpNFBefore, cpNFAfter} {
		if f.cps[cp].any() {
			return false
		}
	}
	return e.active(obs.PointHost) && e.active(obs.PointNFBefore)
}

// tcxChainEnded tells whether a program of the tcx chain ended it for f's
// request: the tc head saw it and the tail, watching (the two are attached
// together), never did.
func (e *Engine) tcxChainEnded(f *flowState) bool {
	return f.cps[cpTCHead].any() && !f.cps[cpTCTail].any() && e.active(obs.PointTCTail)
}

// byUplinkInTC names the uplinks' tc ingress programs of the flow's time.
func (e *Engine) byUplinkInTC(f *flowState) string { return oneOf(e.uplinkTCCands(f, "ingress")) }

func (e *Engine) uplinkTCCands(f *flowState, dir string) []string {
	var cands []string
	for _, p := range e.cfg.Attribution.UplinkTCPrograms {
		if p.Direction != dir || !presentAt(p, f.first) {
			continue
		}
		if c, ok := tcCand(p, f, fmt.Sprintf("%s %s %s (id %d) on the uplink", p.Kind, dir, p.Name, p.ID)); ok {
			cands = append(cands, c)
		}
	}
	return cands
}

// uplinkXDPCands are the uplinks' XDP programs of time t.
func (e *Engine) uplinkXDPCands(t time.Time) []string {
	var cands []string
	for _, p := range e.cfg.Attribution.UplinkXDPPrograms {
		if presentAt(p, t) {
			cands = append(cands, fmt.Sprintf("%s %s (id %d) on the uplink", p.Kind, p.Name, p.ID))
		}
	}
	return cands
}

// hostXDPCands are the XDP programs of the flow's host veth (all host
// veths' when it is not known).
func (e *Engine) hostXDPCands(f *flowState) []string {
	var cands []string
	for _, p := range e.cfg.Attribution.HostXDPPrograms {
		if (p.Ifindex == 0 || f.hostIfindex == 0 || p.Ifindex == f.hostIfindex) && presentAt(p, f.first) {
			cands = append(cands, fmt.Sprintf("%s %s (id %d) on the host veth", p.Kind, p.Name, p.ID))
		}
	}
	return cands
}

// podTCCands are the egress programs on the eth0 of the flow's Pod (all
// Pods' when its host veth is not known).
func (e *Engine) podTCCands(f *flowState) []string {
	var cands []string
	for _, p := range e.cfg.Attribution.PodTCPrograms {
		if host := e.hostSide(f); p.Direction != "egress" || (p.Ifindex != 0 && host != 0 && p.Ifindex != host) || !presentAt(p, f.first) {
			continue
		}
		if c, ok := tcCand(p, f, fmt.Sprintf("%s egress %s (id %d) on the Pod's eth0", p.Kind, p.Name, p.ID)); ok {
			cands = append(cands, c)
		}
	}
	return cands
}

// AddPodTCPrograms adds the programs on the eth0 of Pods that started
// during the run, found at; hostIfindexes are those Pods' host veths. A
// host veth can have the ifindex of a Pod's that went (a Pod deleted and
// made again, see discover.PodWatch): the programs of the gone Pod's eth0
// were there until then, and the new Pod's from then on (tcTimeSlack
// before it), not those of the other Pod tied to the same host veth; so
// were the tc redirects of the gone Pod's host veth (HostRedirects).
func (e *Engine) AddPodTCPrograms(at time.Time, hostIfindexes []int, progs []TCProgram) {
	reused := map[int]bool{}
	// A copy: the caller's Config may share the array.
	all := slices.Clone(e.cfg.Attribution.PodTCPrograms)
	for i := range all {
		p := &all[i]
		if p.Ifindex != 0 && p.Until.IsZero() && slices.Contains(hostIfindexes, p.Ifindex) {
			p.Until = at
			reused[p.Ifindex] = true
		}
	}
	e.cfg.Attribution.PodTCPrograms = all
	redirs := slices.Clone(e.cfg.Attribution.HostRedirects)
	for i := range redirs {
		if r := &redirs[i]; r.Ifindex != 0 && r.Until.IsZero() && slices.Contains(hostIfindexes, r.Ifindex) {
			r.Until = at
			reused[r.Ifindex] = true
		}
	}
	e.cfg.Attribution.HostRedirects = redirs
	for _, p := range progs {
		if reused[p.Ifindex] && p.Since.IsZero() {
			p.Since = at
		}
		e.cfg.Attribution.PodTCPrograms = append(e.cfg.Attribution.PodTCPrograms, p)
	}
	if len(progs) > 0 || len(reused) > 0 {
		e.gen++
	}
}

// AddPodHostSides records the host sides of Pods that started during the
// run, by their addresses (Attribution.PodHostSides); an address given
// again takes its newest.
func (e *Engine) AddPodHostSides(sides map[netip.Addr]int) {
	if len(sides) == 0 {
		return
	}
	// A copy: the caller's Config may share the map.
	all := maps.Clone(e.cfg.Attribution.PodHostSides)
	if all == nil {
		all = map[netip.Addr]int{}
	}
	maps.Copy(all, sides)
	e.cfg.Attribution.PodHostSides = all
}

// SetHostVethsRouted records, for the host veths of Pods that started
// during the run (by ifindex), whether each has no master: routed
// (Attribution.RoutedHostVeths). An ifindex given again takes its newest
// state.
func (e *Engine) SetHostVethsRouted(routed map[int]bool) {
	if len(routed) == 0 {
		return
	}
	// A copy: the caller's Config may share the map.
	all := maps.Clone(e.cfg.Attribution.RoutedHostVeths)
	if all == nil {
		all = map[int]bool{}
	}
	for i, r := range routed {
		if r {
			all[i] = true
		} else {
			delete(all, i)
		}
	}
	e.cfg.Attribution.RoutedHostVeths = all
}

// AddHostRedirects adds the mirred redirects read on the host veths of Pods
// that started during the run, found at (their Since when unset). Call it
// after AddPodTCPrograms of the same Pods, which ends the redirects of the
// veths whose ifindexes they took.
func (e *Engine) AddHostRedirects(at time.Time, redirs []TCRedirect) {
	if len(redirs) == 0 {
		return
	}
	// A copy: the caller's Config may share the array.
	all := slices.Clone(e.cfg.Attribution.HostRedirects)
	for _, r := range redirs {
		if r.Since.IsZero() {
			r.Since = at
		}
		all = append(all, r)
	}
	e.cfg.Attribution.HostRedirects = all
	e.gen++
}

// PodsGone ends, at at, the tc programs on the eth0 of the Pods that went
// and the tc redirects on their host veths (by the host veths' ifindexes),
// and forgets those that ended before every open flow they could concern
// began (and more than a flow timeout ago: a flow of that time may still
// come): a run until stopped sees every Pod that ever came.
func (e *Engine) PodsGone(at time.Time, hostIfindexes []int) {
	a := &e.cfg.Attribution
	if len(a.PodTCPrograms) == 0 && len(a.HostRedirects) == 0 {
		return
	}
	timeout := e.flowTimeout()
	// The earliest open flow of each host veth (0: not known), and of all.
	earliest := map[int]time.Time{}
	var first time.Time
	for _, list := range e.clients {
		for _, f := range list {
			if t, ok := earliest[f.hostIfindex]; !ok || f.first.Before(t) {
				earliest[f.hostIfindex] = f.first
			}
			if first.IsZero() || f.first.Before(first) {
				first = f.first
			}
		}
	}
	gone := func(ifindex int, until time.Time) bool {
		if until.IsZero() || !until.Before(at.Add(-timeout)) {
			return false
		}
		if ifindex == 0 {
			return first.IsZero() || !first.Before(until)
		}
		for _, idx := range []int{ifindex, 0} {
			if t, ok := earliest[idx]; ok && t.Before(until) {
				return false
			}
		}
		return true
	}
	progs := slices.Clone(a.PodTCPrograms) // the caller's Config may share the array
	for i := range progs {
		if p := &progs[i]; p.Until.IsZero() && p.Ifindex != 0 && slices.Contains(hostIfindexes, p.Ifindex) {
			p.Until = at
		}
	}
	a.PodTCPrograms = slices.DeleteFunc(progs, func(p TCProgram) bool { return gone(p.Ifindex, p.Until) })
	redirs := slices.Clone(a.HostRedirects)
	for i := range redirs {
		if r := &redirs[i]; r.Until.IsZero() && r.Ifindex != 0 && slices.Contains(hostIfindexes, r.Ifindex) {
			r.Until = at
		}
	}
	a.HostRedirects = slices.DeleteFunc(redirs, func(r TCRedirect) bool { return gone(r.Ifindex, r.Until) })
	e.gen++
}

// presentAt tells whether p could have been on its veth at t: from when it
// was first seen (or a look before, tcTimeSlack, but not before a look
// that missed it) to when it was seen gone.
func presentAt(p TCProgram, t time.Time) bool {
	return (p.Since.IsZero() || !t.Before(p.Since.Add(-tcTimeSlack))) && !t.Before(p.NotBefore) && (p.Until.IsZero() || t.Before(p.Until))
}

// tcTimeSlack is how much earlier than it was first seen a tc program may
// have been attached: the session looks every 2 s (and a look takes time).
const tcTimeSlack = 5 * time.Second

// SetTCPrograms replaces the tc programs of the host veths, each with when
// it was there (TCProgram.Since, Until): the session looks again while it
// runs.
func (e *Engine) SetTCPrograms(progs []TCProgram) {
	e.cfg.Attribution.TCPrograms = progs
	e.gen++
}

// SetUplinkTCPrograms is SetTCPrograms for the uplinks' programs.
func (e *Engine) SetUplinkTCPrograms(progs []TCProgram) {
	e.cfg.Attribution.UplinkTCPrograms = progs
	e.gen++
}

// byNAT names the NAT rules for the VIP that lead to the flow's backend; the
// rules for the VIP alone, saying so, when none lists it.
func (e *Engine) byNAT(f *flowState) string {
	var backend netip.AddrPort
	if bs := f.sortedBackends(); len(bs) > 0 {
		backend = bs[0]
	}
	rules := e.natRulesFor(f, backend)
	if len(rules) == 0 && backend.IsValid() && f.connBegan != 0 {
		// It may ride the conntrack entry of the flow it continues, made
		// by a rule a rollout since took away.
		rules = e.natRulesAt(f, backend, time.Unix(0, f.connBegan))
	}
	unlisted := len(rules) == 0 && backend.IsValid()
	if unlisted {
		rules = e.natRulesFor(f, netip.AddrPort{})
	}
	rules = preferHook(rules, natHookOf(f))
	var cands []string
	seen := map[string]bool{}
	for _, r := range rules {
		// One path per source condition it is taken with (kube-proxy's
		// Pods' and node's traffic to a NodePort): one candidate.
		if c := r.String(); !seen[c] {
			seen[c] = true
			cands = append(cands, c)
		}
	}
	if unlisted && len(cands) > 0 {
		// Rules to other backends: the rule that chose this one was not
		// read (made and gone between two reads, or not decoded).
		return fmt.Sprintf("no NAT rule read names backend %s; the VIP's rules: %s", backend, oneOf(cands))
	}
	return oneOf(cands)
}

// natRulesFor returns the NAT rules matching the flow's VIP and its client
// and, when backend is valid, listing it among their targets.
func (e *Engine) natRulesFor(f *flowState, backend netip.AddrPort) []NATRule {
	return e.natRulesAt(f, backend, f.first)
}

// natRulesAt is natRulesFor with the rules in force at t.
func (e *Engine) natRulesAt(f *flowState, backend netip.AddrPort, t time.Time) []NATRule {
	var out []NATRule
	for _, r := range e.cfg.Attribution.NATRules {
		if vipMatches(r.VIP, r.Proto, f) && (!backend.IsValid() || listed(r.Backends, backend)) && within(r.Since, r.Until, t) &&
			e.clientMayMeet(r.Sources, f.client.Addr()) {
			out = append(out, r)
		}
	}
	return out
}

// clientMayMeet tells whether client can meet every source condition of a
// rule: false only when one is decided unmet, never on a guess (client or
// node addresses unknown, a prefix of the other family).
func (e *Engine) clientMayMeet(conds []SourceMatch, client netip.Addr) bool {
	for _, c := range conds {
		if met, known := e.meets(c, client.Unmap()); known && !met {
			return false
		}
	}
	return true
}

// meets tells whether client meets c, and whether that is known.
func (e *Engine) meets(c SourceMatch, client netip.Addr) (met, known bool) {
	if !client.IsValid() {
		return false, false
	}
	var in bool
	if c.Local {
		nodeAddrs := e.cfg.Attribution.NodeAddrs
		if nodeAddrs == nil {
			return false, false
		}
		// The node routes all of 127.0.0.0/8 and ::1 as its own.
		in = client.IsLoopback() || slices.Contains(nodeAddrs, client)
	} else {
		for _, p := range c.Prefixes {
			if p.Addr().Is4() != client.Is4() {
				return false, false
			}
			in = in || p.Contains(client)
		}
	}
	return in != c.Not, true
}

func (e *Engine) ipvsFor(f *flowState) []IPVSService {
	var out []IPVSService
	for _, s := range e.cfg.Attribution.IPVS {
		if vipMatches(s.VIP, s.Proto, f) && within(s.Since, s.Until, f.first) {
			out = append(out, s)
		}
	}
	return out
}

func (e *Engine) byIPVS(f *flowState) string {
	var backend string
	if bs := f.sortedBackends(); len(bs) > 0 {
		backend = bs[0].String()
	}
	var cands []string
	for _, s := range e.ipvsFor(f) {
		cands = append(cands, fmt.Sprintf("ipvs %s %s %s -> %s", s.Proto, s.VIP, s.Scheduler, backend))
	}
	return oneOf(cands)
}

// within tells whether t is in [since, until], a zero bound being open.
func within(since, until, t time.Time) bool {
	return (since.IsZero() || !t.Before(since)) && (until.IsZero() || !t.After(until))
}

// SetNATAttribution replaces the NAT rules and IPVS services, each with when
// it was there (Since, Until): the session reads them again while it runs
// when flows reach backends that none names (UnlistedBackends).
func (e *Engine) SetNATAttribution(rules []NATRule, ipvs []IPVSService) {
	e.cfg.Attribution.NATRules, e.cfg.Attribution.IPVS = rules, ipvs
	e.ruleBackends, e.ruleEnds = nil, nil
	e.gen++
	// Each pair is checked again against what was read: a backend whose
	// rule went may come back (a rollout rolled back, an endpoint ready
	// again), and only another read names its rule from then on.
	clear(e.pairs)
}

// SetDeviceRules replaces the rules of the nftables chains on device hooks,
// each with when it was there (Since, Until): the session reads the chains
// again with the NAT rules, and gives a Pod that starts during the run the
// rules of its host veth's chains.
func (e *Engine) SetDeviceRules(rules []DeviceRule) {
	e.cfg.Attribution.DeviceRules = rules
	e.gen++
	clear(e.pairs)
}

// UnnamedTCRewrite tells whether a flow is placed at tc (a host veth's, the
// uplink's) with no program or device chain read naming it: a chain on a
// device hook made during the run that sets a backend the NAT rules already
// name (no UnlistedBackends news asks for a look) leaves its flows so.
func (e *Engine) UnnamedTCRewrite() bool {
	for _, list := range e.clients {
		for _, f := range list {
			if v := e.cachedVerdict(f); v.place == PlaceTC && v.by == "" {
				return true
			}
		}
	}
	return false
}

// UnlistedBackends counts the Service and backend pairs the flows reached
// that no NAT rule, IPVS service or device chain's rewrite in force (not
// gone) when the pair was checked names: a Service created, or endpoints
// changed, since the rules were read (or a rewrite outside netfilter, which
// no rule names anyway).
func (e *Engine) UnlistedBackends() uint64 { return e.unlisted }

// maxPairs bounds the Service and backend pairs remembered as checked;
// beyond it the memory starts over (a pair checked again may count again,
// which only costs the session another read).
const maxPairs = 1 << 12

// checkListed counts the pair of f's Service and backend b in
// UnlistedBackends when no rule or IPVS service in force names it, once per
// pair (until the rules are read again).
func (e *Engine) checkListed(f *flowState, b netip.AddrPort) {
	k := [2]netip.AddrPort{f.service, b}
	if _, done := e.pairs[k]; done {
		return
	}
	if len(e.pairs) >= maxPairs {
		clear(e.pairs)
	}
	e.pairs[k] = struct{}{}
	for _, r := range e.cfg.Attribution.NATRules {
		if r.Until.IsZero() && vipMatches(r.VIP, r.Proto, f) && listed(r.Backends, b) {
			return
		}
	}
	for _, s := range e.cfg.Attribution.IPVS {
		if s.Until.IsZero() && vipMatches(s.VIP, s.Proto, f) && listed(s.Backends, b) {
			return
		}
	}
	for _, r := range e.cfg.Attribution.DeviceRules {
		if r.Until.IsZero() && vipMatches(r.VIP, r.Proto, f) && listed(r.Backends, b) {
			return
		}
	}
	e.unlisted++
}

// vipMatches tells whether a rule's VIP (port 0 = any, proto 0 = any) is the flow's.
func vipMatches(vip netip.AddrPort, proto obs.Proto, f *flowState) bool {
	return vip.Addr() == f.service.Addr() &&
		(vip.Port() == 0 || vip.Port() == f.service.Port()) &&
		(proto == 0 || f.proto == 0 || proto == f.proto)
}

func listed(list []netip.AddrPort, ap netip.AddrPort) bool {
	for _, x := range list {
		if x == ap || (x.Port() == 0 && x.Addr() == ap.Addr()) {
			return true
		}
	}
	return false
}

// oneOf joins candidate rewriters, saying when there are several.
func oneOf(cands []string) string {
	switch len(cands) {
	case 0:
		return ""
	case 1:
		return cands[0]
	}
	return fmt.Sprintf("one of %d: %s", len(cands), strings.Join(cands, "; "))
}

// SetCgroupSockPrograms records the sock_addr programs effective for a client
// cgroup; an empty list records that there are none. Read again (a socket LB
// was loaded since), the cgroup keeps the programs it had: one detached
// since still names the flows it rewrote.
func (e *Engine) SetCgroupSockPrograms(cgroup uint64, progs []SockProgram) {
	if e.cfg.Attribution.SockProgramsByCgroup == nil {
		e.cfg.Attribution.SockProgramsByCgroup = map[uint64][]SockProgram{}
	}
	for _, p := range e.cfg.Attribution.SockProgramsByCgroup[cgroup] {
		if !slices.ContainsFunc(progs, func(q SockProgram) bool {
			return q.ID == p.ID && q.AttachType == p.AttachType && q.Cgroup == p.Cgroup
		}) {
			progs = append(progs, p)
		}
	}
	e.cfg.Attribution.SockProgramsByCgroup[cgroup] = progs
	e.gen++
}

// ForgetCgroups forgets the sock_addr programs of the clients' cgroups
// (SetCgroupSockPrograms) that no open flow is of: a run until stopped
// sees the cgroups of every Pod that ever came. A cgroup seen again is
// told again.
func (e *Engine) ForgetCgroups() {
	byCg := e.cfg.Attribution.SockProgramsByCgroup
	if len(byCg) == 0 {
		return
	}
	used := map[uint64]bool{}
	for _, list := range e.clients {
		for _, f := range list {
			used[f.cgroup] = true
		}
	}
	maps.DeleteFunc(byCg, func(cg uint64, _ []SockProgram) bool { return !used[cg] })
}

// natHookOf is the NAT hook a flow went through: the one the netfilter
// observers saw it at (a client outside the node, whose request came in on
// the uplink, meets PREROUTING too); without them, PREROUTING when it came
// in through a Pod's veth or with its VIP on the uplink's wire (an outside
// client's, a NodePort's), OUTPUT when no such point saw it (the node's
// own).
func natHookOf(f *flowState) string {
	if f.natHook != "" {
		return f.natHook
	}
	if f.cps[cpPod].any() || f.cps[cpHost].any() || f.cps[cpTCHead].any() || f.wireVIP {
		return "prerouting"
	}
	return "output"
}

// natHookName names a NAT hook as NATRule.Hook does.
func natHookName(h obs.Hook) string {
	if h == obs.HookLocalOut {
		return "output"
	}
	return "prerouting"
}

// preferHook keeps the rules of that hook when there are any (kube-proxy
// installs the same chains under both PREROUTING and OUTPUT).
func preferHook(rules []NATRule, hook string) []NATRule {
	var kept []NATRule
	for _, r := range rules {
		if r.Hook == hook {
			kept = append(kept, r)
		}
	}
	if len(kept) == 0 {
		return rules
	}
	return kept
}

// SetGatewayMACs replaces the Pods' gateway MACs (discovery reads them again at
// the end of a run: a Pod resolves its gateway with its first packet).
func (e *Engine) SetGatewayMACs(macs []net.HardwareAddr) {
	e.cfg.Attribution.GatewayMACs = macs
}

// SetUplinkNeighbors replaces what the uplinks' neighbour tables map MACs to
// (the session reads them again as the run goes: a routed node resolves its
// next hop with the first packet).
func (e *Engine) SetUplinkNeighbors(ns map[UplinkNeighborKey]UplinkNeighbor) {
	e.cfg.Attribution.UplinkNeighbors = ns
}
