package flow

// StaleVerdicts lists the flows whose cached verdict is still marked valid but
// differs from a fresh decision: an evidence change that missed invalidating it.
func (e *Engine) StaleVerdicts() []int {
	var stale []int
	for _, list := range e.clients {
		for _, f := range list {
			if v := e.decide(f); f.cachedOK && f.cachedGen == e.gen && (f.cached.place != v.place || f.cached.by != v.by) {
				stale = append(stale, f.id)
			}
		}
	}
	return stale
}

// WarmVerdicts fills every flow's verdict cache.
func (e *Engine) WarmVerdicts() {
	for _, list := range e.clients {
		for _, f := range list {
			e.cachedVerdict(f)
		}
	}
}
