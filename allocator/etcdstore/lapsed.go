package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/kvstore"
)

// RecordLapsed implements allocator.Store: it records the end of
// reservation al, whose lease ran out at end, once etcd agrees. The
// reservation's key goes with its lease, so there is no release
// transaction to carry the record; instead the record is written in a
// transaction that requires the key to be gone. A key still at al's
// revision has not lapsed in etcd yet (etcd extends leases across a
// leader change): false, ask again later. A key rewritten by the same
// owner was confirmed in time: nothing ended, true. A key taken by
// another owner means the reservation did lapse: recorded, true.
func (s *Store) RecordLapsed(ctx context.Context, al allocator.Allocation, end time.Time) (bool, error) {
	if s.hist == nil {
		return true, nil
	}
	key := IPKey(al.Pool, al.Block, al.Addr)
	r := HistoryOf(al, end, EndLapsed)
	for attempt := 0; ; attempt++ {
		put, lease, _, err := s.hist.Op(ctx, r)
		if err != nil {
			return false, err
		}
		resp, err := s.kv.Txn(ctx).If(kvstore.Absent(key)).Then(put).Else(clientv3.OpGet(key)).Commit()
		if attempt == 0 && errors.Is(err, rpctypes.ErrLeaseNotFound) {
			s.hist.Drop(lease)
			continue
		}
		if err != nil {
			return false, fmt.Errorf("record lapse of %s: %w", key, kvstore.Unavailable(err))
		}
		if resp.Succeeded {
			return true, nil
		}
		kv := resp.Responses[0].GetResponseRange().Kvs[0]
		if kv.ModRevision == al.Rev {
			return false, nil
		}
		cur, err := DecodeAllocation(al.Pool, kv)
		if err == nil && cur.Owner.Key() == al.Owner.Key() {
			return true, nil
		}
		// Taken by another owner after the lapse. The record's key is
		// fixed by r, so writing it twice is harmless.
		if _, err := s.kv.Do(ctx, put); err != nil {
			return false, fmt.Errorf("record lapse of %s: %w", key, kvstore.Unavailable(err))
		}
		return true, nil
	}
}
