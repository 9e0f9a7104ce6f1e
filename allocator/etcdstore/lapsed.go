package etcdstore

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// RecordLapsed implements records.Store: it records the end of
// reservation al, whose lease ran out at end, once etcd agrees. The
// reservation's key goes with its lease, so there is no release
// transaction to carry the record; instead the record is written in a
// transaction that requires the key to be gone. A key still at al's
// revision has not lapsed in etcd yet (etcd extends leases across a
// leader change): false, ask again later. A key rewritten by the same
// owner was confirmed in time: nothing ended, true. A key taken by
// another owner means the reservation did lapse: recorded, true.
func (s *Store) RecordLapsed(ctx context.Context, al records.Allocation, end time.Time) (bool, error) {
	if s.hist == nil {
		return true, nil
	}
	key := IPKey(al.Pool, al.Block, al.Addr)
	r := HistoryOf(al, end, EndLapsed)
	done := false
	err := s.hist.Commit(ctx, []HistoryRecord{r}, func(puts []clientv3.Op) error {
		resp, err := s.kv.Txn(ctx).If(kvstore.Absent(key)).Then(puts...).Else(clientv3.OpGet(key)).Commit()
		if err != nil {
			return err
		}
		kvs := resp.Responses
		switch {
		case resp.Succeeded:
			done = true
			return nil
		case kvs[0].GetResponseRange().Kvs[0].ModRevision == al.Rev:
			return nil // not lapsed in etcd yet
		}
		done = true
		if cur, err := DecodeAllocation(al.Pool, kvs[0].GetResponseRange().Kvs[0]); err == nil && cur.Owner.Key() == al.Owner.Key() {
			return nil // confirmed in time: nothing ended
		}
		// Taken by another owner after the lapse. The record's key is
		// fixed by r, so writing it twice is harmless.
		_, err = s.kv.Txn(ctx).Then(puts...).Commit()
		return err
	})
	if err != nil {
		return false, fmt.Errorf("record lapse of %s: %w", key, kvstore.Unavailable(err))
	}
	return done, nil
}
