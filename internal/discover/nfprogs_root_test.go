package discover

import (
	"bytes"
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// TestNodeFindsNetfilterPrograms: another tool's BPF programs on netfilter
// hooks (one that drops at prerouting before NAT, one at forward) are
// listed in the node's netfilter section and its table, by hook and
// priority, and pathtrace's own are not; one in another netns is told
// apart (Elsewhere).
func TestNodeFindsNetfilterPrograms(t *testing.T) {
	tb := newTestbed(t)
	const nfDrop, nfAccept = 0, 1
	drop := loadReturn(t, "pttest_nf_drop", ebpf.Netfilter, ebpf.AttachNetfilter, nfDrop)
	fwd := loadReturn(t, "pttest_nf_fwd", ebpf.Netfilter, ebpf.AttachNetfilter, nfAccept)
	own := loadReturn(t, "pttest_nf_own", ebpf.Netfilter, ebpf.AttachNetfilter, nfAccept)
	other := loadReturn(t, "pttest_nf_other", ebpf.Netfilter, ebpf.AttachNetfilter, nfDrop)
	// Another netns's (the Pod's here), at a priority nothing holds in
	// the node netns.
	err := nsutil.Do(tb.pod, func() error {
		l, err := link.AttachNetfilter(link.NetfilterOptions{Program: other, ProtocolFamily: link.NetfilterProtoIPv4, Hook: link.NetfilterInetPreRouting, Priority: -157})
		if err != nil {
			return err
		}
		t.Cleanup(func() { l.Close() })
		return nil
	})
	if err != nil {
		t.Skipf("attach a netfilter link (kernel without BPF netfilter links?): %v", err)
	}
	err = nsutil.Do(tb.node, func() error {
		for _, a := range []struct {
			prog *ebpf.Program
			hook link.NetfilterInetHook
			prio int32
		}{{drop, link.NetfilterInetPreRouting, -151}, {fwd, link.NetfilterInetForward, 7}, {own, link.NetfilterInetPreRouting, -153}} {
			l, err := link.AttachNetfilter(link.NetfilterOptions{Program: a.prog, ProtocolFamily: link.NetfilterProtoIPv4, Hook: a.hook, Priority: a.prio})
			if err != nil {
				return err
			}
			t.Cleanup(func() { l.Close() })
		}
		return nil
	})
	if err != nil {
		t.Skipf("attach netfilter links (kernel without BPF netfilter links?): %v", err)
	}
	opt := Options{HostNetNS: tb.node, PodIP: netip.MustParseAddr(podIP),
		IsObserver: func(id ebpf.ProgramID) bool { return id == progID(t, own) }}
	info, err := Node(context.Background(), opt)
	if err != nil {
		t.Fatal(err)
	}
	got := info.Netfilter.BPFPrograms
	for _, want := range []NetfilterProgram{
		{Family: "ipv4", Hook: "prerouting", Priority: -151, Name: "pttest_nf_drop", ID: progID(t, drop)},
		{Family: "ipv4", Hook: "forward", Priority: 7, Name: "pttest_nf_fwd", ID: progID(t, fwd)},
		{Family: "ipv4", Hook: "prerouting", Priority: -157, Name: "pttest_nf_other", ID: progID(t, other), Elsewhere: true},
	} {
		i := slices.IndexFunc(got, func(p NetfilterProgram) bool { return p.ID == want.ID })
		if i < 0 {
			t.Errorf("netfilter BPF programs: %+v lacks %+v", got, want)
			continue
		}
		want.LinkID, want.pf, want.hook = got[i].LinkID, got[i].pf, got[i].hook
		if got[i] != want || want.LinkID == 0 {
			t.Errorf("netfilter BPF program: got %+v, want %+v", got[i], want)
		}
	}
	if slices.ContainsFunc(got, func(p NetfilterProgram) bool { return p.ID == progID(t, own) }) {
		t.Errorf("pathtrace's own netfilter program reported: %+v", got)
	}
	var b bytes.Buffer
	if err := info.Table(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "BPF program (ipv4 prerouting priority -151)") || !strings.Contains(b.String(), "pttest_nf_drop") ||
		!strings.Contains(b.String(), "in another netns") {
		t.Errorf("node table does not list the netfilter BPF program:\n%s", b.String())
	}
}
