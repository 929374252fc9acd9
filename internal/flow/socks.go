package flow

import (
	"net/netip"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/obs"
)

// sockState is what the socket-layer observers taught about one socket cookie.
type sockState struct {
	proto obs.Proto
	src   netip.AddrPort // the client endpoint, once its port is known
	srcAt time.Time      // when src was seen
	flows []*flowState   // usually one; unconnected UDP may send to several VIPs

	pid    uint32
	comm   string
	cgroup uint64
	procAt time.Time
}

func (s *sockState) noteProc(o obs.Observation) {
	if o.PID == 0 && o.Comm == "" && o.Cgroup == 0 {
		return
	}
	if s.procAt.IsZero() || o.Time.Before(s.procAt) {
		s.pid, s.comm, s.cgroup, s.procAt = o.PID, o.Comm, o.Cgroup, o.Time
	}
}

func (s *sockState) add(f *flowState) {
	for _, g := range s.flows {
		if g == f {
			return
		}
	}
	s.flows = append(s.flows, f)
	f.noteProc(s.pid, s.comm, s.cgroup, s.procAt)
}

// flowTo returns the socket's flow whose VIP or backend is dst.
func (s *sockState) flowTo(dst netip.AddrPort) *flowState {
	for _, f := range s.flows {
		if f.isRemote(dst) {
			return f
		}
	}
	return nil
}

// sockTable maps socket cookies to their state, bounded: the oldest cookie is
// forgotten first (its flows stay; only later linking by cookie is lost).
type sockTable struct {
	m     map[uint64]*sockState
	order []uint64
	limit int
}

func newSockTable(limit int) sockTable {
	return sockTable{m: make(map[uint64]*sockState), limit: limit}
}

// get returns the state of cookie, creating it; nil for cookie 0 (not known).
func (t *sockTable) get(cookie uint64) *sockState {
	if cookie == 0 {
		return nil
	}
	if s, ok := t.m[cookie]; ok {
		// A flow retired since (Engine.Retire) is no longer its socket's.
		s.flows = slices.DeleteFunc(s.flows, func(f *flowState) bool { return f.retired })
		return s
	}
	s := &sockState{}
	t.m[cookie] = s
	t.order = append(t.order, cookie)
	for len(t.m) > t.limit {
		delete(t.m, t.order[0])
		t.order = t.order[1:]
	}
	return s
}
