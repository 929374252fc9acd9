package probe

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// dropProgram is AttachDrops' observer (bpf/observe_drop.c).
const dropProgram = "pt_drop"

// AttachDrops attaches the drop observer, host-wide (every netns), once per
// Probe: the kernel's skb:kfree_skb tracepoint, which says which packets of
// the traced flows the kernel dropped, why (enum skb_drop_reason, named from
// the kernel's BTF) and in which function (/proc/kallsyms). Optional: where
// it cannot attach (a kernel without the tracepoint's rx_sk argument, before
// 6.12) it is reported not attached, and nothing else changes.
func (p *Probe) AttachDrops() []Attachment {
	a := Attachment{Observer: "tp_btf/kfree_skb", Where: "host-wide (every netns)", Point: obs.PointDrop,
		Note: "drops of the traced flows with the kernel's reason; not the taps' own copies"}
	names, err := loadDropReasons()
	if err != nil {
		a.Note += fmt.Sprintf("; reasons by number: %v", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.globals["kfree_skb"] {
		return nil
	}
	prog, err := p.program(p.dropSpec, dropProgram)
	if err == nil {
		var l link.Link
		if l, err = link.AttachTracing(link.TracingOptions{Program: prog}); err == nil {
			p.keep(l)
			p.globals["kfree_skb"] = true
			p.drops.setReasons(names)
		} else {
			err = fmt.Errorf("attach %s: %w", dropProgram, err)
		}
	}
	a.Err = err
	return []Attachment{a}
}

// dropNames names what a drop event carries as numbers: its reason, from
// the kernel's enum skb_drop_reason, and its location, the kernel function
// around the address (read from /proc/kallsyms once per address, cached).
type dropNames struct {
	mu      sync.Mutex
	reasons map[uint32]string
	funcs   map[uint64]string
}

func (n *dropNames) setReasons(names map[uint32]string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.reasons = names
}

// maxDropFuncs bounds the cache of functions by address: the places that
// drop packets are few (tens); past it, it starts again.
const maxDropFuncs = 1024

// name fills in d's reason and function names.
func (n *dropNames) name(d *obs.KernelDrop) {
	n.mu.Lock()
	defer n.mu.Unlock()
	d.Reason = n.reasons[d.Code]
	fn, ok := n.funcs[d.Location]
	if !ok {
		fn = kernelFunc(kallsymsPath, d.Location)
		if n.funcs == nil || len(n.funcs) >= maxDropFuncs {
			n.funcs = map[uint64]string{}
		}
		n.funcs[d.Location] = fn
	}
	d.Func = fn
}

// dropReasonPrefix is how the kernel's names of drop reasons begin.
const dropReasonPrefix = "SKB_DROP_REASON_"

// loadDropReasons reads the names of enum skb_drop_reason from the running
// kernel's BTF, without their common prefix (NETFILTER_DROP).
func loadDropReasons() (map[uint32]string, error) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return nil, fmt.Errorf("kernel BTF: %w", err)
	}
	var enum *btf.Enum
	if err := spec.TypeByName("skb_drop_reason", &enum); err != nil {
		return nil, fmt.Errorf("enum skb_drop_reason in the kernel's BTF: %w", err)
	}
	return dropReasons(enum), nil
}

// dropReasons names the values of enum skb_drop_reason.
func dropReasons(enum *btf.Enum) map[uint32]string {
	names := make(map[uint32]string, len(enum.Values))
	for _, v := range enum.Values {
		if _, dup := names[uint32(v.Value)]; dup {
			continue // the first name of a value (a later alias such as SKB_DROP_REASON_MAX)
		}
		names[uint32(v.Value)] = strings.TrimPrefix(v.Name, dropReasonPrefix)
	}
	return names
}

// kallsymsPath lists the kernel's symbols.
const kallsymsPath = "/proc/kallsyms"

// kernelFunc is the text symbol of kallsyms (a /proc/kallsyms file) that
// addr is in: the last one at or below it, with its module when not
// vmlinux's ("nf_hook_slow", "nft_do_chain [nf_tables]"); "" when none
// is known (addresses hidden by kptr_restrict read as 0).
func kernelFunc(kallsyms string, addr uint64) string {
	f, err := os.Open(kallsyms)
	if err != nil {
		return ""
	}
	defer f.Close()
	best, bestAddr := "", uint64(0)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "ffffffff81234560 T name [module]"
		line := sc.Text()
		a, rest, ok := strings.Cut(line, " ")
		if !ok || len(rest) < 3 || rest[1] != ' ' || (rest[0] != 't' && rest[0] != 'T') {
			continue
		}
		v, err := strconv.ParseUint(a, 16, 64)
		if err != nil || v == 0 || v > addr || v < bestAddr {
			continue
		}
		best, bestAddr = strings.Replace(rest[2:], "\t", " ", 1), v
	}
	return best
}
