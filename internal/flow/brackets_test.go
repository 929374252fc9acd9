package flow_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestNodeClientRewrittenBeforeItsEgress: a node process's connection
// whose socket tuple (SYN_SENT) names the VIP and whose first packet, at
// the socket's egress hook (after OUTPUT and POSTROUTING), the backend, was
// rewritten by the node's OUTPUT NAT: no Pod netns and no host veth lie on
// its way. Without the netfilter observers and conntrack, that bracket alone
// decides; it was "unknown: could be netfilter in the Pod's netns or tc
// egress in the Pod's netns or tc or netfilter".
func TestNodeClientRewrittenBeforeItsEgress(t *testing.T) {
	nodeClient := netip.MustParseAddrPort("192.168.77.2:41077")
	cfg := httpConfig(obs.PointSockAddr, obs.PointSockState, obs.PointSockEgress, obs.PointUplink)
	cfg.HostNetNS = 1
	cfg.Attribution.NATRules = []flow.NATRule{{Source: "nftables", Table: "ip kube-proxy", Chain: "services", Hook: "output",
		VIP: vip, Proto: obs.TCP, Backends: []netip.AddrPort{backend}, Rule: "dnat to 10.244.20.31:3000"}}
	seq := []obs.Observation{
		{Time: flowtest.At(0), Point: obs.PointSockAddr, Kind: obs.SockConnect, NetNS: 1, Proto: obs.TCP,
			Src: netip.AddrPortFrom(nodeClient.Addr(), 0), Dst: vip, ReqDst: vip, Cookie: 9},
		{Time: flowtest.At(0.01), Point: obs.PointSockState, NetNS: 1, Proto: obs.TCP, Src: nodeClient, Dst: vip, Cookie: 9},
		{Time: flowtest.At(0.02), Point: obs.PointSockEgress, NetNS: 1, Proto: obs.TCP, Src: nodeClient, Dst: backend, Cookie: 9, TCPFlags: 0x02},
		{Time: flowtest.At(0.03), Point: obs.PointUplink, Dir: obs.DirOut, Proto: obs.TCP, Src: nodeClient, Dst: backend, TCPFlags: 0x02},
		{Time: flowtest.At(0.4), Point: obs.PointUplink, Dir: obs.DirIn, Proto: obs.TCP, Src: backend, Dst: nodeClient, TCPFlags: 0x12},
	}
	e := flow.NewEngine(cfg)
	for _, o := range seq {
		e.Add(o)
	}
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceNetfilter || !strings.Contains(f.By, "dnat to 10.244.20.31:3000") {
		t.Errorf("got %s by %q (%s), want netfilter by the OUTPUT rule", f.RewrittenAt, f.By, f.Reason)
	}
}

// TestIPVSExcludedWhenNetfilterNeverSawIt: IPVS rewrites inside netfilter's
// hooks (LOCAL_IN, LOCAL_OUT), after the observers at PREROUTING and
// OUTPUT: a request those observers (watching) never saw met no IPVS
// either. A node whose VIP IPVS also serves, whose veth's cls_bpf program
// rewrote the request and sent it out past netfilter, has its flow placed
// at tc by that program; it was "unknown: could be tc or ipvs".
func TestIPVSExcludedWhenNetfilterNeverSawIt(t *testing.T) {
	cfg := httpConfig(obs.PointHost, obs.PointTCHead, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
	cfg.Attribution.TCPrograms = []flow.TCProgram{{Direction: "ingress", Kind: "cls_bpf", Name: "lb_cls", ID: 8}}
	cfg.Attribution.IPVS = []flow.IPVSService{{VIP: vip, Proto: obs.TCP, Scheduler: "rr", Backends: []netip.AddrPort{other}}}
	seq := []obs.Observation{
		flags(req(0, obs.PointHost, obs.DirIn, vip), 0x02),
		flags(req(0.01, obs.PointTCHead, obs.DirIn, vip), 0x02),
		flags(req(0.03, obs.PointUplink, obs.DirOut, backend), 0x02),
	}
	for _, reverse := range []bool{false, true} {
		e := flow.NewEngine(cfg)
		for i := range seq {
			if reverse {
				i = len(seq) - 1 - i
			}
			e.Add(seq[i])
		}
		f := only(t, e)
		if f.RewrittenAt != flow.PlaceTC || f.By != "cls_bpf ingress lb_cls (id 8)" {
			t.Errorf("reverse=%v: got %s by %q (%s), want tc by the veth's cls_bpf program", reverse, f.RewrittenAt, f.By, f.Reason)
		}
	}
}

// TestClsBPFRedirect: on a node whose host veths carry only legacy cls_bpf
// filters (older Cilium), pathtrace's tc tails are left out: the head runs
// before every filter, and sees what a tail would. Cilium's fast path there
// (its cls_bpf filter DNATs the VIP and redirects the request to the
// uplink, whose egress program SNATs it to the node's address) leaves the
// request seen with the VIP at the tc head and never by netfilter
// (watching), and the backend answering: a tc program took it out of the
// stack, as a tcx program's redirect does where tails watch. It was
// "unknown: ... rewritten where no active point saw it afterwards".
func TestClsBPFRedirect(t *testing.T) {
	svc := netip.MustParseAddrPort("10.96.0.50:80")
	be := netip.MustParseAddrPort("10.200.2.5:8080")
	cl := netip.MustParseAddrPort("10.200.1.10:42000")
	cfg := flow.Config{
		Services: []flow.Service{{Addr: svc.Addr(), Port: svc.Port(), Proto: obs.TCP}},
		Points:   map[obs.Point]bool{obs.PointPod: true, obs.PointHost: true, obs.PointTCHead: true, obs.PointNFBefore: true, obs.PointNFAfter: true, obs.PointUplink: true},
		Attribution: flow.Attribution{
			TCPrograms: []flow.TCProgram{
				{Direction: "ingress", Kind: "cls_bpf", Name: "cil_from_container", ID: 70},
				{Direction: "egress", Kind: "cls_bpf", Name: "cil_to_container", ID: 72},
			},
			UplinkTCPrograms: []flow.TCProgram{{Direction: "egress", Kind: "cls_bpf", Name: "cil_to_netdev", ID: 71}},
		},
	}
	p := func(ms float64, pt obs.Point, dir obs.Dir, src, dst netip.AddrPort, fl uint8) obs.Observation {
		return obs.Observation{Time: flowtest.At(ms), Point: pt, Dir: dir, Proto: obs.TCP, Src: src, Dst: dst, Len: 74, TCPFlags: fl}
	}
	e := flow.NewEngine(cfg)
	for _, o := range []obs.Observation{
		p(0, obs.PointPod, obs.DirOut, cl, svc, 0x02),
		p(0.01, obs.PointHost, obs.DirIn, cl, svc, 0x02),
		p(0.012, obs.PointTCHead, obs.DirIn, cl, svc, 0x02),
		p(0.4, obs.PointTCHead, obs.DirOut, be, cl, 0x12),
		p(0.42, obs.PointHost, obs.DirOut, svc, cl, 0x12),
		p(0.43, obs.PointPod, obs.DirIn, svc, cl, 0x12),
	} {
		e.Add(o)
	}
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceTC || !strings.Contains(f.By, "cls_bpf ingress cil_from_container (id 70)") {
		t.Errorf("got %s by %q (%s), want tc by the veth's cls_bpf filter (or the uplink's)", f.RewrittenAt, f.By, f.Reason)
	}
}
