package nodealloc

import (
	"context"
	"errors"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// claimBlock claims one more block of family f for this node. It tries
// the candidates of the node's block walk until one claim transaction
// succeeds. It does not read the pool's claims first: the node learned
// them at restore, and learns every block taken since from the claim that
// loses its race to it (which marks the block taken, so the loop makes
// progress; it has no attempt budget). Only when no candidate is left
// does it read the claims once more (a block may have been freed, or a
// race that said "changed concurrently" may have been transient), and it
// reports the pool exhausted only if that read leaves nothing to try. A
// claim of unknown outcome leaves its block neither own nor taken, so the
// walk stays on it and the next claim tries it again first: a claim found
// to be this node's own, on its lease, is adopted. No read of every claim
// is needed, which matters most when etcd is slow enough that many claims
// time out at once. The caller's context bounds the whole.
//
// first, if set, is the record of the request the block is claimed for:
// the claim writes it at the block's first free address in its own
// transaction (records.Claim.First), and written is that allocation.
func (a *Allocator) claimBlock(ctx context.Context, ps *poolState, f allocator.Family, first *records.Record) (b netip.Prefix, written *records.Allocation, err error) {
	fresh := false                // others was read since the last lost race
	if b, ok := ps.roomy(f); ok { // an adopted claim whose answer was lost
		return b, nil, nil
	}
	var got netip.Prefix
	err = retry.Do(ctx, a.cfg.ClaimRetry, func(ctx context.Context) error {
		cand, ok := ps.chooseBlock(a.cfg.Node, f)
		if !ok && !fresh {
			if err := a.refreshOthers(ctx, ps); err != nil {
				return err
			}
			fresh = true
			if b, ok := ps.roomy(f); ok {
				got = b
				return nil
			}
			cand, ok = ps.chooseBlock(a.cfg.Node, f)
		}
		if !ok {
			return ps.exhausted(f)
		}
		al, err := a.tryClaim(ctx, ps, cand, first)
		if err != nil {
			fresh = false
			return err
		}
		got, written = cand, al
		return nil
	})
	return got, written, err
}

// claimSpecific claims the block holding a requested static address.
func (a *Allocator) claimSpecific(ctx context.Context, ps *poolState, b netip.Prefix) error {
	_, err := a.tryClaim(ctx, ps, b, nil)
	var ce *records.ClaimError
	if errors.As(err, &ce) {
		return errors.Join(records.ErrNotOwned, err)
	}
	return err
}

// tryClaim runs one claim transaction for b and, if it wins, makes b an
// own block. A lost race is noted in ps.others and returned. A claim
// found held by this node on its current lease is this node's own
// earlier claim whose answer was lost (an unknown outcome): it is
// adopted, not counted as taken. An allocation lets go of mu while the
// transaction is in etcd (offLock).
//
// first, if set, is written in the claim's transaction at the block's
// first free address, and returned as written. If the claim's outcome is
// unknown that address is parked (settle.go): the owner's next attempt
// reads back whether it landed before anything else is planned for it.
func (a *Allocator) tryClaim(ctx context.Context, ps *poolState, b netip.Prefix, first *records.Record) (*records.Allocation, error) {
	c := a.claimRecord()
	c.PoolRev = ps.pool.Rev
	ba, err := allocator.NewBlockAlloc(ps.pool, b)
	if err != nil {
		return nil, err
	}
	ob := &ownBlock{ba: ba}
	a.markHeld(b, ob) // free in etcd, but an endpoint may still use some
	var w *records.IPWrite
	if first != nil {
		if addr, ok := ba.Next(); ok {
			w = &records.IPWrite{Pool: ps.pool.Name, Block: b, Addr: addr, Record: *first, Reserve: first.State == records.StateReserved}
			c.First = w
		}
	}
	pool, lease := ps.pool.Name, a.lease.ID()
	var res records.WriteResult
	a.offLock(func() { res, err = a.cfg.Store.Claim(ctx, pool, b, c, lease) })
	var ce *records.ClaimError
	if errors.As(err, &ce) && ce.PoolChanged {
		// An operator changed the pool since it was read: read it again
		// (a removed cidr is then not tried again).
		p, perr := a.cfg.Store.GetPool(ctx, ps.pool.Name)
		if perr != nil {
			return nil, perr
		}
		ps.setPool(p)
		return nil, err
	}
	if errors.As(err, &ce) {
		if ce.ClaimedBy == a.cfg.Node && ce.ClaimLease == a.lease.ID() {
			a.log.Info("adopting own claim whose answer was lost", "pool", ps.pool.Name, "block", b, "rev", ce.ClaimRev)
			return nil, a.adoptBlock(ctx, ps, b, ce.ClaimRev)
		}
		ps.noteOther(b, ce.ClaimedBy, ce.NonEmpty)
		if ce.ClaimedBy != "" {
			delete(ps.claimsUnknown, b) // another's: an earlier claim did not land
		}
		return nil, err
	}
	if err != nil {
		if outcomeUnknown(err) {
			// Read back with the parked addresses (settleClaims).
			ps.claimsUnknown[b] = true
		}
		if w != nil && outcomeUnknown(err) {
			a.park(ps, w.Record.Owner.Key(), "claim with first address", records.IPRef{Pool: w.Pool, Block: b, Addr: w.Addr})
		}
		return nil, err
	}
	ob.claimRev = res.Rev
	ps.own[b] = ob
	delete(ps.others, b)
	delete(ps.claimsUnknown, b)
	a.log.Info("claimed block", "pool", ps.pool.Name, "block", b, "rev", res.Rev)
	if w == nil {
		return nil, nil
	}
	ob.ba.Mark(w.Addr)
	al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: b, Addr: w.Addr, Rev: res.Rev, Seen: a.cfg.Now()}
	ps.remember(al, res.Expires)
	a.logAllocated(al)
	return al, nil
}

