package discover

import (
	"fmt"
	"os/exec"
	"slices"
	"testing"
)

// TestUplinkNeighbors: discovery reads what the uplinks' neighbour tables
// map MACs to (not the FAILED or INCOMPLETE entries, nor another device's),
// and for a vxlan uplink (flannel.1) its fdb's remote underlay address of
// each MAC; RefreshUplinkNeighbors reads entries added since (a next hop
// resolved with the first packet). No traffic: the entries are permanent.
func TestUplinkNeighbors(t *testing.T) {
	n, info := flannelNode(t,
		// The router, the node's next hop.
		"neigh replace 10.99.70.254 lladdr 5a:cf:13:61:b3:16 nud permanent dev ens3",
		// A failed entry names nothing.
		"neigh replace 10.99.70.9 lladdr 5a:cf:13:61:b3:99 nud failed dev ens3",
		// The remote node's VTEP: its overlay address (its underlay one is
		// in the fdb, added below).
		"neigh replace 10.244.1.0 lladdr 0a:88:00:00:00:02 nud permanent dev flannel.1",
		// A Pod-side neighbour, not on an uplink.
		"neigh replace 10.244.0.5 lladdr 0a:58:0a:f4:00:05 nud permanent dev cni0")
	names := map[int]string{}
	for _, cp := range info.CapturePoints {
		if cp.Role == RoleUplink {
			names[cp.Ifindex] = cp.Ifname
		}
	}
	show := func(ns []UplinkNeighbor) []string {
		var out []string
		for _, ne := range ns {
			s := fmt.Sprintf("%s %s %v", names[ne.Ifindex], ne.MAC, ne.Addrs)
			if ne.VTEP.IsValid() {
				s += " vtep " + ne.VTEP.String()
			}
			out = append(out, s)
		}
		slices.Sort(out)
		return out
	}
	want := []string{
		"ens3 5a:cf:13:61:b3:16 [10.99.70.254]",
		"flannel.1 0a:88:00:00:00:02 [10.244.1.0]",
	}
	if got := show(info.UplinkNeighbors); !slices.Equal(got, want) {
		t.Errorf("uplink neighbours (uplinks %v):\n got %q\nwant %q\nnotes %q", names, got, want, info.Notes)
	}
	// The fdb: the VTEP's underlay address, and a flood entry (all-zero
	// MAC) that names no MAC.
	for _, fdb := range [][]string{{"0a:88:00:00:00:02", "10.99.70.2"}, {"00:00:00:00:00:00", "10.99.70.3"}} {
		if out, err := exec.Command("bridge", "-n", n.name("node"), "fdb", "append", fdb[0],
			"dst", fdb[1], "dev", "flannel.1", "self", "permanent").CombinedOutput(); err != nil {
			t.Fatalf("bridge fdb append %s: %v: %s", fdb[0], err, out)
		}
	}
	if err := RefreshUplinkNeighbors(info); err != nil {
		t.Fatal(err)
	}
	want[1] = "flannel.1 0a:88:00:00:00:02 [10.244.1.0] vtep 10.99.70.2"
	if got := show(info.UplinkNeighbors); !slices.Equal(got, want) {
		t.Errorf("uplink neighbours with the fdb's:\n got %q\nwant %q", got, want)
	}
	// A neighbour resolved after discovery, another address of the
	// router's MAC: read again.
	n.run(t, "node", "neigh replace 10.99.70.253 lladdr 5a:cf:13:61:b3:16 nud permanent dev ens3")
	if err := RefreshUplinkNeighbors(info); err != nil {
		t.Fatal(err)
	}
	want[0] = "ens3 5a:cf:13:61:b3:16 [10.99.70.253 10.99.70.254]"
	if got := show(info.UplinkNeighbors); !slices.Equal(got, want) {
		t.Errorf("uplink neighbours read again:\n got %q\nwant %q", got, want)
	}
}
