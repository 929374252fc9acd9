package session

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestPodsStartedBounded: the Pods started that the report lists stay
// bounded: a bounded run lists the first ones and counts the others, a
// run until stopped the last ones, counting the earlier.
func TestPodsStartedBounded(t *testing.T) {
	pod := func(i int) discover.Pod {
		return discover.Pod{NetNS: discover.NetNS{Path: fmt.Sprintf("/run/netns/p%d", i)},
			Eth0: discover.Iface{Addrs: []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}), 24)}}}
	}
	for _, untilStopped := range []bool{false, true} {
		pf := &podFollow{untilStopped: untilStopped}
		const n = 1000
		for i := range n {
			pf.note(pod(i), time.Unix(0, 0), nil)
		}
		s := pf.summary()
		if len(s) != maxStartedListed+1 {
			t.Fatalf("until stopped %v: %d lines, want %d Pods and a count", untilStopped, len(s), maxStartedListed)
		}
		first, last := s[0], s[len(s)-1]
		if untilStopped {
			first, last = s[1], s[0]
		}
		wantFirst, wantCount := "10.0.0.0 ", fmt.Sprintf("%d more", n-maxStartedListed)
		if untilStopped {
			wantFirst, wantCount = fmt.Sprintf("10.0.%d.%d ", (n-maxStartedListed)>>8, (n-maxStartedListed)&0xff), fmt.Sprintf("%d earlier (the last %d listed)", n-maxStartedListed, maxStartedListed)
		}
		if !strings.HasPrefix(first, wantFirst) || last != wantCount {
			t.Errorf("until stopped %v: first listed %q, count %q; want %q..., %q", untilStopped, first, last, wantFirst, wantCount)
		}
	}
}

// TestForgetGonePods: the Pods that went leave the node's lists with their
// capture points, tc programs and redirects, and their netns the scope;
// the others stay, the uplinks too.
func TestForgetGonePods(t *testing.T) {
	pod := func(ino uint64, veth int) discover.Pod {
		return discover.Pod{NetNS: discover.NetNS{Path: fmt.Sprintf("/run/netns/p%d", ino), Inode: ino}, Eth0: discover.Iface{Ifindex: 2},
			HostPeer: &discover.HostPeer{Iface: discover.Iface{Ifindex: veth}}}
	}
	node := &discover.NodeInfo{Pods: []discover.Pod{pod(11, 101), pod(12, 102), pod(13, 103)}}
	for _, p := range node.Pods {
		node.CapturePoints = append(node.CapturePoints,
			discover.CapturePoint{Role: discover.RolePod, NetNS: p.NetNS.Path, Ifindex: 2},
			discover.CapturePoint{Role: discover.RoleHost, NetNS: "/node", Ifindex: p.HostPeer.Ifindex})
		node.TCPrograms = append(node.TCPrograms,
			discover.TCProgram{Role: discover.RoleHost, Ifindex: p.HostPeer.Ifindex},
			discover.TCProgram{Role: discover.RolePod, Ifindex: 2, HostIfindex: p.HostPeer.Ifindex})
		node.TCRedirects = append(node.TCRedirects, discover.TCRedirect{Role: discover.RoleHost, Ifindex: p.HostPeer.Ifindex})
	}
	node.CapturePoints = append(node.CapturePoints, discover.CapturePoint{Role: discover.RoleUplink, NetNS: "/node", Ifindex: 101})
	tr := &tracer{pods: &podFollow{node: node, untilStopped: true}, scope: map[uint64]bool{1: true, 11: true, 12: true, 13: true},
		late: &tcLate{observed: map[int]tcDirs{101: tcBoth, 102: tcBoth}}}
	tr.forgetGonePods(time.Now(), []uint64{11, 13})
	var inodes []uint64
	for _, p := range node.Pods {
		inodes = append(inodes, p.NetNS.Inode)
	}
	if !slices.Equal(inodes, []uint64{12}) {
		t.Errorf("Pods %v, want 12 only", inodes)
	}
	var cps []string
	for _, cp := range node.CapturePoints {
		cps = append(cps, fmt.Sprintf("%s %s %d", cp.Role, cp.NetNS, cp.Ifindex))
	}
	if want := []string{"pod /run/netns/p12 2", "host /node 102", "uplink /node 101"}; !slices.Equal(cps, want) {
		t.Errorf("capture points %q, want %q", cps, want)
	}
	if len(node.TCPrograms) != 2 || len(node.TCRedirects) != 1 || node.TCRedirects[0].Ifindex != 102 {
		t.Errorf("tc programs %+v, redirects %+v: want Pod 12's", node.TCPrograms, node.TCRedirects)
	}
	if tr.scope[11] || tr.scope[13] || !tr.scope[12] || !tr.scope[1] {
		t.Errorf("scope %v, want the node's and Pod 12's", tr.scope)
	}
	if _, ok := tr.late.observed[101]; ok {
		t.Errorf("the observers of a veth gone still known: %v", tr.late.observed)
	}
	if s := tr.pods.summary(); !slices.Contains(s, "2 Pods followed went during the run") {
		t.Errorf("summary %q", s)
	}
}

