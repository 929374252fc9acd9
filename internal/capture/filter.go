package capture

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/pathtrace/pathtrace/internal/obs"

	"golang.org/x/net/bpf"
)

// MaxFilterAddrs is the most addresses FilterFor accepts. Each address
// watched on every port costs four instructions (a compare and an accept,
// for the source and for the destination), each endpoint a few more, and the
// rest of the program filterFixed; a program over the kernel's limit of
// 4096 classic BPF instructions (maxFilterInsns) is an error too.
const MaxFilterAddrs = 1000

// filterFixed is how many instructions FilterFor's program has besides the
// addresses' compares and accepts.
const filterFixed = 48 + 29 // the prologue and icmpQuote, l4Ports, the reject

// maxFilterInsns is the kernel's limit (BPF_MAXINSNS).
const maxFilterInsns = 4096

// maxEndpointsPerAddr bounds the endpoints of one address the filter
// compares (a conditional jump reaches 255 instructions ahead): an address
// with more is watched on every port.
const maxEndpointsPerAddr = 40

// Ethernet types the filter and the decoder know.
const (
	etherTypeIPv4   = 0x0800
	etherTypeDot1Q  = 0x8100 // 802.1Q customer tag
	etherTypeDot1AD = 0x88a8 // 802.1ad service tag (outer tag of QinQ)
)

// Scratch memory of FilterFor's program.
const (
	scratchHeader  = 0 // icmpQuote: the frame's own IPv4 header
	scratchIP      = 1 // the IPv4 header the compares read
	scratchProto   = 2 // its protocol
	scratchHasPort = 3 // 1 when the ports below are the packet's
	scratchSport   = 4
	scratchDport   = 5
)

// FilterFor builds a classic BPF socket filter that accepts IPv4 frames whose
// source or destination is watched, keeping snaplen bytes of each, and
// rejects everything else in the kernel, so unrelated traffic is never copied
// to user space. An address watched on every port (Port 0) matches on any
// port; one watched on some endpoints only (a backend known with the port it
// serves) matches when the packet's port on that side is one of them (and
// its protocol, when the Watch names one), or when the packet has no ports
// (a later fragment, ICMP, another protocol). Frames may be untagged or
// carry one or two in-band 802.1Q / 802.1ad tags (tags the kernel moved out
// of band are not in the frame and need no handling). Truncated frames are
// rejected: a load past the end of the frame ends the filter with 0.
//
// An ICMP error message (destination unreachable, time exceeded, parameter
// problem: ICMPError) is judged by the packet it quotes instead: it is kept
// when the quoted source or destination is watched (with the quoted ports),
// e.g. a router's net unreachable about a request to a VIP. One set of
// compares serves both (the address list is all of the program's size): an
// error sent to a listed address is kept too, for the quoted packet came
// from there, but one a listed address sent about a packet between two
// unlisted ones (forwarded by it) is dropped. An error whose quote is cut
// before the addresses is judged by its own. The eBPF tap filter also
// follows the client endpoints learned in the kernel; this one knows the
// watched addresses and endpoints only.
//
// Duplicates are counted once, an address watched on every port needs no
// endpoint of it; IPv4-mapped IPv6 addresses are unmapped. Other IPv6
// addresses, invalid addresses, more than MaxFilterAddrs distinct addresses,
// a program over the kernel's limit and a snaplen < 1 are errors. With
// nothing watched the filter accepts nothing.
func FilterFor(watch []obs.Watch, snaplen int) ([]bpf.RawInstruction, error) {
	if snaplen < 1 {
		return nil, fmt.Errorf("filter: snaplen %d, want at least 1", snaplen)
	}
	type ep struct {
		port  uint16
		proto obs.Proto
	}
	eps := map[netip.Addr][]ep{} // nil: every port
	for _, w := range watch {
		a := w.Addr.Unmap()
		if !a.Is4() {
			return nil, fmt.Errorf("filter: address %v is not IPv4", a)
		}
		list, seen := eps[a]
		switch {
		case w.Port == 0 || (seen && list == nil):
			eps[a] = nil
		case !slices.Contains(list, ep{w.Port, w.Proto}):
			eps[a] = append(list, ep{w.Port, w.Proto})
		}
	}
	uniq := slices.SortedFunc(maps.Keys(eps), netip.Addr.Compare)
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
	prog = append(prog, l4Ports...)
	for _, side := range []struct{ addr, port uint32 }{{12, scratchSport}, {16, scratchDport}} { // IPv4 source, destination
		load := bpf.LoadIndirect{Off: side.addr, Size: 4}
		prog = append(prog, load)
		for _, a := range uniq {
			b := a.As4()
			v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
			list := eps[a]
			if list == nil || len(list) > maxEndpointsPerAddr {
				prog = append(prog, bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: v, SkipTrue: 1}, accept)
				continue
			}
			// The address: accept a packet without ports, or one of
			// its endpoints on this side; then reload the address for
			// the next compares.
			var block []bpf.Instruction
			block = append(block,
				bpf.LoadScratch{Dst: bpf.RegA, N: scratchHasPort},
				bpf.JumpIf{Cond: bpf.JumpEqual, Val: 0, SkipFalse: 1},
				accept)
			for _, e := range list {
				if e.proto == 0 {
					block = append(block,
						bpf.LoadScratch{Dst: bpf.RegA, N: int(side.port)},
						bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(e.port), SkipTrue: 1},
						accept)
					continue
				}
				block = append(block,
					bpf.LoadScratch{Dst: bpf.RegA, N: int(side.port)},
					bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(e.port), SkipTrue: 3},
					bpf.LoadScratch{Dst: bpf.RegA, N: scratchProto},
					bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(e.proto), SkipTrue: 1},
					accept)
			}
			block = append(block, load)
			prog = append(prog, bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: v, SkipTrue: uint8(len(block))})
			prog = append(prog, block...)
		}
	}
	prog = append(prog, reject)
	if len(prog) > maxFilterInsns {
		return nil, fmt.Errorf("filter: %d addresses and endpoints need %d instructions, over the kernel's %d", len(uniq), len(prog), maxFilterInsns)
	}
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("filter: assemble: %w", err)
	}
	return raw, nil
}

