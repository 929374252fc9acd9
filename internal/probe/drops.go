package probe

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// dropProgram is AttachDrops' observer (bpf/observe_drop.c); ksymProgram
// names the kernel functions its events point at.
const (
	dropProgram = "pt_drop"
	ksymProgram = "pt_ksym"
)

// AttachDrops attaches the drop observer, host-wide (every netns), once per
// Probe: the kernel's skb:kfree_skb tracepoint, which says which packets of
// the traced flows the kernel dropped, why (enum skb_drop_reason, named from
// the kernel's BTF) and in which function (the kernel's symbol lookup, run
// by a BPF program; /proc/kallsyms where it cannot load). Optional: where
// it cannot attach (a kernel without the tracepoint's rx_sk argument, before
// 6.12) it is reported not attached, and nothing else changes.
func (p *Probe) AttachDrops() []Attachment {
	a := Attachment{Observer: "tp_btf/kfree_skb", Where: "host-wide (every netns)", Point: obs.PointDrop,
		Note: "drops of the traced flows with the kernel's reason; not the taps' own copies"}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.globals["kfree_skb"] {
		return nil
	}
	names, nameErr, err := kernelDrops()
	if nameErr != nil {
		a.Note += fmt.Sprintf("; reasons by number: %v", nameErr)
	}
	var prog *ebpf.Program
	if err == nil {
		prog, err = p.program(p.dropSpec, dropProgram)
	}
	if err == nil {
		var l link.Link
		if l, err = link.AttachTracing(link.TracingOptions{Program: prog}); err == nil {
			p.keep(l)
			p.globals["kfree_skb"] = true
			p.drops.setReasons(names)
			if ksym, err := p.program(p.dropSpec, ksymProgram); err == nil {
				p.drops.setKsym(ksym)
			}
		} else {
			err = fmt.Errorf("attach %s: %w", dropProgram, err)
		}
	}
	a.Err = err
	return []Attachment{a}
}

// dropNames names what a drop event carries as numbers: its reason, from
// the kernel's enum skb_drop_reason, and its location, the kernel function
// around the address, looked up once per address, cached: by the kernel's
// own symbol lookup (pt_ksym, microseconds) where its program loads, else
// from /proc/kallsyms. That read takes tens of milliseconds (the kernel
// formats every symbol): the event reader, which the capture's consumer
// waits on to catch up, does not wait for it. A new address is then looked
// up aside, and its first events go without the function (Func ""), which
// DropFunc gives later.
type dropNames struct {
	mu       sync.Mutex
	reasons  map[uint32]string
	funcs    map[uint64]string
	ksym     *ebpf.Program // pt_ksym; nil: kallsyms
	kallsyms string        // /proc/kallsyms, another file in tests
}

func (n *dropNames) setKsym(prog *ebpf.Program) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.ksym = prog
}

func (n *dropNames) setReasons(names map[uint32]string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.reasons = names
}

// maxDropFuncs bounds the cache of functions by address: the places that
// drop packets are few (tens); past it, it starts again.
const maxDropFuncs = 1024

// pendingFunc marks, in dropNames.funcs, an address being looked up.
const pendingFunc = "\x00"

// name fills in d's reason and, once its address was looked up, its
// function's name; it never waits for kallsyms.
func (n *dropNames) name(d *obs.KernelDrop) {
	n.mu.Lock()
	defer n.mu.Unlock()
	d.Reason = n.reasons[d.Code]
	fn, ok := n.funcs[d.Location]
	if !ok && n.ksym != nil {
		fn, ok = kernelSymbol(n.ksym, d.Location), true
		n.put(d.Location, fn)
	}
	if !ok {
		n.put(d.Location, pendingFunc)
		go n.lookUp(d.Location)
	}
	if fn != pendingFunc {
		d.Func = fn
	}
}

// put caches fn for addr (with n.mu held).
func (n *dropNames) put(addr uint64, fn string) {
	if n.funcs == nil || len(n.funcs) >= maxDropFuncs {
		n.funcs = map[uint64]string{}
	}
	n.funcs[addr] = fn
}

