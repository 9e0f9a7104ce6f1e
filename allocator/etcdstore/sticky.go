package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// GetBinding implements records.Store.
func (s *Store) GetBinding(ctx context.Context, pool, identity string) (records.Binding, bool, error) {
	resp, err := s.kv.Get(ctx, BindingKey(pool, identity))
	if err != nil {
		return records.Binding{}, false, fmt.Errorf("read sticky binding %s: %w", identity, kvstore.Unavailable(err))
	}
	if len(resp.Kvs) == 0 {
		return records.Binding{}, false, nil
	}
	v, err := kvstore.Decode[records.Binding](resp.Kvs[0])
	if err != nil {
		return records.Binding{}, false, err
	}
	b := v.Value
	b.Pool, b.Rev, b.Lease = pool, resp.Kvs[0].ModRevision, resp.Kvs[0].Lease
	return b, true, nil
}

// ListBindings reads every sticky binding of a pool ("" for every pool).
func (s *Store) ListBindings(ctx context.Context, pool string) ([]records.Binding, error) {
	prefix := Prefix + "sticky/"
	if pool != "" {
		prefix = StickyPrefix(pool)
	}
	resp, err := s.kv.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list sticky bindings: %w", kvstore.Unavailable(err))
	}
	var out []records.Binding
	for _, kv := range resp.Kvs {
		v, err := kvstore.Decode[records.Binding](kv)
		if err != nil {
			continue
		}
		b := v.Value
		rest := strings.TrimPrefix(string(kv.Key), Prefix+"sticky/")
		b.Pool, _, _ = strings.Cut(rest, "/")
		b.Rev, b.Lease = kv.ModRevision, kv.Lease
		out = append(out, b)
	}
	return out, nil
}

// WriteBound implements records.Store.
func (s *Store) WriteBound(ctx context.Context, b records.Binding, writes []records.IPWrite) (records.WriteResult, error) {
	key := BindingKey(b.Pool, b.Identity)
	cmp := kvstore.Absent(key)
	if b.Rev != 0 {
		cmp = kvstore.Unchanged(key, b.Rev)
	}
	val, err := kvstore.EncodeJSON(b)
	if err != nil {
		return records.WriteResult{}, err
	}
	// An earlier pod whose DEL never reached etcd: its interval ends at
	// the takeover (IP history).
	var ended []HistoryRecord
	for _, w := range writes {
		if w.Ends != nil {
			ended = append(ended, HistoryOf(*w.Ends, s.now(), EndTakenOver))
		}
	}
	return s.writeIPs(ctx, writes, []clientv3.Cmp{cmp}, []clientv3.Op{clientv3.OpPut(key, val)}, ended)
}

