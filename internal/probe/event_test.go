package probe

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// The Go decoder's offsets must be those of struct pt_event in every object.
func TestEventLayoutMatchesBTF(t *testing.T) {
	want := map[string]int{
		"ktime_ns": evKtime, "cookie": evCookie, "cgroup_id": evCgroup, "netns": evNetns,
		"pid": evPid, "ifindex": evIfindex, "len": evLen, "saddr": evSaddr, "daddr": evDaddr,
		"req_daddr": evReqDaddr, "sport": evSport, "dport": evDport, "req_dport": evReqDport,
		"vlan_tci": evVlanTCI, "vlan_proto": evVlanProto, "point": evPoint, "dir": evDir,
		"proto": evProto, "hook": evHook, "kind": evKind, "tcp_flags": evTCPFlags, "comm": evComm,
		"drop_reason": evReason, "location": evLocation,
	}
	for name, load := range map[string]func() (*ebpf.CollectionSpec, error){
		"sock": loadObserveSock, "tc": loadObserveTC, "nf": loadObserveNF, "drop": loadObserveDrop,
	} {
		spec, err := load()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var ev *btf.Struct
		if err := spec.Types.TypeByName("pt_event", &ev); err != nil {
			t.Fatalf("%s: struct pt_event in BTF: %v", name, err)
		}
		if ev.Size != eventSize {
			t.Errorf("%s: sizeof(struct pt_event) = %d, decoder expects %d", name, ev.Size, eventSize)
		}
		if len(ev.Members) != len(want) {
			t.Errorf("%s: struct pt_event has %d members, decoder knows %d", name, len(ev.Members), len(want))
		}
		for _, m := range ev.Members {
			off, ok := want[m.Name]
			if !ok {
				t.Errorf("%s: member %s unknown to the decoder", name, m.Name)
				continue
			}
			if got := int(m.Offset.Bytes()); got != off {
				t.Errorf("%s: member %s at offset %d, decoder reads %d", name, m.Name, got, off)
			}
		}
	}
}

// rawEvent builds a record as the kernel would write it.
type rawEvent [eventSize]byte

func (r *rawEvent) u16(off int, v uint16) { binary.LittleEndian.PutUint16(r[off:], v) }
func (r *rawEvent) u32(off int, v uint32) { binary.LittleEndian.PutUint32(r[off:], v) }
func (r *rawEvent) u64(off int, v uint64) { binary.LittleEndian.PutUint64(r[off:], v) }
func (r *rawEvent) addr(off int, a string) {
	b := netip.MustParseAddr(a).As4()
	copy(r[off:], b[:])
}
func (r *rawEvent) port(off int, p uint16) { binary.BigEndian.PutUint16(r[off:], p) }

func TestDecodeSockAddr(t *testing.T) {
	var r rawEvent
	r.u64(evKtime, 5_000_000_000)
	r.u64(evCookie, 77)
	r.u64(evCgroup, 1234)
	r.u32(evNetns, 4026531840)
	r.u32(evPid, 4242)
	r.addr(evDaddr, "10.244.20.31")
	r.port(evDport, 3000)
	r.addr(evReqDaddr, "10.120.0.80")
	r.port(evReqDport, 80)
	r[evPoint] = 1
	r[evProto] = 6
	r[evKind] = 1
	r[evHook] = 3 // ignored outside netfilter points
	copy(r[evComm:], "curl\x00junk")

	epoch := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	o, err := decodeEvent(r[:], epoch)
	if err != nil {
		t.Fatal(err)
	}
	want := obs.Observation{
		Time: epoch.Add(5 * time.Second), Point: obs.PointSockAddr, Proto: obs.TCP,
		Dst:    netip.MustParseAddrPort("10.244.20.31:3000"),
		ReqDst: netip.MustParseAddrPort("10.120.0.80:80"),
		Kind:   obs.SockConnect, Cookie: 77, PID: 4242, Comm: "curl", Cgroup: 1234, NetNS: 4026531840,
	}
	if !o.Time.Equal(want.Time) {
		t.Errorf("time %v, want %v", o.Time, want.Time)
	}
	o.Time = want.Time
	if o.Src.IsValid() {
		t.Errorf("source %v from an all-zero address, want unknown", o.Src)
	}
	if o.Point != want.Point || o.Proto != want.Proto || o.Dst != want.Dst || o.ReqDst != want.ReqDst ||
		o.Kind != want.Kind || o.Cookie != want.Cookie || o.PID != want.PID || o.Comm != want.Comm ||
		o.Cgroup != want.Cgroup || o.NetNS != want.NetNS || o.Hook != 0 {
		t.Errorf("decoded\n %+v\nwant\n %+v", o, want)
	}
}

