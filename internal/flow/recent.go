package flow

// recentSet remembers the keys added most recently, in bounded memory: two
// generations of at most limit keys each; when the newer one fills, the
// older is dropped. A key is remembered for at least limit additions after
// its own, so a burst of new keys never makes it forget the recent ones all
// at once.
type recentSet[K comparable] struct {
	cur, old map[K]struct{}
	limit    int
}

func newRecentSet[K comparable](limit int) recentSet[K] {
	return recentSet[K]{cur: map[K]struct{}{}, old: map[K]struct{}{}, limit: limit}
}

func (s *recentSet[K]) has(k K) bool {
	if _, ok := s.cur[k]; ok {
		return true
	}
	_, ok := s.old[k]
	return ok
}

func (s *recentSet[K]) add(k K) {
	if len(s.cur) >= s.limit {
		s.old, s.cur = s.cur, make(map[K]struct{}, s.limit)
	}
	s.cur[k] = struct{}{}
}
