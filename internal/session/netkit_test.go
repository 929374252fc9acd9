package session

import (
	"testing"

	"github.com/pathtrace/pathtrace/internal/discover"
)

// TestNetkitProgramsNoTCX: a netkit pair's programs run inside the pair,
// before its host side's RX tap and tcx chain: tcx observers there would
// only see what the tap sees, so they bring none; a tcx program on the same
// primary still does, in its direction.
func TestNetkitProgramsNoTCX(t *testing.T) {
	cp := discover.CapturePoint{Role: discover.RoleHost, Ifname: "lxc1", Ifindex: 4, Kind: "netkit"}
	node := &discover.NodeInfo{CapturePoints: []discover.CapturePoint{cp}, TCPrograms: []discover.TCProgram{
		{Ifname: "lxc1", Ifindex: 4, Role: discover.RoleHost, Dir: "ingress", Via: "netkit", Name: "cil_from_container"},
		{Ifname: "lxc1", Ifindex: 4, Role: discover.RoleHost, Dir: "egress", Via: "netkit", Name: "cil_to_container"},
	}}
	if d := tcDirsOf(node, cp); d != 0 {
		t.Errorf("directions %b for netkit programs only, want none", d)
	}
	if needTails(node) {
		t.Errorf("tails needed for netkit programs only")
	}
	node.TCPrograms = append(node.TCPrograms, discover.TCProgram{Ifname: "lxc1", Ifindex: 4, Role: discover.RoleHost, Dir: "egress", Via: "tcx", Name: "mesh"})
	if d := tcDirsOf(node, cp); d != tcEgress {
		t.Errorf("directions %b with a tcx program on egress, want egress only", d)
	}
}
