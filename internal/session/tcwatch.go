package session

import (
	"slices"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// tcWatch looks again, every tcWatchEvery, at the tc programs on the host
// veths: a CNI agent that restarts or upgrades (Cilium) detaches its
// programs and attaches new ones while a trace runs, and a flow's "by" must
// name the program of its time, not the one discovery found at the start.
// The engine gets every program with when it was there (flow.TCProgram
// Since, Until).
type tcWatch struct {
	look  *discover.TCWatch
	progs []flow.TCProgram // what the engine has, the ones gone included
	next  time.Time
}

const (
	tcWatchEvery = 2 * time.Second // flow.tcTimeSlack covers it
	// maxGoneTCPrograms bounds the programs kept after they went (an
	// agent that keeps restarting): the oldest are forgotten first.
	maxGoneTCPrograms = 256
)

func newTCWatch(node *discover.NodeInfo, isObserver func(ebpf.ProgramID) bool, now time.Time) *tcWatch {
	return &tcWatch{look: discover.NewTCWatch(node.HostNetNS.Path, node.CapturePoints, isObserver),
		progs: hostTCPrograms(node.TCPrograms), next: now.Add(tcWatchEvery)}
}

// check reads the programs again when it is time, and tells the engine when
// they changed. A read that fails keeps what is known.
func (w *tcWatch) check(now time.Time, eng *flow.Engine) {
	if w == nil || now.Before(w.next) {
		return
	}
	w.next = now.Add(tcWatchEvery)
	found, err := w.look.Look()
	if err != nil {
		return
	}
	if w.update(hostTCPrograms(found), now) {
		eng.SetTCPrograms(slices.Clone(w.progs))
	}
}

// add watches the host veths of Pods that started, whose programs found
// begin now.
func (w *tcWatch) add(cps []discover.CapturePoint, found []discover.TCProgram, now time.Time, eng *flow.Engine) {
	w.look.Add(cps)
	progs := hostTCPrograms(found)
	if len(progs) == 0 {
		return
	}
	for i := range progs {
		progs[i].Since = now
	}
	w.progs = append(w.progs, progs...)
	eng.SetTCPrograms(slices.Clone(w.progs))
}

// update ends the programs no longer there and adds the new ones; it
// reports whether anything changed.
func (w *tcWatch) update(cur []flow.TCProgram, now time.Time) bool {
	changed := false
	for i := range w.progs {
		p := &w.progs[i]
		if p.Until.IsZero() && !slices.ContainsFunc(cur, func(c flow.TCProgram) bool { return sameTCProgram(c, *p) }) {
			p.Until, changed = now, true
		}
	}
	for _, c := range cur {
		if !slices.ContainsFunc(w.progs, func(p flow.TCProgram) bool { return p.Until.IsZero() && sameTCProgram(c, p) }) {
			c.Since = now
			w.progs, changed = append(w.progs, c), true
		}
	}
	if gone := slices.IndexFunc(w.progs, func(p flow.TCProgram) bool { return !p.Until.IsZero() }); gone >= 0 &&
		len(w.progs) > maxGoneTCPrograms+len(cur) {
		w.progs = slices.Delete(w.progs, gone, gone+1)
	}
	return changed
}

func sameTCProgram(a, b flow.TCProgram) bool {
	return a.Ifindex == b.Ifindex && a.Direction == b.Direction && a.Kind == b.Kind && a.ID == b.ID
}

// hostTCPrograms are the programs on the host veths, in the engine's terms.
func hostTCPrograms(progs []discover.TCProgram) []flow.TCProgram {
	var out []flow.TCProgram
	for _, p := range progs {
		if p.Role != discover.RoleHost {
			continue
		}
		out = append(out, flow.TCProgram{Direction: p.Dir, Kind: p.Via, Name: p.Name, ID: uint32(p.ID), Ifindex: p.Ifindex})
	}
	return out
}
