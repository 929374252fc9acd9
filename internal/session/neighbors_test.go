package session

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestNameUplinkNeighbors: a flow reported with an uplink MAC the engine's
// neighbours do not name makes the session read them again (here the node
// as discovery left it: no netns to read) and name it; not more than once
// per neighborsEvery, and not for flows that miss nothing.
func TestNameUplinkNeighbors(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	hw, _ := net.ParseMAC("5a:cf:13:61:b3:16")
	node := &discover.NodeInfo{}
	tr := &tracer{node: node, eng: flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: netip.MustParseAddr("10.96.0.80")}}})}
	missing := func() []flow.Flow {
		return []flow.Flow{{UplinkDstMAC: hw.String(), UplinkIfindex: 2}}
	}
	// Nothing missing: no read.
	tr.nameUplinkNeighbors(t0, []flow.Flow{{UplinkDstMAC: "02:00:0a:f4:08:01", UplinkDstIsGateway: true}, {}})
	if !tr.neighborsRead.IsZero() {
		t.Error("read again for flows missing no neighbour")
	}
	// The next hop resolved since discovery.
	node.UplinkNeighbors = []discover.UplinkNeighbor{{Ifindex: 2, MAC: hw, Addrs: []netip.Addr{netip.MustParseAddr("172.30.0.1")}}}
	fs := missing()
	tr.nameUplinkNeighbors(t0, fs)
	if fs[0].UplinkDstNeighbor != "172.30.0.1" || !tr.neighborsRead.Equal(t0) {
		t.Errorf("named %q (read at %v), want 172.30.0.1 read at %v", fs[0].UplinkDstNeighbor, tr.neighborsRead, t0)
	}
	// Within neighborsEvery: not read again.
	node.UplinkNeighbors[0].Addrs = []netip.Addr{netip.MustParseAddr("172.30.0.2")}
	fs = []flow.Flow{{UplinkDstMAC: "02:00:00:00:00:99", UplinkIfindex: 2}}
	tr.nameUplinkNeighbors(t0.Add(neighborsEvery-time.Millisecond), fs)
	if !tr.neighborsRead.Equal(t0) {
		t.Errorf("read again after %v", neighborsEvery-time.Millisecond)
	}
	fs = missing()
	tr.nameUplinkNeighbors(t0.Add(neighborsEvery), fs)
	if fs[0].UplinkDstNeighbor != "172.30.0.2" {
		t.Errorf("after %v: named %q, want 172.30.0.2", neighborsEvery, fs[0].UplinkDstNeighbor)
	}
	// The engine's map keys discovery's MACs by device.
	m := uplinkNeighbors(node)
	if got := m[flow.UplinkNeighborKey{Ifindex: 2, MAC: obs.MAC(hw)}].String(); len(m) != 1 || got != "172.30.0.2" {
		t.Errorf("engine's neighbours %v", m)
	}
}
