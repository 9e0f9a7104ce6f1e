package memstore

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// A live migration's writes (records.Migrations), each one step, as
// etcdstore's are one transaction each. The cluster's schema level is
// not modelled here (every node understands alternates); a node's
// liveness is, through NodeDown.

// NodeDown marks node as having no live record (down is true) or back:
// a migration's admit and cut-over to it are refused meanwhile, as
// etcdstore compares the node's record.
func (s *Store) NodeDown(node string, down bool) {
	s.lock()
	defer s.mu.Unlock()
	if s.down == nil {
		s.down = map[string]bool{}
	}
	s.down[node] = down
}

// migrationOK checks what every migration write compares: the binding
// and each record as read, each record b's owner's.
func (s *Store) migrationOK(what string, b records.Binding, cur []records.Allocation) error {
	if len(cur) == 0 {
		return fmt.Errorf("%w: %s of %s: no address records", records.ErrBadRequest, what, b.Identity)
	}
	if err := checkTxnSize(1+len(cur), 1+2*len(cur)+s.historyOps(len(cur))); err != nil {
		return fmt.Errorf("%s of %s: %w", what, b.Identity, err)
	}
	for _, al := range cur {
		if al.Identity != b.Identity || al.Owner.Key() != b.Owner.Key() || !slices.Contains(b.Addrs, al.Addr) {
			return fmt.Errorf("%s of %s: %s is held by %s, not by the binding's owner: %w", what, b.Identity, al.Addr, al.Owner.Key(), retry.ErrConflict)
		}
	}
	ok := modRev(s.bindings, bindKey{b.Pool, b.Identity}) == b.Rev
	for _, al := range cur {
		ok = ok && s.ips.rev(ik(al.Pool, al.Block, al.Addr)) == al.Rev
	}
	if !ok {
		return fmt.Errorf("%s of %s: the binding or an address record changed meanwhile: %w", what, b.Identity, retry.ErrConflict)
	}
	return nil
}

// Admit implements records.Migrations.
func (s *Store) Admit(_ context.Context, b records.Binding, cur []records.Allocation, alt records.Alternate) (records.Binding, error) {
	s.lock()
	defer s.mu.Unlock()
	switch {
	case b.Kept():
		return records.Binding{}, fmt.Errorf("%w: admit %s: no pod holds %s", records.ErrMigration, alt.Owner.Key(), b.Identity)
	case b.Alternate != nil && !s.down[b.Alternate.Node]:
		return records.Binding{}, fmt.Errorf("%w: admit %s: %s has an alternate already", records.ErrMigration, alt.Owner.Key(), b.Identity)
	}
	if err := records.CoversBinding(b, cur); err != nil {
		return records.Binding{}, fmt.Errorf("admit %s as the alternate of %s: %w", alt.Owner.Key(), b.Identity, err)
	}
	if err := s.migrationOK("admit", b, cur); err != nil {
		return records.Binding{}, err
	}
	if s.down[alt.Node] {
		return records.Binding{}, fmt.Errorf("admit %s: node %s has no live record: %w", alt.Owner.Key(), alt.Node, retry.ErrConflict)
	}
	tx := s.begin()
	for _, al := range cur {
		rec := al.Record
		rec.Alternate = &alt
		s.ips.put(tx, ik(al.Pool, al.Block, al.Addr), rec, 0)
		if old := b.Alternate; old != nil {
			h := al
			h.Owner, h.Node, h.Since = old.Owner, old.Node, old.Since
			s.record(tx, s.historyOf(h, s.now, endAlternateEnded))
		}
	}
	nb := b
	nb.Alternate = &alt
	put(tx, s.bindings, bindKey{b.Pool, b.Identity}, nb, 0)
	nb.Rev = tx.end()
	return nb, nil
}

// CutOver implements records.Migrations.
func (s *Store) CutOver(_ context.Context, b records.Binding, cur []records.Allocation, keepOld bool) (records.Binding, error) {
	s.lock()
	defer s.mu.Unlock()
	alt := b.Alternate
	if alt == nil {
		return records.Binding{}, fmt.Errorf("%w: cut over %s: no alternate", records.ErrMigration, b.Identity)
	}
	if err := s.migrationOK("cut over", b, cur); err != nil {
		return records.Binding{}, err
	}
	if s.down[alt.Node] {
		return records.Binding{}, fmt.Errorf("cut over %s: node %s: %w", b.Identity, alt.Node, records.ErrAlternateGone)
	}
	for _, al := range cur {
		if _, ok := s.homes[bk(al.Pool, al.Block)]; !ok {
			return records.Binding{}, fmt.Errorf("cut over %s: block %s has no home: %w", b.Identity, al.Block, retry.ErrConflict)
		}
	}
	now := s.now.UTC()
	var old *records.Alternate
	if keepOld {
		old = &records.Alternate{Owner: b.Owner, Node: b.Node, Since: now, Migration: alt.Migration}
	}
	tx := s.begin()
	for _, al := range cur {
		rec := al.Record
		rec.Owner, rec.Node, rec.State, rec.Since, rec.Alternate = alt.Owner, alt.Node, records.StateAllocated, now, old
		rec.Borrowed = dec[records.Home](s.homes[bk(al.Pool, al.Block)]).Node != alt.Node
		s.ips.put(tx, ik(al.Pool, al.Block, al.Addr), rec, 0)
		k := addrKey{al.Pool, al.Addr}
		if rec.Borrowed {
			put(tx, s.lent, k, s.lentHome(k, alt.Node, now), 0)
		} else {
			del(tx, s.lent, k)
		}
		s.record(tx, s.historyOf(al, s.now, endMigrated))
	}
	nb := b
	nb.Owner, nb.Node, nb.Since, nb.Alternate = alt.Owner, alt.Node, now, old
	put(tx, s.bindings, bindKey{b.Pool, b.Identity}, nb, 0)
	nb.Rev = tx.end()
	return nb, nil
}

// DropAlternate implements records.Migrations.
func (s *Store) DropAlternate(_ context.Context, b records.Binding, cur []records.Allocation) (records.Binding, error) {
	s.lock()
	defer s.mu.Unlock()
	alt := b.Alternate
	if alt == nil {
		return b, nil
	}
	if err := s.migrationOK("drop the alternate", b, cur); err != nil {
		return records.Binding{}, err
	}
	tx := s.begin()
	nb := s.dropAlternate(tx, b, cur, endAlternateEnded)
	nb.Rev = tx.end()
	return nb, nil
}

// dropAlternate writes b and the records of cur without b's alternate,
// and the alternate's interval on each address to history, ended for
// reason; it returns the binding written.
func (s *Store) dropAlternate(tx *batch, b records.Binding, cur []records.Allocation, reason string) records.Binding {
	alt := b.Alternate
	for _, al := range cur {
		rec := al.Record
		rec.Alternate = nil
		s.ips.put(tx, ik(al.Pool, al.Block, al.Addr), rec, 0)
		h := al
		h.Owner, h.Node, h.Since = alt.Owner, alt.Node, alt.Since
		s.record(tx, s.historyOf(h, s.now, reason))
	}
	nb := b
	nb.Alternate = nil
	put(tx, s.bindings, bindKey{b.Pool, b.Identity}, nb, 0)
	return nb
}
