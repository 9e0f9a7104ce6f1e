package memstore

import (
	"context"
	"sort"
	"time"
)

// Leases and the fake clock. A lease ends when the clock reaches its
// expiry, or when it is revoked; either way every key on it goes in one
// step, at one revision, as etcd's lessor revokes an expired lease.
// etcd revokes an expired lease a little after its TTL; here it is
// exact.

type lease struct {
	ttl     time.Duration
	expires time.Time
}

// Now is the fake clock's reading.
func (s *Store) Now() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.now
}

// Advance moves the clock on by d and ends the leases that expire.
func (s *Store) Advance(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.now = s.now.Add(d)
	s.expire()
}

// Grant grants a lease of ttl, rounded up to whole seconds as etcd's,
// and returns its ID: a node's session lease.
func (s *Store) Grant(ttl time.Duration) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.grant(ttl)
}

func (s *Store) grant(ttl time.Duration) int64 {
	ttl = ttl.Round(0)
	if r := ttl % time.Second; r != 0 {
		ttl += time.Second - r
	}
	s.next++
	s.lease[s.next] = &lease{ttl: ttl, expires: s.now.Add(ttl)}
	s.schedule(s.now.Add(ttl))
	return s.next
}

// KeepAlive renews a lease for its TTL, as a session's keep-alive does;
// false if the lease has ended.
func (s *Store) KeepAlive(id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expire()
	l, ok := s.lease[id]
	if ok {
		l.expires = s.now.Add(l.ttl)
	}
	return ok
}

// Revoke ends a lease now, with every key on it; an unknown lease is
// ignored.
func (s *Store) Revoke(id int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.revoke(id)
}

// revoke deletes lease id and its keys, in one revision.
func (s *Store) revoke(id int64) {
	if _, ok := s.lease[id]; !ok {
		return
	}
	delete(s.lease, id)
	b := s.begin()
	dropLeased(b, s.claims, id)
	dropLeased(b, s.homes, id)
	s.ips.dropLease(b, id)
	dropLeased(b, s.lent, id)
	dropLeased(b, s.fences, id)
	dropLeased(b, s.bindings, id)
	dropLeased(b, s.pools, id)
	b.end()
}

func dropLeased[K comparable](b *batch, m map[K]entry, id int64) {
	for k, e := range m {
		if e.lease == id {
			del(b, m, k)
		}
	}
}

// schedule notes that something may end at t.
func (s *Store) schedule(t time.Time) {
	if s.due.IsZero() || t.Before(s.due) {
		s.due = t
	}
}

// expire ends every lease whose time has come, earliest first, and the
// history records past their retention.
func (s *Store) expire() {
	if s.due.IsZero() || s.now.Before(s.due) {
		return
	}
	var due []int64
	for id, l := range s.lease {
		if !l.expires.After(s.now) {
			due = append(due, id)
		}
	}
	sort.Slice(due, func(i, j int) bool {
		a, b := s.lease[due[i]], s.lease[due[j]]
		if !a.expires.Equal(b.expires) {
			return a.expires.Before(b.expires)
		}
		return due[i] < due[j]
	})
	for _, id := range due {
		s.revoke(id)
	}
	s.expireHistory()
	s.due = time.Time{}
	for _, l := range s.lease {
		s.schedule(l.expires)
	}
	for _, hs := range s.history {
		s.schedule(hs[0].expires) // a record expires after those before it
	}
}

// live reports whether lease id exists (0, no lease, always does): a put
// on a lease etcd does not know is refused, with nothing applied.
func (s *Store) live(id int64) bool {
	_, ok := s.lease[id]
	return id == 0 || ok
}

// lock takes the store's lock and ends the leases due: the start of
// every call.
func (s *Store) lock() {
	s.mu.Lock()
	s.expire()
}

// LeaseExpiry implements records.Store: now plus the lease's remaining
// TTL in whole seconds, as etcd answers; now for a lease that has ended.
func (s *Store) LeaseExpiry(_ context.Context, id int64) (time.Time, error) {
	s.lock()
	defer s.mu.Unlock()
	l, ok := s.lease[id]
	if !ok {
		return s.now, nil
	}
	left := l.expires.Sub(s.now) / time.Second * time.Second
	return s.now.Add(left), nil
}

// reservationLease is the shared lease new reservations are put on, as
// etcdstore's: granted for ttl plus a quarter, and shared for a quarter
// of ttl, so every reservation lives at least ttl; the first reservation
// in the second half of a window grants the next window's lease ahead,
// as etcdstore's does in the background. It returns the lease and when
// it ends.
func (s *Store) reservationLease() (int64, time.Time) {
	window := s.opts.ReservationTTL / 4
	usable := func(id int64, granted time.Time) bool { return id != 0 && s.now.Sub(granted) < window }
	if !usable(s.resID, s.resGranted) && usable(s.resNext, s.resNextGranted) {
		s.resID, s.resGranted, s.resExpires = s.resNext, s.resNextGranted, s.resNextExpires
		s.resNext = 0
	}
	ttl := s.opts.ReservationTTL + window
	if usable(s.resID, s.resGranted) {
		if s.now.Sub(s.resGranted) >= window/2 && s.resNext == 0 {
			s.resNext = s.grant(ttl)
			s.resNextGranted, s.resNextExpires = s.now, s.lease[s.resNext].expires
		}
		return s.resID, s.resExpires
	}
	s.resID = s.grant(ttl)
	s.resGranted, s.resExpires = s.now, s.lease[s.resID].expires
	return s.resID, s.resExpires
}

// dropReservationLease forgets the shared lease once a write found it
// gone, so the next reservation grants another.
func (s *Store) dropReservationLease(id int64) {
	if s.resID == id {
		s.resID = 0
	}
	if s.resNext == id {
		s.resNext = 0
	}
}
