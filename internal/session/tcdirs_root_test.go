package session

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/nsutil"
	"github.com/pathtrace/pathtrace/internal/obs"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// TestTCObserversOnlyWhereProgram: a host veth whose tc program is on its
// ingress only (Cilium's) gets tcx observers on its ingress, none on its
// egress: nothing there to bracket, and each observer costs a grace period
// under the RTNL lock at the start and at the stop (110 such Pods took 5 s
// more each way). A program that appears on the egress later gets the
// egress observers then, and the ingress ones are not attached twice.
func TestTCObserversOnlyWhereProgram(t *testing.T) {
	names := testNetNS(t, "pttest-tcdir", "-node", "-pod")
	node, pod := "/run/netns/"+names[0], names[1]
	run(t, "ip", "-n", names[0], "link", "add", "hv0", "type", "veth", "peer", "name", "eth0", "netns", pod)
	run(t, "ip", "-n", names[0], "link", "set", "hv0", "up")
	var ifindex int
	if err := nsutil.Do(node, func() error {
		ifc, err := net.InterfaceByName("hv0")
		if err == nil {
			ifindex = ifc.Index
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	noop, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "cni_from_pod", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}}) // TCX_NEXT
	if err != nil {
		t.Skipf("load a tc program: %v", err)
	}
	defer noop.Close()
	attach := func(typ ebpf.AttachType) {
		t.Helper()
		if err := nsutil.Do(node, func() error {
			l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: noop, Attach: typ})
			if err == nil {
				t.Cleanup(func() { l.Close() })
			}
			return err
		}); err != nil {
			t.Skipf("tcx: %v", err)
		}
	}
	count := func(typ ebpf.AttachType) int {
		t.Helper()
		var n int
		if err := nsutil.Do(node, func() error {
			res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: typ})
			if err == nil {
				n = len(res.Programs)
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return n
	}
	attach(ebpf.AttachTCXIngress)

	pr, err := probe.New()
	if err != nil {
		t.Skipf("probe: %v", err)
	}
	defer pr.Close()
	pr.Preload(true, true)
	cp := discover.CapturePoint{Role: discover.RoleHost, NetNS: node, Ifname: "hv0", Ifindex: ifindex}
	info := &discover.NodeInfo{HostNetNS: discover.NetNS{Path: node}, CapturePoints: []discover.CapturePoint{cp},
		TCPrograms: []discover.TCProgram{{Ifname: "hv0", Ifindex: ifindex, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "cni_from_pod", ID: 1}}}
	atts := attachTCObservers(pr, info)
	for _, a := range atts {
		switch {
		case a.Dir == obs.DirIn && a.Err != nil:
			t.Errorf("%s: %v, want attached", a.Observer, a.Err)
		case a.Dir == obs.DirOut && !errors.Is(a.Err, errNoTCProgramDir):
			t.Errorf("%s: %v, want not attached: %v", a.Observer, a.Err, errNoTCProgramDir)
		}
	}
	if in, out := count(ebpf.AttachTCXIngress), count(ebpf.AttachTCXEgress); in != 3 || out != 0 {
		t.Fatalf("tcx programs on ingress %d, egress %d; want 3 (the CNI's, head and tail) and 0", in, out)
	}

	// A program appears on the egress during the run.
	attach(ebpf.AttachTCXEgress)
	tr := &tracer{pr: pr, tc: &tcWatch{look: discover.NewTCWatch(node, nil, pr.IsObserver)},
		late: &tcLate{observed: tcObserved(info), tails: true}}
	tr.observeTC(time.Now(), []discover.TCProgram{
		{Ifname: "hv0", Ifindex: ifindex, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "cni_from_pod"},
		{Ifname: "hv0", Ifindex: ifindex, Role: discover.RoleHost, Dir: "egress", Via: "tcx", Name: "cni_from_pod"},
	})
	if in, out := count(ebpf.AttachTCXIngress), count(ebpf.AttachTCXEgress); in != 3 || out != 3 {
		t.Fatalf("after an egress program appeared: tcx programs on ingress %d, egress %d; want 3 and 3", in, out)
	}
	for _, a := range tr.late.atts {
		if a.Dir != obs.DirOut || a.Err != nil {
			t.Errorf("late attachment %s (%v): want only the egress observers, attached", a.Observer, a.Err)
		}
	}
	if len(tr.late.atts) != 2 {
		t.Errorf("%d late attachments, want the 2 egress observers", len(tr.late.atts))
	}
	if len(tr.late.notes) != 1 || !strings.Contains(tr.late.notes[0], "tcx egress cni_from_pod appeared there") {
		t.Errorf("notes %q, want one, naming the egress program", tr.late.notes)
	}

	// A veth whose programs on both directions appear in one look: its
	// observers in one attachment, one note.
	tr.late = &tcLate{observed: map[int]tcDirs{}, tails: true}
	pr.Detach() // the observers go; the veth has only its programs
	pr2, err := probe.New()
	if err != nil {
		t.Fatal(err)
	}
	defer pr2.Close()
	pr2.Preload(true, true)
	tr.pr = pr2
	tr.observeTC(time.Now(), []discover.TCProgram{
		{Ifname: "hv0", Ifindex: ifindex, Role: discover.RoleHost, Dir: "ingress", Via: "tcx", Name: "cni_from_pod"},
		{Ifname: "hv0", Ifindex: ifindex, Role: discover.RoleHost, Dir: "egress", Via: "tcx", Name: "cni_to_pod"},
	})
	if in, out := count(ebpf.AttachTCXIngress), count(ebpf.AttachTCXEgress); in != 3 || out != 3 {
		t.Fatalf("both programs appeared: tcx programs on ingress %d, egress %d; want 3 and 3", in, out)
	}
	if len(tr.late.notes) != 1 || len(tr.late.atts) != 4 {
		t.Errorf("notes %q, %d attachments; want one note and the 4 observers", tr.late.notes, len(tr.late.atts))
	}
}
