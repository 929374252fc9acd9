package flow

// recentSet remembers the keys added most recently, each with a value, in
// bounded memory: two generations of at most limit keys each; when the
// newer one fills, the older is dropped. A key is remembered for at least
// limit additions after its own, so a burst of new keys never makes it
// forget the recent ones all at once.
type recentSet[K comparable, V any] struct {
	cur, old map[K]V
	limit    int
}

func newRecentSet[K comparable, V any](limit int) recentSet[K, V] {
	return recentSet[K, V]{cur: map[K]V{}, old: map[K]V{}, limit: limit}
}

func (s *recentSet[K, V]) get(k K) (V, bool) {
	if v, ok := s.cur[k]; ok {
		return v, true
	}
	v, ok := s.old[k]
	return v, ok
}

func (s *recentSet[K, V]) has(k K) bool {
	_, ok := s.get(k)
	return ok
}

// forget drops k.
func (s *recentSet[K, V]) forget(k K) {
	delete(s.cur, k)
	delete(s.old, k)
}

// put remembers k with v, as the most recent key.
func (s *recentSet[K, V]) put(k K, v V) {
	if _, ok := s.cur[k]; !ok && len(s.cur) >= s.limit {
		s.old, s.cur = s.cur, make(map[K]V, s.limit)
	}
	s.cur[k] = v
}
