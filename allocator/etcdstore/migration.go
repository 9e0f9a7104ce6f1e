package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// A live migration's three writes (records.Migrations). Each rewrites the
// sticky binding and the records of its addresses from what was read,
// comparing every one at its revision, in one transaction: the binding
// and the records never disagree on who the alternate is, or who
// forwards.

// migrationGuards are the compares every migration write makes: the
// binding and each record as read, each record still of b's identity.
func migrationGuards(b records.Binding, cur []records.Allocation) ([]clientv3.Cmp, error) {
	if len(cur) == 0 {
		return nil, fmt.Errorf("%w: migration of %s: no address records", records.ErrBadRequest, b.Identity)
	}
	cmps := []clientv3.Cmp{kvstore.Unchanged(BindingKey(b.Pool, b.Identity), b.Rev)}
	for _, al := range cur {
		if al.Identity != b.Identity || al.Owner.Key() != b.Owner.Key() || !slices.Contains(b.Addrs, al.Addr) {
			return nil, fmt.Errorf("migration of %s: %s is held by %s (identity %q), not by the binding's owner %s: %w",
				b.Identity, al.Addr, al.Owner.Key(), al.Identity, b.Owner.Key(), retry.ErrConflict)
		}
		cmps = append(cmps, kvstore.Unchanged(IPKey(al.Pool, al.Block, al.Addr), al.Rev))
	}
	return cmps, nil
}

