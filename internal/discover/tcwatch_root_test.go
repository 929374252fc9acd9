package discover

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// BenchmarkTCWatchLook is one look of a session's tc watch (every 2 s)
// on a node of 50 Pods, each host veth with a tcx program in each direction,
// as Cilium attaches them.
func BenchmarkTCWatchLook(b *testing.B) {
	const pods = 50
	cps := vethsWithTCX(b, pods)
	node := cps[0].netns
	points := make([]CapturePoint, len(cps))
	for i, c := range cps {
		points[i] = c.cp
	}
	notOwn := func(ebpf.ProgramID) bool { return false }
	w := NewTCWatch(node, points, notOwn)
	for b.Loop() {
		progs, err := w.Look()
		if err != nil || len(progs) != 2*pods {
			b.Fatalf("%d programs (%v), want %d", len(progs), err, 2*pods)
		}
	}
}

type benchVeth struct {
	netns string
	cp    CapturePoint
	links []link.Link // ingress, egress
}

// TestTCWatchLook: the watch's looks, which remember programs by ID, still
// see a program replaced (the new ID, its name), leave out pathtrace's own,
// name a cls_bpf filter, and skip a deleted veth without an error.
func TestTCWatchLook(t *testing.T) {
	veths := vethsWithTCX(t, 3)
	node := veths[0].netns
	var cps []CapturePoint
	for _, v := range veths {
		cps = append(cps, v.cp)
	}
	ownProg := loadReturn(t, "rs_own", ebpf.SchedCLS, ebpf.AttachTCXIngress, -1)
	own := progID(t, ownProg)
	w := NewTCWatch(node, cps, func(id ebpf.ProgramID) bool { return id == own })
	look := func() map[string]TCProgram { // by ifname/dir
		t.Helper()
		progs, err := w.Look()
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]TCProgram{}
		for _, p := range progs {
			m[p.Ifname+"/"+p.Dir+"/"+p.Via] = p
		}
		return m
	}
	first := look()
	if len(first) != 6 || first["hv1/ingress/tcx"].Name != "rs_bench_tcx" {
		t.Fatalf("first look: %+v, want rs_bench_tcx at both directions of 3 veths", first)
	}
	look() // a look from the cache alone

	// hv1's ingress program replaced, pathtrace's own added beside it,
	// a cls_bpf filter on hv2, hv0 deleted.
	repl := loadReturn(t, "rs_replaced", ebpf.SchedCLS, ebpf.AttachTCXIngress, -1)
	veths[1].links[0].Close()
	err := nsutil.Do(node, func() error {
		for _, p := range []*ebpf.Program{repl, ownProg} {
			l, err := link.AttachTCX(link.TCXOptions{Interface: veths[1].cp.Ifindex, Program: p, Attach: ebpf.AttachTCXIngress})
			if err != nil {
				return err
			}
			t.Cleanup(func() { l.Close() })
		}
		return exec.Command("ip", "link", "del", "hv0").Run()
	})
	if err != nil {
		t.Fatal(err)
	}
	addClsBPF(t, node, veths[2].cp.Ifindex, loadReturn(t, "rs_cls", ebpf.SchedCLS, ebpf.AttachNone, -1))
	got := look()
	if p := got["hv1/ingress/tcx"]; p.Name != "rs_replaced" || p.ID != progID(t, repl) {
		t.Errorf("hv1 ingress after the replacement: %+v", p)
	}
	if p := got["hv2/egress/cls_bpf"]; p.Name != "rs_cls" {
		t.Errorf("hv2 cls_bpf: %+v", p)
	}
	if len(got) != 5 {
		t.Errorf("%d programs, want 5 (hv0 deleted, the observer left out): %+v", len(got), got)
	}
	if len(w.cps) != 2 {
		t.Errorf("the watch still looks at %d veths, want 2: hv0 was deleted", len(w.cps))
	}
}

// vethsWithTCX makes a netns (rs-bench-*, removed at the end) with n host
// veths (their peers stay in it: only the host side is read), each with a
// tcx program at ingress and egress.
func vethsWithTCX(tb testing.TB, n int) []benchVeth {
	tb.Helper()
	if testing.Short() || os.Geteuid() != 0 {
		tb.Skip("needs root (and not -short): creates a network namespace")
	}
	name := fmt.Sprintf("rs-bench-%06x", rand.IntN(1<<24))
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		tb.Fatalf("ip netns add: %v: %s", err, out)
	}
	tb.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	path := "/run/netns/" + name
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "rs_bench_tcx", Type: ebpf.SchedCLS, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()}}) // TCX_NEXT
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { prog.Close() })
	var out []benchVeth
	err = nsutil.Do(path, func() error {
		for i := range n {
			veth := fmt.Sprintf("hv%d", i)
			if o, err := exec.Command("ip", "link", "add", veth, "type", "veth", "peer", "name", "pv"+veth[2:]).CombinedOutput(); err != nil {
				return fmt.Errorf("%v: %s", err, o)
			}
			ifc, err := net.InterfaceByName(veth)
			if err != nil {
				return err
			}
			bv := benchVeth{path, CapturePoint{Role: RoleHost, Ifname: veth, Ifindex: ifc.Index}, nil}
			for _, at := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				l, err := link.AttachTCX(link.TCXOptions{Interface: ifc.Index, Program: prog, Attach: at})
				if err != nil {
					return err
				}
				tb.Cleanup(func() { l.Close() })
				bv.links = append(bv.links, l)
			}
			out = append(out, bv)
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return out
}
