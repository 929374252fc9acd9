package flow_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestTCProgramsOfTheFlowsTime: a flow's tc rewrite is attributed to the
// programs on its veth at its time, when a CNI agent replaced them while the
// trace ran; a flow within the time the session could not tell names both.
func TestTCProgramsOfTheFlowsTime(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/tc-tcp.json")
	if err != nil {
		t.Fatal(err)
	}
	prog := func(name string, id uint32) flow.TCProgram {
		return flow.TCProgram{Direction: "ingress", Kind: "tcx", Name: name, ID: id}
	}
	for _, c := range []struct {
		name            string
		swapSeen, newBy float64 // ms: when the old program was seen gone, the new one first seen
		want            []string
	}{
		{"replaced long before", -30000, -30000, []string{"lb_new (id 60)"}},
		{"replaced long after", 60000, 60000, []string{"lb_old (id 52)"}},
		{"replaced around it", 3000, 3000, []string{"one of 2", "lb_old (id 52)", "lb_new (id 60)"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			old, repl := prog("lb_old", 52), prog("lb_new", 60)
			old.Until, repl.Since = flowtest.At(c.swapSeen), flowtest.At(c.newBy)
			cfg := s.Config
			cfg.Attribution.TCPrograms = []flow.TCProgram{old, repl}
			e := flow.NewEngine(cfg)
			for _, o := range s.Observations {
				e.Add(o)
			}
			tc := 0
			for _, f := range e.Flows() {
				if f.RewrittenAt != flow.PlaceTC {
					continue
				}
				tc++
				for _, w := range c.want {
					if !strings.Contains(f.By, w) {
						t.Errorf("flow %s: by %q, want it to name %q", f.Client, f.By, w)
					}
				}
				if len(c.want) == 1 && strings.Contains(f.By, "one of") {
					t.Errorf("flow %s: by %q names more than the program of its time", f.Client, f.By)
				}
			}
			if tc == 0 {
				t.Fatal("no flow was rewritten in tc")
			}
		})
	}
}

// TestTCTailSawTheVIP: the tail observer runs after the tcx programs the
// veth had when it was attached, and before its cls_bpf filters; when it saw
// the VIP and netfilter the backend, those tcx programs are not the
// rewriter, but one attached during the run may sit past the tail.
func TestTCTailSawTheVIP(t *testing.T) {
	for _, c := range []struct {
		name      string
		tcxSince  float64 // ms; 0: there from the start
		want, not []string
	}{
		{"tcx there from the start", 0, []string{"cls_bpf ingress hb_dnat (id 8)"}, []string{"one of", "hb_noop"}},
		{"tcx attached during the run", 5, []string{"one of 2", "tcx ingress hb_noop (id 7)", "cls_bpf ingress hb_dnat (id 8)"}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := httpConfig(obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter)
			tcx := flow.TCProgram{Direction: "ingress", Kind: "tcx", Name: "hb_noop", ID: 7}
			if c.tcxSince != 0 {
				tcx.Since = flowtest.At(c.tcxSince)
			}
			cfg.Attribution.TCPrograms = []flow.TCProgram{tcx, {Direction: "ingress", Kind: "cls_bpf", Name: "hb_dnat", ID: 8}}
			e := flow.NewEngine(cfg)
			e.Add(req(10, obs.PointTCHead, obs.DirIn, vip))
			e.Add(req(10.01, obs.PointTCTail, obs.DirIn, vip))
			e.Add(req(10.02, obs.PointNFBefore, 0, backend))
			e.Add(req(10.03, obs.PointNFAfter, 0, backend))
			f := only(t, e)
			if f.RewrittenAt != flow.PlaceTC {
				t.Fatalf("rewritten_at %s (%s), want tc", f.RewrittenAt, f.Reason)
			}
			for _, w := range c.want {
				if !strings.Contains(f.By, w) {
					t.Errorf("by %q, want it to name %q", f.By, w)
				}
			}
			for _, n := range c.not {
				if strings.Contains(f.By, n) {
					t.Errorf("by %q names %q", f.By, n)
				}
			}
		})
	}
}

