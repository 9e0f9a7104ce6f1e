package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// EnsurePool implements allocator.Store. The pool is written only if no
// pool changed since the pools were read, so two pools with overlapping
// CIDRs cannot be created at once: overlapping pools would hand the same
// address out twice, once under each pool's keys.
//
// An existing pool keeps what operators set with kvipamctl: p's reserved
// ranges are added to the stored ones, and its disabled flag stays.
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
			p = mergeStored(v.Value, p)
			if err := allocator.CheckPoolUpdate(v.Value, p); err != nil {
				return err
			}
			if poolEqual(v.Value, p) {
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

// mergeStored is p as a configuration asks for it, keeping what the
// stored pool has that configuration does not manage.
func mergeStored(stored, p allocator.Pool) allocator.Pool {
	p.Disabled = stored.Disabled
	res := slices.Clone(stored.Reserved)
	for _, r := range p.Reserved {
		if !slices.ContainsFunc(res, func(x allocator.Reservation) bool { return x.Range == r.Range }) {
			res = append(res, r)
		}
	}
	p.Reserved = res
	return p
}

func poolEqual(a, b allocator.Pool) bool {
	return a.Name == b.Name && a.BlockSizeV4 == b.BlockSizeV4 && a.BlockSizeV6 == b.BlockSizeV6 &&
		slices.Equal(a.CIDRs, b.CIDRs) && slices.Equal(a.Reserved, b.Reserved) && a.Disabled == b.Disabled
}

// GetPool implements allocator.Store.
func (s *Store) GetPool(ctx context.Context, name string) (allocator.Pool, error) {
	v, err := kvstore.GetJSON[allocator.Pool](ctx, s.kv, PoolKey(name))
	if errors.Is(err, kvstore.ErrNotFound) {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	v.Value.Rev = v.ModRevision
	return v.Value, err
}

// ListPools implements allocator.Store.
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
