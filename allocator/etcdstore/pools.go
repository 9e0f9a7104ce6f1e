package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// EnsurePool implements records.Store. The pool is written only if no
// pool changed since the pools were read, so two pools with overlapping
// CIDRs cannot be created at once: overlapping pools would hand the same
// address out twice, once under each pool's keys.
//
// An existing pool keeps what operators set with kvipamctl: p's reserved
// ranges are added to the stored ones, its disabled flag and draining
// cidrs stay, and so do its node selector, reuse cooldown and masquerade
// unless p gives them.
func (s *Store) EnsurePool(ctx context.Context, p allocator.Pool) (allocator.Pool, error) {
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, err
	}
	var out allocator.Pool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		pools, rev, err := kvstore.ListJSON[allocator.Pool](ctx, s.kv, PoolsPrefix())
		if err != nil {
			return err
		}
		p := p
		var others []allocator.Pool
		for _, v := range pools {
			if v.Value.Name != p.Name {
				others = append(others, v.Value)
				continue
			}
			p = allocator.MergeConfigured(v.Value, p)
			if err := allocator.CheckPoolUpdate(v.Value, p); err != nil {
				return err
			}
			if allocator.SameSpec(v.Value, p) {
				out = v.Value
				out.Rev = v.ModRevision
				return nil
			}
		}
		if err := allocator.CheckDisjoint(p, others); err != nil {
			return err
		}
		return s.putPool(ctx, p, rev, &out)
	})
	return out, err
}

// SeedPool creates p if etcd has no pool of its name (create-if-absent),
// and otherwise writes nothing: a pool lives in etcd, and an agent's
// configuration only seeds it. It returns the stored pool and whether
// this call created it; the caller compares the two to warn of a
// configuration that differs from etcd. A pool an operator deleted
// (DeletedPoolKey) is not created again: that wraps ErrPoolDeleted.
// Creation is refused if p overlaps another pool; it is written only if
// no pool changed since the pools were read and the pool has not been
// deleted meanwhile, so two seeds of overlapping pools cannot both land.
func (s *Store) SeedPool(ctx context.Context, p allocator.Pool) (stored allocator.Pool, created bool, err error) {
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, false, err
	}
	err = retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		pools, rev, err := kvstore.ListJSON[allocator.Pool](ctx, s.kv, PoolsPrefix())
		if err != nil {
			return err
		}
		var others []allocator.Pool
		for _, v := range pools {
			if v.Value.Name == p.Name {
				stored, created = v.Value, false
				stored.Rev = v.ModRevision
				return nil
			}
			others = append(others, v.Value)
		}
		mark, err := kvstore.GetJSON[DeletedPool](ctx, s.kv, DeletedPoolKey(p.Name))
		switch {
		case err == nil:
			return fmt.Errorf("seed pool %s: %w at %s (kvipamctl pool create makes it again)", p.Name, ErrPoolDeleted, mark.Value.DeletedAt.Format(time.RFC3339))
		case !errors.Is(err, kvstore.ErrNotFound):
			return err
		}
		if err := allocator.CheckDisjoint(p, others); err != nil {
			return err
		}
		val, err := kvstore.EncodeJSON(p)
		if err != nil {
			return err
		}
		gate, err := s.poolGate(ctx, p)
		if err != nil {
			return err
		}
		resp, err := s.kv.Txn(ctx).
			If(append(gate, clientv3.Compare(clientv3.ModRevision(PoolsPrefix()), "<", rev+1).WithPrefix(),
				clientv3.Compare(clientv3.Version(DeletedPoolKey(p.Name)), "=", 0))...).
			Then(clientv3.OpPut(PoolKey(p.Name), val)).
			Commit()
		if err != nil {
			return fmt.Errorf("seed pool %s: %w", p.Name, kvstore.Unavailable(err))
		}
		if !resp.Succeeded {
			return fmt.Errorf("seed pool %s: pools changed: %w", p.Name, retry.ErrConflict)
		}
		stored, created = p, true
		stored.Rev = resp.Header.Revision
		return nil
	})
	return stored, created, err
}

// ErrPoolDeleted is returned by SeedPool for a pool an operator deleted.
var ErrPoolDeleted = errors.New("pool deleted by an operator")

// GetPool implements records.Store.
func (s *Store) GetPool(ctx context.Context, name string) (allocator.Pool, error) {
	v, err := kvstore.GetJSON[allocator.Pool](ctx, s.kv, PoolKey(name))
	if errors.Is(err, kvstore.ErrNotFound) {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	v.Value.Rev = v.ModRevision
	return v.Value, err
}

// ListPools implements records.Store.
func (s *Store) ListPools(ctx context.Context) ([]allocator.Pool, error) {
	vs, _, err := kvstore.ListJSON[allocator.Pool](ctx, s.kv, PoolsPrefix())
	if err != nil {
		return nil, err
	}
	out := make([]allocator.Pool, len(vs))
	for i, v := range vs {
		out[i] = v.Value
		out[i].Rev = v.ModRevision
	}
	return out, nil
}
