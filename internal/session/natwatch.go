package session

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"time"

	"github.com/pathtrace/pathtrace/internal/discover"
	"github.com/pathtrace/pathtrace/internal/flow"
)

// natWatch reads the node's NAT rules, IPVS services and nftables chains on
// device hooks again when flows reach a Service backend that none of the
// rules read so far names: kube-proxy rewrites its rules whenever a Service
// is created or its endpoints change (a rolling restart during an
// incident), and a flow's "by" must name the rule that chose its backend,
// not the rules to the backends of the start. Reading only on such news
// keeps a node with thousands of Services from paying for a listing every
// few seconds. The engine gets every rule with when it was there
// (flow.NATRule, flow.DeviceRule Since, Until).
type natWatch struct {
	look  *discover.NATWatch
	node  *discover.NodeInfo // rules and chains that appear are added to its lists
	rules []flow.NATRule     // what the engine has, the ones gone included
	ipvs  []flow.IPVSService
	// chains are the device chains of the last listing (discovery's, at
	// first); dev the engine's rules of them, the ones gone included.
	chains []discover.DeviceChain
	dev    []flow.DeviceRule
	// last is the time of the previous look (discovery's, at first): a rule
	// first seen now was not there then.
	last time.Time
	// lastRead holds, for a source the looks since could not read in
	// full, the time of the last look that did: a rule of it first seen
	// now may have been there since then.
	lastRead map[string]time.Time
	next     time.Time // no look before
	seen     uint64    // the engine's UnlistedBackends at the previous look

	looks, appeared, went int
	firstLook, lastLook   time.Time
	listed                int // rules and chains added to node's lists
}

const (
	// natWatchEvery bounds how often the rules are read.
	natWatchEvery = 5 * time.Second
	// maxGoneNAT bounds the rules and IPVS services kept after they went,
	// and those added to the node's list (endpoints that keep changing): the
	// oldest gone are forgotten first.
	maxGoneNAT = 1024
	// natLookTimeout bounds the look made when the run ends (an
	// iptables-legacy-save that hangs).
	natLookTimeout = 5 * time.Second
)

func newNATWatch(node *discover.NodeInfo, start time.Time) *natWatch {
	chains := node.Netfilter.DeviceChains
	return &natWatch{look: node.NATWatch(), node: node, rules: natRulesOf(node.Netfilter.Rules),
		ipvs: ipvsOf(node.IPVS.Services), chains: chains, dev: deviceRulesOf(chains, node.CapturePoints),
		last: start, next: start}
}

// check reads the rules again when flows reached backends no rule named
// since the previous look, at most every natWatchEvery (unless final: the
// run's last look), and tells the engine when they changed.
func (w *natWatch) check(ctx context.Context, now time.Time, eng *flow.Engine, final bool) {
	if w == nil || (!final && now.Before(w.next)) {
		return
	}
	// The run's last look also reads a device chain made meanwhile that no
	// news asked for: one that set a backend the NAT rules name, whose
	// flows are placed at tc unnamed.
	n := eng.UnlistedBackends()
	if n == w.seen && !(final && eng.UnnamedTCRewrite()) {
		return
	}
	prev := w.seen
	w.seen, w.next = n, now.Add(natWatchEvery)
	nf, ipvs, unread := w.look.Look(ctx)
	if len(unread) > 0 && ctx.Err() != nil {
		// The run's end cut the look short (iptables-legacy-save killed):
		// the run's last look, with a context of its own, reads again.
		w.seen = prev
	}
	if w.update(nf.Rules, ipvsOf(ipvs.Services), unread, now) {
		eng.SetNATAttribution(slices.Clone(w.rules), slices.Clone(w.ipvs))
	}
	if !slices.Contains(unread, discover.SourceNFTables) && w.updateDevices(nf.DeviceChains, now) {
		eng.SetDeviceRules(slices.Clone(w.dev))
	}
	for _, src := range []string{discover.SourceNFTables, discover.SourceIPTablesLegacy, "ipvs"} {
		if !slices.Contains(unread, src) {
			delete(w.lastRead, src)
		} else if _, ok := w.lastRead[src]; !ok {
			if w.lastRead == nil {
				w.lastRead = map[string]time.Time{}
			}
			w.lastRead[src] = w.last
		}
	}
	w.last = now
	w.looks++
	if w.firstLook.IsZero() {
		w.firstLook = now
	}
	w.lastLook = now
}

// update ends the rules and services no longer there (unless their source
// could not be read in full) and adds the new ones, since the previous
// look; it reports whether anything changed.
func (w *natWatch) update(found []discover.NATRule, ipvs []flow.IPVSService, unread []string, now time.Time) bool {
	cur := natRulesOf(found)
	changed := false
	for i := range w.rules {
		r := &w.rules[i]
		if r.Until.IsZero() && !slices.Contains(unread, r.Source) &&
			!slices.ContainsFunc(cur, func(c flow.NATRule) bool { return sameNATRule(c, *r) }) {
			r.Until, changed = now, true
			w.went++
		}
	}
	for i, c := range cur {
		if slices.ContainsFunc(w.rules, func(r flow.NATRule) bool { return r.Until.IsZero() && sameNATRule(c, r) }) {
			continue
		}
		c.Since = w.since(c.Source)
		w.rules, changed = append(w.rules, c), true
		w.appeared++
		if w.listed < maxGoneNAT {
			w.node.Netfilter.Rules = append(w.node.Netfilter.Rules, found[i])
			w.listed++
		}
	}
	w.rules = forgetGone(w.rules, maxGoneNAT, func(r flow.NATRule) bool { return !r.Until.IsZero() })
	for i := range w.ipvs {
		s := &w.ipvs[i]
		if s.Until.IsZero() && !slices.Contains(unread, "ipvs") &&
			!slices.ContainsFunc(ipvs, func(c flow.IPVSService) bool { return sameIPVS(c, *s) }) {
			s.Until, changed = now, true
			w.went++
		}
	}
	for _, c := range ipvs {
		if !slices.ContainsFunc(w.ipvs, func(s flow.IPVSService) bool { return s.Until.IsZero() && sameIPVS(c, s) }) {
			c.Since = w.since("ipvs")
			w.ipvs, changed = append(w.ipvs, c), true
			w.appeared++
		}
	}
	w.ipvs = forgetGone(w.ipvs, maxGoneNAT, func(s flow.IPVSService) bool { return !s.Until.IsZero() })
	return changed
}

