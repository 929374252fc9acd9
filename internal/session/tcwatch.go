package session

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
	"github.com/pathtrace/pathtrace/internal/probe"
)

// tcWatch looks again, every tcWatchEvery, at the tc programs on the host
// veths and the uplinks: a CNI agent that restarts or upgrades (Cilium)
// detaches its programs and attaches new ones while a trace runs, and a
// flow's "by" must name the program of its time, not the one discovery
// found at the start (nor none, for an uplink's NodePort program that came
// after it). The engine gets every program with when it was there
// (flow.TCProgram Since, Until).
type tcWatch struct {
	look  *discover.TCWatch
	progs []flow.TCProgram // what the engine has, the ones gone included
	// uplinkProgs: the same for the uplinks' programs.
	uplinkProgs []flow.TCProgram
	next        time.Time
	// looked is when the previous look was (zero before the first): a
	// program a look finds was attached after it.
	looked time.Time
	// names are the interfaces' names by ifindex, as the programs on them
	// were found, to say where a program went.
	names   map[int]string
	changes tcChanges
}

// tcChanges is what the looks found changed, for the report: a line per
// interface and look, the last maxTCChanges of them, the earlier counted;
// the programs that went with their interface (a Pod deleted) are only
// counted.
type tcChanges struct {
	lines          []string
	earlier        int
	withInterfaces int
}

// maxTCChanges bounds the lines tcChanges keeps.
const maxTCChanges = 64

const (
	tcWatchEvery = 2 * time.Second // flow.tcTimeSlack covers it
	// maxGoneTCPrograms bounds the programs kept after they went (an
	// agent that keeps restarting): the oldest are forgotten first.
	maxGoneTCPrograms = 256
)

func newTCWatch(node *discover.NodeInfo, isObserver func(ebpf.ProgramID) bool, now time.Time) *tcWatch {
	w := &tcWatch{look: discover.NewTCWatch(node.HostNetNS.Path, node.CapturePoints, isObserver),
		progs: hostTCPrograms(node.TCPrograms), uplinkProgs: uplinkTCPrograms(node.TCPrograms), next: now.Add(tcWatchEvery)}
	w.learnNames(node.TCPrograms)
	return w
}

// learnNames remembers the names of the interfaces of progs.
func (w *tcWatch) learnNames(progs []discover.TCProgram) {
	for _, p := range progs {
		if p.Role != discover.RoleHost && p.Role != discover.RoleUplink {
			continue
		}
		if w.names == nil {
			w.names = map[int]string{}
		}
		w.names[p.Ifindex] = p.Ifname
	}
}

// check reads the programs again when it is time, tells the engine when
// they changed, and returns the programs found (nil when it did not look).
// A read that fails keeps what is known.
func (w *tcWatch) check(now time.Time, eng *flow.Engine) (found []discover.TCProgram) {
	if w == nil || now.Before(w.next) {
		return nil
	}
	w.next = now.Add(tcWatchEvery)
	found, err := w.look.Look()
	if err != nil {
		return nil
	}
	w.apply(found, now, eng)
	return found
}

// apply tells the engine what a look found, when it changed.
func (w *tcWatch) apply(found []discover.TCProgram, now time.Time, eng *flow.Engine) {
	w.learnNames(found)
	if w.update(hostTCPrograms(found), now) {
		eng.SetTCPrograms(slices.Clone(w.progs))
	}
	var went, appeared []flow.TCProgram
	if w.uplinkProgs, went, appeared = updatePrograms(w.uplinkProgs, uplinkTCPrograms(found), w.looked, now); len(went)+len(appeared) > 0 {
		eng.SetUplinkTCPrograms(slices.Clone(w.uplinkProgs))
		w.note(now, discover.RoleUplink, went, appeared)
	}
	w.looked = now
}

