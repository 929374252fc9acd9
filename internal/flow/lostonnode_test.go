package flow_test

import (
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
)

// TestLostOnNodeNotCutByTheEnd: a connection still sending when the run
// stops has its last segments captured by its host veth's tap and not by
// the uplink's, which stopped first (the taps stop one by one): they are
// not packets the node lost. Those received before the stop that never
// left the uplink still are. (By hand: a UDP flood across the end of a run
// in the lab read "393 never left the uplink", with no qdisc and no
// kernel_drops.) Both ways a packet is counted: Add, and Repeat.
func TestLostOnNodeNotCutByTheEnd(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-data-lost-on-uplink-qdisc.json")
	if err != nil {
		t.Fatal(err)
	}
	handshake := s.Observations[:10] // SYN, SYN-ACK, ACK: out of the uplink
	for _, repeat := range []bool{false, true} {
		for _, tc := range []struct {
			name      string
			lostLate  uint64 // data segments after the stop the uplink missed
			lostEarly uint64 // before it
			want      uint64
		}{
			{"cut by the end", 4, 0, 0},
			{"lost before the end", 0, 3, 3},
			{"both", 4, 3, 3},
		} {
			e := flow.NewEngine(s.Config)
			for _, o := range handshake {
				e.Add(o)
			}
			data := handshake[6] // the client's ACK at the host veth
			data.TCPFlags = 0x18
			up := handshake[9] // and at the uplink
			up.TCPFlags = 0x18
			var h flow.Handle
			send := func(ms float64, left bool) {
				d := data
				d.Time = flowtest.At(ms)
				if repeat && h != (flow.Handle{}) {
					if !e.Repeat(&h, d.Point, d.Time, d.Len) {
						t.Fatalf("Repeat refused the data segment at %v ms", ms)
					}
				} else {
					var ok bool
					if h, ok = e.AddPacket(d); !ok {
						t.Fatalf("AddPacket did not take the data segment at %v ms", ms)
					}
				}
				if left {
					u := up
					u.Time = flowtest.At(ms + 0.01)
					e.Add(u)
				}
			}
			ms := 10.0
			for i := 0; i < 20; i++ {
				send(ms, uint64(i) >= tc.lostEarly)
				ms++
			}
			e.Stopping(flowtest.At(ms))
			// The uplink's copies of the packets before the stop, late
			// by up to the node's transit time, count.
			u := up
			u.Time = flowtest.At(ms + 50)
			e.Add(u)
			data.Time = flowtest.At(ms - 0.5)
			e.Add(data)
			// Later ones are the packets the host veth's tap received
			// after the stop, whose copies the uplink's, stopped, missed.
			ms += 150
			for i := 0; i < 10; i++ {
				send(ms, uint64(i) < 10-tc.lostLate)
				ms += 20
			}
			flows := e.Flows()
			if len(flows) != 1 {
				t.Fatalf("%d flows, want 1", len(flows))
			}
			f := flows[0]
			if f.LostOnNode != tc.want {
				t.Errorf("repeat %v, %s: lost_on_node %d, want %d (reason %q)", repeat, tc.name, f.LostOnNode, tc.want, f.Reason)
			}
			if note := strings.Contains(f.Reason, "never left the uplink"); note != (tc.want > 0) {
				t.Errorf("repeat %v, %s: the reason says packets never left: %v, want %v (%q)", repeat, tc.name, note, tc.want > 0, f.Reason)
			}
		}
	}
}
