package discover

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

// TestFilterActions decodes the actions of tc filters that are not BPF from
// their netlink messages: what tc(8) (iproute2 6.1) sent to add them
// (testdata/tc/*.request, captured with strace: this kernel has no act_nat,
// act_pedit, act_ct nor flower, and a filter message is laid out the same
// both ways); a pedit's or a ct's rewrite is of what its filter matches; and
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
			[]filterAction{{"u32", "pref 10", "nat", "nat ingress 10.120.0.80/32 -> 10.244.20.31", vip}}},
		{"u32-nat-egress.request", // egress pref 14 protocol ip u32 match ip src 10.244.20.31/32 action nat egress 10.244.20.31/32 10.120.0.80
			[]filterAction{{"u32", "pref 14", "nat", "nat egress 10.244.20.31/32 -> 10.120.0.80", none}}},
		{"flower-nat-ingress.request", // ingress pref 13 protocol ip flower dst_ip 10.120.0.83 action nat ingress 10.120.0.83/32 10.244.20.34
			[]filterAction{{"flower", "pref 13", "nat", "nat ingress 10.120.0.83/32 -> 10.244.20.34", netip.MustParsePrefix("10.120.0.83/32")}}},
		{"u32-pedit-dst.request", // ingress pref 11 protocol ip u32 match ip dst 10.120.0.81/32 action pedit ex munge ip dst set 10.244.20.32 pipe csum ip and tcp
			[]filterAction{{"u32", "pref 11", "pedit", "pedit munge ip dst set 10.244.20.32", netip.MustParsePrefix("10.120.0.81/32")}, {"u32", "pref 11", "csum", "", none}}},
		{"u32-pedit-legacy-any-dst.request", // ingress pref 15 protocol ip u32 match ip dport 80 0xffff action pedit munge ip dst set 10.244.20.35
			[]filterAction{{"u32", "pref 15", "pedit", "pedit munge ip dst set 10.244.20.35", netip.MustParsePrefix("0.0.0.0/0")}}},
		{"flower-ct-nat-dst.request", // ingress pref 12 protocol ip flower dst_ip 10.120.0.82 action ct commit nat dst addr 10.244.20.33 port 80
			[]filterAction{{"flower", "pref 12", "ct", "ct commit nat dst addr 10.244.20.33 port 80", netip.MustParsePrefix("10.120.0.82/32")}}},
		{"u32-mirred.dump", // ingress pref 10 protocol ip u32 match ip dst 10.120.0.80/32 action mirred egress redirect dev hv1
			[]filterAction{{"u32", "pref 10", "mirred", "", none}}},
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