// add watches the host veths (and uplinks) of Pods that started, whose
// programs found begin now; an uplink already watched keeps its own.
func (w *tcWatch) add(cps []discover.CapturePoint, found []discover.TCProgram, now time.Time, eng *flow.Engine) {
	w.look.Add(cps)
	w.learnNames(found)
	if progs := hostTCPrograms(found); len(progs) > 0 {
		for i := range progs {
			progs[i].Since = now
		}
		w.progs = append(w.progs, progs...)
		eng.SetTCPrograms(slices.Clone(w.progs))
	}
	var changed bool
	for _, p := range uplinkTCPrograms(found) {
		if !slices.ContainsFunc(w.uplinkProgs, func(q flow.TCProgram) bool { return q.Until.IsZero() && sameTCProgram(p, q) }) {
			p.Since = now
			w.uplinkProgs, changed = append(w.uplinkProgs, p), true
		}
	}
	if changed {
		eng.SetUplinkTCPrograms(slices.Clone(w.uplinkProgs))
	}
}

// update ends the host veths' programs no longer there and adds the new
// ones; it reports whether anything changed.
func (w *tcWatch) update(cur []flow.TCProgram, now time.Time) bool {
	var went, appeared []flow.TCProgram
	w.progs, went, appeared = updatePrograms(w.progs, cur, w.looked, now)
	w.note(now, discover.RoleHost, went, appeared)
	return len(went)+len(appeared) > 0
}

// updatePrograms ends the programs of progs no longer in cur and adds the
// new ones, which the look at looked missed; it returns those that went and
// those that appeared.
func updatePrograms(progs, cur []flow.TCProgram, looked, now time.Time) (out, went, appeared []flow.TCProgram) {
	for i := range progs {
		p := &progs[i]
		if p.Until.IsZero() && !slices.ContainsFunc(cur, func(c flow.TCProgram) bool { return sameTCProgram(c, *p) }) {
			p.Until = now
			went = append(went, *p)
		}
	}
	for _, c := range cur {
		if !slices.ContainsFunc(progs, func(p flow.TCProgram) bool { return p.Until.IsZero() && sameTCProgram(c, p) }) {
			c.Since, c.NotBefore = now, looked
			progs = append(progs, c)
			appeared = append(appeared, c)
		}
	}
	// An agent's restart ends the programs of every veth at once.
	progs = forgetGone(progs, maxGoneTCPrograms, func(p flow.TCProgram) bool { return !p.Until.IsZero() })
	return progs, went, appeared
}

// note keeps, for the report, what a look found changed on the interfaces
// of a role: a line per interface, in ifindex order ("at 03:12:07 on
// veth-a (host veth #2): tcx ingress cil_from_container (id 52) went, tcx
// ingress cil_from_container (id 60) appeared"). A program that went with
// its interface (a Pod deleted: its veth is no longer watched) is counted,
// not listed: the Pod's going is said with its capture.
func (w *tcWatch) note(now time.Time, role string, went, appeared []flow.TCProgram) {
	byIface := map[int][]string{}
	for _, p := range went {
		if w.look != nil && !w.look.Watches(p.Ifindex) {
			w.changes.withInterfaces++
			continue
		}
		byIface[p.Ifindex] = append(byIface[p.Ifindex], tcProgramText(p)+" went")
	}
	for _, p := range appeared {
		byIface[p.Ifindex] = append(byIface[p.Ifindex], tcProgramText(p)+" appeared")
	}
	for _, ifindex := range slices.Sorted(maps.Keys(byIface)) {
		name := cmp.Or(w.names[ifindex], "?")
		w.changes.add(fmt.Sprintf("at %s on %s (%s #%d): %s", now.Format("15:04:05"), name, roleName(role), ifindex, strings.Join(byIface[ifindex], ", ")))
	}
	if w.look != nil {
		for _, p := range went {
			if !w.look.Watches(p.Ifindex) {
				delete(w.names, p.Ifindex) // its interface went: bounded by those watched
			}
		}
	}
}

// roleName names an interface's role in tcChanges' lines.
func roleName(role string) string {
	if role == discover.RoleHost {
		return "host veth"
	}
	return role
}

// tcProgramText names a program as the node block lists it, a filter's
// action as a flow's "by" does.
func tcProgramText(p flow.TCProgram) string {
	if p.Action != "" {
		return p.Action
	}
	return fmt.Sprintf("%s %s %s (id %d)", p.Kind, p.Direction, p.Name, p.ID)
}

