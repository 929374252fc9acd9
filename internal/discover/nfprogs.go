package discover

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/pathtrace/pathtrace/internal/nsutil"
)

// NetfilterProgram is a BPF program attached to a netfilter hook with a
// BPF_LINK_TYPE_NETFILTER link (another tool's: a firewall, a policy agent).
// It runs among the hook's other functions by its priority: one below NAT's
// (-100) at prerouting sees the VIP before kube-proxy's DNAT, and one that
// returns NF_DROP ends the packet there. The kernel does not say in which
// network namespace a netfilter link is: these are the machine's, those
// found to be in another netns than the node's marked Elsewhere.
type NetfilterProgram struct {
	Family   string         `json:"family"` // ipv4, ipv6
	Hook     string         `json:"hook"`   // prerouting, input, forward, output, postrouting
	Priority int32          `json:"priority"`
	Name     string         `json:"name"`
	ID       ebpf.ProgramID `json:"id"`
	LinkID   link.ID        `json:"link_id"`
	// Elsewhere: not in the node netns, which has no hook function at that
	// hook and priority (see placeNetfilterPrograms).
	Elsewhere bool `json:"elsewhere,omitempty"`

	pf   link.NetfilterProtocolFamily
	hook link.NetfilterInetHook
}

// probeProgramName names the no-op program placeNetfilterPrograms
// attaches for a moment, left out of the lists.
const probeProgramName = "pt_nf_probe"

// maxNetfilterLinks bounds the links looked at.
const maxNetfilterLinks = 4096

// netfilterPrograms lists the machine's netfilter BPF programs but
// pathtrace's observers (own), in hook and priority order.
func netfilterPrograms(own func(ebpf.ProgramID) bool) ([]NetfilterProgram, error) {
	it := new(link.Iterator)
	defer it.Close()
	var out []NetfilterProgram
	for n := 0; it.Next(); n++ {
		if n >= maxNetfilterLinks {
			return out, fmt.Errorf("stopped after %d BPF links", maxNetfilterLinks)
		}
		info, err := it.Link.Info()
		if err != nil || info.Type != link.NetfilterType {
			continue // gone meanwhile, or another kind
		}
		nf := info.Netfilter()
		if nf == nil || own(info.Program) {
			continue
		}
		name := programName(info.Program)
		if name == probeProgramName {
			continue // another pathtrace's, placing its list
		}
		out = append(out, NetfilterProgram{
			Family:   nfFamilyName(uint32(nf.ProtocolFamily)),
			Hook:     nfHookName(uint32(nf.Hook)),
			Priority: nf.Priority,
			Name:     name,
			ID:       info.Program,
			LinkID:   info.ID,
			pf:       nf.ProtocolFamily,
			hook:     nf.Hook,
		})
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return out, err
	}
	sortNetfilterPrograms(out)
	return out, nil
}

func sortNetfilterPrograms(ps []NetfilterProgram) {
	order := map[string]int{"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}
	for i := 1; i < len(ps); i++ {
		for j := i; j > 0; j-- {
			a, b := ps[j-1], ps[j]
			if order[a.Hook] < order[b.Hook] || order[a.Hook] == order[b.Hook] && a.Priority <= b.Priority {
				break
			}
			ps[j-1], ps[j] = b, a
		}
	}
}

func nfFamilyName(pf uint32) string {
	switch pf {
	case 2:
		return "ipv4"
	case 10:
		return "ipv6"
	}
	return fmt.Sprintf("family %d", pf)
}

func nfHookName(h uint32) string {
	if names := []string{"prerouting", "input", "forward", "output", "postrouting"}; int(h) < len(names) {
		return names[h]
	}
	return fmt.Sprintf("hook %d", h)
}

// placeNetfilterPrograms marks Elsewhere the programs that are not in the
// netns at hostPath. A netfilter hook of a netns takes one BPF function per
// priority: attaching a no-op program (NF_ACCEPT) at a listed program's
// family, hook and priority there fails with EBUSY when a function holds
// that priority in that netns (the listed one, or another hook's), and
// succeeds when none does: the listed one is in another netns. The probe
// is detached at once; it accepts whatever passes meanwhile. Programs it
// cannot place stay unmarked (possibly the node's).
func placeNetfilterPrograms(hostPath string, progs []NetfilterProgram) error {
	if len(progs) == 0 {
		return nil
	}
	const nfAccept = 1
	probe, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: probeProgramName, Type: ebpf.Netfilter, AttachType: ebpf.AttachNetfilter,
		License: "GPL", Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, nfAccept), asm.Return()}})
	if err != nil {
		return fmt.Errorf("load the netfilter probe: %w", err)
	}
	defer probe.Close()
	return nsutil.Do(hostPath, func() error {
		var errs []error
		for i := range progs {
			p := &progs[i]
			l, err := link.AttachNetfilter(link.NetfilterOptions{Program: probe, ProtocolFamily: p.pf, Hook: p.hook, Priority: p.Priority})
			switch {
			case err == nil:
				l.Close()
				p.Elsewhere = true
			case errors.Is(err, unix.EBUSY):
			default:
				errs = append(errs, fmt.Errorf("%s %s priority %d: %w", p.Family, p.Hook, p.Priority, err))
			}
		}
		return errors.Join(errs...)
	})
}