// TestGonePodsLabelsStayTaken: in a run until stopped without a capture
// file, a gone Pod's taps are forgotten at once; a Pod made again with its
// address (or host veth name) must still get a label of its own (#2)
// while the report names the old one: in capture_ended (the last gone
// listed: its eth0), or in an open flow's points (its host veth, listed
// no more).
func TestGonePodsLabelsStayTaken(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.10:53")
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 53, Proto: obs.UDP}}})
	// A flow of the gone Pod still open, counted at its host veth.
	eng.Add(obs.Observation{Time: time.Unix(1_700_000_000, 0), Point: obs.PointHost, Ifname: "host:veth-b", Dir: obs.DirIn, Proto: obs.UDP,
		Src: netip.MustParseAddrPort("10.244.8.23:40000"), Dst: svc, Len: 74})
	tr := &tracer{eng: eng, taps: []tap{{}, {}, {label: "uplink:bond0"}},
		gone: &goneTaps{free: []int{0, 1}, n: 2, ended: []goneTap{{"pod:eth0@10.244.8.23", "its netns was deleted"}}}}
	taken := tr.labelsTaken()
	for _, l := range []string{"pod:eth0@10.244.8.23", "host:veth-b", "uplink:bond0"} {
		if got := tr.newLabel(l, taken); got != l+"#2" {
			t.Errorf("new tap %s labelled %q while the report names %s, want #2", l, got, l)
		}
	}
	// Listed no more, and no open flow counts there: free again.
	tr.gone.ended = nil
	if got := tr.newLabel("pod:eth0@10.244.8.23", tr.labelsTaken()); got != "pod:eth0@10.244.8.23" {
		t.Errorf("new tap labelled %q: a label nothing names any more stays taken", got)
	}
}

// TestCgroupsBounded: a run until stopped keeps a bounded number of client
// cgroups resolved: beyond it, they are forgotten (the engine's too, but
// for open flows') and resolved again when seen again.
func TestCgroupsBounded(t *testing.T) {
	eng := flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: netip.MustParseAddr("192.0.2.80")}}})
	tr := &tracer{eng: eng, gone: &goneTaps{}, cgroupRoot: t.TempDir(), cgroupDone: map[uint64]bool{}}
	for id := range uint64(maxCgroupsDone) {
		tr.cgroupDone[id+1] = true
		eng.SetCgroupSockPrograms(id+1, nil)
	}
	tr.attributeCgroup(maxCgroupsDone + 1)
	if len(tr.cgroupDone) != 1 {
		t.Errorf("%d cgroups resolved, want the new one only", len(tr.cgroupDone))
	}
	// A bounded run keeps them all.
	tr.gone = nil
	for id := range uint64(maxCgroupsDone) {
		tr.cgroupDone[id+1] = true
	}
	tr.attributeCgroup(maxCgroupsDone + 2)
	if len(tr.cgroupDone) != maxCgroupsDone+2 {
		t.Errorf("a bounded run kept %d cgroups resolved, want %d", len(tr.cgroupDone), maxCgroupsDone+2)
	}
}

// TestSkippedPodsNamed: the Pods the bound left out are named by their
// host veths (and when), as many as were kept, and the rest counted.
func TestSkippedPodsNamed(t *testing.T) {
	for _, c := range []struct {
		pf   podFollow
		want string
	}{
		{podFollow{skipped: 1, maxPods: 2, untilStopped: true, skippedVeths: []string{"lxc1 at 10:00:02"}}, "1 not followed: pathtrace follows at most 2 Pods at once (host veth lxc1 at 10:00:02)"},
		{podFollow{skipped: 20, maxPods: 4, skippedVeths: []string{"cali1 at 10:00:02", "cali2 at 10:00:04"}}, "20 not followed: pathtrace follows at most 4 Pods (host veths cali1 at 10:00:02, cali2 at 10:00:04, 18 more)"},
		{podFollow{skipped: 3, maxPods: 4}, "3 not followed: pathtrace follows at most 4 Pods"},
	} {
		if s := c.pf.summary(); !slices.Equal(s, []string{c.want}) {
			t.Errorf("summary %q, want %q", s, c.want)
		}
	}
}
