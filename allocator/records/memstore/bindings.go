package memstore

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// GetBinding implements records.Store.
func (s *Store) GetBinding(_ context.Context, pool, identity string) (records.Binding, bool, error) {
	s.lock()
	defer s.mu.Unlock()
	key := bindKey{pool, identity}
	if _, ok := s.bindings[key]; !ok {
		return records.Binding{}, false, nil
	}
	return s.binding(key), true, nil
}

func (s *Store) binding(k bindKey) records.Binding {
	e := s.bindings[k]
	b := dec[records.Binding](e)
	b.Pool, b.Rev, b.Lease = k.pool, e.rev, e.lease
	return b
}

// ListBindings implements records.Store ("" for every pool), in
// etcdstore's key order.
func (s *Store) ListBindings(_ context.Context, pool string) ([]records.Binding, error) {
	s.lock()
	defer s.mu.Unlock()
	var keys []bindKey
	for k := range s.bindings {
		if pool == "" || k.pool == pool {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].pool+"/"+keys[i].identity < keys[j].pool+"/"+keys[j].identity })
	var out []records.Binding
	for _, k := range keys {
		out = append(out, s.binding(k))
	}
	return out, nil
}

// WriteBound implements records.Store: writes and b (no lease) in one
// step, if the binding is still at b.Rev (absent when 0).
func (s *Store) WriteBound(_ context.Context, b records.Binding, writes []records.IPWrite) (records.WriteResult, error) {
	s.lock()
	defer s.mu.Unlock()
	key := bindKey{b.Pool, b.Identity}
	var ended []histRec
	for _, w := range writes {
		if w.Ends != nil {
			ended = append(ended, s.historyOf(*w.Ends, s.now, endTakenOver))
		}
	}
	return s.writeIPs(writes,
		func() bool { return modRev(s.bindings, key) == b.Rev },
		func(tx *batch) { put(tx, s.bindings, key, b, 0) },
		ended...)
}

// Keep implements records.Store: als become kept records of b's
// identity and b a kept binding, on a new lease of b's window, if b and
// every allocation are unchanged.
func (s *Store) Keep(_ context.Context, b records.Binding, als []records.Allocation) (time.Time, error) {
	s.lock()
	defer s.mu.Unlock()
	window := b.Window()
	lease := s.grant(window)
	end := s.now.Add(window)
	key := bindKey{b.Pool, b.Identity}
	ops := 1 + len(als) + s.historyOps(len(als))
	for _, al := range als {
		if al.Borrowed {
			ops++
		}
	}
	if err := checkTxnSize(1+len(als), ops); err != nil {
		// etcdstore leaves the window's lease to expire, holding nothing.
		return time.Time{}, fmt.Errorf("keep %s: %w", b.Identity, err)
	}
	ok := modRev(s.bindings, key) == b.Rev
	for _, al := range als {
		ok = ok && s.ips.rev(ik(al.Pool, al.Block, al.Addr)) == al.Rev
	}
	if !ok {
		s.revoke(lease)
		return time.Time{}, fmt.Errorf("keep %s: binding or allocation changed: %w", b.Identity, retry.ErrConflict)
	}
	tx := s.begin()
	now := s.now.UTC()
	for _, al := range als {
		rec := al.Record // rewritten from the record read, as etcdstore does
		rec.Owner = records.Owner{Namespace: al.Namespace, Pod: al.Pod, Network: al.Network}
		rec.State, rec.Since, rec.Identity, rec.WindowSeconds, rec.Alternate = records.StateKept, now, b.Identity, 0, nil
		s.ips.put(tx, ik(al.Pool, al.Block, al.Addr), rec, lease)
		if al.Borrowed {
			put(tx, s.lent, addrKey{al.Pool, al.Addr}, s.lentHome(addrKey{al.Pool, al.Addr}, al.Node, now), lease)
		}
	}
	kept := b
	kept.Owner, kept.Node, kept.Since, kept.Alternate = records.Owner{}, "", now, nil
	put(tx, s.bindings, key, kept, lease)
	for _, al := range als {
		s.record(tx, s.historyOf(al, s.now, endKept))
	}
	tx.end()
	return end, nil
}

// DropStaleBinding implements records.Store.
func (s *Store) DropStaleBinding(_ context.Context, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	s.lock()
	defer s.mu.Unlock()
	key := bindKey{b.Pool, b.Identity}
	if err := checkTxnSize(1+len(refs), 1); err != nil {
		return fmt.Errorf("drop stale binding of %s: %w", b.Identity, err)
	}
	ok := modRev(s.bindings, key) == b.Rev
	for _, ref := range refs {
		ok = ok && s.ips.rev(ik(ref.Pool, ref.Block, ref.Addr)) == cur[ref.Addr].Rev // absent: 0
	}
	if !ok {
		return fmt.Errorf("drop stale binding of %s: changed meanwhile: %w", b.Identity, retry.ErrConflict)
	}
	tx := s.begin()
	del(tx, s.bindings, key)
	tx.end()
	return nil
}