// TestDecodeSockEgressSentAgain checks that the egress observer's report of
// a datagram a socket LB after sendmsg4 sent to a new destination keeps its
// kind: the engine makes that destination another backend of the socket's
// flow only then.
func TestDecodeSockEgressSentAgain(t *testing.T) {
	var r rawEvent
	r.u64(evCookie, 77)
	r.addr(evSaddr, "10.244.8.23")
	r.port(evSport, 51000)
	r.addr(evDaddr, "10.244.20.32")
	r.port(evDport, 5353)
	r[evPoint] = 3
	r[evProto] = 17
	r[evKind] = 2
	o, err := decodeEvent(r[:], time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if o.Point != obs.PointSockEgress || o.Kind != obs.SockSendmsg || o.Cookie != 77 ||
		o.Dst != netip.MustParseAddrPort("10.244.20.32:5353") {
		t.Errorf("decoded %+v", o)
	}
}

func TestDecodeTCWithVLAN(t *testing.T) {
	var r rawEvent
	r.addr(evSaddr, "10.244.8.23")
	r.port(evSport, 40000)
	r.addr(evDaddr, "10.120.0.80")
	r.port(evDport, 80)
	r.u32(evIfindex, 7)
	r.u32(evLen, 74)
	r.u16(evVlanTCI, 0x20c8) // PCP 1, VID 200
	r.u16(evVlanProto, 0x8100)
	r[evPoint] = 5
	r[evDir] = 2
	r[evProto] = 6
	r[evTCPFlags] = 0x02
	o, err := decodeEvent(r[:], time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if o.Point != obs.PointTCTail || o.Dir != obs.DirOut || o.VLAN != 200 || o.TPID != 0x8100 ||
		o.Ifindex != 7 || o.Len != 74 || o.TCPFlags != 0x02 ||
		o.Src != netip.MustParseAddrPort("10.244.8.23:40000") || o.Dst != netip.MustParseAddrPort("10.120.0.80:80") {
		t.Errorf("decoded %+v", o)
	}
	if o.Kind != 0 || o.ReqDst.IsValid() {
		t.Errorf("socket fields set on a tc observation: %+v", o)
	}
}

func TestDecodeNetfilterHookAndUntagged(t *testing.T) {
	var r rawEvent
	r.u16(evVlanTCI, 5) // no TPID: not tagged
	r[evPoint] = 7
	r[evHook] = 3
	r[evProto] = 17
	o, err := decodeEvent(r[:], time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if o.Point != obs.PointNFAfter || o.Hook != obs.HookLocalOut || o.Proto != obs.UDP || o.VLAN != 0 || o.TPID != 0 {
		t.Errorf("decoded %+v", o)
	}
}

func TestDecodeRejectsBadRecords(t *testing.T) {
	var r rawEvent
	r[evPoint] = 1
	if _, err := decodeEvent(r[:eventSize-1], time.Time{}); err == nil {
		t.Error("short record accepted")
	}
	r[evPoint] = 0
	if _, err := decodeEvent(r[:], time.Time{}); err == nil {
		t.Error("record with point 0 accepted")
	}
	r[evPoint] = bpfPointCount
	if _, err := decodeEvent(r[:], time.Time{}); err == nil {
		t.Error("record with an unknown point accepted")
	}
}

func BenchmarkDecodeEvent(b *testing.B) {
	var r rawEvent
	r[evPoint] = 4
	r.addr(evDaddr, "10.120.0.80")
	epoch := time.Now()
	for b.Loop() {
		if _, err := decodeEvent(r[:], epoch); err != nil {
			b.Fatal(err)
		}
	}
}
