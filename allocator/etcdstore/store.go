// Package etcdstore keeps kvipam's allocation state in etcd: the key
// layout of docs/etcd-schema.md, its parsing (ParseKey), and the fenced
// transactions that uphold the invariants of docs/design.md, an operator's
// guarded deletes and whole-store reads (Operator) included. It is the one
// door to etcd: no other package builds a key, reads one back or writes a
// transaction.
// It implements records.Store.
package etcdstore

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// Store is the etcd-backed records.Store. It is safe for concurrent use.
type Store struct {
	cli *clientv3.Client // watches
	// kv and leases are cli with each request bounded by the call
	// timeout (kvstore.WithCallTimeout).
	kv     clientv3.KV
	leases kvstore.Leases
	// claims is cli for block claims and their listing, bounded by
	// claimTimeout: a node claims a block rarely, and when thousands
	// start at once etcd queues their claims longer than the call
	// timeout; the claims still land, and timing them out only adds
	// retries to the queue (BenchmarkClaimStorm on three members: 5,000
	// nodes 5.5-18 s with 1 s, 2.8 s with 5 s).
	claims clientv3.KV
	res    reservationLeases
	hist   *HistoryRecorder // nil: no IP history
	now    func() time.Time
}

var _ records.Store = (*Store)(nil)

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
	ahead := o.CallTimeout
	if ahead <= 0 {
		ahead = o.ReservationTTL / 4
	}
	s := &Store{cli: cli, kv: kvstore.WithCallTimeout(cli, o.CallTimeout), claims: kvstore.WithCallTimeout(cli, claimTimeout(o.CallTimeout)), leases: leases,
		res: reservationLeases{leases: leases, ttl: o.ReservationTTL, ahead: ahead, now: time.Now}, now: time.Now}
	if o.HistoryRetention == 0 {
		o.HistoryRetention = DefaultHistoryRetention
	}
	s.hist = NewHistoryRecorder(leases, o.HistoryRetention)
	return s
}

// Close ends the store's background work (IP history's leases granted
// ahead, HistoryRecorder.Close). The client is the caller's to close,
// after.
func (s *Store) Close() { s.hist.Close() }

// claimTimeout is the bound of claim requests: five call timeouts, at
// least 5 s; none when calls have none.
func claimTimeout(call time.Duration) time.Duration {
	if call < 0 {
		return call
	}
	return max(5*call, 5*time.Second)
}

// Ping checks that etcd answers, with a count-only read of HealthKey.
func (s *Store) Ping(ctx context.Context) error {
	_, err := s.kv.Get(ctx, HealthKey(), clientv3.WithCountOnly())
	return kvstore.Unavailable(err)
}
