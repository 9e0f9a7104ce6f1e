package nodealloc

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// claimCandidates is how many blocks one claim transaction tries
// (records.Claims.Claim): in a cold start of thousands of nodes about a
// third of the blocks are being taken, so a node's first choice is lost
// to another's now and then; the next candidates in the same transaction
// cost no round trip of their own.
const claimCandidates = 3

// claimBlock claims one more block of family f for this node. It tries
// the candidates of the node's block walk until one claim transaction
// succeeds. It does not read the pool's claims first: the node learned
// them at restore, and learns every block taken since from the claim that
// passes over it (which marks the block taken, so the loop makes
// progress; it has no attempt budget). Only when no candidate is left
// does it read the claims once more (a block may have been freed, or a
// race that said "changed concurrently" may have been transient), and it
// reports the pool exhausted only if that read leaves nothing to try. A
// claim of unknown outcome leaves its candidates neither own nor taken,
// so the walk stays on them and the next claim tries them again: a
// candidate found claimed on the node's lease is its own earlier claim,
// and is adopted (the transaction then takes nothing else). No read of
// every claim is needed, which matters most when etcd is slow enough
// that many claims time out at once. The caller's context bounds the
// whole.
//
// first, if set, is the record of the request the block is claimed for:
// the claim writes it at the first free address of the block it takes,
// in its own transaction (records.Candidate.First), and written is that
// allocation.
func (a *Allocator) claimBlock(ctx context.Context, ps *poolState, f allocator.Family, first *records.Record) (b netip.Prefix, written *records.Allocation, err error) {
	fresh := false                // others was read since the last lost race
	if b, ok := ps.roomy(f); ok { // an adopted claim whose answer was lost
		return b, nil, nil
	}
	var got netip.Prefix
	err = retry.Do(ctx, a.cfg.ClaimRetry, func(ctx context.Context) error {
		cands := ps.chooseBlocks(a.cfg.Node, f, claimCandidates)
		if len(cands) == 0 && !fresh {
			if err := a.refreshOthers(ctx, ps); err != nil {
				return err
			}
			fresh = true
			if b, ok := ps.roomy(f); ok {
				got = b
				return nil
			}
			cands = ps.chooseBlocks(a.cfg.Node, f, claimCandidates)
		}
		if len(cands) == 0 {
			return ps.exhausted(f)
		}
		b, al, err := a.tryClaim(ctx, ps, cands, first)
		if err != nil {
			fresh = false
			return err
		}
		got, written = b, al
		return nil
	})
	return got, written, err
}

// claimSpecific claims the block holding a requested static address.
func (a *Allocator) claimSpecific(ctx context.Context, ps *poolState, b netip.Prefix) error {
	_, _, err := a.tryClaim(ctx, ps, []netip.Prefix{b}, nil)
	var ce *records.ClaimError
	if errors.As(err, &ce) {
		return errors.Join(records.ErrNotOwned, err)
	}
	return err
}

// tryClaim runs one claim transaction for the candidate blocks and, if it
// takes one, makes it an own block. Every candidate passed over is noted
// in ps.others. A candidate found held by this node on its current lease
// is this node's own earlier claim whose answer was lost (an unknown
// outcome): it is adopted, not counted as taken, and returned if the
// transaction took nothing else. An allocation lets go of mu while the
// transaction is in etcd (offLock).
//
// first, if set, is written in the claim's transaction at the taken
// block's first free address, and returned as written. If the claim's
// outcome is unknown each candidate's address is parked (settle.go): the
// owner's next attempt reads back whether one landed before anything else
// is planned for it.
func (a *Allocator) tryClaim(ctx context.Context, ps *poolState, blocks []netip.Prefix, first *records.Record) (netip.Prefix, *records.Allocation, error) {
	c := a.claimRecord()
	c.PoolRev = ps.pool.Rev
	cands := make([]records.Candidate, len(blocks))
	obs := make([]*ownBlock, len(blocks))
	for i, b := range blocks {
		ba, err := allocator.NewBlockAlloc(ps.pool, b)
		if err != nil {
			return netip.Prefix{}, nil, err
		}
		obs[i] = &ownBlock{ba: ba}
		a.markHeld(b, obs[i]) // free in etcd, but an endpoint may still use some
		cands[i].Block = b
		if first == nil {
			continue
		}
		if addr, ok := ba.Next(); ok {
			cands[i].First = &records.IPWrite{Pool: ps.pool.Name, Block: b, Addr: addr, Record: *first}
		}
	}
	pool, lease := ps.pool.Name, a.lease.ID()
	var res records.ClaimResult
	var err error
	a.offLock(func() { res, err = a.cfg.Store.Claim(ctx, pool, cands, c, lease) })
	var adopted netip.Prefix
	for _, ce := range res.Lost {
		switch {
		case ce.PoolChanged:
			// An operator changed the pool since it was read: read it
			// again (a removed cidr is then not tried again). Every
			// candidate was refused for it.
			p, perr := a.cfg.Store.GetPool(ctx, ps.pool.Name)
			if perr != nil {
				return netip.Prefix{}, nil, perr
			}
			ps.setPool(p)
			return netip.Prefix{}, nil, err
		case ce.ClaimedBy == a.cfg.Node && ce.ClaimLease == lease:
			a.log.Info("adopting own claim whose answer was lost", "pool", ps.pool.Name, "block", ce.Block, "rev", ce.ClaimRev)
			if aerr := a.adoptBlock(ctx, ps, ce.Block, ce.ClaimRev); aerr != nil {
				return netip.Prefix{}, nil, aerr
			}
			if !adopted.IsValid() {
				adopted = ce.Block
			}
		default:
			ps.noteOther(ce.Block, ce.ClaimedBy, ce.NonEmpty)
		}
	}
	if err != nil {
		if adopted.IsValid() {
			return adopted, nil, nil
		}
		if first != nil && outcomeUnknown(err) {
			for _, cand := range cands {
				if w := cand.First; w != nil {
					a.park(ps, w.Record.Owner.Key(), "claim with first address", records.IPRef{Pool: w.Pool, Block: w.Block, Addr: w.Addr})
				}
			}
		}
		return netip.Prefix{}, nil, err
	}
	b, ob, w := blocks[res.Won], obs[res.Won], cands[res.Won].First
	ob.claimRev = res.Rev
	ps.own[b] = ob
	delete(ps.others, b)
	a.log.Info("claimed block", "pool", ps.pool.Name, "block", b, "rev", res.Rev)
	if w == nil {
		return b, nil, nil
	}
	ob.ba.Mark(w.Addr)
	al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: b, Addr: w.Addr, Rev: res.Rev, Seen: time.Now()}
	ps.remember(al, time.Time{})
	a.logAllocated(al)
	return b, al, nil
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

// chooseBlocks picks up to k blocks to try, in order: the next blocks
// of the node's walk (blockwalk.go) that are neither its own nor known
// to be another's. A /32 (or /128) block that is a CIDR's network or
// broadcast address has nothing to hand out and is never claimed.
func (ps *poolState) chooseBlocks(node string, f allocator.Family, k int) []netip.Prefix {
	w := ps.walks[f]
	if w == nil {
		w = allocator.NewBlockWalk(node, ps.pool, f)
		ps.walks[f] = w
	}
	single := (f == allocator.IPv4 && w.Bits() == 32) || (f == allocator.IPv6 && w.Bits() == 128)
	return w.Candidates(k, func(b netip.Prefix) bool {
		_, mine := ps.own[b]
		_, other := ps.others[b]
		return mine || other || (single && len(ps.pool.Excluded(b)) > 0)
	})
}
