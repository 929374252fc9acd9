package flow

// StaleVerdicts lists the flows whose cached verdict is still marked valid but
// differs from a fresh decision: an evidence change that missed invalidating it.
func (e *Engine) StaleVerdicts() []int {
	var stale []int
	for _, list := range e.clients {
		for _, f := range list {
			if v := e.decide(f, true); f.cachedOK && f.cachedGen == e.gen && (f.cached.place != v.place || f.cached.by != v.by) {
				stale = append(stale, f.id)
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
				bad = append(bad, f.id)
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
