package session

import (
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/capture"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// BenchmarkConsume is the user-space cost of one captured frame of a known
// flow, from the tap's ring to the pcapng encoder: copy into a batch,
// classification (the Repeat path), the time-ordered merge of the points and
// the packet block with its comment. Each frame is seen at three points a
// microsecond apart, as a request crosses a Pod's eth0, its host veth and
// the uplink, so the merge switches points at every frame. "many Pods" has
// the capture points of 41 Pods, three of them with traffic. The file write
// itself is left out (io.Discard). "8 flows" is "3 points" with the frames
// of 8 flows in turn (8 client ports), as a busy client's sockets send.
func BenchmarkConsume(b *testing.B) {
	points := []tap{{label: "pod:eth0", point: obs.PointPod}, {label: "host:veth-a", point: obs.PointHost}, {label: "uplink:bond0", point: obs.PointUplink}}
	many := []tap{{label: "uplink:bond0", point: obs.PointUplink}}
	for i := range 41 {
		many = append(many, tap{label: fmt.Sprintf("pod%d:eth0", i), point: obs.PointPod}, tap{label: fmt.Sprintf("host:veth%d", i), point: obs.PointHost})
	}
	for _, c := range []struct {
		name   string
		taps   []tap
		active []int
		flows  int
	}{
		{"3 points", points, []int{0, 1, 2}, 1},
		{"many Pods", many, []int{39, 40, 0}, 1},
		{"8 flows", points, []int{0, 1, 2}, 8},
	} {
		b.Run(c.name, func(b *testing.B) {
			tr := testTracerOf(b, io.Discard, c.taps)
			var raws [][]byte
			for i := range c.flows {
				raws = append(raws, udpFrame(b, netip.AddrPortFrom(client.Addr(), client.Port()+uint16(i)), vip))
			}
			raw := raws[0]
			p := capture.Packet{Dir: obs.DirOut, Len: len(raw), CapLen: len(raw), Data: raw}
			b.ReportAllocs()
			b.ResetTimer()
			at := base
			perRound := maxBatch * len(c.active)
			for n := 0; n < b.N; n += perRound {
				for k, tapIdx := range c.active {
					bt := tr.newBatch(tapIdx, false)
					for j := range maxBatch {
						p.Time = at.Add(time.Duration(3*j+k) * time.Microsecond)
						p.Data = raws[j%len(raws)]
						bt.add(&p)
					}
					if reason := tr.consume(bt); reason != "" {
						b.Fatal(reason)
					}
				}
				at = at.Add(3 * maxBatch * time.Microsecond)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/frame")
		})
	}
}

// BenchmarkNewFlow is the user-space cost of one short TCP connection to the
// VIP, as the connect() latency benchmark makes them: the socket observers'
// events and 4 packets (SYN, SYN-ACK, ACK, RST, with those flags) at each of two capture
// points, written with their comments; handed over in batches of 64
// connections, as ring blocks and ring-buffer reads do. Every flow is new.
func BenchmarkNewFlow(b *testing.B) {
	tr := testTracer(b, io.Discard)
	tcpVIP := netip.AddrPortFrom(vip.Addr(), 80)
	tr.eng = flow.NewEngine(flow.Config{Services: []flow.Service{{Addr: tcpVIP.Addr(), Port: tcpVIP.Port(), Proto: obs.TCP}}, MaxFlows: b.N + 1})
	frames := [][]byte{tcpFrame(b, client, tcpVIP), tcpFrame(b, tcpVIP, client), tcpFrame(b, client, tcpVIP), tcpFrame(b, client, tcpVIP)}
	for k, flags := range []byte{0x02, 0x12, 0x10, 0x04} { // SYN, SYN-ACK, ACK, RST
		frames[k][14+20+13] = flags
	}
	const perBatch = 64
	b.ReportAllocs()
	b.ResetTimer()
	at := base
	for start := 0; start < b.N; start += perBatch {
		ob := tr.newBatch(-1, false)
		fbs := []*batch{tr.newBatch(0, false), tr.newBatch(1, false)}
		for i := start; i < min(start+perBatch, b.N); i++ {
			c := netip.AddrPortFrom(client.Addr(), uint16(1024+i%60000))
			at = at.Add(50 * time.Microsecond)
			cookie := uint64(i + 1)
			ob.obs = append(ob.obs,
				obs.Observation{Time: at, Point: obs.PointSockAddr, Kind: obs.SockConnect, Proto: obs.TCP, Src: netip.AddrPortFrom(client.Addr(), 0), Dst: tcpVIP, ReqDst: tcpVIP, Cookie: cookie, PID: 42, Comm: "client", Cgroup: 7},
				obs.Observation{Time: at, Point: obs.PointSockState, Proto: obs.TCP, Src: c, Dst: tcpVIP, Cookie: cookie, PID: 42, Comm: "client"},
				obs.Observation{Time: at, Point: obs.PointSockEgress, Proto: obs.TCP, Src: c, Dst: tcpVIP, Cookie: cookie, TCPFlags: 0x02},
			)
			for k, f := range frames {
				dir := obs.DirOut
				if k == 1 {
					setPorts(f, 80, c.Port())
					dir = obs.DirIn
				} else {
					setPorts(f, c.Port(), 80)
				}
				for tap, fb := range fbs {
					fb.add(&capture.Packet{Time: at.Add(time.Duration(k*5+tap) * time.Microsecond), Dir: dir, Len: len(f), CapLen: len(f), Data: f})
				}
			}
		}
		tr.consume(ob)
		for _, fb := range fbs {
			if reason := tr.consume(fb); reason != "" {
				b.Fatal(reason)
			}
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/flow")
}

// tcpFrame is an Ethernet/IPv4/TCP frame.
func tcpFrame(t testing.TB, src, dst netip.AddrPort) []byte {
	t.Helper()
	f := udpFrame(t, src, dst)
	f[14+9] = 6 // protocol TCP; the UDP header's place holds the ports
	return append(f, make([]byte, 20)...)
}

// setPorts rewrites a frame's L4 ports in place.
func setPorts(f []byte, sport, dport uint16) {
	binary.BigEndian.PutUint16(f[34:], sport)
	binary.BigEndian.PutUint16(f[36:], dport)
}