// TestTCXChainEnded: a request the tc head saw and the tail (watching)
// never did was ended by a program of the tcx chain (TCX_PASS, a redirect):
// the kernel then runs none of the veth's cls_bpf filters, which cannot
// have rewritten it.
func TestTCXChainEnded(t *testing.T) {
	cfg := httpConfig(obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter)
	cfg.Attribution.TCPrograms = []flow.TCProgram{
		{Direction: "ingress", Kind: "tcx", Name: "hb_dnat_ok", ID: 7},
		{Direction: "ingress", Kind: "cls_bpf", Name: "hb_noop", ID: 8},
	}
	e := flow.NewEngine(cfg)
	e.Add(req(10, obs.PointTCHead, obs.DirIn, vip))
	e.Add(req(10.02, obs.PointNFBefore, 0, backend))
	e.Add(req(10.03, obs.PointNFAfter, 0, backend))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceTC || f.By != "tcx ingress hb_dnat_ok (id 7)" {
		t.Errorf("got %s by %q, want tc by the tcx program alone", f.RewrittenAt, f.By)
	}
	if strings.Contains(f.Reason, "cls_bpf program after it") {
		t.Errorf("reason %q still offers a cls_bpf filter that never ran", f.Reason)
	}
}

// TestNowhereNamesMirredRedirect: a request that left the uplink with the
// VIP, never seen by netfilter (which watched) although the node hands its
// bridged frames to it, names the tc filter at its host veth's ingress
// whose mirred action redirected it past the bridge and netfilter; another
// veth's is not named.
func TestNowhereNamesMirredRedirect(t *testing.T) {
	cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
	cfg.Attribution.TCPrograms = nil
	cfg.Attribution.HostRedirects = []flow.TCRedirect{
		{Ifindex: 5, Text: "veth-a ingress u32 pref 10: mirred egress redirect to bond0"},
		{Ifindex: 9, Text: "veth-b ingress matchall pref 1: mirred egress redirect to eth1"},
	}
	e := flow.NewEngine(cfg)
	h := req(10, obs.PointHost, obs.DirIn, vip)
	h.Ifindex = 5
	e.Add(h)
	e.Add(req(10.02, obs.PointUplink, obs.DirOut, vip))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceNowhere || f.By != "" {
		t.Fatalf("got %s by %q, want nowhere by nobody", f.RewrittenAt, f.By)
	}
	if !strings.Contains(f.Reason, "netfilter never saw it (a tc filter at its host veth's ingress") ||
		!strings.Contains(f.Reason, "veth-a ingress u32 pref 10: mirred egress redirect to bond0") || strings.Contains(f.Reason, "veth-b") {
		t.Errorf("reason %q does not name the redirect of its own veth", f.Reason)
	}
}

// TestNowhereRedirectOfARoutedPod: with bridge-nf-call-iptables 0, the
// NAT rules that did not apply to a bridged Pod's request are put on the
// bridge, and its redirect passes the bridge; a routed Pod's host veth (no
// master, as Calico's) is on no bridge: its request met netfilter whatever
// that sysctl says, and only the redirect kept it away.
func TestNowhereRedirectOfARoutedPod(t *testing.T) {
	for _, c := range []struct {
		name   string
		routed bool
		want   []string
		lacks  string
	}{
		{"bridged", false, []string{"bridge-nf-call-iptables=0: bridged frames bypass netfilter", "past the bridge and netfilter"}, ""},
		{"routed", true, []string{"1 NAT rule(s) for the VIP exist but did not apply; netfilter never saw it (a tc filter at its host veth's ingress sends packets to another interface, past netfilter: "}, "bridge"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
			cfg.Attribution.TCPrograms = nil
			off := false
			cfg.Attribution.BridgeNFCallIPTables = &off
			cfg.Attribution.NATRules = []flow.NATRule{{Source: "nftables", Table: "ip kube-proxy", Chain: "services", Hook: "prerouting",
				VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{backend}, Rule: "dnat to " + backend.String()}}
			cfg.Attribution.HostRedirects = []flow.TCRedirect{{Ifindex: 5, Text: "cali1a2b3c4d5e6 ingress u32 pref 49152: mirred egress redirect to enp7s0"}}
			if c.routed {
				cfg.Attribution.RoutedHostVeths = map[int]bool{5: true}
			}
			e := flow.NewEngine(cfg)
			h := req(10, obs.PointHost, obs.DirIn, vip)
			h.Ifindex = 5
			e.Add(h)
			e.Add(req(10.02, obs.PointUplink, obs.DirOut, vip))
			f := only(t, e)
			if f.RewrittenAt != flow.PlaceNowhere {
				t.Fatalf("got %s by %q, want nowhere", f.RewrittenAt, f.By)
			}
			for _, w := range c.want {
				if !strings.Contains(f.Reason, w) {
					t.Errorf("reason %q lacks %q", f.Reason, w)
				}
			}
			if c.lacks != "" && strings.Contains(f.Reason, c.lacks) {
				t.Errorf("reason %q speaks of a %s", f.Reason, c.lacks)
			}
		})
	}
}