// add keeps line, and forgets the oldest beyond maxTCChanges.
func (c *tcChanges) add(line string) {
	c.lines = append(c.lines, line)
	if n := len(c.lines) - maxTCChanges; n > 0 {
		c.lines = slices.Delete(c.lines, 0, n)
		c.earlier += n
	}
}

// summary lists the tc programs that changed during the run, for the
// report; nil when none did.
func (w *tcWatch) summary() []string {
	if w == nil {
		return nil
	}
	c := w.changes
	out := slices.Clone(c.lines)
	if c.earlier > 0 {
		out = append([]string{fmt.Sprintf("%d earlier (the last %d listed)", c.earlier, len(c.lines))}, out...)
	}
	if c.withInterfaces > 0 {
		out = append(out, fmt.Sprintf("%d went with their interface (a Pod deleted)", c.withInterfaces))
	}
	return out
}

// sameTCProgram tells a program by its ID, a filter (ID 0) by its action
// and what it rewrites: a pedit's or ct's destinations are its filter's
// match, not in the action's text.
func sameTCProgram(a, b flow.TCProgram) bool {
	return a.Ifindex == b.Ifindex && a.Direction == b.Direction && a.Kind == b.Kind && a.ID == b.ID && a.Action == b.Action && a.Dst == b.Dst && a.DstPort == b.DstPort
}

// hostTCPrograms are the programs on the host veths, in the engine's terms.
func hostTCPrograms(progs []discover.TCProgram) []flow.TCProgram {
	return tcProgramsOf(progs, discover.RoleHost)
}

// uplinkTCPrograms are discovery's tc programs of the uplinks in the
// engine's terms.
func uplinkTCPrograms(progs []discover.TCProgram) []flow.TCProgram {
	return tcProgramsOf(progs, discover.RoleUplink)
}

// podTCPrograms are discovery's tc programs of the Pods' eth0 in the
// engine's terms: each by its Pod's host veth, as the engine knows a flow's.
func podTCPrograms(progs []discover.TCProgram) []flow.TCProgram {
	var out []flow.TCProgram
	for _, p := range progs {
		if p.Role == discover.RolePod {
			out = append(out, engineTCProgram(p, p.HostIfindex))
		}
	}
	return out
}

func tcProgramsOf(progs []discover.TCProgram, role string) []flow.TCProgram {
	var out []flow.TCProgram
	for _, p := range progs {
		if p.Role == role {
			out = append(out, engineTCProgram(p, p.Ifindex))
		}
	}
	return out
}

// engineTCProgram is p in the engine's terms, tied to the host veth (or
// uplink) ifindex.
func engineTCProgram(p discover.TCProgram, ifindex int) flow.TCProgram {
	tp := flow.TCProgram{Direction: p.Dir, Kind: p.Via, Name: p.Name, ID: uint32(p.ID), Ifindex: ifindex, Dst: p.Rewrites, DstPort: p.RewritesPort}
	if p.Action != "" {
		tp.Action, tp.Conntrack = p.FilterText(), p.Conntrack()
	}
	return tp
}

// tcLate is what the session attached while it ran: tcx observers on host
// veths that got a tc program (a Pod that started, a CNI agent that
// started), and the taps of Pods that started.
type tcLate struct {
	observed map[int]tcDirs // host veths with tcx observers, by ifindex, and their directions
	tails    bool           // the node's host veths get tail observers
	atts     []probe.Attachment
	notes    []string // what the report says, bounded
	more     int
	// bounded: a run until stopped keeps the last maxLateAtts of atts
	// (the Pods that went had many), and counts the others in attsMore.
	bounded  bool
	attsMore int
}

// maxLateAtts bounds what a run until stopped keeps of tcLate.atts.
const maxLateAtts = 1024

// keep adds atts to what was attached late.
func (l *tcLate) keep(atts ...probe.Attachment) {
	l.atts = append(l.atts, atts...)
	if n := len(l.atts) - maxLateAtts; l.bounded && n > 0 {
		l.atts = slices.Delete(l.atts, 0, n)
		l.attsMore += n
	}
}