// commitMigration commits puts under cmps with the history records of
// ended, and returns the binding as written (its revision the commit's).
func (s *Store) commitMigration(ctx context.Context, what string, nb records.Binding, cmps []clientv3.Cmp, puts []clientv3.Op, ended []HistoryRecord) (records.Binding, error) {
	val, err := kvstore.EncodeJSON(nb)
	if err != nil {
		return records.Binding{}, err
	}
	puts = append(puts, clientv3.OpPut(BindingKey(nb.Pool, nb.Identity), val))
	var resp *clientv3.TxnResponse
	err = s.hist.Commit(ctx, ended, func(hist []clientv3.Op) (err error) {
		resp, err = s.kv.Txn(ctx).If(cmps...).Then(append(slices.Clip(puts), hist...)...).Commit()
		return err
	})
	if err != nil {
		return records.Binding{}, fmt.Errorf("%s of %s: %w", what, nb.Identity, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return records.Binding{}, fmt.Errorf("%s of %s: the binding, an address record or the node changed meanwhile: %w", what, nb.Identity, retry.ErrConflict)
	}
	nb.Rev = resp.Header.Revision
	return nb, nil
}

// putRecord is the put of al's key with rec.
func putRecord(al records.Allocation, rec records.Record) (clientv3.Op, error) {
	val, err := kvstore.EncodeJSON(rec)
	if err != nil {
		return clientv3.Op{}, err
	}
	return clientv3.OpPut(IPKey(al.Pool, al.Block, al.Addr), val), nil
}

// Admit implements records.Migrations.
func (s *Store) Admit(ctx context.Context, b records.Binding, cur []records.Allocation, alt records.Alternate) (records.Binding, error) {
	if b.Kept() {
		return records.Binding{}, fmt.Errorf("%w: admit %s as the alternate of %s: no pod holds the identity (take it over)", records.ErrMigration, alt.Owner.Key(), b.Identity)
	}
	var ended []HistoryRecord
	var away clientv3.Cmp
	if old := b.Alternate; old != nil {
		// An earlier migration's target on a node with no live record
		// (gone with its pod, without a DEL) gives way; a live one is a
		// migration in progress.
		resp, err := s.kv.Get(ctx, NodeKey(old.Node), clientv3.WithCountOnly())
		if err != nil {
			return records.Binding{}, fmt.Errorf("admit %s: read node %s: %w", alt.Owner.Key(), old.Node, kvstore.Unavailable(err))
		}
		if resp.Count > 0 {
			return records.Binding{}, fmt.Errorf("%w: admit %s as the alternate of %s: %s (node %s) is its alternate already",
				records.ErrMigration, alt.Owner.Key(), b.Identity, old.Owner.Key(), old.Node)
		}
		away = kvstore.Absent(NodeKey(old.Node))
		for _, al := range cur {
			ended = append(ended, HistoryRecord{Pool: al.Pool, IP: al.Addr.String(), Owner: old.Owner, Node: old.Node,
				Start: old.Since.UTC(), End: s.now().UTC(), Reason: EndAlternateEnded})
		}
	}
	set, err := s.ReadSchema(ctx)
	if err != nil {
		return records.Binding{}, err
	}
	if need := schema.MigrationNeeds(); set.Level < need {
		why := "the agents have not raised it yet: a node runs a version that does not know it"
		if set.Downgrade {
			why = "a downgrade holds it (kvipamctl downgrade cancel)"
		}
		return records.Binding{}, fmt.Errorf("%w: live migration of %s needs %s (level %d), and the cluster runs at level %d: %s",
			ErrSchemaLevel, b.Identity, schema.MigrationOwner, need, set.Level, why)
	}
	if err := records.CoversBinding(b, cur); err != nil {
		return records.Binding{}, fmt.Errorf("admit %s as the alternate of %s: %w", alt.Owner.Key(), b.Identity, err)
	}
	cmps, err := migrationGuards(b, cur)
	if err != nil {
		return records.Binding{}, err
	}
	// The alternate's node is live: its agent watches for the guest.
	cmps = append(cmps, settingUnchanged(set), kvstore.Exists(NodeKey(alt.Node)))
	if ended != nil {
		cmps = append(cmps, away)
	}
	var puts []clientv3.Op
	for _, al := range cur {
		rec := al.Record
		rec.Alternate = &alt
		op, err := putRecord(al, rec)
		if err != nil {
			return records.Binding{}, err
		}
		puts = append(puts, op)
	}
	nb := b
	nb.Alternate = &alt
	return s.commitMigration(ctx, "admit a live migration's target", nb, cmps, puts, ended)
}

// CutOver implements records.Migrations.
func (s *Store) CutOver(ctx context.Context, b records.Binding, cur []records.Allocation, keepOld bool) (records.Binding, error) {
	alt := b.Alternate
	if alt == nil {
		return records.Binding{}, fmt.Errorf("%w: cut over %s: no migration in progress (no alternate)", records.ErrMigration, b.Identity)
	}
	cmps, err := migrationGuards(b, cur)
	if err != nil {
		return records.Binding{}, err
	}
	// Where each address routes after: a block the new node is home of
	// routes it there already; any other address gets a home of its own
	// naming the new node, as a borrowed one has. The homes read are
	// compared, and a lent home is rewritten from the one read.
	var keys []string
	for _, al := range cur {
		keys = append(keys, HomeKey(al.Pool, al.Block), LentKey(al.Pool, al.Addr))
	}
	got, _, err := s.getKeys(ctx, keys)
	if err != nil {
		return records.Binding{}, fmt.Errorf("cut over %s: read homes: %w", b.Identity, err)
	}
	now := s.now().UTC()
	cmps = append(cmps, kvstore.Exists(NodeKey(alt.Node)))
	var puts []clientv3.Op
	var ended []HistoryRecord
	var old *records.Alternate
	if keepOld {
		old = &records.Alternate{Owner: b.Owner, Node: b.Node, Since: now, Migration: alt.Migration}
	}
	for _, al := range cur {
		hk, lk := HomeKey(al.Pool, al.Block), LentKey(al.Pool, al.Addr)
		home := got[hk]
		if home == nil {
			return records.Binding{}, fmt.Errorf("cut over %s: block %s of %s has no home (released): %w", b.Identity, al.Block, al.Addr, retry.ErrConflict)
		}
		cmps = append(cmps, kvstore.Unchanged(hk, home.ModRevision))
		h, err := kvstore.Decode[records.Home](home)
		if err != nil {
			return records.Binding{}, err
		}
		rec := al.Record
		rec.Owner, rec.Node, rec.State, rec.Since, rec.Alternate = alt.Owner, alt.Node, records.StateAllocated, now, old
		rec.Borrowed = h.Value.Node != alt.Node
		op, err := putRecord(al, rec)
		if err != nil {
			return records.Binding{}, err
		}
		puts = append(puts, op)
		if rec.Borrowed {
			var lent records.Home
			if kv := got[lk]; kv != nil {
				if v, err := kvstore.Decode[records.Home](kv); err == nil {
					lent = v.Value
				}
			}
			lent.Node, lent.Since = alt.Node, now
			val, err := kvstore.EncodeJSON(lent)
			if err != nil {
				return records.Binding{}, err
			}
			puts = append(puts, clientv3.OpPut(lk, val))
		} else {
			puts = append(puts, clientv3.OpDelete(lk))
		}
		ended = append(ended, HistoryOf(al, now, EndMigrated))
	}
	nb := b
	nb.Owner, nb.Node, nb.Since, nb.Alternate = alt.Owner, alt.Node, now, old
	out, err := s.commitMigration(ctx, "cut over", nb, cmps, puts, ended)
	if errors.Is(err, retry.ErrConflict) {
		if resp, gerr := s.kv.Get(ctx, NodeKey(alt.Node), clientv3.WithCountOnly()); gerr == nil && resp.Count == 0 {
			return records.Binding{}, fmt.Errorf("cut over %s to %s: node %s: %w", b.Identity, alt.Owner.Key(), alt.Node, records.ErrAlternateGone)
		}
	}
	return out, err
}

// DropAlternate implements records.Migrations.
func (s *Store) DropAlternate(ctx context.Context, b records.Binding, cur []records.Allocation) (records.Binding, error) {
	if b.Alternate == nil {
		return b, nil
	}
	cmps, err := migrationGuards(b, cur)
	if err != nil {
		return records.Binding{}, err
	}
	nb, puts, ended, err := alternateDropped(b, cur, s.now(), EndAlternateEnded)
	if err != nil {
		return records.Binding{}, err
	}
	return s.commitMigration(ctx, "drop the alternate", nb, cmps, puts, ended)
}

// alternateDropped is the write that ends b's alternate: the puts of the
// records of cur without it (the binding's own put is the caller's), the
// binding without it, and the second owner's interval on each address,
// as IP history shows it, ended at now for reason.
func alternateDropped(b records.Binding, cur []records.Allocation, now time.Time, reason string) (records.Binding, []clientv3.Op, []HistoryRecord, error) {
	alt := b.Alternate
	var puts []clientv3.Op
	var ended []HistoryRecord
	for _, al := range cur {
		rec := al.Record
		rec.Alternate = nil
		op, err := putRecord(al, rec)
		if err != nil {
			return records.Binding{}, nil, nil, err
		}
		puts = append(puts, op)
		ended = append(ended, HistoryRecord{Pool: al.Pool, IP: al.Addr.String(), Owner: alt.Owner, Node: alt.Node,
			Start: alt.Since.UTC(), End: now.UTC(), Reason: reason})
	}
	nb := b
	nb.Alternate = nil
	return nb, puts, ended, nil
}

// CutOverIdentity is an operator's cut-over (kvipamctl ip migrate
// --cut-over): identity's alternate in pool becomes the owner its
// addresses route to, the former owner its alternate until its DEL. It
// reads the binding and the records afresh after a lost race.
func (s *Store) CutOverIdentity(ctx context.Context, pool, identity string) (records.Binding, error) {
	var out records.Binding
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		b, ok, err := s.GetBinding(ctx, pool, identity)
		switch {
		case err != nil:
			return err
		case !ok:
			return fmt.Errorf("sticky identity %s in pool %s: %w", identity, pool, records.ErrNotFound)
		case b.Alternate == nil:
			return fmt.Errorf("%w: sticky identity %s has no migration in progress (no alternate); kvipamctl claim show %s --pool %s", records.ErrMigration, identity, identity, pool)
		}
		p, err := s.GetPool(ctx, pool)
		if err != nil {
			return err
		}
		refs := bindingRefs(p, b)
		got, err := s.GetIPs(ctx, refs)
		if err != nil {
			return err
		}
		var cur []records.Allocation
		for _, r := range refs {
			if al, ok := got[r.Addr]; ok {
				cur = append(cur, al)
			}
		}
		out, err = s.CutOver(ctx, b, cur, true)
		return err
	})
	return out, err
}