// refreshOthers re-reads which blocks other nodes hold. A claim of this
// node on its current lease that the node does not know is its own claim
// whose answer was lost; it is adopted. An allocation lets go of mu while
// the listing is in etcd (offLock).
func (a *Allocator) refreshOthers(ctx context.Context, ps *poolState) error {
	pool := ps.pool.Name
	var infos []records.BlockInfo
	var err error
	a.offLock(func() { infos, err = a.cfg.Store.ListBlocks(ctx, pool) })
	if err != nil {
		return err
	}
	prev := ps.others
	ps.others = map[netip.Prefix]otherBlock{}
	for _, info := range infos {
		if _, mine := ps.own[info.Block]; mine {
			continue
		}
		switch {
		case info.Owned(a.cfg.Node) && info.ClaimLease == a.lease.ID():
			a.log.Info("adopting own claim whose answer was lost", "pool", ps.pool.Name, "block", info.Block, "rev", info.ClaimRev)
			if err := a.adoptBlock(ctx, ps, info.Block, info.ClaimRev); err != nil {
				return err
			}
		case info.Claim != nil:
			ps.others[info.Block] = otherBlock{node: info.Claim.Node}
		case info.Home != nil && prev[info.Block].orphaned:
			// A home without a claim is an orphaned block or an expired
			// claim over an empty, free block; only a claim transaction can
			// tell, so keep what the last one said.
			ps.others[info.Block] = prev[info.Block]
		}
	}
	return nil
}

// chooseBlock picks the next block to try: the next block of the node's
// walk (blockwalk.go) that is neither its own nor known to be another's.
// A /32 (or /128) block that is a CIDR's network or broadcast address has
// nothing to hand out and is never claimed.
func (ps *poolState) chooseBlock(node string, f allocator.Family) (netip.Prefix, bool) {
	w := ps.walks[f]
	if w == nil {
		w = allocator.NewBlockWalk(node, ps.pool, f)
		ps.walks[f] = w
	}
	single := (f == allocator.IPv4 && w.Bits() == 32) || (f == allocator.IPv6 && w.Bits() == 128)
	return w.Next(func(b netip.Prefix) bool {
		_, mine := ps.own[b]
		_, other := ps.others[b]
		return mine || other || (single && len(ps.pool.Excluded(b)) > 0)
	})
}
