package probe

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/btf"

	"github.com/pathtrace/pathtrace/internal/obs"
)

func TestDecodeDrop(t *testing.T) {
	var r rawEvent
	r[evPoint] = 8
	r[evProto] = 17
	r.addr(evSaddr, "10.244.20.31")
	r.port(evSport, 5353)
	r.addr(evDaddr, "10.244.8.23")
	r.port(evDport, 40000)
	r.u32(evNetns, 4026532000)
	r.u32(evIfindex, 7)
	r.u32(evReason, 12)
	r.u64(evLocation, 0xffffffff81fbd0af)
	o, err := decodeEvent(r[:], time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if o.Point != obs.PointDrop || o.Drop == nil || o.Drop.Code != 12 || o.Drop.Location != 0xffffffff81fbd0af {
		t.Fatalf("decoded %+v (drop %+v)", o, o.Drop)
	}
	if o.NetNS != 4026532000 || o.Ifindex != 7 || o.Src.String() != "10.244.20.31:5353" || o.Dst.String() != "10.244.8.23:40000" {
		t.Errorf("decoded %+v", o)
	}
}

func TestDropReasonsFromBTF(t *testing.T) {
	enum := &btf.Enum{Name: "skb_drop_reason", Values: []btf.EnumValue{
		{Name: "SKB_NOT_DROPPED_YET", Value: 0}, {Name: "SKB_CONSUMED", Value: 1},
		{Name: "SKB_DROP_REASON_NOT_SPECIFIED", Value: 2}, {Name: "SKB_DROP_REASON_NETFILTER_DROP", Value: 12},
		{Name: "SKB_DROP_REASON_MAX", Value: 12}, // an alias: the first name stays
	}}
	got := dropReasons(enum)
	for code, want := range map[uint32]string{1: "SKB_CONSUMED", 2: "NOT_SPECIFIED", 12: "NETFILTER_DROP"} {
		if got[code] != want {
			t.Errorf("reason %d: %q, want %q", code, got[code], want)
		}
	}
}

func TestKernelFuncFromKallsyms(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kallsyms")
	syms := "ffffffff81000000 T _stext\n" +
		"ffffffff81fbd000 t nft_do_chain\t[nf_tables]\n" +
		"ffffffff81fbd050 d some_data\n" +
		"ffffffff81fbe000 T nf_hook_slow\n"
	if err := os.WriteFile(path, []byte(syms), 0o644); err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[uint64]string{
		0xffffffff81fbd0af: "nft_do_chain [nf_tables]", // not the data symbol before it
		0xffffffff81fbe010: "nf_hook_slow",
		0xffffffff80000000: "",
	} {
		if got := kernelFunc(path, addr); got != want {
			t.Errorf("%#x: %q, want %q", addr, got, want)
		}
	}
	hidden := filepath.Join(t.TempDir(), "hidden")
	os.WriteFile(hidden, []byte("0000000000000000 T nf_hook_slow\n"), 0o644)
	if got := kernelFunc(hidden, 0xffffffff81fbe010); got != "" {
		t.Errorf("addresses hidden (kptr_restrict): %q, want none", got)
	}
}

func TestTracepointRxSkFromBTF(t *testing.T) {
	proto := func(n int) *btf.Spec {
		params := make([]btf.FuncParam, n)
		for i := range params {
			params[i] = btf.FuncParam{Name: fmt.Sprint("p", i), Type: &btf.Int{Name: "int", Size: 4}}
		}
		b, err := btf.NewBuilder([]btf.Type{&btf.Typedef{Name: "btf_trace_kfree_skb",
			Type: &btf.Pointer{Target: &btf.FuncProto{Return: &btf.Void{}, Params: params}}}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		raw, err := b.Marshal(nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		spec, err := btf.LoadSpecFromReader(bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		return spec
	}
	if err := tracepointHasRxSk(proto(5)); err != nil {
		t.Errorf("with rx_sk (6.12 on): %v", err)
	}
	if err := tracepointHasRxSk(proto(4)); err == nil || !strings.Contains(err.Error(), "no rx_sk") {
		t.Errorf("without rx_sk (6.8-6.11): %v, want it said", err)
	}
}

// TestDropReasonsRelocated: the drop observer compares the tracepoint's
// reason with the running kernel's numbers of the reasons it leaves out,
// relocated at load, not the numbers of the headers it was built against:
// enum skb_drop_reason grows in its middle between releases (QUEUE_PURGE
// moved from 104 to 105), and a stale number reported every socket's
// queue purged at its close as a drop of the flow.
func TestDropReasonsRelocated(t *testing.T) {
	spec, err := loadObserveDrop()
	if err != nil {
		t.Fatal(err)
	}
	prog := spec.Programs["pt_drop"]
	if prog == nil {
		t.Fatal("no pt_drop program")
	}
	var relocated int
	for i := range prog.Instructions {
		r := btf.CORERelocationMetadata(&prog.Instructions[i])
		if r != nil && strings.Contains(r.String(), "enumval_value") && strings.Contains(r.String(), "skb_drop_reason") {
			relocated++
		}
	}
	if relocated < 2 {
		t.Errorf("pt_drop has %d enum skb_drop_reason values relocated, want 2 (SKB_CONSUMED, QUEUE_PURGE)", relocated)
	}
}
