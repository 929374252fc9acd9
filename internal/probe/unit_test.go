package probe

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

func TestCgroup2Mount(t *testing.T) {
	const mountinfo = `25 30 0:23 / /sys rw,nosuid shared:7 - sysfs sysfs rw
35 25 0:30 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
41 35 0:38 / /sys/fs/cgroup/my\040unified rw,relatime shared:10 - cgroup2 cgroup2 rw
42 35 0:39 / /sys/fs/cgroup/cpu rw shared:11 - cgroup cgroup rw,cpu
`
	got, err := cgroup2Mount(strings.NewReader(mountinfo))
	if err != nil || got != "/sys/fs/cgroup/my unified" {
		t.Errorf("cgroup2Mount = %q, %v; want /sys/fs/cgroup/my unified", got, err)
	}
	if _, err := cgroup2Mount(strings.NewReader("42 35 0:39 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw\n")); err == nil {
		t.Error("no cgroup2 mount, no error")
	}
}

func ctFlow(src, dst, replySrc, replyDst string, proto uint8) ctEntry {
	ap := netip.MustParseAddrPort
	return ctEntry{
		proto:  proto,
		orig:   ctTuple{src: ap(src), dst: ap(dst)},
		reply:  ctTuple{src: ap(replySrc), dst: ap(replyDst)},
		mark:   9,
		status: 0x08 | 0x20, // IPS_CONFIRMED | IPS_DST_NAT
	}
}

func TestConntrackObservationDNAT(t *testing.T) {
	now := time.Unix(100, 0)
	f := ctFlow("10.244.8.23:40000", "10.120.0.80:80", "10.244.20.31:3000", "10.244.8.23:40000", 6)
	o := conntrackObservation(f, 55, now)
	want := obs.Observation{
		Time: now, Point: obs.PointConntrack, Proto: obs.TCP,
		Src:    netip.MustParseAddrPort("10.244.8.23:40000"),
		Dst:    netip.MustParseAddrPort("10.120.0.80:80"),
		NATDst: netip.MustParseAddrPort("10.244.20.31:3000"),
		NetNS:  55, CTMark: 9, CTStatus: 0x08 | 0x20, // IPS_CONFIRMED | IPS_DST_NAT
	}
	if o.Time != want.Time || o.Point != want.Point || o.Proto != want.Proto || o.Src != want.Src ||
		o.Dst != want.Dst || o.NATDst != want.NATDst || o.NetNS != want.NetNS || o.CTMark != want.CTMark ||
		o.CTStatus != want.CTStatus {
		t.Errorf("got %+v\nwant %+v", o, want)
	}
}

func TestConntrackObservationWithoutNAT(t *testing.T) {
	f := ctFlow("10.244.8.23:40000", "10.244.20.31:5353", "10.244.20.31:5353", "10.244.8.23:40000", 17)
	if o := conntrackObservation(f, 1, time.Time{}); o.NATDst.IsValid() || o.Proto != obs.UDP {
		t.Errorf("no NAT: got NATDst %v proto %v", o.NATDst, o.Proto)
	}
}
