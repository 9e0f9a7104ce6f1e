package kvstore

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultCallTimeout bounds one etcd request when a caller sets none. A
// healthy request takes about a millisecond; one that is not answered in
// a second is waiting for a leader (an election takes about one election
// timeout, 1 s by default) or a member that is gone. Abandoning it lets
// the caller retry, through another member or after the election,
// instead of waiting for etcd's own request timeout (5 s and more) while
// everything queued behind it waits too. An abandoned write's outcome is
// unknown; the allocator settles such writes by reading them back.
const DefaultCallTimeout = time.Second

// WithCallTimeout returns kv with every request (Get, Put, Delete,
// Compact, Do, and a Txn from Txn to Commit) bounded by d, on top of the
// caller's context. d <= 0 returns kv unchanged. An abandoned request
// fails with context.DeadlineExceeded, which Unavailable classifies.
func WithCallTimeout(kv clientv3.KV, d time.Duration) clientv3.KV {
	if d <= 0 {
		return kv
	}
	return timeoutKV{kv: kv, d: d}
}

type timeoutKV struct {
	kv clientv3.KV
	d  time.Duration
}

func (k timeoutKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	defer cancel()
	return k.kv.Put(ctx, key, val, opts...)
}

func (k timeoutKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	defer cancel()
	return k.kv.Get(ctx, key, opts...)
}

func (k timeoutKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	defer cancel()
	return k.kv.Delete(ctx, key, opts...)
}

func (k timeoutKV) Compact(ctx context.Context, rev int64, opts ...clientv3.CompactOption) (*clientv3.CompactResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	defer cancel()
	return k.kv.Compact(ctx, rev, opts...)
}

func (k timeoutKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	defer cancel()
	return k.kv.Do(ctx, op)
}

// Txn's deadline starts at Txn, as the context is captured there; a
// transaction is built and committed at once.
func (k timeoutKV) Txn(ctx context.Context) clientv3.Txn {
	ctx, cancel := context.WithTimeout(ctx, k.d)
	return &timeoutTxn{txn: k.kv.Txn(ctx), cancel: cancel}
}

type timeoutTxn struct {
	txn    clientv3.Txn
	cancel context.CancelFunc
}

func (t *timeoutTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.txn = t.txn.If(cs...)
	return t
}

func (t *timeoutTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.txn = t.txn.Then(ops...)
	return t
}

func (t *timeoutTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.txn = t.txn.Else(ops...)
	return t
}

func (t *timeoutTxn) Commit() (*clientv3.TxnResponse, error) {
	defer t.cancel()
	return t.txn.Commit()
}

// Leases is the part of clientv3.Lease that grants leases and reads their
// time to live.
type Leases interface {
	Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error)
	TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error)
}

// LeasesWithCallTimeout bounds each Grant and TimeToLive of l by d, as
// WithCallTimeout does for KV requests.
func LeasesWithCallTimeout(l Leases, d time.Duration) Leases {
	if d <= 0 {
		return l
	}
	return timeoutLeases{l: l, d: d}
}

type timeoutLeases struct {
	l Leases
	d time.Duration
}

func (t timeoutLeases) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, t.d)
	defer cancel()
	return t.l.Grant(ctx, ttl)
}

func (t timeoutLeases) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, t.d)
	defer cancel()
	return t.l.TimeToLive(ctx, id, opts...)
}