// TestNowhereBridgeNFOnlyWhereNetfilterMissedIt: bridge-nf-call-iptables 0
// explains NAT rules that did not apply only to a request netfilter never
// saw: not to a node process's, which passes no bridge and which netfilter
// saw at output, nor to a bridged Pod's that netfilter saw at prerouting
// (a conntrack entry made before the rules, say).
func TestNowhereBridgeNFOnlyWhereNetfilterMissedIt(t *testing.T) {
	nodeClient := netip.MustParseAddrPort("192.168.77.2:41077")
	for _, c := range []struct {
		name string
		seq  []obs.Observation
	}{
		{"node process", []obs.Observation{
			{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockConnect, NetNS: 1, Proto: obs.TCP,
				Src: netip.AddrPortFrom(nodeClient.Addr(), 0), Dst: vip, ReqDst: vip, Cookie: 9},
			{Time: flowtest.At(0.01), Point: obs.PointSockState, NetNS: 1, Proto: obs.TCP, Src: nodeClient, Dst: vip, Cookie: 9},
			{Time: flowtest.At(0.02), Point: obs.PointSockEgress, NetNS: 1, Proto: obs.TCP, Src: nodeClient, Dst: vip, Cookie: 9, TCPFlags: 0x02},
			{Time: flowtest.At(0.021), Point: obs.PointNFBefore, Hook: obs.HookLocalOut, Proto: obs.TCP, Src: nodeClient, Dst: vip, TCPFlags: 0x02},
			{Time: flowtest.At(0.022), Point: obs.PointNFAfter, Hook: obs.HookLocalOut, Proto: obs.TCP, Src: nodeClient, Dst: vip, TCPFlags: 0x02},
			{Time: flowtest.At(0.03), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: nodeClient, Dst: vip, TCPFlags: 0x02},
		}},
		{"bridged Pod seen by netfilter", []obs.Observation{
			req(10, obs.PointHost, obs.DirIn, vip),
			req(10.01, obs.PointNFBefore, 0, vip),
			req(10.011, obs.PointNFAfter, 0, vip),
			req(10.02, obs.PointUplink, obs.DirOut, vip),
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := httpConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
			cfg.HostNetNS = 1
			cfg.Attribution.TCPrograms = nil
			off := false
			cfg.Attribution.BridgeNFCallIPTables = &off
			cfg.Attribution.NATRules = []flow.NATRule{{Source: "nftables", Table: "ip kube-proxy", Chain: "services", Hook: "prerouting",
				VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{backend}, Rule: "dnat to " + backend.String()}}
			e := flow.NewEngine(cfg)
			for _, o := range c.seq {
				e.Add(o)
			}
			f := only(t, e)
			if f.RewrittenAt != flow.PlaceNowhere || !strings.Contains(f.Reason, "NAT rule(s) for the VIP exist but did not apply") {
				t.Fatalf("got %s by %q (%s), want nowhere with its rules", f.RewrittenAt, f.By, f.Reason)
			}
			if strings.Contains(f.Reason, "bridge") {
				t.Errorf("reason %q puts it on the bridge", f.Reason)
			}
		})
	}
}

// TestUDPSidecarRedirect: an unconnected UDP socket's datagram to the VIP
// that its Pod's own OUTPUT NAT redirects to a local proxy (a sidecar's DNS
// capture) has no socket tuple between the socket observer and its first
// packet; with no sock_addr program effective on its cgroup (read), the
// socket layer is excluded and the verdict is the Pod's netfilter. With
// one, it stays open.
func TestUDPSidecarRedirect(t *testing.T) {
	dnsVIP := netip.MustParseAddrPort("10.120.0.10:53")
	proxy := netip.MustParseAddrPort("127.0.0.1:15053")
	const cg = 9001
	for _, c := range []struct {
		name  string
		progs []flow.SockProgram
		want  flow.Place
	}{
		{"no sock_addr program", []flow.SockProgram{}, flow.PlaceNetfilter},
		{"a sendmsg4 program", []flow.SockProgram{{AttachType: "sendmsg4", Name: "lb_sendmsg4", ID: 3}}, flow.PlaceUnknown},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := flow.Config{Services: []flow.Service{{Addr: dnsVIP.Addr(), Port: dnsVIP.Port(), Proto: obs.UDP}},
				Points: map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockEgress: true, obs.PointPod: true}}
			e := flow.NewEngine(cfg)
			e.SetCgroupSockPrograms(cg, c.progs)
			e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockSendmsg, Proto: obs.UDP,
				Src: netip.MustParseAddrPort("10.244.8.23:0"), ReqDst: dnsVIP, Dst: dnsVIP, Cookie: 11, Cgroup: cg})
			e.Add(obs.Observation{Time: flowtest.At(0.01), Point: obs.PointSockEgress, Proto: obs.UDP,
				Src: netip.MustParseAddrPort("10.244.8.23:36236"), Dst: proxy, Cookie: 11, Cgroup: cg, Len: 33})
			f := only(t, e)
			if f.RewrittenAt != c.want {
				t.Fatalf("got %s by %q (%s), want %s", f.RewrittenAt, f.By, f.Reason, c.want)
			}
			if c.want == flow.PlaceNetfilter && (f.By != flow.ByClientNetfilter || !strings.Contains(f.Reason, "socket excluded")) {
				t.Errorf("by %q reason %q", f.By, f.Reason)
			}
		})
	}
}

