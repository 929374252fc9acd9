package report

import (
	"bytes"
	"net/netip"
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
)

// TestUplinkNeighborCell: the UPLINK DST MAC cell names what the node's
// neighbour table maps a non-gateway MAC to, in parentheses; a gateway's
// stays "gw", an unknown one the MAC alone. The JSON has it as
// uplink_dst_neighbor, left out when unknown.
func TestUplinkNeighborCell(t *testing.T) {
	vlan := uint16(0)
	mk := func(id int, mac string, gw bool, neigh string) flow.Flow {
		return flow.Flow{ID: id, Proto: "tcp", Client: netip.AddrPortFrom(netip.MustParseAddr("10.244.1.5"), uint16(40400+id)),
			Service: netip.MustParseAddrPort("10.96.0.80:80"), Backend: netip.MustParseAddrPort("10.244.2.7:8080"),
			RewrittenAt: flow.PlaceNetfilter, By: "nft nat KUBE-SVC-X -> dnat", VLAN: &vlan, Reply: true,
			UplinkDstMAC: mac, UplinkDstIsGateway: gw, UplinkDstNeighbor: neigh}
	}
	flows := []flow.Flow{
		mk(1, "5a:cf:13:61:b3:16", false, "172.30.0.1"),
		mk(2, "0a:88:00:00:00:02", false, "10.88.2.0, VTEP 192.168.90.2"),
		mk(3, "ce:58:b4:73:6f:47", true, ""),
		mk(4, "de:ad:be:ef:00:02", false, ""),
	}
	var b bytes.Buffer
	w := NewWriter(&b, FormatTable)
	if err := w.Flows(flows); err != nil {
		t.Fatal(err)
	}
	table := b.String()
	for _, want := range []string{"5a:cf:13:61:b3:16 (172.30.0.1) ", "0a:88:00:00:00:02 (10.88.2.0, VTEP 192.168.90.2) ",
		"ce:58:b4:73:6f:47 gw ", "de:ad:be:ef:00:02 "} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if strings.Contains(table, "de:ad:be:ef:00:02 (") || strings.Contains(table, "gw (") {
		t.Errorf("a cell without a known neighbour names one:\n%s", table)
	}

	b.Reset()
	w = NewWriter(&b, FormatJSON)
	if err := w.Flows(flows); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d JSON lines, want 4:\n%s", len(lines), b.String())
	}
	if !strings.Contains(lines[0], `"uplink_dst_neighbor":"172.30.0.1"`) ||
		!strings.Contains(lines[1], `"uplink_dst_neighbor":"10.88.2.0, VTEP 192.168.90.2"`) {
		t.Errorf("JSON lacks uplink_dst_neighbor:\n%s", b.String())
	}
	for _, l := range lines[2:] {
		if strings.Contains(l, "uplink_dst_neighbor") {
			t.Errorf("JSON names an unknown neighbour: %s", l)
		}
	}
	if strings.Contains(b.String(), "UplinkIfindex") || strings.Contains(b.String(), "uplink_ifindex") {
		t.Errorf("JSON has the uplink ifindex: %s", b.String())
	}
}

// TestVLANColumn: the VLAN column says untagged only for a frame without a
// tag; an 802.1Q priority tag (VLAN ID 0) is a tag, shown as tcpdump -e
// shows it (vlan 0), with its protocol.
func TestVLANColumn(t *testing.T) {
	v := func(n uint16) *uint16 { return &n }
	for _, c := range []struct {
		vlan  *uint16
		proto string
		want  string
	}{
		{nil, "", "-"},
		{v(0), "", "untagged"},
		{v(0), "802.1Q", "0 (802.1Q)"},
		{v(200), "", "200"},
		{v(300), "802.1ad", "300 (802.1ad)"},
	} {
		if got := vlan(c.vlan, c.proto); got != c.want {
			t.Errorf("vlan(%v, %q) = %q, want %q", c.vlan, c.proto, got, c.want)
		}
	}
}