// Keep implements records.Store.
func (s *Store) Keep(ctx context.Context, b records.Binding, als []records.Allocation) (time.Time, error) {
	window := b.Window()
	lease, err := s.leases.Grant(ctx, int64(window/time.Second))
	if err != nil {
		return time.Time{}, fmt.Errorf("keep %s: grant a lease of %s: %w", b.Identity, window, kvstore.Unavailable(err))
	}
	end := s.now().Add(window)
	withLease := clientv3.WithLease(lease.ID)
	key := BindingKey(b.Pool, b.Identity)
	cmps := []clientv3.Cmp{kvstore.Unchanged(key, b.Rev)}
	var lentKeys []string
	for _, al := range als {
		if al.Borrowed {
			lentKeys = append(lentKeys, LentKey(al.Pool, al.Addr))
		}
	}
	lent, err := s.lentHomes(ctx, lentKeys)
	if err != nil {
		_, _ = s.cli.Revoke(ctx, lease.ID)
		return time.Time{}, fmt.Errorf("keep %s: %w", b.Identity, err)
	}
	var ops []clientv3.Op
	for _, al := range als {
		k := IPKey(al.Pool, al.Block, al.Addr)
		cmps = append(cmps, kvstore.Unchanged(k, al.Rev))
		// Rewritten from the record read (what a newer version wrote
		// in it stays), held for the identity by no pod.
		rec := al.Record
		rec.Owner = records.Owner{Namespace: al.Namespace, Pod: al.Pod, Network: al.Network}
		rec.State, rec.Since, rec.Identity, rec.WindowSeconds = records.StateKept, s.now().UTC(), b.Identity, 0
		// No pod holds a kept address: nor does a live migration's
		// second owner (the allocator hands the addresses to a live
		// alternate instead of keeping them: CutOver).
		rec.Alternate = nil
		val, err := kvstore.EncodeJSON(rec)
		if err != nil {
			return time.Time{}, err
		}
		ops = append(ops, clientv3.OpPut(k, val, withLease))
		if al.Borrowed {
			h := lent[LentKey(al.Pool, al.Addr)]
			h.Node, h.Since = al.Node, rec.Since
			home, err := kvstore.EncodeJSON(h)
			if err != nil {
				return time.Time{}, err
			}
			ops = append(ops, clientv3.OpPut(LentKey(al.Pool, al.Addr), home, withLease))
		}
	}
	kept := b
	kept.Owner, kept.Node, kept.Since, kept.Alternate = records.Owner{}, "", s.now().UTC(), nil
	val, err := kvstore.EncodeJSON(kept)
	if err != nil {
		return time.Time{}, err
	}
	ops = append(ops, clientv3.OpPut(key, val, withLease))
	// The pod's interval ends here (IP history); the identity's next pod
	// starts a new one.
	ended := make([]HistoryRecord, len(als))
	for i, al := range als {
		ended[i] = HistoryOf(al, s.now(), EndKept)
	}
	var resp *clientv3.TxnResponse
	err = s.hist.Commit(ctx, ended, func(hist []clientv3.Op) (err error) {
		resp, err = s.kv.Txn(ctx).If(cmps...).Then(append(slices.Clip(ops), hist...)...).Commit()
		return err
	})
	if err != nil {
		if errors.Is(err, retry.ErrConflict) {
			// Refused for a missing lease: nothing holds the window's.
			_, _ = s.cli.Revoke(ctx, lease.ID)
		}
		return time.Time{}, fmt.Errorf("keep %s: %w", b.Identity, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		_, _ = s.cli.Revoke(ctx, lease.ID)
		return time.Time{}, fmt.Errorf("keep %s: binding or allocation changed: %w", b.Identity, retry.ErrConflict)
	}
	return end, nil
}

// DropStaleBinding implements records.Store.
func (s *Store) DropStaleBinding(ctx context.Context, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	key := BindingKey(b.Pool, b.Identity)
	cmps := []clientv3.Cmp{kvstore.Unchanged(key, b.Rev)}
	for _, ref := range refs {
		ik := IPKey(ref.Pool, ref.Block, ref.Addr)
		if al, ok := cur[ref.Addr]; ok {
			cmps = append(cmps, kvstore.Unchanged(ik, al.Rev))
		} else {
			cmps = append(cmps, kvstore.Absent(ik))
		}
	}
	resp, err := s.kv.Txn(ctx).If(cmps...).Then(clientv3.OpDelete(key)).Commit()
	if err != nil {
		return fmt.Errorf("drop stale binding of %s: %w", b.Identity, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("drop stale binding of %s: changed meanwhile: %w", b.Identity, retry.ErrConflict)
	}
	return nil
}

// ReleaseBinding frees a kept sticky identity's addresses before its
// window ends: the binding and its kept records go in one transaction,
// if nothing changed. A binding a pod holds is refused (release the pod).
func (s *Store) ReleaseBinding(ctx context.Context, pool, identity string) ([]netip.Addr, error) {
	b, ok, err := s.GetBinding(ctx, pool, identity)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("sticky identity %s in pool %s: %w", identity, pool, records.ErrNotFound)
	}
	if !b.Kept() {
		return nil, fmt.Errorf("sticky identity %s is held by %s on node %s: %w: delete the pod, or wait for its DEL", identity, b.Owner.Key(), b.Node, records.ErrIdentityInUse)
	}
	p, err := s.GetPool(ctx, pool)
	if err != nil {
		return nil, err
	}
	cmps := []clientv3.Cmp{kvstore.Unchanged(BindingKey(pool, identity), b.Rev)}
	ops := []clientv3.Op{clientv3.OpDelete(BindingKey(pool, identity))}
	refs := bindingRefs(p, b)
	cur, err := s.GetIPs(ctx, refs)
	if err != nil {
		return nil, err
	}
	var freed []netip.Addr
	for _, ref := range refs {
		al, ok := cur[ref.Addr]
		if !ok || al.State != records.StateKept || al.Identity != identity {
			continue // not the identity's any more: left alone
		}
		cmps = append(cmps, kvstore.Unchanged(IPKey(pool, ref.Block, ref.Addr), al.Rev))
		ops = append(ops, clientv3.OpDelete(IPKey(pool, ref.Block, ref.Addr)), clientv3.OpDelete(LentKey(pool, ref.Addr)))
		freed = append(freed, ref.Addr)
	}
	resp, err := s.kv.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return nil, fmt.Errorf("release sticky identity %s: %w", identity, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return nil, fmt.Errorf("release sticky identity %s: changed meanwhile (a pod took it?): %w", identity, retry.ErrConflict)
	}
	return freed, nil
}

// bindingRefs names the keys of b's addresses in pool p (an address out
// of p's cidrs now has none).
func bindingRefs(p allocator.Pool, b records.Binding) []records.IPRef {
	var refs []records.IPRef
	for _, addr := range b.Addrs {
		if blk, ok := p.BlockFor(addr); ok {
			refs = append(refs, records.IPRef{Pool: p.Name, Block: blk, Addr: addr})
		}
	}
	return refs
}

// WatchSticky lists every pool's sticky bindings, then follows the
// changes until ctx ends, as WatchHomes does: how an agent learns that a
// live migration of one of its pods was cut over, or its alternate left.
// A deleted binding names only its Pool and Identity.
func (s *Store) WatchSticky(ctx context.Context, h Handler[records.Binding]) error {
	prefix := allStickyPrefix()
	return s.follow(ctx, prefix, decoded[records.Binding]{h: h, decode: func(kv *mvccpb.KeyValue) (records.Binding, bool) {
		v, err := kvstore.Decode[records.Binding](kv)
		if err != nil {
			return records.Binding{}, false
		}
		b := v.Value
		b.Pool, _, _ = strings.Cut(strings.TrimPrefix(string(kv.Key), prefix), "/")
		b.Rev, b.Lease = kv.ModRevision, kv.Lease
		return b, true
	}, fromKey: func(key string) (records.Binding, bool) {
		pool, identity, ok := strings.Cut(strings.TrimPrefix(key, prefix), "/")
		return records.Binding{Pool: pool, Identity: identity}, ok
	}})
}
