package probe

import (
	"fmt"

	"github.com/cilium/ebpf"
)

// TapFilter returns the eBPF socket filter for AF_PACKET taps (attach it with
// SO_ATTACH_BPF): it accepts IPv4 frames, untagged or with up to two in-band
// 802.1Q/802.1ad tags, whose source or destination is a watched address or a
// client endpoint the observers learned in the kernel, keeping snaplen bytes
// of each, and rejects everything else. It reads this Probe's maps, so a tap
// follows a rewritten flow from its first packet after the rewrite.
//
// The Probe owns the program (one per snaplen) and closes it in Close; the
// caller must not close it. A socket it is attached to keeps its own
// reference, so a tap keeps filtering after Close (with maps that no longer
// change).
func (p *Probe) TapFilter(snaplen int) (*ebpf.Program, error) {
	if snaplen < 1 || snaplen > 65535 {
		return nil, fmt.Errorf("tap filter: snaplen %d, want 1..65535", snaplen)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	const name = "pt_tap_filter"
	key := fmt.Sprintf("%s/%d", name, snaplen)
	if prog := p.progs[key]; prog != nil {
		return prog, nil
	}
	if p.pktSpec == nil {
		return nil, fmt.Errorf("tap filter: the probe no longer loads programs (ReleaseSpecs)")
	}
	spec := p.pktSpec.Copy()
	v, ok := spec.Variables["tap_snaplen"]
	if !ok {
		return nil, fmt.Errorf("tap filter: object lacks tap_snaplen")
	}
	if err := v.Set(uint32(snaplen)); err != nil {
		return nil, fmt.Errorf("tap filter: set snaplen: %w", err)
	}
	return p.cachedProgram(spec, key, name)
}