// errNoTailsLoaded is why a host veth that got a tc program during the
// session has no tail observers: the node had no tcx program on its host
// veths at the start (errNoOtherTCX), so none were loaded, and this veth's
// program may well be one.
var errNoTailsLoaded = errors.New("no host veth had a tcx program when the trace started, so no tail observer was loaded: the head observer and the next point bracket this veth's tc programs")

// observeTC attaches the tcx observers on each host veth in progs, in the
// direction of the program, that has none yet: a rewrite there is then
// bracketed as at the veths of the start.
func (tr *tracer) observeTC(now time.Time, progs []discover.TCProgram) {
	// One attachment per veth, of every direction that got a program,
	// named by the first program that brings one.
	type veth struct {
		ifindex int
		ifname  string
		dirs    tcDirs
		why     string
	}
	var veths []*veth
	for _, p := range progs {
		if p.Role != discover.RoleHost || !bracketedByTCX(p) {
			continue
		}
		i := slices.IndexFunc(veths, func(v *veth) bool { return v.ifindex == p.Ifindex })
		if i < 0 {
			veths = append(veths, &veth{ifindex: p.Ifindex, ifname: p.Ifname})
			i = len(veths) - 1
		}
		v, d := veths[i], tcDir(p.Dir)
		if v.why == "" && d&^tr.late.observed[p.Ifindex] != 0 {
			v.why = fmt.Sprintf("%s %s %s appeared there", p.Via, p.Dir, p.Name)
		}
		v.dirs |= d
	}
	for _, v := range veths {
		tr.observeVeth(now, v.ifindex, v.ifname, v.dirs, v.why)
	}
}

// observeVeth attaches the tcx observers of the directions dirs on the host
// veth ifindex unless it has them; why says what brought them, for the
// report.
func (tr *tracer) observeVeth(now time.Time, ifindex int, ifname string, dirs tcDirs, why string) {
	had := tr.late.observed[ifindex]
	if dirs&^had == 0 {
		return
	}
	tr.late.observed[ifindex] = had | dirs
	skip := (dirs &^ had).skip()
	if had&tcIngress != 0 {
		skip.Ingress = errAttachedBefore
	}
	if had&tcEgress != 0 {
		skip.Egress = errAttachedBefore
	}
	if !tr.late.tails {
		skip.Tails = errNoTailsLoaded
	}
	atts := tr.pr.AttachTCSkip(tr.tc.look.HostNetNS(), ifindex, ifname, skip)
	note := fmt.Sprintf("tcx observers on %s at %s (%s)", ifname, now.Format("15:04:05"), why)
	for _, a := range atts {
		switch {
		case errors.Is(a.Err, errAttachedBefore):
			continue // listed when they were attached
		case a.Err != nil && !errors.Is(a.Err, errNoTailsLoaded) && !errors.Is(a.Err, errNoTCProgramDir):
			note += fmt.Sprintf("; %s not attached: %v", a.Observer, a.Err)
		}
		tr.late.keep(a)
	}
	tr.late.note(note)
}

// errAttachedBefore marks the observers of a direction that observeVeth
// attached before: they are not attached again.
var errAttachedBefore = errors.New("attached before")

// newVeths forgets the observers of the host veths that had the ifindexes
// of cps' host veths, a new Pod's: a Pod deleted and made again can get
// its predecessor's ifindex (see discover.PodWatch), and the observers on
// the veth that went went with it.
func (l *tcLate) newVeths(cps []discover.CapturePoint) {
	for _, cp := range cps {
		if cp.Role == discover.RoleHost {
			delete(l.observed, cp.Ifindex)
		}
	}
}

// summary lists what was attached late, for the report; nil when nothing.
func (l *tcLate) summary() []string {
	out := l.notes
	if l.more > 0 {
		out = append(out, fmt.Sprintf("%d more", l.more))
	}
	if l.attsMore > 0 {
		out = append(out, fmt.Sprintf("%d earlier attachments (taps and observers of Pods started) are not kept in the node's list: a run until stopped keeps the last %d", l.attsMore, maxLateAtts))
	}
	return out
}

// maxLateNotes bounds what the report lists one by one.
const maxLateNotes = 64

func (l *tcLate) note(s string) {
	if len(l.notes) >= maxLateNotes {
		l.more++
		return
	}
	l.notes = append(l.notes, s)
}