// l4Ports follows icmpQuote (X: the IPv4 header the compares read, the
// frame's own or the one an ICMP error quotes) and keeps that packet's
// protocol and, for the first fragment of TCP or UDP whose ports are in
// the frame, its ports in the scratch memory (scratchHasPort 1); it leaves
// X as it found it.
var l4Ports = []bpf.Instruction{
	/* 0 */ bpf.StoreScratch{Src: bpf.RegX, N: scratchIP},
	/* 1 */ bpf.LoadConstant{Dst: bpf.RegA, Val: 0},
	/* 2 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchHasPort},
	/* 3 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchSport}, // the kernel wants every scratch slot read stored first
	/* 4 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchDport},
	/* 5 */ bpf.LoadIndirect{Off: 9, Size: 1}, // protocol
	/* 6 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchProto},
	/* 7 */ bpf.JumpIf{Cond: bpf.JumpEqual, Val: ipProtoTCP, SkipTrue: 1},
	/* 8 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: ipProtoUDP, SkipTrue: 19},
	/* 9 */ bpf.LoadIndirect{Off: 6, Size: 2}, // flags, fragment offset
	/* 10 */ bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: 0x1fff, SkipTrue: 17},
	/* 11 */ bpf.LoadIndirect{Off: 0, Size: 1}, // version, IHL
	/* 12 */ bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: 0x0f},
	/* 13 */ bpf.ALUOpConstant{Op: bpf.ALUOpShiftLeft, Val: 2},
	/* 14 */ bpf.ALUOpX{Op: bpf.ALUOpAdd}, // the L4 header
	/* 15 */ bpf.ALUOpConstant{Op: bpf.ALUOpAdd, Val: 4}, // the end of its ports
	/* 16 */ bpf.TAX{},
	/* 17 */ bpf.LoadExtension{Num: bpf.ExtLen},
	/* 18 */ bpf.JumpIfX{Cond: bpf.JumpLessThan, SkipTrue: 9}, // ports cut (a short quote)
	/* 19 */ bpf.TXA{},
	/* 20 */ bpf.ALUOpConstant{Op: bpf.ALUOpSub, Val: 4},
	/* 21 */ bpf.TAX{}, // the L4 header
	/* 22 */ bpf.LoadIndirect{Off: 0, Size: 2}, // source port
	/* 23 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchSport},
	/* 24 */ bpf.LoadIndirect{Off: 2, Size: 2}, // destination port
	/* 25 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchDport},
	/* 26 */ bpf.LoadConstant{Dst: bpf.RegA, Val: 1},
	/* 27 */ bpf.StoreScratch{Src: bpf.RegA, N: scratchHasPort},
	/* 28 */ bpf.LoadScratch{Dst: bpf.RegX, N: scratchIP},
}

// IP protocols whose ports l4Ports reads.
const (
	ipProtoTCP = 6
	ipProtoUDP = 17
)

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
