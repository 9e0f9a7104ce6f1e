package etcdstore

import (
	"context"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// Guard is a condition a guarded delete is fenced by, checked in the same
// transaction: Key absent (Rev 0), Key unchanged at Rev, or (Prefix) no key
// at all under Key.
type Guard struct {
	Key    string `json:"key"`
	Rev    int64  `json:"rev,omitempty"`
	Prefix bool   `json:"prefix,omitempty"`
}

// String says what the guard requires, for plans shown to a person.
func (g Guard) String() string {
	switch {
	case g.Prefix:
		return "no key under " + g.Key
	case g.Rev == 0:
		return g.Key + " absent"
	default:
		return fmt.Sprintf("%s at revision %d", g.Key, g.Rev)
	}
}

// GuardedDelete is one delete of an operator's repair: Key, only if it
// still has revision Rev and every guard holds, together with the keys of
// Also and the record of the ownership interval it ends (History, nil for
// none).
type GuardedDelete struct {
	Key     string
	Rev     int64
	Guards  []Guard
	Also    []string
	History *HistoryRecord
}

// deleteGuarded runs d as one transaction on kv: it compares d.Key's
// revision and every guard, and deletes d.Key and d.Also, recording
// d.History through hist when both are set (hist nil: no history). A
// delete with no guards and no record is one kvstore.DeleteAt.
//
// gone reports that a guarded delete found d.Key already gone (an
// unguarded one cannot tell, and reports the key deleted). A changed key
// or a failed guard wraps retry.ErrConflict, naming what changed. A
// transaction of unknown outcome (its answer lost, a deadline) is settled
// as every write is: d.Key is read back, and the delete is done if the key
// is gone, not applied if it is still at d.Rev. ctx bounds the
// transaction and the read-back.
func deleteGuarded(ctx context.Context, kv clientv3.KV, hist *HistoryRecorder, d GuardedDelete) (gone bool, err error) {
	gone, err = tryDelete(ctx, kv, hist, d)
	if err == nil || errors.Is(err, retry.ErrConflict) {
		return gone, err
	}
	resp, rerr := kv.Get(ctx, d.Key, clientv3.WithKeysOnly())
	switch {
	case rerr != nil:
		return false, fmt.Errorf("%w; its outcome is unknown and the key could not be read back (%v): run the plan again", err, rerr)
	case len(resp.Kvs) == 0:
		return false, nil
	case resp.Kvs[0].ModRevision == d.Rev:
		return false, fmt.Errorf("%w; read back: not applied, the key is as planned: run the plan again", err)
	default:
		return false, fmt.Errorf("delete %s: changed since the plan (revision %d, now %d): %w", d.Key, d.Rev, resp.Kvs[0].ModRevision, retry.ErrConflict)
	}
}

func tryDelete(ctx context.Context, kv clientv3.KV, hist *HistoryRecorder, d GuardedDelete) (gone bool, err error) {
	if d.History != nil && hist != nil {
		err := hist.Commit(ctx, []HistoryRecord{*d.History}, func(puts []clientv3.Op) (err error) {
			gone, err = guardedTxn(ctx, kv, d, puts)
			return err
		})
		return gone, err
	}
	if len(d.Guards) == 0 {
		return false, kvstore.DeleteAt(ctx, kv, d.Key, d.Rev)
	}
	return guardedTxn(ctx, kv, d, nil)
}

// guardedTxn deletes d.Key in one transaction comparing its revision and
// every guard, with the extra operations then.
func guardedTxn(ctx context.Context, kv clientv3.KV, d GuardedDelete, then []clientv3.Op) (gone bool, err error) {
	cmps, reads := fenced(d.Key, d.Rev, d.Guards)
	then = append([]clientv3.Op{clientv3.OpDelete(d.Key)}, then...)
	for _, k := range d.Also {
		then = append(then, clientv3.OpDelete(k))
	}
	resp, err := kv.Txn(ctx).If(cmps...).Then(then...).Else(reads...).Commit()
	if err != nil {
		return false, fmt.Errorf("delete %s: %w", d.Key, err)
	}
	if resp.Succeeded {
		return false, nil
	}
	return guardFailure("delete "+d.Key, d.Rev, d.Guards, resp)
}

// fenced are the compares of a write to key fenced by its revision and
// guards, and the reads, in the same order, that explain a failed one
// (guardFailure).
func fenced(key string, rev int64, guards []Guard) ([]clientv3.Cmp, []clientv3.Op) {
	cmps := []clientv3.Cmp{kvstore.Unchanged(key, rev)}
	reads := []clientv3.Op{clientv3.OpGet(key, clientv3.WithKeysOnly())}
	for _, g := range guards {
		switch {
		case g.Prefix:
			cmps = append(cmps, kvstore.PrefixEmpty(g.Key))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithPrefix(), clientv3.WithCountOnly()))
		case g.Rev == 0:
			cmps = append(cmps, kvstore.Absent(g.Key))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithCountOnly()))
		default:
			cmps = append(cmps, kvstore.Unchanged(g.Key, g.Rev))
			reads = append(reads, clientv3.OpGet(g.Key, clientv3.WithKeysOnly()))
		}
	}
	return cmps, reads
}

// guardFailure explains a fenced write (what) that did not happen from
// the Else reads of fenced: the key itself (gone: it is absent), then one
// read per guard.
func guardFailure(what string, rev int64, guards []Guard, resp *clientv3.TxnResponse) (gone bool, err error) {
	cur := resp.Responses[0].GetResponseRange()
	if len(cur.Kvs) == 0 {
		return true, nil
	}
	if now := cur.Kvs[0].ModRevision; now != rev {
		return false, fmt.Errorf("%s: changed since the plan (revision %d, now %d): %w", what, rev, now, retry.ErrConflict)
	}
	for i, g := range guards {
		r := resp.Responses[i+1].GetResponseRange()
		switch {
		case g.Prefix && r.Count > 0:
			return false, fmt.Errorf("%s: %d keys appeared under %s: %w", what, r.Count, g.Key, retry.ErrConflict)
		case !g.Prefix && g.Rev == 0 && r.Count > 0:
			return false, fmt.Errorf("%s: %s exists again (node back or block re-claimed): %w", what, g.Key, retry.ErrConflict)
		case !g.Prefix && g.Rev != 0 && (len(r.Kvs) == 0 || r.Kvs[0].ModRevision != g.Rev):
			return false, fmt.Errorf("%s: %s changed since the plan: %w", what, g.Key, retry.ErrConflict)
		}
	}
	return false, fmt.Errorf("%s: a guard failed: %w", what, retry.ErrConflict)
}
