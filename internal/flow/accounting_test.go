package flow_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestReusedPortsAccounted: every flow a client opens is reported, counted
// beyond --max-flows (flows_over_max) or counted as joined to an earlier
// flow of its client port and Service (flows_joined), never lost, when
// sockets reuse client ports (a resolver's socket per query, an HTTP/1.0
// client's connection per request), in every order the session can deliver
// their observations. A later socket's flow is a flow of its own when its
// socket's events come before its packets; after them (the observers' ring
// buffer is read every 100 ms, a quiet tap's block retired after up to 100
// ms: either can come first), a UDP one's packets were already taken for
// the earlier flow (nothing in a datagram tells the sockets apart), and it
// joins it.
func TestReusedPortsAccounted(t *testing.T) {
	udp, tcp := obs.UDP, obs.TCP
	for _, c := range []struct {
		name     string
		maxFlows int
		conns    []conn
	}{
		{"dns sockets, a port reused 31 s later, another backend", 0, []conn{
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0, cookie: 31},
			{proto: udp, cl: ap(podA, 51001), svc: dnsVIP, be: dns2, at: 0.5, cookie: 32},
			{proto: udp, cl: ap(podB, 51000), svc: dnsVIP, be: dns2, at: 1, cookie: 33},
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns2, at: 31000, cookie: 34},
		}},
		{"dns sockets, a port reused 2 s later, conntrack's entry and backend", 0, []conn{
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 0, cookie: 31},
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 2000, cookie: 32},
		}},
		{"beyond --max-flows, dns and http ports reused", 2, []conn{
			{proto: tcp, cl: ap(podC, 40100), svc: vip, be: be1, at: 0, close: true, cookie: 1},
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 1, cookie: 2},
			{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be2, at: 5, close: true, cookie: 3},
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns1, at: 2000, cookie: 4},
			{proto: tcp, cl: ap(podB, 40100), svc: vip, be: be3, at: 2005, close: true, cookie: 5},
			{proto: udp, cl: ap(podA, 51000), svc: dnsVIP, be: dns2, at: 40000, cookie: 6},
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := busyConfig(allPoints...)
			cfg.MaxFlows = c.maxFlows
			o := generate(cfg, c.conns...)
			for name, order := range deliveryOrders(o, 128) {
				seq := make([]obs.Observation, len(order))
				for i, j := range order {
					seq[i] = o[j]
				}
				for _, fast := range []bool{false, true} {
					label := fmt.Sprintf("%s order (repeat path %v)", name, fast)
					e := flow.NewEngine(cfg)
					if stale := feedSeq(e, seq, fast); stale != "" {
						t.Errorf("%s: %s", label, stale)
					}
					flushAt(e, seq[len(seq)-1].Time)
					fs, s := e.Flows(), e.Summary()
					over, joined := s.Drops[flow.DropFlowsOverMax], s.Drops[flow.DropFlowsJoined]
					// Every connection's requests were seen: none counts as
					// seen by its replies alone, refused ones neither.
					if n := uint64(len(fs)) + over + joined; n != uint64(len(c.conns)) || s.Unmatched != 0 || s.Drops[flow.DropUnmatchedOverflow] != 0 || s.RepliesWithoutRequest != 0 {
						t.Errorf("%s: %d flows, %d over the maximum, %d joined: %d of %d connections; %d unmatched, %d overflowed, %d seen by their replies alone",
							label, len(fs), over, joined, n, len(c.conns), s.Unmatched, s.Drops[flow.DropUnmatchedOverflow], s.RepliesWithoutRequest)
						logFlows(t, fs)
						continue
					}
					if name == "time" && joined != 0 {
						t.Errorf("%s: %d flows joined, want none when every socket's events come first", label, joined)
					}
					for _, f := range fs {
						// Its backends are those of its own connections.
						var bes []string
						for _, cn := range c.conns {
							if cn.cl == f.Client && cn.svc == f.Service {
								bes = append(bes, cn.be.String())
							}
						}
						if f.RewrittenAt != flow.PlaceNetfilter || !f.Reply || !slices.Contains(bes, f.Backend.String()) ||
							joined == 0 && len(f.Backends) > 0 {
							t.Errorf("%s: flow %s -> %s: %s backend %s backends %v reply %v; want netfilter, a backend of %v, a reply",
								label, f.Client, f.Service, f.RewrittenAt, f.Backend, f.Backends, f.Reply, bes)
						}
					}
				}
			}
		})
	}
}
