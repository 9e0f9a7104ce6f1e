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
// short window, so a reservation costs no extra round trip. The lease is
// granted for ttl plus the window, so every reservation lives at least ttl.
type reservationLeases struct {
	leases  kvstore.Leases
	ttl     time.Duration
	mu      sync.Mutex
	id      clientv3.LeaseID
	granted time.Time
	expires time.Time
}

func (r *reservationLeases) get(ctx context.Context) (clientv3.LeaseID, time.Time, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	window := r.ttl / 4
	if r.id != 0 && now.Sub(r.granted) < window {
		return r.id, r.expires, nil
	}
	secs := int64((r.ttl + window + time.Second - 1) / time.Second)
	resp, err := r.leases.Grant(ctx, secs)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("grant reservation lease: %w", kvstore.Unavailable(err))
	}
	r.id, r.granted, r.expires = resp.ID, now, now.Add(time.Duration(resp.TTL)*time.Second)
	return r.id, r.expires, nil
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

// drop forgets lease id (etcd no longer knows it), so the next get grants anew.
func (r *reservationLeases) drop(id clientv3.LeaseID) {
	r.mu.Lock()
	if r.id == id {
		r.id = 0
	}
	r.mu.Unlock()
}
