package capture

import (
	"fmt"
	"net/netip"
	"slices"

	"golang.org/x/net/bpf"
)

// MaxFilterAddrs is the most addresses FilterFor accepts. Each address costs
// four instructions (a compare and an accept, for the source and for the
// destination) and the rest of the program filterFixed, which keeps the
// program under the kernel's limit of 4096 classic BPF instructions.
const MaxFilterAddrs = 1000

// filterFixed is how many instructions FilterFor's program has besides the
// addresses' compares and accepts.
const filterFixed = 48

// Ethernet types the filter and the decoder know.
const (
	etherTypeIPv4   = 0x0800
	etherTypeDot1Q  = 0x8100 // 802.1Q customer tag
	etherTypeDot1AD = 0x88a8 // 802.1ad service tag (outer tag of QinQ)
)

// FilterFor builds a classic BPF socket filter that accepts IPv4 frames whose
// source or destination is one of addrs, keeping snaplen bytes of each, and
// rejects everything else in the kernel, so unrelated traffic is never copied
// to user space. Frames may be untagged or carry one or two in-band 802.1Q /
// 802.1ad tags (tags the kernel moved out of band are not in the frame and
// need no handling). Truncated frames are rejected: a load past the end of the
// frame ends the filter with 0.
//
// An ICMP error message (destination unreachable, time exceeded, parameter
// problem: ICMPError) is judged by the packet it quotes instead: it is kept
// when the quoted source or destination is listed, e.g. a router's net
// unreachable about a request to a VIP. One set of compares serves both (the
// address list is all of the program's size): an error sent to a listed
// address is kept too, for the quoted packet came from there, but one a
// listed address sent about a packet between two unlisted ones (forwarded by
// it) is dropped. An error whose quote is cut before the addresses is judged
// by its own. The eBPF tap filter also follows the client endpoints learned
// in the kernel; this one knows addresses only.
//
// Duplicate addresses are counted once; IPv4-mapped IPv6 addresses are
// unmapped. Other IPv6 addresses, invalid addresses, more than
// MaxFilterAddrs distinct addresses and a snaplen < 1 are errors. With no
// addresses the filter accepts nothing.
func FilterFor(addrs []netip.Addr, snaplen int) ([]bpf.RawInstruction, error) {
	if snaplen < 1 {
		return nil, fmt.Errorf("filter: snaplen %d, want at least 1", snaplen)
	}
	uniq := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		a = a.Unmap()
		if !a.Is4() {
			return nil, fmt.Errorf("filter: address %v is not IPv4", a)
		}
		uniq = append(uniq, a)
	}
	slices.SortFunc(uniq, netip.Addr.Compare)
	uniq = slices.Compact(uniq)
	if len(uniq) > MaxFilterAddrs {
		return nil, fmt.Errorf("filter: %d addresses, at most %d fit in one classic BPF program", len(uniq), MaxFilterAddrs)
	}
	if len(uniq) == 0 {
		return bpf.Assemble([]bpf.Instruction{bpf.RetConstant{Val: 0}})
	}
	accept := bpf.RetConstant{Val: uint32(snaplen)}
	reject := bpf.RetConstant{Val: 0}

	// Find the IPv4 header and leave its offset in X. Every jump is short
	// (classic BPF conditional jumps reach at most 255 instructions ahead),
	// so the reject sits right after the dispatch and each address is
	// followed by its own accept.
	prog := []bpf.Instruction{
		/* 0 */ bpf.LoadAbsolute{Off: 12, Size: 2},
		/* 1 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeIPv4, SkipTrue: 9},
		/* 2 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeDot1Q, SkipTrue: 1},
		/* 3 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeDot1AD, SkipFalse: 6},
		/* 4 */ bpf.LoadAbsolute{Off: 16, Size: 2}, // one tag
		/* 5 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeIPv4, SkipTrue: 7},
		/* 6 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeDot1Q, SkipTrue: 1},
		/* 7 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeDot1AD, SkipFalse: 2},
		/* 8 */ bpf.LoadAbsolute{Off: 20, Size: 2}, // two tags
		/* 9 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: etherTypeIPv4, SkipTrue: 5},
		/* 10 */ reject,
		/* 11 */ bpf.LoadConstant{Dst: bpf.RegX, Val: 14},
		/* 12 */ bpf.Jump{Skip: 3},
		/* 13 */ bpf.LoadConstant{Dst: bpf.RegX, Val: 18},
		/* 14 */ bpf.Jump{Skip: 1},
		/* 15 */ bpf.LoadConstant{Dst: bpf.RegX, Val: 22},
	}
	prog = append(prog, icmpQuote...)
	for _, off := range []uint32{12, 16} { // IPv4 source, destination
		prog = append(prog, bpf.LoadIndirect{Off: off, Size: 4})
		for _, a := range uniq {
			b := a.As4()
			v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
			prog = append(prog, bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: v, SkipTrue: 1}, accept)
		}
	}
	prog = append(prog, reject)
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("filter: assemble: %w", err)
	}
	return raw, nil
}

