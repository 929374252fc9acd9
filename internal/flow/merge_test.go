package flow

import (
	"net/netip"
	"testing"
	"time"
)

// TestMergeMovesRetiredUpstreams: a redirected connection's retired proxy
// upstreams follow it when its flow is merged into another (its socket's,
// once its port is known): kept under the merged flow they were lost to
// its report, and never deleted in a run until stopped. Their delay counts
// from the merged flow's first sighting.
func TestMergeMovesRetiredUpstreams(t *testing.T) {
	e := NewEngine(Config{})
	at := time.Unix(1000, 0)
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	g := &flowState{service: svc, first: at, last: at}
	f := &flowState{service: svc, first: at.Add(time.Millisecond), last: at.Add(time.Millisecond)}
	e.nflows = 2
	e.retiredUpstreams = map[*flowState][]proxyUpstream{f: {{id: 7, after: 300 * time.Microsecond, comm: "envoy"}}}
	e.merge(g, f)
	if _, ok := e.retiredUpstreams[f]; ok || len(e.retiredUpstreams) != 1 {
		t.Fatalf("upstreams still kept under the merged flow: %v", e.retiredUpstreams)
	}
	ups := e.proxyUpstreams(g)
	if len(ups) != 1 || ups[0].id != 7 || ups[0].after != time.Millisecond+300*time.Microsecond {
		t.Errorf("proxy upstreams of the flow merged into %+v, want flow 7 1.3ms after", ups)
	}
}
