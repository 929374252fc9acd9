package flow

import (
	"cmp"
	"fmt"
	"strings"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// KernelDrop counts a flow's packets the kernel dropped (the drop
// observer, skb:kfree_skb) in one direction, for one reason, in one
// function, netns and device. Count is what the observer reported: the
// first drops of each flow direction, then one every 10 ms (the rest is
// counted in observer_events_summarized): a flood's is a lower bound.
type KernelDrop struct {
	Direction string `json:"direction"` // "request" or "reply"
	Count     uint64 `json:"count"`
	// Reason is the kernel's enum skb_drop_reason without its
	// SKB_DROP_REASON_ prefix (NETFILTER_DROP), or its number when the
	// kernel's BTF did not name it.
	Reason string `json:"reason"`
	// Function is the kernel function that dropped it ("nft_do_chain
	// [nf_tables]": a module's is named), "" when the kernel did not
	// tell.
	Function string `json:"function,omitempty"`
	// Location is the kernel address that dropped it: the events of one
	// place are counted together, whether or not the function was named
	// yet (a probe that reads kallsyms names a new address aside: its
	// first events come without).
	Location uint64 `json:"-"`
	NetNS    uint64 `json:"netns"`
	// Ifindex is the device the packet was at (or came in by), 0 when none.
	Ifindex int `json:"ifindex"`
	// Where names that place, as the session found it: the capture point
	// there ("uplink:bond0"), else the netns and the interface ("the
	// node's netns, cni0 (ifindex 4)"; "netns /run/netns/gw, ifindex 2"
	// when the interface's name was not found); "" when it found none.
	Where string    `json:"where,omitempty"`
	First time.Time `json:"first"`
}

// reasonNotSpecified is the reason of a plain kfree_skb(): a drop in most
// paths, but also how some drivers free a packet they sent, so it alone
// never makes a flow's replies lost.
const reasonNotSpecified = "NOT_SPECIFIED"

// maxKernelDrops bounds the entries of one flow (each a direction, reason,
// function and place); further ones are added to the last.
const maxKernelDrops = 8

// noteDrop records a drop observation on its flow; false when no flow
// claims the packet yet (it waits as other observations do). A drop of a
// flow refused beyond MaxFlows, or of a connection seen by its replies
// alone, is taken with them: no flow will claim it.
func (e *Engine) noteDrop(o obs.Observation) bool {
	if !hasPorts(o) {
		e.withoutPorts++
		return true
	}
	f, reply := e.find(o)
	if f == nil {
		return e.refusedClients.has(clientKey{o.Proto, o.Src}) || e.refusedClients.has(clientKey{o.Proto, o.Dst}) || e.ReplyWithoutRequest(o)
	}
	d := KernelDrop{Direction: "request", Count: 1, NetNS: o.NetNS, Ifindex: o.Ifindex, First: o.Time}
	if reply {
		d.Direction = "reply"
	}
	if o.Drop != nil {
		d.Reason, d.Function, d.Location = o.Drop.Reason, o.Drop.Func, o.Drop.Location
		if d.Reason == "" {
			d.Reason = fmt.Sprint(o.Drop.Code)
		}
	}
	f.addDrop(d)
	f.evidenceChanged()
	return true
}

// addDrop counts d among f's drops.
func (f *flowState) addDrop(d KernelDrop) {
	if f.drops == nil {
		f.drops = new([]KernelDrop)
	}
	drops := *f.drops
	for i := range drops {
		k := &drops[i]
		samePlace := k.Function == d.Function
		if k.Location != 0 || d.Location != 0 {
			samePlace = k.Location == d.Location
		}
		if k.Direction == d.Direction && k.Reason == d.Reason && samePlace && k.NetNS == d.NetNS && k.Ifindex == d.Ifindex ||
			i == maxKernelDrops-1 {
			k.Count += d.Count
			k.Function = cmp.Or(k.Function, d.Function)
			if d.First.Before(k.First) {
				k.First = d.First
			}
			return
		}
	}
	*f.drops = append(drops, d)
}

// kernelDrops are f's drops, nil when none.
func (f *flowState) kernelDrops() []KernelDrop {
	if f.drops == nil {
		return nil
	}
	return *f.drops
}

// requestDropped tells whether the kernel dropped requests of f for a
// reason it named (not a plain kfree_skb(): NOT_SPECIFIED).
func (f *flowState) requestDropped() bool {
	for _, d := range f.kernelDrops() {
		if d.Direction == "request" && d.Reason != reasonNotSpecified {
			return true
		}
	}
	return false
}

// replyDrops counts f's reply packets the kernel dropped, other than those
// of reason NOT_SPECIFIED (reasonNotSpecified).
func (f *flowState) replyDrops() uint64 {
	var n uint64
	for _, d := range f.kernelDrops() {
		if d.Direction == "reply" && d.Reason != reasonNotSpecified {
			n += d.Count
		}
	}
	return n
}

// String says why and where a drop was: "NETFILTER_DROP in nft_do_chain
// [nf_tables] (at uplink:bond0)", or with the netns inode and ifindex when
// the place has no name (Where).
func (d KernelDrop) String() string {
	var b strings.Builder
	b.WriteString(d.Reason)
	if d.Function != "" {
		b.WriteString(" in " + d.Function)
	}
	if d.Where != "" {
		fmt.Fprintf(&b, " (at %s)", d.Where)
	} else {
		fmt.Fprintf(&b, " (netns %d, ifindex %d)", d.NetNS, d.Ifindex)
	}
	return b.String()
}

// repliesDroppedInKernel tells whether the kernel dropped replies of f
// (for a reason other than NOT_SPECIFIED) and none reached its client: its
// Pod's eth0 tap, which lost no frames, saw no reply come in; or, without
// that tap (a node process's flow has none past the uplink), the kernel
// dropped at least as many replies as the point that saw most of them saw
// (the drop observer reports fewer drops than there were, never more: its
// budget).
func (e *Engine) repliesDroppedInKernel(f *flowState) bool {
	n := f.replyDrops()
	if n == 0 {
		return false
	}
	// The client's Pod's eth0 tap tells only when it saw the flow's
	// requests leave: an outside client's (a NodePort's) has none.
	podTap := !f.fromNode && e.active(obs.PointPod) && !e.captureLost[obs.PointPod]
	podOut := false
	var seen uint64
	for _, p := range f.points {
		if !p.reply {
			podOut = podOut || p.point == obs.PointPod && p.dir == obs.DirOut
			continue
		}
		if podTap && p.point == obs.PointPod && p.dir == obs.DirIn {
			return false
		}
		seen = max(seen, p.packets)
	}
	return podTap && podOut || n >= seen
}

// dropsReason says what the kernel dropped of f, "" when nothing.
func (f *flowState) dropsReason() string {
	var parts []string
	for _, d := range f.kernelDrops() {
		unit := "packets"
		if d.Count == 1 {
			unit = "packet"
		}
		parts = append(parts, fmt.Sprintf("%d %s %s: %s", d.Count, d.Direction, unit, d.String()))
	}
	if len(parts) == 0 {
		return ""
	}
	return "the kernel dropped " + strings.Join(parts, "; ")
}
