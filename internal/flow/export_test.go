package flow

import (
	"fmt"
	"unsafe"
)

// StaleVerdicts lists the flows whose cached verdict is still marked valid but
// differs from a fresh decision (its by as comments carry it): an evidence
// change that missed invalidating it.
func (e *Engine) StaleVerdicts() []int {
	var stale []int
	for _, list := range e.clients {
		for _, f := range list {
			if v := e.decide(f, true); f.cachedOK && f.cachedGen == e.gen && (f.cached.place != v.place || f.cached.by != CommentBy(v.by)) {
				stale = append(stale, f.seq)
			}
		}
	}
	return stale
}

// BriefMismatches lists the flows whose verdict without its reason (what
// packet comments use) differs in place or by from the full one.
func (e *Engine) BriefMismatches() []int {
	var bad []int
	for _, list := range e.clients {
		for _, f := range list {
			if b, v := e.decide(f, false), e.decide(f, true); b.place != v.place || b.by != v.by || b.reason != "" {
				bad = append(bad, f.seq)
			}
		}
	}
	return bad
}

// WarmVerdicts fills every flow's verdict cache.
func (e *Engine) WarmVerdicts() {
	for _, list := range e.clients {
		for _, f := range list {
			e.cachedVerdict(f)
		}
	}
}

// SNATIndexErrors checks the SNAT index: every listed flow is live, listed
// once, under its current SNAT source; every live flow with a SNAT source
// is listed.
func (e *Engine) SNATIndexErrors() []string {
	var errs []string
	listed := map[*flowState]int{}
	for k, list := range e.snat {
		if len(list) == 0 {
			errs = append(errs, fmt.Sprintf("empty list under %v", k.client))
		}
		for _, f := range list {
			listed[f]++
			if f.merged || f.snat != k.client || f.proto != k.proto {
				errs = append(errs, fmt.Sprintf("flow %d (merged %v, snat %v) listed under %v", f.seq, f.merged, f.snat, k.client))
			}
		}
	}
	for _, list := range e.clients {
		for _, f := range list {
			if f.snat.IsValid() && listed[f] != 1 {
				errs = append(errs, fmt.Sprintf("flow %d with snat %v listed %d times", f.seq, f.snat, listed[f]))
			}
			delete(listed, f)
		}
	}
	for f := range listed {
		errs = append(errs, fmt.Sprintf("flow %d listed but not in the flow table", f.seq))
	}
	return errs
}

// CommentedFlows counts the flows that keep packet comments.
func (e *Engine) CommentedFlows() int {
	n := 0
	for _, list := range e.clients {
		for _, f := range list {
			if f.comments != [6]string{} {
				n++
			}
		}
	}
	return n
}

// ByData maps each flow's ID to where the bytes of its cached verdict's
// "by" lie (nil without one).
func (e *Engine) ByData() map[int]*byte {
	out := map[int]*byte{}
	for _, list := range e.clients {
		for _, f := range list {
			if f.cachedOK && f.cached.by != "" {
				out[f.seq] = unsafe.StringData(f.cached.by)
			}
		}
	}
	return out
}

// Sizes reports the size of every table the engine keeps that can grow
// with the flows it saw: a run until stopped must keep each bounded.
func (e *Engine) Sizes() map[string]int {
	n := 0
	for _, l := range e.clients {
		n += len(l)
	}
	snat := 0
	for _, l := range e.snat {
		snat += len(l)
	}
	sockFlows := 0
	for _, s := range e.socks.m {
		sockFlows += len(s.flows)
	}
	return map[string]int{
		"clients":        len(e.clients),
		"upstreams":      len(e.retiredUpstreams),
		"clients.flows":  n,
		"nflows":         e.nflows,
		"snat":           len(e.snat),
		"snat.flows":     snat,
		"socks":          len(e.socks.m),
		"socks.order":    len(e.socks.order),
		"socks.flows":    sockFlows,
		"waiting.queue":  len(e.waiting.queue),
		"waiting.byEnd":  len(e.waiting.byEnd),
		"waiting.others": len(e.waiting.others),
		"waiting.pairs":  len(e.waiting.pairs),
		"replays":        len(e.replays),
		"commented":      len(e.commented),
		"lateCounts":     len(e.lateCounts),
		"refused":        len(e.refused.cur) + len(e.refused.old),
		"refusedClients": len(e.refusedClients.cur) + len(e.refusedClients.old),
		"retiredKeys":    len(e.retiredKeys.cur) + len(e.retiredKeys.old),
		"replyOnly":      len(e.replyOnly.cur) + len(e.replyOnly.old),
		"backends":       len(e.backends),
		"backendPorts":   len(e.backendPorts),
		"pairs":          len(e.pairs),
		"labels":         len(e.labels.names),
		"byNames":        len(e.byNames),
		"cgroups":        len(e.cfg.Attribution.SockProgramsByCgroup),
		"podTCPrograms":  len(e.cfg.Attribution.PodTCPrograms),
		"hostRedirects":  len(e.cfg.Attribution.HostRedirects),
	}
}

// SetMaxLabels sets how many capture point labels the engine holds at once.
func (e *Engine) SetMaxLabels(n int) { e.labels.maxNames = n }

// HandleMerged tells whether h's flow was merged into another since h was
// made (CommentOf is then false, and the capture path classifies the frame
// again).
func HandleMerged(h *Handle) bool { return h.f != nil && h.f.merged }
