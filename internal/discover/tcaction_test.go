package discover

import (
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

const tcaEgressRedir = 1 // TCA_EGRESS_REDIR: a mirred's action

// TestFilterActions decodes the actions of tc filters that are not BPF from
// their netlink messages: what tc(8) (iproute2 6.1) sent to add them
// (testdata/tc/*.request, captured with strace: this kernel has no act_nat,
// act_pedit, act_ct nor flower, and a filter message is laid out the same
// both ways); a pedit's or a ct's rewrite is of what its filter matches,
// its destination and port; and
// a kernel's dump
// of a u32 filter with a mirred action (u32-mirred.dump: the root, the hash
// table and the filter, as the kernel sends them).
func TestFilterActions(t *testing.T) {
	vip, none := netip.MustParsePrefix("10.120.0.80/32"), netip.Prefix{}
	for _, tc := range []struct {
		file string // and the tc(8) command it holds
		want []filterAction
	}{
		{"u32-nat-ingress.request", // ingress pref 10 protocol ip u32 match ip dst 10.120.0.80/32 action nat ingress 10.120.0.80/32 10.244.20.31
			[]filterAction{{"u32", "pref 10", "nat", "nat ingress 10.120.0.80/32 -> 10.244.20.31", vip, 0, 0, 0}}},
		{"u32-nat-egress.request", // egress pref 14 protocol ip u32 match ip src 10.244.20.31/32 action nat egress 10.244.20.31/32 10.120.0.80
			[]filterAction{{"u32", "pref 14", "nat", "nat egress 10.244.20.31/32 -> 10.120.0.80", none, 0, 0, 0}}},
		{"flower-nat-ingress.request", // ingress pref 13 protocol ip flower dst_ip 10.120.0.83 action nat ingress 10.120.0.83/32 10.244.20.34
			[]filterAction{{"flower", "pref 13", "nat", "nat ingress 10.120.0.83/32 -> 10.244.20.34", netip.MustParsePrefix("10.120.0.83/32"), 0, 0, 0}}},
		{"u32-pedit-dst.request", // ingress pref 11 protocol ip u32 match ip dst 10.120.0.81/32 action pedit ex munge ip dst set 10.244.20.32 pipe csum ip and tcp
			[]filterAction{{"u32", "pref 11", "pedit", "pedit munge ip dst set 10.244.20.32", netip.MustParsePrefix("10.120.0.81/32"), 0, 0, 0}, {"u32", "pref 11", "csum", "", none, 0, 0, 0}}},
		{"u32-pedit-legacy-any-dst.request", // ingress pref 15 protocol ip u32 match ip dport 80 0xffff action pedit munge ip dst set 10.244.20.35
			[]filterAction{{"u32", "pref 15", "pedit", "pedit munge ip dst set 10.244.20.35", netip.MustParsePrefix("0.0.0.0/0"), 80, 0, 0}}},
		{"flower-ct-nat-dst.request", // ingress pref 12 protocol ip flower dst_ip 10.120.0.82 action ct commit nat dst addr 10.244.20.33 port 80
			[]filterAction{{"flower", "pref 12", "ct", "ct commit nat dst addr 10.244.20.33 port 80", netip.MustParsePrefix("10.120.0.82/32"), 0, 0, 0}}},
		{"u32-mirred.dump", // ingress pref 10 protocol ip u32 match ip dst 10.120.0.80/32 action mirred egress redirect dev hv1
			[]filterAction{{"u32", "pref 10", "mirred", "", none, 0, tcaEgressRedir, 2}}},
	} {
		b, err := os.ReadFile(filepath.Join("testdata", "tc", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := syscall.ParseNetlinkMessage(b)
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		var got []filterAction
		for _, m := range msgs {
			as, err := filterActions(m.Data)
			if err != nil {
				t.Fatalf("%s: %v", tc.file, err)
			}
			got = append(got, as...)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.file, got, tc.want)
		}
	}
}

// FuzzFilterActions: no filter message, however cut or malformed, makes
// the decoder panic. Seeded with the messages of testdata/tc.
func FuzzFilterActions(f *testing.F) {
	files, err := filepath.Glob(filepath.Join("testdata", "tc", "*"))
	if err != nil {
		f.Fatal(err)
	}
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		msgs, err := syscall.ParseNetlinkMessage(b)
		if err != nil {
			f.Fatalf("%s: %v", file, err)
		}
		for _, m := range msgs {
			f.Add(m.Data)
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		_, _ = filterActions(data)
	})
}

// TestFilterActionsOfDumps decodes filters laid out as the kernel dumps
// them, which tc(8)'s requests are not: per action its kind, stats and
// hardware count around the options (tcf_action_dump_1), a pedit's
// TCA_PEDIT_KEYS_EX before its TCA_PEDIT_PARMS_EX (tcf_pedit_dump), an
// act_ct's zone, TCA_CT_PARMS and times with the NAT (tcf_ct_dump), 64-bit
// attributes after a pad, nests with NLA_F_NESTED or without. A u32
// selector whose port key comes before its /24 destination key, a pedit
// then csum then mirred (port 80 of the /24); a flower with a port but no
// dst_ip (its ct rewrites any destination of that port); an act_nat of a /16 on a filter of one VIP
// (it rewrites that VIP only); an egress act_nat (sources: no destination).
func TestFilterActionsOfDumps(t *testing.T) {
	ne := binary.NativeEndian
	attrs := func(fn func(ae *netlink.AttributeEncoder)) []byte {
		ae := netlink.NewAttributeEncoder()
		fn(ae)
		b, err := ae.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	tcGen := func(index uint32, rest ...byte) []byte { // index, capab, action, refcnt, bindcnt
		b := make([]byte, tcGenLen)
		ne.PutUint32(b, index)
		ne.PutUint32(b[12:], 1)
		ne.PutUint32(b[16:], 1)
		return append(b, rest...)
	}
	u32s := func(vs ...uint32) []byte {
		var b []byte
		for _, v := range vs {
			b = ne.AppendUint32(b, v)
		}
		return b
	}
	be := func(addr string) uint32 { return ne.Uint32(netip.MustParseAddr(addr).AsSlice()) }
	tm := make([]byte, 32) // struct tcf_t
	action := func(kind string, options []byte) []byte {
		return attrs(func(ae *netlink.AttributeEncoder) {
			ae.String(tcaActKind, kind)
			ae.Bytes(4|netlink.Nested, attrs(func(st *netlink.AttributeEncoder) { // TCA_ACT_STATS
				st.Bytes(6, nil)              // TCA_STATS_PAD
				st.Bytes(1, make([]byte, 16)) // TCA_STATS_BASIC
			}))
			ae.Uint32(10, 0) // TCA_ACT_IN_HW_COUNT
			ae.Bytes(tcaActOptions, options)
		})
	}
	table := func(actions ...[]byte) []byte {
		return attrs(func(ae *netlink.AttributeEncoder) {
			for i, a := range actions {
				ae.Bytes(uint16(i+1), a)
			}
		})
	}
	filter := func(kind string, pref uint32, options []byte) []byte {
		msg := make([]byte, tcMsgLen)
		ne.PutUint32(msg[4:], 4)
		ne.PutUint32(msg[12:], 0xfffffff2)
		ne.PutUint32(msg[16:], pref<<16|0x0008) // ETH_P_IP, network order
		return append(msg, attrs(func(ae *netlink.AttributeEncoder) {
			ae.String(unix.TCA_KIND, kind)
			ae.Uint32(unix.TCA_CHAIN, 0)
			ae.Bytes(unix.TCA_OPTIONS, options)
		})...)
	}
	pedit := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaPeditKeysEx|netlink.Nested, attrs(func(ks *netlink.AttributeEncoder) {
			ks.Bytes(tcaPeditKeyEx|netlink.Nested, attrs(func(k *netlink.AttributeEncoder) {
				k.Uint16(tcaPeditKeyHtype, peditHtypeIP4)
				k.Uint16(tcaPeditKeyCmd, peditCmdSet)
			}))
		}))
		// nkeys 1, then the key: mask 0, val, off 16, at, offmask, shift
		ae.Bytes(tcaPeditParmsEx, append(tcGen(3, 1, 0, 0, 0), u32s(0, be("10.244.20.31"), ipDstOff, 0, 0, 0)...))
		ae.Bytes(3, nil) // TCA_PEDIT_PAD
		ae.Bytes(1, tm)  // TCA_PEDIT_TM
	})
	csum := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(1, tcGen(4, u32s(1|8)...)) // TCA_CSUM_PARMS: ip and tcp
		ae.Bytes(3, nil)
		ae.Bytes(2, tm)
	})
	mirred := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(2, tcGen(5, u32s(1, 7)...)) // TCA_MIRRED_PARMS: egress redirect, ifindex 7
		ae.Bytes(3, nil)
		ae.Bytes(1, tm)
	})
	// struct tc_u32_sel (flags terminal, nkeys 2) and its keys: mask, val
	// (network order), off, offmask.
	sel := append([]byte{1, 0, 2, 0}, make([]byte, 12)...)
	sel = append(sel, u32s(be("0.0.255.255"), be("0.0.0.80"), 20, 0)...)
	sel = append(sel, u32s(be("255.255.255.0"), be("10.120.0.0"), ipDstOff, 0)...)
	u32 := filter("u32", 10, attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaU32Sel, sel)
		ae.Uint32(2, 0x800) // TCA_U32_HASH
		ae.Bytes(tcaU32Act, table(action("pedit", pedit), action("csum", csum), action("mirred", mirred)))
		ae.Bytes(12, nil)             // TCA_U32_PAD
		ae.Bytes(9, make([]byte, 32)) // TCA_U32_PCNT
	}))

	ct := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Uint16(tcaCtAction, tcaCtActCommit|1<<3|tcaCtActNatDst) // commit, nat, nat dst
		ae.Uint16(4, 0)                                            // TCA_CT_ZONE
		ae.Bytes(tcaCtNatIPv4Min, netip.MustParseAddr("10.244.20.31").AsSlice())
		ae.Bytes(tcaCtNatIPv4Max, netip.MustParseAddr("10.244.20.31").AsSlice())
		ae.Bytes(tcaCtNatPortMin, []byte{0x0b, 0xb8})
		ae.Bytes(tcaCtNatPortMax, []byte{0x0b, 0xb8})
		ae.Bytes(1, tcGen(6)) // TCA_CT_PARMS
		ae.Bytes(15, nil)     // TCA_CT_PAD
		ae.Bytes(2, tm)       // TCA_CT_TM
	})
	flower := filter("flower", 12, attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(8, []byte{0x08, 0x00})  // TCA_FLOWER_KEY_ETH_TYPE
		ae.Uint8(9, unix.IPPROTO_TCP)    // TCA_FLOWER_KEY_IP_PROTO
		ae.Bytes(19, []byte{0, 80})      // TCA_FLOWER_KEY_TCP_DST
		ae.Bytes(36, []byte{0xff, 0xff}) // and its mask
		ae.Uint32(22, 0)                 // TCA_FLOWER_FLAGS
		ae.Uint32(86, 0)                 // TCA_FLOWER_IN_HW_COUNT
		ae.Bytes(tcaFlowerAct|netlink.Nested, table(action("ct", ct)))
	}))

	nat := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaNatParms, tcGen(8, u32s(be("10.244.20.31"), be("10.120.0.80"), be("255.255.255.255"), tcNatEgress)...))
		ae.Bytes(3, nil) // TCA_NAT_PAD
		ae.Bytes(2, tm)  // TCA_NAT_TM
	})
	// A u32 filter for one VIP with an act_nat of the whole /16 rewrites
	// only what both match.
	subnet := attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaNatParms, tcGen(9, u32s(be("10.120.0.0"), be("10.244.0.0"), be("255.255.0.0"), 0)...))
	})
	sel = append([]byte{1, 0, 1, 0}, make([]byte, 12)...)
	sel = append(sel, u32s(be("255.255.255.255"), be("10.120.0.80"), ipDstOff, 0)...)
	u32Subnet := filter("u32", 11, attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaU32Sel, sel)
		ae.Bytes(tcaU32Act, table(action("nat", subnet)))
	}))
	matchall := filter("matchall", 14, attrs(func(ae *netlink.AttributeEncoder) {
		ae.Bytes(tcaMatchallAct, table(action("nat", nat)))
		ae.Uint32(3, 0) // TCA_MATCHALL_FLAGS
	}))

	for _, tc := range []struct {
		name string
		msg  []byte
		want []filterAction
	}{
		{"u32 dport 80, dst /24: pedit, csum, mirred", u32, []filterAction{
			{"u32", "pref 10", "pedit", "pedit munge ip dst set 10.244.20.31", netip.MustParsePrefix("10.120.0.0/24"), 80, 0, 0},
			{"u32", "pref 10", "csum", "", netip.Prefix{}, 0, 0, 0},
			{"u32", "pref 10", "mirred", "", netip.Prefix{}, 0, tcaEgressRedir, 7}}},
		{"u32 dst /32: nat ingress of a /16", u32Subnet, []filterAction{
			{"u32", "pref 11", "nat", "nat ingress 10.120.0.0/16 -> 10.244.0.0", netip.MustParsePrefix("10.120.0.80/32"), 0, 0, 0}}},
		{"flower tcp dst_port 80: ct commit nat dst", flower, []filterAction{
			{"flower", "pref 12", "ct", "ct commit nat dst addr 10.244.20.31 port 3000", netip.MustParsePrefix("0.0.0.0/0"), 80, 0, 0}}},
		{"matchall: nat egress", matchall, []filterAction{
			{"matchall", "pref 14", "nat", "nat egress 10.244.20.31/32 -> 10.120.0.80", netip.Prefix{}, 0, 0, 0}}},
	} {
		got, err := filterActions(tc.msg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, got, tc.want)
		}
	}
}
