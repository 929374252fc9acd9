package flow_test

import (
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/flow/flowtest"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// packetKey is what a caller recognises a repeated packet by.
type packetKey struct {
	point    obs.Point
	dir      obs.Dir
	proto    obs.Proto
	src, dst netip.AddrPort
}

func isPacket(p obs.Point) bool {
	switch p {
	case obs.PointPod, obs.PointHost, obs.PointUplink, obs.PointTCHead, obs.PointTCTail, obs.PointNFBefore, obs.PointNFAfter:
		return true
	}
	return false
}

// withRepeats follows every packet observation with copies of it a few
// microseconds later: the later packets of a flow.
func withRepeats(in []obs.Observation) []obs.Observation {
	var out []obs.Observation
	for _, o := range in {
		out = append(out, o)
		if isPacket(o.Point) {
			for i := 1; i <= 3; i++ {
				r := o
				r.Time = o.Time.Add(time.Duration(i) * time.Microsecond)
				r.Len += i
				out = append(out, r)
			}
		}
	}
	return out
}

// TestRepeatMatchesAdd feeds every recorded sequence, with repeated packets,
// once through Add and once through AddPacket/Repeat the way the capture path
// does; flows, summaries and packet references must be identical.
func TestRepeatMatchesAdd(t *testing.T) {
	scenarios, err := flowtest.LoadDir(scenarioDir)
	if err != nil {
		t.Fatal(err)
	}
	repeats := 0
	for _, s := range scenarios {
		t.Run(s.Name, func(t *testing.T) {
			for name, order := range orders(s) {
				var seq []obs.Observation
				if order == nil {
					seq = withRepeats(s.Observations)
				} else {
					ordered := make([]obs.Observation, len(order))
					for i, j := range order {
						ordered[i] = s.Observations[j]
					}
					seq = withRepeats(ordered)
				}
				plain := flow.NewEngine(s.Config)
				fast := flow.NewEngine(s.Config)
				handles := map[packetKey]flow.Handle{}
				last := map[packetKey]obs.Observation{}
				for _, o := range seq {
					plain.Add(o)
					// An observation naming its socket is an observer's
					// event (netfilter's at OUTPUT): no tap frame, never
					// on the fast path.
					if !isPacket(o.Point) || o.Cookie != 0 {
						fast.Add(o)
						continue
					}
					k := packetKey{o.Point, o.Dir, o.Proto, o.Src, o.Dst}
					last[k] = o
					// A TCP SYN, FIN or RST is always added, never
					// repeated (Repeat; the capture path's classify).
					control := o.Proto == obs.TCP && o.TCPFlags&0x07 != 0
					if h, ok := handles[k]; ok && !control && fast.Repeat(&h, o.Point, o.Time, o.Len) {
						repeats++
						continue
					}
					if h, ok := fast.AddPacket(o); ok {
						handles[k] = h
					} else {
						delete(handles, k)
					}
				}
				if got, want := fast.Flows(), plain.Flows(); !reflect.DeepEqual(got, want) {
					t.Errorf("%s order: flows differ\nfast:  %+v\nplain: %+v", name, got, want)
				}
				if got, want := fast.Summary(), plain.Summary(); !reflect.DeepEqual(got, want) {
					t.Errorf("%s order: summaries differ\nfast:  %+v\nplain: %+v", name, got, want)
				}
				for k, h := range handles {
					want, wantOK := plain.Classify(last[k])
					got, gotOK := fast.CommentOf(&h)
					if !gotOK && wantOK && flow.HandleMerged(&h) {
						// Its flow merged into another after its last
						// packet (a flow beyond the node's SNAT that
						// conntrack then named): the capture path
						// classifies the frame again.
						continue
					}
					if gotOK != wantOK || wantOK && got != want.Comment() {
						t.Errorf("%s order: %v: CommentOf = %q %v, Classify = %q %v", name, k, got, gotOK, want.Comment(), wantOK)
					}
				}
			}
		})
	}
	if repeats == 0 {
		t.Fatal("no packet took the Repeat path: the test checks nothing")
	}
}