// TestUDPSidecarProxyNotListening: a DNS query its Pod's own OUTPUT NAT
// redirected to a proxy port where nothing listened (the proxy not started
// yet) is dropped by the Pod's kernel, which answers an ICMP port
// unreachable (the app reads ECONNREFUSED): the reason says no proxy took
// it, not that the proxy's upstream is another flow.
func TestUDPSidecarProxyNotListening(t *testing.T) {
	dnsVIP := netip.MustParseAddrPort("10.120.0.10:53")
	proxy := netip.MustParseAddrPort("127.0.0.1:15053")
	app := netip.MustParseAddrPort("10.244.8.23:35027")
	const cg = 9001
	cfg := flow.Config{Services: []flow.Service{{Addr: dnsVIP.Addr(), Port: dnsVIP.Port(), Proto: obs.UDP}},
		Points: map[obs.Point]bool{obs.PointSockAddr: true, obs.PointSockEgress: true, obs.PointPod: true, obs.PointDrop: true}}
	e := flow.NewEngine(cfg)
	e.SetCgroupSockPrograms(cg, []flow.SockProgram{})
	e.Add(obs.Observation{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockSendmsg, Proto: obs.UDP,
		Src: netip.MustParseAddrPort("10.244.8.23:0"), ReqDst: dnsVIP, Dst: dnsVIP, Cookie: 12, Cgroup: cg})
	e.Add(obs.Observation{Time: flowtest.At(0.01), Point: obs.PointSockEgress, Proto: obs.UDP, Src: app, Dst: proxy, Cookie: 12, Cgroup: cg, Len: 36})
	e.Add(obs.Observation{Time: flowtest.At(0.02), Point: obs.PointDrop, Proto: obs.UDP, Src: app, Dst: proxy, NetNS: 4026533211, Ifindex: 1,
		Drop: &obs.KernelDrop{Reason: "NO_SOCKET", Func: "__udp4_lib_rcv"}})
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceNetfilter || f.By != flow.ByClientNetfilter {
		t.Fatalf("got %s by %q (%s), want netfilter by %q", f.RewrittenAt, f.By, f.Reason, flow.ByClientNetfilter)
	}
	if !strings.Contains(f.Reason, "but nothing listened there: the Pod's kernel dropped the request (NO_SOCKET in __udp4_lib_rcv) and refused it with an ICMP port unreachable") ||
		strings.Contains(f.Reason, "upstream connection") || f.Refused {
		t.Errorf("refused %v, reason %q", f.Refused, f.Reason)
	}
}

// TestPodTCProgramsOfARecreatedPod: a Pod deleted and made again whose host
// veth got its predecessor's ifindex (discover.PodWatch) has its own eth0
// programs, found when it started: a flow of the new Pod is not put on the
// gone Pod's program, nor a flow of the gone Pod on the new one's, though
// both are tied to the same host veth ifindex. It named both ("one of 2:
// tcx egress mesh_lb (id 71) ...; tcx egress mesh_lb (id 91) ..."), one of
// them a program that was no longer anywhere.
func TestPodTCProgramsOfARecreatedPod(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/tc-pod-eth0-egress.json")
	if err != nil {
		t.Fatal(err)
	}
	newLB := flow.TCProgram{Direction: "egress", Kind: "tcx", Name: "mesh_lb", ID: 91, Ifindex: 5}
	for _, tc := range []struct {
		name  string
		found float64 // when the new Pod was found (ms; the flow is at 0)
		want  string
	}{
		{"the flow is the new Pod's", -2000, "tcx egress mesh_lb (id 91) on the Pod's eth0"},
		{"the flow is the gone Pod's", 20000, "tcx egress mesh_lb (id 71) on the Pod's eth0"},
	} {
		e := flow.NewEngine(s.Config)
		// Another Pod started too, whose host veth is another one.
		other := flow.TCProgram{Direction: "egress", Kind: "tcx", Name: "other_lb", ID: 95, Ifindex: 12}
		e.AddPodTCPrograms(flowtest.At(tc.found), []int{5, 12}, []flow.TCProgram{newLB, other})
		for _, o := range s.Observations {
			e.Add(o)
		}
		flows := e.Flows()
		if len(flows) != 1 {
			t.Fatalf("%s: %d flows, want 1", tc.name, len(flows))
		}
		if f := flows[0]; f.RewrittenAt != flow.PlaceTC || f.By != tc.want {
			t.Errorf("%s: %s by %q, want tc by %q", tc.name, f.RewrittenAt, f.By, tc.want)
		}
	}
}

