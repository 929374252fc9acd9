package flow_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// netkitConfig is a node whose Pod's host side (ifindex 4) is the primary
// of a netkit pair with a program on its peer (what the Pod sends), as
// Cilium's datapathMode=netkit attaches cil_from_container, and no tc
// program on the host side itself.
func netkitConfig() flow.Config {
	cfg := httpConfig(obs.PointPod, obs.PointHost, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
	cfg.Attribution.TCPrograms = []flow.TCProgram{
		{Direction: "ingress", Kind: "netkit", Name: "cil_from_container", ID: 31, Ifindex: 4},
		{Direction: "egress", Kind: "netkit", Name: "cil_to_container", ID: 32, Ifindex: 4},
	}
	return cfg
}

// at puts an observation on the interface ifindex.
func at(o obs.Observation, ifindex int) obs.Observation {
	o.Ifindex = ifindex
	return o
}

// TestNetkitPeerProgram: a netkit pair runs its peer's programs inside the
// pair, after the Pod's eth0 TX tap and before the host side's RX tap: the
// Pod's eth0 saw the VIP, the host side the backend. The rewrite is the
// netkit program's (a tc-like BPF stage), never "nothing in between".
func TestNetkitPeerProgram(t *testing.T) {
	e := flow.NewEngine(netkitConfig())
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(at(req(10.01, obs.PointHost, obs.DirIn, backend), 4))
	e.Add(req(10.02, obs.PointNFBefore, 0, backend))
	e.Add(req(10.03, obs.PointNFAfter, 0, backend))
	e.Add(req(10.04, obs.PointUplink, obs.DirOut, backend))
	wantNetkitPeer(t, only(t, e), "netkit", "the netkit pair's program did it")
}

// TestNetkitRedirect: the netkit peer program redirected the request
// straight to the uplink (bpf_redirect_neigh): the host side's tap, the
// node's tc and netfilter (all watching) never saw it, the uplink saw the
// backend. Only the netkit program was on its way.
func TestNetkitRedirect(t *testing.T) {
	e := flow.NewEngine(netkitConfig())
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(req(10.04, obs.PointUplink, obs.DirOut, backend))
	wantNetkitPeer(t, only(t, e), "redirect", "the program took it past the node's stack")
}

// wantNetkitPeer wants f rewritten at tc by the netkit peer program, its
// reason holding word (it says what).
func wantNetkitPeer(t *testing.T, f flow.Flow, word, what string) {
	t.Helper()
	if f.RewrittenAt != flow.PlaceTC || f.By != "netkit peer cil_from_container (id 31)" {
		t.Fatalf("rewritten_at %s by %q (%s), want tc by the netkit peer program", f.RewrittenAt, f.By, f.Reason)
	}
	if !strings.Contains(f.Reason, word) {
		t.Errorf("reason %q does not say %s", f.Reason, what)
	}
}

// TestVethNoNetkit: a veth (no netkit program) whose host side saw the
// backend after the Pod's eth0 saw the VIP stays inconsistent: nothing
// rewrites inside a veth.
func TestVethNoNetkit(t *testing.T) {
	cfg := netkitConfig()
	cfg.Attribution.TCPrograms = nil
	e := flow.NewEngine(cfg)
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(at(req(10.01, obs.PointHost, obs.DirIn, backend), 4))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceUnknown || !strings.Contains(f.Reason, "nothing between these points rewrites") {
		t.Fatalf("rewritten_at %s (%s), want unknown, inconsistent", f.RewrittenAt, f.Reason)
	}
}

// TestNetkitRedirectOwnPair: on a node of many netkit Pods (Cilium loads
// one program per endpoint), a request its pair redirected past the host
// side is tied to its own pair's program by its client, not to every
// pair's.
func TestNetkitRedirectOwnPair(t *testing.T) {
	cfg := netkitConfig()
	cfg.Attribution.TCPrograms = append(cfg.Attribution.TCPrograms,
		flow.TCProgram{Direction: "ingress", Kind: "netkit", Name: "cil_from_container", ID: 41, Ifindex: 5})
	cfg.Attribution.PodHostSides = map[netip.Addr]int{client.Addr(): 4}
	e := flow.NewEngine(cfg)
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(req(10.04, obs.PointUplink, obs.DirOut, backend))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceTC || f.By != "netkit peer cil_from_container (id 31)" {
		t.Fatalf("rewritten_at %s by %q (%s), want tc by its own pair's peer program", f.RewrittenAt, f.By, f.Reason)
	}
}
