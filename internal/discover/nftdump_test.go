package discover

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"reflect"
	"slices"
	"syscall"
	"testing"

	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/google/nftables/xt"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// ruleMessage is an NFT_MSG_NEWRULE message's data as the kernel sends it
// in a listing: nfgenmsg, table, chain, expressions, userdata (a comment).
func ruleMessage(t testing.TB, exprs []expr.Any, comment string) []byte {
	t.Helper()
	var list []netlink.Attribute
	for _, e := range exprs {
		b, err := expr.Marshal(unix.NFPROTO_IPV4, e)
		if err != nil {
			t.Fatal(err)
		}
		list = append(list, netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: b})
	}
	elems, err := netlink.MarshalAttributes(list)
	if err != nil {
		t.Fatal(err)
	}
	attrs := []netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: []byte("nat\x00")},
		{Type: unix.NFTA_RULE_CHAIN, Data: []byte("KUBE-SERVICES\x00")},
		{Type: unix.NLA_F_NESTED | unix.NFTA_RULE_EXPRESSIONS, Data: elems},
	}
	if comment != "" {
		attrs = append(attrs, netlink.Attribute{Type: unix.NFTA_RULE_USERDATA, Data: userdata.AppendString(nil, userdata.TypeComment, comment)})
	}
	b, err := netlink.MarshalAttributes(attrs)
	if err != nil {
		t.Fatal(err)
	}
	return append([]byte{unix.NFPROTO_IPV4, unix.NFNETLINK_V0, 0, 0}, b...)
}

// dumpPart is the bytes of one part of a dump: its messages, of sequence
// seq, each padded to 4 bytes.
func dumpPart(seq uint32, typ netlink.HeaderType, payloads ...[]byte) []byte {
	var part []byte
	for _, p := range payloads {
		part = binary.NativeEndian.AppendUint32(part, uint32(16+len(p)))
		part = binary.NativeEndian.AppendUint16(part, uint16(typ))
		part = binary.NativeEndian.AppendUint16(part, uint16(netlink.Multi))
		part = binary.NativeEndian.AppendUint32(part, seq)
		part = binary.NativeEndian.AppendUint32(part, 0)
		part = append(part, p...)
		part = append(part, make([]byte, -len(p)&3)...)
	}
	return part
}

// newRule is NFT_MSG_NEWRULE's message type.
const newRule = netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWRULE)

func doneMsg(errno int32) []byte { return binary.NativeEndian.AppendUint32(nil, uint32(errno)) }

// TestReadDumpOnePartAtATime: a dump is handed over as each part is read,
// never collected whole: KUBE-SERVICES, a rule per Service, is reduced to
// natRules one socket buffer at a time. google/nftables' GetRules held
// every message of it, then every rule decoded, until the last one was.
func TestReadDumpOnePartAtATime(t *testing.T) {
	const seq, parts, perPart = 7, 20, 50
	var queue [][]byte
	queue = append(queue, dumpPart(seq-1, newRule, []byte("an earlier request's")))
	for i := range parts {
		var msgs [][]byte
		for j := range perPart {
			msgs = append(msgs, []byte(fmt.Sprint(i*perPart+j)))
		}
		queue = append(queue, dumpPart(seq, newRule, msgs...))
	}
	queue = append(queue, dumpPart(seq, netlink.Done, doneMsg(0)))
	handed, reads := 0, 0
	recv := func(b []byte) (int, error) {
		if handed != (reads-1)*perPart && reads > 1 {
			t.Fatalf("part %d read with %d messages handed over, want the %d of the parts before", reads, handed, (reads-1)*perPart)
		}
		n := copy(b, queue[reads])
		reads++
		return n, nil
	}
	err := readDump(recv, seq, func(data []byte) error {
		if string(data) != fmt.Sprint(handed) {
			t.Fatalf("message %d is %q", handed, data)
		}
		handed++
		return nil
	})
	if err != nil || handed != parts*perPart || reads != len(queue) {
		t.Errorf("err %v, %d messages handed over in %d reads, want %d in %d", err, handed, reads, parts*perPart, len(queue))
	}
}

// TestReadDumpErrors: the kernel's error ends a dump with it; fn's error
// ends it once the rest is read, so the next request reads its own reply.
func TestReadDumpErrors(t *testing.T) {
	serve := func(queue ...[]byte) (func([]byte) (int, error), *int) {
		reads := 0
		return func(b []byte) (int, error) {
			if reads == len(queue) {
				return 0, errors.New("read past the dump's end")
			}
			reads++
			return copy(b, queue[reads-1]), nil
		}, &reads
	}
	recv, _ := serve(dumpPart(1, netlink.Error, doneMsg(-int32(unix.ENOENT))))
	if err := readDump(recv, 1, func([]byte) error { return nil }); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("a chain that is gone: %v, want ENOENT", err)
	}
	recv, reads := serve(dumpPart(1, newRule, []byte("a"), []byte("b")), dumpPart(1, newRule, []byte("c")), dumpPart(1, netlink.Done, doneMsg(0)))
	bad, calls := errors.New("bad rule"), 0
	err := readDump(recv, 1, func([]byte) error { calls++; return bad })
	if err != bad || calls != 1 || *reads != 3 {
		t.Errorf("fn failing: err %v after %d calls and %d reads, want %v after 1 call, the dump read to its end (3)", err, calls, *reads, bad)
	}
}