// TestMirredRedirectOfAGoneVeth: a mirred redirect read on a host veth at
// the start stays on it, not on the veth of a Pod made again later with its
// ifindex: the new Pod's nowhere flow (bridge-nf-call-iptables 0, say) is
// not told that a tc filter of its host veth sends its packets past
// netfilter; a flow of the veth's own time still is.
func TestMirredRedirectOfAGoneVeth(t *testing.T) {
	for _, c := range []struct {
		name     string
		found    float64 // when the new Pod was found (ms; the flow is at 10)
		redirect bool
	}{
		{"the new Pod's flow", 5, false},
		{"the gone Pod's flow", 5000, true},
	} {
		cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
		cfg.Attribution.TCPrograms = nil
		cfg.Attribution.HostRedirects = []flow.TCRedirect{
			{Ifindex: 5, Text: "veth-a ingress u32 pref 10: mirred egress redirect to bond0"},
		}
		e := flow.NewEngine(cfg)
		e.AddPodTCPrograms(flowtest.At(c.found), []int{5}, nil)
		h := req(10, obs.PointHost, obs.DirIn, vip)
		h.Ifindex = 5
		e.Add(h)
		e.Add(req(10.02, obs.PointUplink, obs.DirOut, vip))
		f := only(t, e)
		if f.RewrittenAt != flow.PlaceNowhere {
			t.Fatalf("%s: got %s, want nowhere", c.name, f.RewrittenAt)
		}
		if got := strings.Contains(f.Reason, "mirred egress redirect to bond0"); got != c.redirect {
			t.Errorf("%s: the reason names veth-a's redirect: %v, want %v (%q)", c.name, got, c.redirect, f.Reason)
		}
	}
}

// TestMirredRedirectOfANewVeth: the mirred redirect read on the host veth
// of a Pod that started during the run (AddHostRedirects) is named by that
// Pod's nowhere flow, as one read at the start is; when the new veth took
// the ifindex of a gone Pod's, a flow of the gone Pod's time names the old
// veth's redirect, not the new one's.
func TestMirredRedirectOfANewVeth(t *testing.T) {
	const (
		old = "veth-a ingress u32 pref 10: mirred egress redirect to bond0"
		neu = "veth-b ingress matchall pref 1: mirred egress redirect to eth1"
	)
	for _, c := range []struct {
		name    string
		start   []flow.TCRedirect // read at the start
		found   float64           // when the new Pod was found (ms; the flow is at 10)
		want    string
		wantNot string
	}{
		{"a new Pod's flow", nil, 1000, neu, ""},
		{"the gone Pod's flow", []flow.TCRedirect{{Ifindex: 5, Text: old}}, 60000, old, neu},
	} {
		cfg := httpConfig(obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
		cfg.Attribution.TCPrograms = nil
		cfg.Attribution.HostRedirects = c.start
		e := flow.NewEngine(cfg)
		e.AddPodTCPrograms(flowtest.At(c.found), []int{5}, nil)
		e.AddHostRedirects(flowtest.At(c.found), []flow.TCRedirect{{Ifindex: 5, Text: neu}})
		h := req(10, obs.PointHost, obs.DirIn, vip)
		h.Ifindex = 5
		e.Add(h)
		e.Add(req(10.02, obs.PointUplink, obs.DirOut, vip))
		f := only(t, e)
		if f.RewrittenAt != flow.PlaceNowhere {
			t.Fatalf("%s: got %s, want nowhere", c.name, f.RewrittenAt)
		}
		if !strings.Contains(f.Reason, c.want) || c.wantNot != "" && strings.Contains(f.Reason, c.wantNot) {
			t.Errorf("%s: reason %q, want it to name %q and not %q", c.name, f.Reason, c.want, c.wantNot)
		}
	}
}
