package memstore

import (
	"context"
	"fmt"
	"sort"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// GetPool implements records.Store.
func (s *Store) GetPool(_ context.Context, name string) (allocator.Pool, error) {
	s.lock()
	defer s.mu.Unlock()
	e, ok := s.pools[name]
	if !ok {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	p := dec[allocator.Pool](e)
	p.Rev = e.rev
	return p, nil
}

// ListPools implements records.Store, in name order.
func (s *Store) ListPools(_ context.Context) ([]allocator.Pool, error) {
	s.lock()
	defer s.mu.Unlock()
	return s.listPools(), nil
}

func (s *Store) listPools() []allocator.Pool {
	out := make([]allocator.Pool, 0, len(s.pools))
	for _, e := range s.pools {
		p := dec[allocator.Pool](e)
		p.Rev = e.rev
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// EnsurePool implements records.Store as etcdstore does: the stored
// pool keeps what operators set (allocator.MergeConfigured), the update must pass
// CheckPoolUpdate, and the pool must overlap no other.
func (s *Store) EnsurePool(_ context.Context, p allocator.Pool) (allocator.Pool, error) {
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, err
	}
	s.lock()
	defer s.mu.Unlock()
	var others []allocator.Pool
	for _, v := range s.listPools() {
		if v.Name != p.Name {
			others = append(others, v)
			continue
		}
		stored := v
		stored.Rev = 0
		p = allocator.MergeConfigured(stored, p)
		if err := allocator.CheckPoolUpdate(stored, p); err != nil {
			return allocator.Pool{}, err
		}
		if allocator.SameSpec(stored, p) {
			return v, nil
		}
	}
	if err := allocator.CheckDisjoint(p, others); err != nil {
		return allocator.Pool{}, err
	}
	return s.putPool(p), nil
}

// SeedPool implements records.Store: create-if-absent; a pool an
// operator deleted (DeletePool) is not created again: that wraps
// ErrPoolDeleted, as etcdstore's.
func (s *Store) SeedPool(_ context.Context, p allocator.Pool) (allocator.Pool, bool, error) {
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, false, err
	}
	s.lock()
	defer s.mu.Unlock()
	var others []allocator.Pool
	for _, v := range s.listPools() {
		if v.Name == p.Name {
			return v, false, nil
		}
		others = append(others, v)
	}
	if s.deleted[p.Name] {
		return allocator.Pool{}, false, fmt.Errorf("seed pool %s: %w", p.Name, ErrPoolDeleted)
	}
	if err := allocator.CheckDisjoint(p, others); err != nil {
		return allocator.Pool{}, false, err
	}
	b := s.begin()
	put(b, s.pools, p.Name, p, 0)
	p.Rev = b.end()
	return p, true, nil
}
