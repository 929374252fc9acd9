package capture

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// dstFilter is an eBPF socket filter keeping snaplen bytes of untagged IPv4
// frames to 192.0.2.2 and rejecting everything else.
func dstFilter(t *testing.T, snaplen int32) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "pttest_dst", Type: ebpf.SocketFilter, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Reg(asm.R6, asm.R1), // LD_ABS reads the skb in R6
			asm.LoadAbs(12, asm.Half),
			asm.JNE.Imm(asm.R0, etherTypeIPv4, "reject"),
			asm.LoadAbs(14+16, asm.Word),                 // host order
			asm.JNE.Imm32(asm.R0, -0x3ffffdfe, "reject"), // 0xc0000202 = 192.0.2.2
			asm.Mov.Imm(asm.R0, snaplen),
			asm.Return(),
			asm.Mov.Imm(asm.R0, 0).WithSymbol("reject"),
			asm.Return(),
		},
	})
	if err != nil {
		t.Fatalf("socket filter program: %v", err)
	}
	return prog
}

func TestTapEBPFProgram(t *testing.T) {
	needRoot(t)
	l := newLab(t)
	a1, b1 := udpListen(t, l.a, "192.0.2.1:4001"), udpListen(t, l.b, "192.0.2.2:4002")
	a2, b2 := udpListen(t, l.a, "198.51.100.1:4003"), udpListen(t, l.b, "198.51.100.2:4004")

	const snaplen = 44 // the UDP header and 2 of the 9 payload bytes
	prog := dstFilter(t, snaplen)
	if _, err := Open(Config{NetNS: l.a, Ifname: "pta", Program: prog, Filter: mustFilter(t, 96)}); err == nil {
		t.Fatal("Open with both a Filter and a Program succeeded")
	}
	tap, err := Open(Config{NetNS: l.a, Ifname: "pta", Role: "pod", Program: prog})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tap.Close() })
	prog.Close() // the socket holds its own reference
	var rec recorder
	stop := startRun(t, tap, rec.add)

	send(t, a2, b2, 2) // rejected: another destination
	send(t, b1, a1, 2) // rejected: 192.0.2.2 is the source
	send(t, a1, b1, 3) // accepted
	waitFor(t, "3 datagrams to 192.0.2.2", func() bool {
		return len(rec.matching(t, "192.0.2.1:4001", "192.0.2.2:4002")) == 3
	})
	pkts := rec.snapshot()
	if len(pkts) != 3 {
		t.Errorf("%d frames delivered, want exactly the 3 datagrams to 192.0.2.2", len(pkts))
	}
	for _, p := range pkts {
		if p.CapLen != snaplen || p.Len <= snaplen {
			t.Errorf("frame of %d bytes captured %d, want the program's %d", p.Len, p.CapLen, snaplen)
		}
	}
	if err := tap.Close(); err != nil {
		t.Fatal(err)
	}
	if err := stop(); err != nil {
		t.Error(err)
	}
}
