package flow_test

import (
	"strings"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestLostOnNodeLeavesOutOtherBackends: of a UDP flow whose first two
// datagrams were NATed to a backend the node dropped (its client's own
// Pod), before a later one was NATed anew to a backend behind the uplink,
// the host veth received 4 requests and the uplink sent 2. Those 2 went to
// the dropped pick, as netfilter saw, not towards the uplink: no loss on
// the way out, even when the drop observer did not tell of the drops.
// Without netfilter's sighting of them either, nothing explains them: they
// vanished between the host veth and the uplink, and the reason says so.
func TestLostOnNodeLeavesOutOtherBackends(t *testing.T) {
	s, err := flowtest.Load("../../testdata/flows/netfilter-udp-renatted-after-drop.json")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		keep func(obs.Observation) bool
		want uint64
	}{
		{"drops not seen", func(o obs.Observation) bool { return o.Point != obs.PointDrop }, 0},
		{"neither drops nor netfilter seen", func(o obs.Observation) bool {
			return o.Point != obs.PointDrop && !(o.Point == obs.PointNFBefore || o.Point == obs.PointNFAfter) || !early(o)
		}, 2},
	} {
		e := flow.NewEngine(s.Config)
		for _, o := range s.Observations {
			if tc.keep(o) {
				e.Add(o)
			}
		}
		flows := e.Flows()
		if len(flows) != 1 {
			t.Fatalf("%s: %d flows, want 1", tc.name, len(flows))
		}
		f := flows[0]
		if f.LostOnNode != tc.want {
			t.Errorf("%s: lost_on_node %d, want %d (reason %q)", tc.name, f.LostOnNode, tc.want, f.Reason)
		}
		if note := strings.Contains(f.Reason, "never left the uplink"); note != (tc.want > 0) {
			t.Errorf("%s: the reason says packets never left: %v, want %v (%q)", tc.name, note, tc.want > 0, f.Reason)
		}
	}
}

// early tells the observations of the scenario's first two datagrams, the
// dropped ones (before 500 ms).
func early(o obs.Observation) bool { return o.Time.Before(flowtest.At(500)) }
