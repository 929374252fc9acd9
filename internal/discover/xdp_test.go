package discover

import (
	"bytes"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
)

// TestXDPProgramsListed: an XDP program on the uplink (Cilium's bpf_xdp, a
// Katran-like LB) rewrites or redirects a request before the uplink's RX
// tap, where no point can bracket it: the node block lists it with its
// mode, and leaves out pathtrace's own and the Pods' eth0 (not the node's).
func TestXDPProgramsListed(t *testing.T) {
	dev := func(index int, name string, x *netlink.LinkXdp) netlink.Link {
		return &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Index: index, Name: name, Xdp: x}}
	}
	host := &hostNS{links: map[int]netlink.Link{
		2: dev(2, "eth0", &netlink.LinkXdp{Attached: true, AttachMode: 2, ProgId: 77}),
		3: dev(3, "lxc1", &netlink.LinkXdp{Attached: true, AttachMode: 1, ProgId: 78}),
		4: dev(4, "lxc2", nil),
	}}
	cps := []CapturePoint{
		{Role: RoleUplink, Ifname: "eth0", Ifindex: 2},
		{Role: RoleHost, Ifname: "lxc1", Ifindex: 3},
		{Role: RoleHost, Ifname: "lxc2", Ifindex: 4},
		{Role: RolePod, Ifname: "eth0", Ifindex: 3},
	}
	cache := newProgCache(func(id ebpf.ProgramID) bool { return id == 78 })
	cache.seen[77] = progFacts{name: "cil_xdp_entry"}
	got := xdpPrograms(host, cps, cache)
	want := []XDPProgram{{Ifname: "eth0", Ifindex: 2, Role: RoleUplink, Mode: "xdpgeneric", Name: "cil_xdp_entry", ID: 77}}
	if len(got) != 1 || got[0] != want[0] {
		t.Fatalf("xdpPrograms = %+v, want %+v", got, want)
	}
	var b bytes.Buffer
	if err := (&NodeInfo{XDPPrograms: got}).Table(&b); err != nil {
		t.Fatal(err)
	}
	if row := "xdp        eth0 xdpgeneric  cil_xdp_entry (id 77)  uplink"; !strings.Contains(b.String(), row) {
		t.Errorf("node block lacks %q:\n%s", row, b.String())
	}
}
