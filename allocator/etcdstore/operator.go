package etcdstore

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// OperatorClient is what a whole-store reader (kvipamctl's inspector) needs of
// etcd: range reads, transactions for the guarded deletes (DeleteGuarded),
// and lease look-ups for reservations. *clientv3.Client satisfies it.
type OperatorClient interface {
	clientv3.KV
	TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error)
}

var _ OperatorClient = (*clientv3.Client)(nil)

// Operator is the door of an operator's whole-store work (kvipamctl's
// inspector: check, repair, node remove): it reads every kvipam record and
// the leases of reservations, and runs guarded deletes.
type Operator struct {
	cli      OperatorClient
	pageSize int
}

// NewOperator returns an Operator over cli. pageSize, when positive, splits
// each range read into pages of that many keys (all at one revision);
// zero reads each record kind with one range read.
func NewOperator(cli OperatorClient, pageSize int) *Operator {
	return &Operator{cli: cli, pageSize: pageSize}
}

// scanPrefixes are the record kinds ScanAll reads, in order.
func scanPrefixes() []string {
	return []string{SchemaKey(), PoolsPrefix(), nodesPrefix(), AllClaimsPrefix(), AllHomesPrefix(), AllIPsPrefix(), allStickyPrefix()}
}

// ScanAll hands every kvipam record (the schema level, pools, nodes, claims, homes, lent
// addresses and allocations, sticky bindings) to add, one record kind
// after the other, and returns the revision it read at: the later reads
// are pinned to the revision of the first. A compaction of that revision
// during the read fails it; run it again.
func (o *Operator) ScanAll(ctx context.Context, add func(*mvccpb.KeyValue)) (rev int64, err error) {
	for _, prefix := range scanPrefixes() {
		if rev, err = o.scan(ctx, prefix, rev, add); err != nil {
			return 0, err
		}
	}
	return rev, nil
}

// scan range-reads prefix at rev (the current revision if 0, which it
// then returns) and hands every key-value to add.
func (o *Operator) scan(ctx context.Context, prefix string, rev int64, add func(*mvccpb.KeyValue)) (int64, error) {
	key, end := prefix, clientv3.GetPrefixRangeEnd(prefix)
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end)}
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		if o.pageSize > 0 {
			opts = append(opts, clientv3.WithLimit(int64(o.pageSize)))
		}
		resp, err := o.cli.Get(ctx, key, opts...)
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", prefix, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			add(kv)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return rev, nil
		}
		// The next page starts just after the last key read.
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// LeaseTTL returns how long lease has left in seconds as etcd reports it,
// or -1 for a lease etcd no longer has.
func (o *Operator) LeaseTTL(ctx context.Context, lease int64) (int64, error) {
	resp, err := o.cli.TimeToLive(ctx, clientv3.LeaseID(lease))
	switch {
	case errors.Is(err, rpctypes.ErrLeaseNotFound):
		return -1, nil
	case err != nil:
		return 0, err
	}
	return resp.TTL, nil
}

// DeleteGuarded runs d as one transaction, recording d.History through
// hist (see deleteGuarded).
func (o *Operator) DeleteGuarded(ctx context.Context, hist *HistoryRecorder, d GuardedDelete) (gone bool, err error) {
	return deleteGuarded(ctx, o.cli, hist, d)
}
