package session

import (
	"net/netip"
	"testing"
	"time"

	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/obs"
)

// TestRetireLagsTheClock: a run until stopped hands a closed connection
// to Options.Finished once it was quiet for the engine's close delay
// behind the wall clock less retireLag (what the sources may still
// deliver), also when no observation came since to move the engine's
// clock; a bounded run (no Finished) retires nothing.
func TestRetireLagsTheClock(t *testing.T) {
	svc := netip.MustParseAddrPort("10.120.0.80:80")
	c := netip.MustParseAddrPort("10.244.8.23:40000")
	at := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	feed := func(e *flow.Engine) {
		for i, p := range []struct {
			reply bool
			flags uint8
		}{{false, 0x02}, {true, 0x12}, {false, 0x11}, {true, 0x11}} {
			o := obs.Observation{Time: at.Add(time.Duration(i) * time.Millisecond), Point: obs.PointPod, Proto: obs.TCP, TCPFlags: p.flags, Src: c, Dst: svc, Dir: obs.DirOut, Len: 60}
			if p.reply {
				o.Src, o.Dst, o.Dir = svc, c, obs.DirIn
			}
			e.Add(o)
		}
	}
	cfg := flow.Config{Services: []flow.Service{{Addr: svc.Addr(), Port: 80, Proto: obs.TCP}}}
	var got []flow.Flow
	tr := &tracer{eng: flow.NewEngine(cfg), opt: Options{Finished: func(fs []flow.Flow) { got = append(got, fs...) }}}
	feed(tr.eng)
	tr.retire(at.Add(10 * time.Second)) // 7 s of the engine's clock: not quiet long enough
	if len(got) != 0 {
		t.Fatalf("retired %d flows 10 s after the close, with the lag", len(got))
	}
	tr.retire(at.Add(13 * time.Second))
	if len(got) != 1 || got[0].Client != c {
		t.Fatalf("retired %+v 13 s after the close, want the flow", got)
	}
	bounded := &tracer{eng: flow.NewEngine(cfg)}
	feed(bounded.eng)
	bounded.retire(at.Add(time.Hour))
	if n := bounded.eng.Open(); n != 1 {
		t.Errorf("a bounded run retired its flow: %d open", n)
	}
}