// icmpQuote follows the prologue (X: the IPv4 header's offset) and moves X
// to the quoted IPv4 header of an ICMP error message, which the address
// compares after it then read. Any other frame, an error that is a later
// fragment, or whose quote is cut before its addresses or is not IPv4 keeps
// X at its own header. A TCP or UDP frame runs its first two instructions.
var icmpQuote = []bpf.Instruction{
	/* 0 */ bpf.LoadIndirect{Off: 9, Size: 1}, // protocol
	/* 1 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: ipProtoICMP, SkipTrue: 27},
	/* 2 */ bpf.LoadIndirect{Off: 6, Size: 2}, // flags, fragment offset
	/* 3 */ bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: 0x1fff, SkipTrue: 25},
	/* 4 */ bpf.LoadIndirect{Off: 0, Size: 1}, // version, IHL
	/* 5 */ bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 0x0f},
	/* 6 */ bpf.ALUOpConstant{Op: bpf.ALUOpShiftLeft, Val: 2},
	/* 7 */ bpf.JumpIf{Cond: bpf.JumpLessThan, Val: 20, SkipTrue: 21},
	/* 8 */ bpf.StoreScratch{Src: bpf.RegX, N: 0}, // the header, to go back to
	/* 9 */ bpf.ALUOpX{Op: bpf.ALUOpAdd}, // the ICMP header
	/* 10 */ bpf.ALUOpConstant{Op: bpf.ALUOpAdd, Val: 8 + 20}, // the end of the quoted header
	/* 11 */ bpf.TAX{},
	/* 12 */ bpf.LoadExtension{Num: bpf.ExtLen},
	/* 13 */ bpf.JumpIfX{Cond: bpf.JumpLessThan, SkipTrue: 14}, // quote cut
	/* 14 */ bpf.TXA{},
	/* 15 */ bpf.ALUOpConstant{Op: bpf.ALUOpSub, Val: 8 + 20},
	/* 16 */ bpf.TAX{},
	/* 17 */ bpf.LoadIndirect{Off: 0, Size: 1}, // ICMP type
	/* 18 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: ICMPDestUnreachable, SkipTrue: 2},
	/* 19 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: ICMPTimeExceeded, SkipTrue: 1},
	/* 20 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: ICMPParamProblem, SkipFalse: 7},
	/* 21 */ bpf.TXA{},
	/* 22 */ bpf.ALUOpConstant{Op: bpf.ALUOpAdd, Val: 8},
	/* 23 */ bpf.TAX{}, // the quoted IPv4 header
	/* 24 */ bpf.LoadIndirect{Off: 0, Size: 1},
	/* 25 */ bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 0xf0},
	/* 26 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: 0x40, SkipTrue: 1},
	/* 27 */ bpf.Jump{Skip: 1},
	/* 28 */ bpf.LoadScratch{Dst: bpf.RegX, N: 0}, // back to the frame's own header
}
