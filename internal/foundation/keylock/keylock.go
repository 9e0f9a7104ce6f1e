// Package keylock serializes work per key: callers that lock the same key
// run one after another, callers with different keys at once. The agent
// locks per owner (one attachment's requests), the eBPF datapath per host
// interface.
package keylock

import "sync"

// Map is a lock per key. An entry lives while someone holds or waits for
// it, so the map holds only keys in use. The zero Map is ready to use; a
// Map must not be copied after first use.
type Map[K comparable] struct {
	mu sync.Mutex
	m  map[K]*entry
}

type entry struct {
	mu   sync.Mutex
	refs int
}

// Lock takes key's lock and returns its unlock, which must be called once.
func (l *Map[K]) Lock(key K) (unlock func()) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[K]*entry{}
	}
	e := l.m[key]
	if e == nil {
		e = &entry{}
		l.m[key] = e
	}
	e.refs++
	l.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		l.mu.Lock()
		if e.refs--; e.refs == 0 {
			delete(l.m, key)
		}
		l.mu.Unlock()
	}
}

// Waiters is how many callers hold or wait for key's lock: 0 once all
// have unlocked (the entry is gone).
func (l *Map[K]) Waiters(key K) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.m[key]; e != nil {
		return e.refs
	}
	return 0
}