// TestRuleExprsAsListed: a rule decoded from its listing's message reduces
// to the natRules its expressions do; what nftRuleEval ignores (a counter,
// a log) is not decoded.
func TestRuleExprsAsListed(t *testing.T) {
	counter, log := &expr.Counter{Bytes: 1, Packets: 2}, &expr.Log{Key: 1 << unix.NFTA_LOG_PREFIX, Data: []byte("svc")}
	for _, tc := range []struct {
		name    string
		exprs   []expr.Any
		comment string
	}{
		{"iptables-nft -d VIP -p tcp -m comment -m tcp --dport 80 -j KUBE-SVC", []expr.Any{
			loadDaddr(1), cmpEq(1, ip4("10.96.0.80")...), loadProto(1), cmpEq(1, unix.IPPROTO_TCP),
			&expr.Match{Name: "comment", Info: ptr(xt.Comment("default/web:http cluster IP"))},
			&expr.Match{Name: "tcp", Info: &xt.Tcp{DstPorts: [2]uint16{80, 80}}},
			counter, jump("KUBE-SVC-WEB")}, ""},
		{"iptables-nft -j DNAT", []expr.Any{loadProto(1), cmpEq(1, unix.IPPROTO_TCP),
			&expr.Target{Name: "DNAT", Info: &xt.NatIPv4MultiRangeCompat{{Flags: 3, MinIP: net.ParseIP("10.244.20.31").To4(), MaxIP: net.ParseIP("10.244.20.31").To4(), MinPort: 3000, MaxPort: 3000}}}}, ""},
		{"nft dnat with a comment", append([]expr.Any{log, loadProto(1), cmpEq(1, unix.IPPROTO_TCP)}, dnatTo("10.244.20.32", 3000)...), "web"},
		{"nft reject", []expr.Any{loadDaddr(1), cmpEq(1, ip4("10.96.0.90")...), &expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: 3}}, ""},
		{"nft goto", []expr.Any{gotoChain("endpoint-1")}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exprs, ud, err := ruleExprs(unix.NFPROTO_IPV4, ruleMessage(t, tc.exprs, tc.comment))
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range exprs {
				switch e.(type) {
				case *expr.Counter, *expr.Log:
					t.Errorf("decoded %T, which nftRuleEval ignores", e)
				}
			}
			if got, want := nftNATRules(exprs, noSets), nftNATRules(tc.exprs, noSets); !reflect.DeepEqual(got, want) {
				t.Errorf("natRules\n got %+v\nwant %+v", got, want)
			}
			if c, _ := userdata.GetString(ud, userdata.TypeComment); c != tc.comment {
				t.Errorf("comment %q, want %q", c, tc.comment)
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// TestNFTGraphHoldsOnlyChainsRead: an nftables graph lists no chain names
// beforehand (kube-proxy's table has a chain per Service and one per
// endpoint, 20,000 names on a node of 5,000 Services, held at every read
// of the rules): every chain a rule jumps to exists, and a walk reads
// those it reaches.
func TestNFTGraphHoldsOnlyChainsRead(t *testing.T) {
	table := map[string][]expr.Any{
		"nat-prerouting": {jump("services")},
		"services":       {loadDaddr(1), cmpEq(1, ip4("10.96.0.80")...), gotoChain("service-web")},
		"service-web":    dnatTo("10.244.20.31", 3000),
		"service-other":  dnatTo("10.244.20.99", 3000),
	}
	var read []string
	g := &natGraph{source: SourceNFTables, table: "ip kube-proxy", family: "ip", chains: map[string][]natRule{},
		bases: []natBase{{"nat-prerouting", "prerouting", true, natDstPriority}},
		load: func(name string) ([]natRule, bool, error) {
			read = append(read, name)
			return nftNATRules(table[name], noSets), true, nil
		}}
	got := g.match([]netip.Addr{netip.MustParseAddr("10.96.0.80")})
	if len(got) != 1 || got[0].Backend != netip.MustParseAddrPort("10.244.20.31:3000") {
		t.Errorf("DNATs %+v, want the one to 10.244.20.31:3000", got)
	}
	if want := []string{"nat-prerouting", "services", "service-web"}; !slices.Equal(read, want) || len(g.chains) != len(want) {
		t.Errorf("read %q and holds %d chains, want %q", read, len(g.chains), want)
	}
}
