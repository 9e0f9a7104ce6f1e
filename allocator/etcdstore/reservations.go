package etcdstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kvipam/kvipam/kvstore"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// LeaseExpiry implements allocator.Store.
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

// drop forgets lease id (etcd no longer knows it), so the next get grants anew.
func (r *reservationLeases) drop(id clientv3.LeaseID) {
	r.mu.Lock()
	if r.id == id {
		r.id = 0
	}
	r.mu.Unlock()
}
