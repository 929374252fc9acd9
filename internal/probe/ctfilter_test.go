package probe

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"golang.org/x/net/bpf"
)

// ctEvent is a ctnetlink event message as the kernel lays it out, up to the
// original tuple's IP addresses (and a protocol tuple after them).
func ctEvent(family uint8, src, dst netip.Addr) []byte {
	s, d := src.As4(), dst.As4()
	ip := append(nla(1, s[:]), nla(2, d[:])...)
	proto := nla(1, []byte{6}) // CTA_PROTO_NUM
	tuple := append(nla(1|nlaNested, ip), nla(2|nlaNested, proto)...)
	body := append([]byte{family, 0, 0, 0}, nla(1|nlaNested, tuple)...)
	msg := binary.LittleEndian.AppendUint32(nil, uint32(16+len(body)))
	msg = binary.LittleEndian.AppendUint16(msg, 0x0100) // IPCTNL_MSG_CT_NEW
	msg = append(msg, make([]byte, 10)...)              // flags, seq, pid
	return append(msg, body...)
}

func runCTFilter(t *testing.T, raw []bpf.RawInstruction, msg []byte) bool {
	t.Helper()
	insts, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("the filter does not disassemble")
	}
	vm, err := bpf.NewVM(insts)
	if err != nil {
		t.Fatal(err)
	}
	n, err := vm.Run(msg)
	if err != nil {
		t.Fatal(err)
	}
	return n != 0
}

func TestConntrackFilter(t *testing.T) {
	a := netip.MustParseAddr
	vip, backend, other, client := a("10.120.0.80"), a("10.244.20.31"), a("10.244.8.1"), a("10.244.8.23")
	f := conntrackFilter([]netip.Addr{vip, backend})
	if f == nil {
		t.Fatal("no filter for two addresses")
	}
	if off := ctDstAddrOff; [4]byte(ctEvent(2, client, vip)[off:off+4]) != vip.As4() {
		t.Fatalf("the test message does not hold the destination at offset %d", off)
	}
	for _, c := range []struct {
		name string
		msg  []byte
		pass bool
	}{
		{"to the VIP", ctEvent(2, client, vip), true},
		{"to a watched backend", ctEvent(2, client, backend), true},
		{"to another address", ctEvent(2, client, other), false},
		{"from the VIP to another address", ctEvent(2, vip, other), false},
		{"IPv6", ctEvent(10, client, other), false},
		{"too short for the layout", ctEvent(2, client, other)[:ctMinLen-1], true},
		{"another first attribute", func() []byte { m := ctEvent(2, client, other); m[ctOrigOff+2] = 7; return m }(), true},
	} {
		if got := runCTFilter(t, f, c.msg); got != c.pass {
			t.Errorf("%s: passes %v, want %v", c.name, got, c.pass)
		}
	}

	many := make([]netip.Addr, maxCTFilterAddrs)
	for i := range many {
		many[i] = netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})
	}
	f = conntrackFilter(many)
	if f == nil || len(f) > 4096 {
		t.Fatalf("%d addresses: a filter of %d instructions, want one within 4096", len(many), len(f))
	}
	if !runCTFilter(t, f, ctEvent(2, client, many[len(many)-1])) || runCTFilter(t, f, ctEvent(2, client, other)) {
		t.Error("the largest filter does not tell the last address from another")
	}
	if conntrackFilter(append(many, vip)) != nil {
		t.Error("a filter beyond maxCTFilterAddrs, where none (all to user space) is wanted")
	}
}
