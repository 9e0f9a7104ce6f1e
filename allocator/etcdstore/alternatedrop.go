package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// GuardedAlternateDrop is an operator's end of a live migration whose
// second owner's node is gone (kvipamctl node remove): the sticky binding
// at Binding in Pool, only if still at revision Rev and naming the
// alternate Owner (an owner key) on Node, loses it, and so do the address
// records of Records, each only if still at its revision, in one
// transaction that also checks every guard and records the second owner's
// interval on each address in IP history, ended as Reason at End.
type GuardedAlternateDrop struct {
	Pool    string
	Binding string
	Rev     int64
	Owner   string
	Node    string
	Records []Guard
	Guards  []Guard
	Reason  string
	End     time.Time
}

// DropAlternateGuarded runs d, recording its history through hist (nil:
// none). gone reports that the binding was already gone, or no longer
// names the alternate: nothing to end. A changed binding or record, or a
// failed guard, wraps retry.ErrConflict. A transaction of unknown outcome
// is settled as every write is: the binding is read back, and the end is
// done if it names the alternate no more, not applied if it is still at
// d.Rev.
func (o *Operator) DropAlternateGuarded(ctx context.Context, hist *HistoryRecorder, d GuardedAlternateDrop) (gone bool, err error) {
	gone, err = tryDropAlternate(ctx, o.cli, hist, d)
	if err == nil || errors.Is(err, retry.ErrConflict) {
		return gone, err
	}
	b, found, rerr := readBindingAt(ctx, o.cli, d)
	switch {
	case rerr != nil:
		return false, fmt.Errorf("%w; its outcome is unknown and the binding could not be read back (%v): run the plan again", err, rerr)
	case found && b.Rev == d.Rev:
		return false, fmt.Errorf("%w; read back: not applied, the binding is as planned: run the plan again", err)
	case !found || !names(b, d):
		return false, nil
	default:
		return false, fmt.Errorf("end the migration of %s: the binding changed since the plan (revision %d, now %d): %w", d.Binding, d.Rev, b.Rev, retry.ErrConflict)
	}
}

// names reports whether b's alternate is the one d ends.
func names(b records.Binding, d GuardedAlternateDrop) bool {
	return b.Alternate != nil && b.Alternate.Owner.Key() == d.Owner && b.Alternate.Node == d.Node
}

// readBindingAt reads the binding d ends.
func readBindingAt(ctx context.Context, kv clientv3.KV, d GuardedAlternateDrop) (records.Binding, bool, error) {
	resp, err := kv.Get(ctx, d.Binding)
	if err != nil {
		return records.Binding{}, false, err
	}
	return decodeBindingAt(resp.Kvs, d)
}

// decodeBindingAt decodes the binding d ends from a read of its key.
func decodeBindingAt(kvs []*mvccpb.KeyValue, d GuardedAlternateDrop) (records.Binding, bool, error) {
	if len(kvs) == 0 {
		return records.Binding{}, false, nil
	}
	v, err := kvstore.Decode[records.Binding](kvs[0])
	if err != nil {
		return records.Binding{}, false, fmt.Errorf("binding %s: %w", d.Binding, err)
	}
	b := v.Value
	b.Pool, b.Rev = d.Pool, kvs[0].ModRevision
	return b, true, nil
}

func tryDropAlternate(ctx context.Context, kv clientv3.KV, hist *HistoryRecorder, d GuardedAlternateDrop) (gone bool, err error) {
	what := "end the migration of " + d.Binding
	// The binding and the records, in one read at one revision.
	gets := []clientv3.Op{clientv3.OpGet(d.Binding)}
	for _, g := range d.Records {
		gets = append(gets, clientv3.OpGet(g.Key))
	}
	read, err := kv.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return false, fmt.Errorf("%s: read: %w", what, err)
	}
	b, found, err := decodeBindingAt(read.Responses[0].GetResponseRange().Kvs, d)
	switch {
	case err != nil:
		return false, fmt.Errorf("%s: %w", what, err)
	case !found:
		return true, nil
	case b.Rev != d.Rev:
		return false, fmt.Errorf("%s: changed since the plan (revision %d, now %d): %w", what, d.Rev, b.Rev, retry.ErrConflict)
	case !names(b, d):
		return true, nil
	}
	cur := make([]records.Allocation, 0, len(d.Records))
	for i, g := range d.Records {
		kvs := read.Responses[i+1].GetResponseRange().Kvs
		if len(kvs) == 0 || kvs[0].ModRevision != g.Rev {
			return false, fmt.Errorf("%s: %s changed since the plan: %w", what, g.Key, retry.ErrConflict)
		}
		al, err := DecodeAllocation(d.Pool, kvs[0])
		if err != nil {
			return false, fmt.Errorf("%s: %w", what, err)
		}
		cur = append(cur, al)
	}
	nb, puts, ended, err := alternateDropped(b, cur, d.End, d.Reason)
	if err != nil {
		return false, err
	}
	val, err := kvstore.EncodeJSON(nb)
	if err != nil {
		return false, err
	}
	puts = append(puts, clientv3.OpPut(d.Binding, val))
	// The records are fenced at their revisions, as guards.
	guards := append(slices.Clone(d.Records), d.Guards...)
	cmps, reads := fenced(d.Binding, d.Rev, guards)
	commit := func(then []clientv3.Op) error {
		resp, err := kv.Txn(ctx).If(cmps...).Then(append(slices.Clip(puts), then...)...).Else(reads...).Commit()
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if !resp.Succeeded {
			gone, err = guardFailure(what, d.Rev, guards, resp)
		}
		return err
	}
	if hist == nil {
		return gone, commit(nil)
	}
	err = hist.Commit(ctx, ended, commit)
	return gone, err
}
