package flow_test

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// stackedConfig traces the client as a Pod whose eth0 is a macvlan on the
// uplink: no host veth, hence no host tap, tc ingress nor its observers.
func stackedConfig() flow.Config {
	cfg := httpConfig(obs.PointPod, obs.PointNFBefore, obs.PointNFAfter, obs.PointUplink)
	cfg.Attribution.TCPrograms = nil
	cfg.Attribution.StackedPods = map[netip.Addr]string{client.Addr(): "macvlan on up0"}
	return cfg
}

// TestStackedPodRewriteUnfound: the Pod's eth0 saw the VIP, the uplink the
// backend, netfilter (watching) nothing, and no tc program is on the
// uplink: with no host side, the only place left is the uplink's egress,
// where pathtrace found nothing (a tc action, an nftables netdev egress
// chain): unknown, saying so, never a host veth's tc that does not exist.
func TestStackedPodRewriteUnfound(t *testing.T) {
	e := flow.NewEngine(stackedConfig())
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(req(10.04, obs.PointUplink, obs.DirOut, backend))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceUnknown || !strings.Contains(f.Reason, "no host side (macvlan on up0)") || strings.Contains(f.Reason, "host veth") {
		t.Fatalf("rewritten_at %s (%s), want unknown, at the uplink's egress of a Pod without host side", f.RewrittenAt, f.Reason)
	}
}

// TestStackedPodUplinkTC: the same with a tc program on the uplink's
// egress: it did it.
func TestStackedPodUplinkTC(t *testing.T) {
	cfg := stackedConfig()
	cfg.Attribution.UplinkTCPrograms = []flow.TCProgram{{Direction: "egress", Kind: "tcx", Name: "up_lb", ID: 12}}
	e := flow.NewEngine(cfg)
	e.Add(req(10, obs.PointPod, obs.DirOut, vip))
	e.Add(req(10.04, obs.PointUplink, obs.DirOut, backend))
	f := only(t, e)
	if f.RewrittenAt != flow.PlaceTC || f.By != "tcx egress up_lb (id 12) on the uplink" || strings.Contains(f.Reason, "host veth") {
		t.Fatalf("rewritten_at %s by %q (%s), want tc by the uplink's egress program", f.RewrittenAt, f.By, f.Reason)
	}
}
