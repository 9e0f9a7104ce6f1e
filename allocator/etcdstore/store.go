// Package etcdstore keeps kvipam's allocation state in etcd: the key
// layout of docs/etcd-schema.md and the fenced transactions that uphold the
// invariants of docs/design.md. It implements allocator.Store.
package etcdstore

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/kvstore"
)

// Store is the etcd-backed allocator.Store. It is safe for concurrent use.
type Store struct {
	cli *clientv3.Client // watches
	// kv and leases are cli with each request bounded by the call
	// timeout (kvstore.WithCallTimeout).
	kv     clientv3.KV
	leases kvstore.Leases
	res    reservationLeases
	hist   *HistoryRecorder // nil: no IP history
	now    func() time.Time
}

var _ allocator.Store = (*Store)(nil)

// Options tune a Store.
type Options struct {
	// ReservationTTL is the least time a reservation lives before its
	// lease can expire it. Default 2 minutes.
	ReservationTTL time.Duration
	// HistoryRetention is how long a record of an ended ownership interval
	// is kept (IP history). Zero: DefaultHistoryRetention; negative: no
	// history is written.
	HistoryRetention time.Duration
	// CallTimeout bounds each etcd request (not watches). Zero:
	// kvstore.DefaultCallTimeout; negative: only the caller's context.
	CallTimeout time.Duration
}

// New returns a Store over cli.
func New(cli *clientv3.Client, o Options) *Store {
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = 2 * time.Minute
	}
	if o.CallTimeout == 0 {
		o.CallTimeout = kvstore.DefaultCallTimeout
	}
	leases := kvstore.LeasesWithCallTimeout(cli, o.CallTimeout)
	s := &Store{cli: cli, kv: kvstore.WithCallTimeout(cli, o.CallTimeout), leases: leases,
		res: reservationLeases{leases: leases, ttl: o.ReservationTTL}, now: time.Now}
	if o.HistoryRetention == 0 {
		o.HistoryRetention = DefaultHistoryRetention
	}
	s.hist = NewHistoryRecorder(leases, o.HistoryRetention)
	return s
}

// Ping checks that etcd answers, with a count-only read of HealthKey.
func (s *Store) Ping(ctx context.Context) error {
	_, err := s.kv.Get(ctx, HealthKey(), clientv3.WithCountOnly())
	return kvstore.Unavailable(err)
}
