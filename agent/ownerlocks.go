package agent

import "sync"

// ownerLocks serializes the requests of one owner (one attachment) and
// lets those of different owners run at once. An entry lives while
// someone holds or waits for it.
type ownerLocks struct {
	mu sync.Mutex
	m  map[string]*ownerLock
}

type ownerLock struct {
	mu   sync.Mutex
	refs int
}

// lock takes key's lock and returns its unlock.
func (l *ownerLocks) lock(key string) (unlock func()) {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[string]*ownerLock{}
	}
	e := l.m[key]
	if e == nil {
		e = &ownerLock{}
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