// since is when a rule of source first seen now was not there yet: the
// last look that read that source.
func (w *natWatch) since(source string) time.Time {
	if t, ok := w.lastRead[source]; ok {
		return t
	}
	return w.last
}

// updateDevices ends the device chains' rules no longer there and adds the
// new ones, since the previous look, from the chains listed now; it reports
// whether anything changed. A chain made during the run is added to the
// node's list.
func (w *natWatch) updateDevices(found []discover.DeviceChain, now time.Time) bool {
	cur := deviceRulesOf(found, w.node.CapturePoints)
	changed := false
	for i := range w.dev {
		r := &w.dev[i]
		if r.Until.IsZero() && !slices.ContainsFunc(cur, func(c flow.DeviceRule) bool { return sameDeviceRule(c, *r) }) {
			r.Until, changed = now, true
			w.went++
		}
	}
	if w.addDeviceRules(cur, w.since(discover.SourceNFTables)) {
		changed = true
	}
	w.dev = forgetGone(w.dev, maxGoneNAT, func(r flow.DeviceRule) bool { return !r.Until.IsZero() })
	for _, c := range found {
		if !slices.ContainsFunc(w.chains, func(o discover.DeviceChain) bool { return reflect.DeepEqual(c, o) }) &&
			w.listed < maxGoneNAT {
			w.node.Netfilter.DeviceChains = append(w.node.Netfilter.DeviceChains, c)
			w.listed++
		}
	}
	w.chains = found
	return changed
}

// addDeviceRules adds the rules of cur not in force yet, there since since.
func (w *natWatch) addDeviceRules(cur []flow.DeviceRule, since time.Time) bool {
	changed := false
	for _, c := range cur {
		if slices.ContainsFunc(w.dev, func(r flow.DeviceRule) bool { return r.Until.IsZero() && sameDeviceRule(c, r) }) {
			continue
		}
		c.Since = since
		w.dev, changed = append(w.dev, c), true
		w.appeared++
	}
	return changed
}

// podsAdded gives the engine the rules of the chains listed last on the
// host veths of Pods that started during the run (the node's capture
// points hold theirs now). The chains were there before the veths: their
// rules hold for every flow of those veths.
func (w *natWatch) podsAdded(eng *flow.Engine) {
	if w == nil {
		return
	}
	if w.addDeviceRules(deviceRulesOf(w.chains, w.node.CapturePoints), time.Time{}) {
		eng.SetDeviceRules(slices.Clone(w.dev))
	}
}

// forgetGone drops the oldest gone entries beyond bound, however many went
// at once.
func forgetGone[T any](list []T, bound int, gone func(T) bool) []T {
	n := 0
	for _, x := range list {
		if gone(x) {
			n++
		}
	}
	for ; n > bound; n-- {
		i := slices.IndexFunc(list, gone)
		list = slices.Delete(list, i, i+1)
	}
	return list
}

func sameNATRule(a, b flow.NATRule) bool {
	return a.Source == b.Source && a.Table == b.Table && a.Chain == b.Chain && a.Hook == b.Hook &&
		a.VIP == b.VIP && a.Proto == b.Proto && a.Rule == b.Rule && slices.Equal(a.Backends, b.Backends) &&
		slices.EqualFunc(a.Sources, b.Sources, flow.SourceMatch.Equal)
}

func sameDeviceRule(a, b flow.DeviceRule) bool {
	return a.Chain == b.Chain && a.Hook == b.Hook && a.Device == b.Device && a.Ifindex == b.Ifindex && a.Uplink == b.Uplink &&
		a.VIP == b.VIP && a.Proto == b.Proto && a.Rule == b.Rule && slices.Equal(a.Backends, b.Backends)
}

func sameIPVS(a, b flow.IPVSService) bool {
	return a.VIP == b.VIP && a.Proto == b.Proto && a.Scheduler == b.Scheduler && slices.Equal(a.Backends, b.Backends)
}

// summary says what the looks found, for the report; "" when the rules
// were not read again or did not change (as on a node whose Services are
// rewritten outside netfilter, where no rule ever names a backend).
func (w *natWatch) summary() string {
	if w == nil || w.appeared+w.went == 0 {
		return ""
	}
	when := "at " + w.firstLook.Format("15:04:05")
	if w.looks > 1 {
		when = fmt.Sprintf("%d times, %s to %s", w.looks, w.firstLook.Format("15:04:05"), w.lastLook.Format("15:04:05"))
	}
	return fmt.Sprintf("read again %s (flows reached backends that no rule read before named): %d rule(s) or IPVS service(s) appeared, %d went; each flow's \"by\" names those of its time",
		when, w.appeared, w.went)
}
