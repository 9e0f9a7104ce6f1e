package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvipam/kvipam/kvstore"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// LeaseExpiry implements records.Store.
func (s *Store) LeaseExpiry(ctx context.Context, lease int64) (time.Time, error) {
	resp, err := s.leases.TimeToLive(ctx, clientv3.LeaseID(lease))
	if err != nil {
		return time.Time{}, fmt.Errorf("read lease %x: %w", lease, kvstore.Unavailable(err))
	}
	return s.now().Add(time.Duration(max(resp.TTL, 0)) * time.Second), nil
}

// reservationLeases shares one lease among the reservations made within a
// short window (a quarter of ttl), so a reservation costs no extra round
// trip. The lease is granted for ttl plus the window, so every reservation
// lives at least ttl. While reservations keep coming, the next window's
// lease is granted ahead, in the background, by the first reservation in
// the second half of the current window: an ADD then waits for a grant
// only after the node was idle for a window (or a grant failed), not once
// a window. A lease granted ahead is used only within a window of its own
// grant, so the bound holds for it too.
type reservationLeases struct {
	leases kvstore.Leases
	ttl    time.Duration
	// ahead bounds a grant made ahead, which no caller's context bounds.
	ahead time.Duration
	now   func() time.Time

	mu       sync.Mutex
	cur      resLease
	next     resLease // granted ahead; zero until then
	granting bool     // a grant ahead is under way
	// waited counts the reservations that waited for a grant.
	waited int
}

// resLease is one shared reservation lease.
type resLease struct {
	id               clientv3.LeaseID
	granted, expires time.Time
}

// usable reports whether a reservation written at now may go on l.
func (l resLease) usable(now time.Time, window time.Duration) bool {
	return l.id != 0 && now.Sub(l.granted) < window
}

func (r *reservationLeases) get(ctx context.Context) (clientv3.LeaseID, time.Time, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now, window := r.now(), r.ttl/4
	if !r.cur.usable(now, window) && r.next.usable(now, window) {
		r.cur, r.next = r.next, resLease{}
	}
	if r.cur.usable(now, window) {
		if now.Sub(r.cur.granted) >= window/2 && r.next.id == 0 && !r.granting {
			r.granting = true
			go r.grantAhead()
		}
		return r.cur.id, r.cur.expires, nil
	}
	// Granted under mu: the reservations that arrive meanwhile wait for
	// this grant rather than each granting one.
	l, err := r.grant(ctx)
	if err != nil {
		return 0, time.Time{}, err
	}
	r.waited++
	r.cur = l
	return l.id, l.expires, nil
}

// grant grants a lease for ttl plus the window.
func (r *reservationLeases) grant(ctx context.Context) (resLease, error) {
	secs := int64((r.ttl + r.ttl/4 + time.Second - 1) / time.Second)
	now := r.now()
	resp, err := r.leases.Grant(ctx, secs)
	if err != nil {
		return resLease{}, fmt.Errorf("grant reservation lease: %w", kvstore.Unavailable(err))
	}
	return resLease{id: resp.ID, granted: now, expires: now.Add(time.Duration(resp.TTL) * time.Second)}, nil
}

// grantAhead grants the next window's lease without mu held. It ends
// within r.ahead; if the grant fails, the first reservation after the
// window grants one itself.
func (r *reservationLeases) grantAhead() {
	ctx, cancel := context.WithTimeout(context.Background(), r.ahead)
	defer cancel()
	l, err := r.grant(ctx)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.granting = false
	if err == nil {
		r.next = l
	}
}

// drop forgets lease id (etcd no longer knows it), so the next get grants anew.
func (r *reservationLeases) drop(id clientv3.LeaseID) {
	r.mu.Lock()
	if r.cur.id == id {
		r.cur = resLease{}
	}
	if r.next.id == id {
		r.next = resLease{}
	}
	r.mu.Unlock()
}

// reservationLeaseGone reports whether err, a transaction's that put
// reservations on lease id (0: none), says that lease expired or was
// revoked, and if so forgets it, so that the next get grants a new one:
// the write lost a race, and its retry succeeds. If the transaction put on
// other leases too (alone false: a claim on the node's lease), etcd's
// "lease not found" does not say which, so etcd is asked about id; if it
// cannot say, the lease is taken to live.
func (s *Store) reservationLeaseGone(ctx context.Context, err error, id clientv3.LeaseID, alone bool) bool {
	if id == 0 || !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return false
	}
	if !alone {
		resp, terr := s.leases.TimeToLive(ctx, id)
		if terr != nil || resp.TTL > 0 {
			return false
		}
	}
	s.res.drop(id)
	return true
}