// lookUp reads the function of addr into the cache.
func (n *dropNames) lookUp(addr uint64) string {
	n.mu.Lock()
	ksym := n.ksym
	n.mu.Unlock()
	var fn string
	if ksym != nil {
		fn = kernelSymbol(ksym, addr)
	} else {
		fn = kernelFunc(cmp.Or(n.kallsyms, kallsymsPath), addr)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.put(addr, fn)
	return fn
}

// ksymLen is the name room of struct pt_ksym_ctx (PT_KSYM_LEN).
const ksymLen = 128

// kernelSymbol runs pt_ksym: the function addr is in, with its module when
// not vmlinux's, as kernelFunc reads it from kallsyms; "" when the kernel
// knows no symbol there (it prints the address) or the run fails.
func kernelSymbol(prog *ebpf.Program, addr uint64) string {
	var in, out [8 + ksymLen]byte
	binary.NativeEndian.PutUint64(in[:], addr)
	if _, err := prog.Run(&ebpf.RunOptions{Context: in[:], ContextOut: out[:]}); err != nil {
		return ""
	}
	name, _, _ := bytes.Cut(out[8:], []byte{0})
	if len(name) == 0 || bytes.HasPrefix(name, []byte("0x")) {
		return ""
	}
	return string(name)
}

// DropFunc names the kernel function at a drop event's address
// (obs.KernelDrop.Location), which its first events may have gone
// without: from the cache, else read now.
func (p *Probe) DropFunc(addr uint64) string {
	n := &p.drops
	n.mu.Lock()
	fn, ok := n.funcs[addr]
	n.mu.Unlock()
	if ok && fn != pendingFunc {
		return fn
	}
	return n.lookUp(addr)
}

// dropReasonPrefix is how the kernel's names of drop reasons begin.
const dropReasonPrefix = "SKB_DROP_REASON_"

// kernelDrops reads from the running kernel's BTF the names of enum
// skb_drop_reason, without their common prefix (NETFILTER_DROP), into
// names (nil, with nameErr, when unreadable), and whether its
// skb:kfree_skb tracepoint passes the receiving socket (rx_sk, Linux 6.12
// on), which the observer needs to leave the packet sockets' copies out:
// noRxSk says why not.
func kernelDrops() (names map[uint32]string, nameErr, noRxSk error) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		err = fmt.Errorf("kernel BTF: %w", err)
		return nil, err, err
	}
	var enum *btf.Enum
	if err := spec.TypeByName("skb_drop_reason", &enum); err != nil {
		nameErr = fmt.Errorf("enum skb_drop_reason in the kernel's BTF: %w", err)
	} else {
		names = dropReasons(enum)
	}
	return names, nameErr, tracepointHasRxSk(spec)
}

// tracepointHasRxSk tells, from the type of the kfree_skb tracepoint's
// BTF-enabled form (btf_trace_kfree_skb: context, skb, location, reason,
// rx_sk), whether it passes rx_sk; nil when it does.
func tracepointHasRxSk(spec *btf.Spec) error {
	var td *btf.Typedef
	if err := spec.TypeByName("btf_trace_kfree_skb", &td); err != nil {
		return fmt.Errorf("no kfree_skb tracepoint in the kernel's BTF: %w", err)
	}
	ptr, ok := td.Type.(*btf.Pointer)
	if !ok {
		return fmt.Errorf("btf_trace_kfree_skb is a %T, not a pointer to a function", td.Type)
	}
	proto, ok := ptr.Target.(*btf.FuncProto)
	if !ok {
		return fmt.Errorf("btf_trace_kfree_skb points to a %T, not a function", ptr.Target)
	}
	if len(proto.Params) < 5 {
		return fmt.Errorf("the kernel's kfree_skb tracepoint has no rx_sk argument (Linux 6.12 on): its packet sockets' copies could not be told from drops")
	}
	return nil
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
