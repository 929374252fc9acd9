package flow_test

import (
	"net"
	"net/netip"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestUplinkDstNeighbor: a flow whose uplink frame went to a MAC other than
// its Pod's gateway names what the node's neighbour table maps it to on
// the uplink the frame left by (a routed node's next hop; a vxlan uplink's
// remote VTEP with its fdb's underlay address); a gateway's MAC, a MAC
// the table does not know, or one known on another uplink only, names
// nothing. At most two addresses are named.
func TestUplinkDstNeighbor(t *testing.T) {
	mac := func(s string) obs.MAC {
		hw, err := net.ParseMAC(s)
		if err != nil {
			t.Fatal(err)
		}
		return obs.MAC(hw)
	}
	addrs := func(ss ...string) []netip.Addr {
		var out []netip.Addr
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	gw, router, vtep, many, stranger := mac("02:00:0a:f4:08:01"), mac("5a:cf:13:61:b3:16"), mac("0a:88:00:00:00:02"),
		mac("5a:cf:13:61:b3:17"), mac("02:00:00:00:00:99")
	cfg := httpConfig(obs.PointUplink)
	cfg.Attribution.GatewayMACs = []net.HardwareAddr{gw[:]}
	cfg.Attribution.UplinkNeighbors = map[flow.UplinkNeighborKey]flow.UplinkNeighbor{
		{Ifindex: 2, MAC: router}: {Addrs: addrs("172.30.0.1")},
		{Ifindex: 3, MAC: router}: {Addrs: addrs("172.31.0.1")},
		{Ifindex: 5, MAC: vtep}:   {Addrs: addrs("10.88.2.0"), VTEP: netip.MustParseAddr("192.168.90.2")},
		{Ifindex: 2, MAC: many}:   {Addrs: addrs("172.30.0.2", "172.30.0.3", "172.30.0.4")},
		{Ifindex: 2, MAC: gw}:     {Addrs: addrs("172.30.0.9")},
	}
	for _, tt := range []struct {
		name    string
		mac     obs.MAC
		ifindex int
		want    string
	}{
		{"routed next hop", router, 2, "172.30.0.1"},
		{"same MAC on another uplink", router, 3, "172.31.0.1"},
		{"vxlan remote VTEP", vtep, 5, "10.88.2.0, VTEP 192.168.90.2"},
		{"at most two named", many, 2, "172.30.0.2, 172.30.0.3, +1 more"},
		{"uplink unknown: the lowest ifindex's", router, 0, "172.30.0.1"},
		{"known on another uplink only", vtep, 2, ""},
		{"unknown MAC", stranger, 2, ""},
		{"the Pod's gateway", gw, 2, ""},
	} {
		e := flow.NewEngine(cfg)
		o := req(0, obs.PointUplink, obs.DirOut, vip)
		o.DstMAC, o.Ifindex = tt.mac, tt.ifindex
		e.Add(o)
		f := only(t, e)
		if f.UplinkDstNeighbor != tt.want {
			t.Errorf("%s: uplink_dst_neighbor %q, want %q", tt.name, f.UplinkDstNeighbor, tt.want)
		}
		if f.UplinkIfindex != tt.ifindex {
			t.Errorf("%s: uplink ifindex %d, want %d", tt.name, f.UplinkIfindex, tt.ifindex)
		}
	}
}

// TestNameUplinkNeighborsLater: a flow reported before the neighbour table
// knew its uplink MAC (the next hop resolved with its first packet) is
// missing one; once the session sets the table read again, the engine
// names it in the flows reported, and in its later snapshots.
func TestNameUplinkNeighborsLater(t *testing.T) {
	hw, _ := net.ParseMAC("5a:cf:13:61:b3:16")
	router := obs.MAC(hw)
	e := flow.NewEngine(httpConfig(obs.PointUplink))
	o := req(0, obs.PointUplink, obs.DirOut, vip)
	o.DstMAC, o.Ifindex = router, 4
	e.Add(o)
	fs := e.Flows()
	if len(fs) != 1 || !fs[0].UplinkNeighborMissing() || fs[0].UplinkDstNeighbor != "" {
		t.Fatalf("before the table knows the MAC: %+v, want one flow missing its neighbour", fs)
	}
	e.SetUplinkNeighbors(map[flow.UplinkNeighborKey]flow.UplinkNeighbor{
		{Ifindex: 4, MAC: router}: {Addrs: []netip.Addr{netip.MustParseAddr("172.30.0.1")}},
	})
	e.NameUplinkNeighbors(fs)
	if fs[0].UplinkDstNeighbor != "172.30.0.1" || fs[0].UplinkNeighborMissing() {
		t.Errorf("named later: %q, want 172.30.0.1", fs[0].UplinkDstNeighbor)
	}
	if f := only(t, e); f.UplinkDstNeighbor != "172.30.0.1" {
		t.Errorf("next snapshot: %q, want 172.30.0.1", f.UplinkDstNeighbor)
	}
	// A flow without an uplink MAC, or to the gateway, misses nothing.
	for _, f := range []flow.Flow{{}, {UplinkDstMAC: "02:00:0a:f4:08:01", UplinkDstIsGateway: true}} {
		if f.UplinkNeighborMissing() {
			t.Errorf("%+v misses a neighbour", f)
		}
	}
}
