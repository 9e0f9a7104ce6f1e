package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Restore rebuilds the node's state from the store on lease, for every
// pool the store holds (whatever the pools' selectors: the node may hold
// addresses in a pool that no longer chooses it): it re-claims
// every block whose home is this node (orphaned blocks, and claims left on
// an earlier lease of this node), and reads their allocations, one range
// read per block. No allocation is changed; a sticky binding that names a
// container of this node holding none of its addresses is dropped
// (sweepBindings). Call it at start and after the lease was lost and a new
// one granted.
//
// Restore fails, and the allocator refuses to allocate or release, if a
// block of this node that holds allocations cannot be re-claimed: serving
// without it would forget its pods (a DEL would free nothing, a retried
// ADD would get a second address).
func (a *Allocator) Restore(ctx context.Context, lease Lease) error {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.restored = false
	a.lease = lease
	a.fenceRev = 0
	specs, err := a.cfg.Store.ListPools(ctx)
	if err != nil {
		return fmt.Errorf("restore: list pools: %w", err)
	}
	pools := map[string]*poolState{}
	for _, p := range specs {
		ps := newPoolState(p)
		a.logRefused(ps)
		// A re-claim that loses a race (the old lease expired between the
		// listing and the compare) is retried on a fresh listing.
		if err := retry.Do(ctx, a.cfg.RestoreRetry, func(ctx context.Context) error { return a.restorePool(ctx, ps) }); err != nil {
			return fmt.Errorf("restore pool %s: %w", p.Name, err)
		}
		if err := a.restoreBorrowed(ctx, ps); err != nil {
			return fmt.Errorf("restore pool %s: borrowed addresses: %w", p.Name, err)
		}
		pools[p.Name] = ps
	}
	a.pools = pools
	a.restored = true
	for _, ps := range pools {
		a.sweepBindings(ctx, ps)
	}
	// A pool that is disabled, or whose selector no longer chooses this
	// node (relabelled while it was away), gets its empty blocks back;
	// so do a pool's draining cidrs.
	for _, ps := range pools {
		a.giveBackEmpty(ctx, ps)
	}
	return nil
}

// restorePool makes ps match the store for one listing. Blocks already
// adopted by an earlier pass are kept. It returns an error wrapping
// ErrConflict if one of the node's own non-empty blocks could not be
// re-claimed in this pass.
func (a *Allocator) restorePool(ctx context.Context, ps *poolState) error {
	infos, err := a.cfg.Store.ListBlocks(ctx, ps.pool.Name)
	if err != nil {
		return err
	}
	me := a.cfg.Node
	var lost []error
	for _, info := range infos {
		if _, done := ps.own[info.Block]; done {
			continue
		}
		home := info.Home != nil && info.Home.Node == me
		switch {
		case info.Owned(me) && info.ClaimLease == a.lease.ID():
			// Already ours on the current lease.
		case home && (info.Claim == nil || info.Claim.Node == me):
			rev, err := a.cfg.Store.Reclaim(ctx, ps.pool.Name, info, a.claimRecord(), a.lease.ID())
			var ce *records.ClaimError
			if errors.As(err, &ce) {
				ps.noteOther(info.Block, ce.ClaimedBy, ce.NonEmpty)
				if ce.NonEmpty {
					a.log.Warn("could not re-claim own block that holds allocations", "pool", ps.pool.Name, "block", info.Block, "reason", ce.Error())
					lost = append(lost, fmt.Errorf("re-claim own block %s: %w", info.Block, err))
				}
				continue
			}
			if err != nil {
				return err
			}
			a.log.Info("re-claimed block", "pool", ps.pool.Name, "block", info.Block, "orphaned", info.Claim == nil)
			info.ClaimRev = rev
		case home:
			// Home here, claim elsewhere: no claim transaction writes that
			// (a claim needs an empty block and moves the home), so it was
			// written by hand. Never take it over; if the block holds
			// allocations, this node cannot serve its pods.
			ps.others[info.Block] = otherBlock{node: info.Claim.Node}
			ips, err := a.cfg.Store.ListIPs(ctx, ps.pool.Name, info.Block)
			if err != nil {
				return err
			}
			if len(ips) > 0 {
				ce := &records.ClaimError{Block: info.Block, ClaimedBy: info.Claim.Node, NonEmpty: true, HomeNode: me}
				a.log.Error("own block that holds allocations is claimed by another node", "pool", ps.pool.Name, "block", info.Block, "claimed_by", info.Claim.Node, "allocations", len(ips))
				lost = append(lost, fmt.Errorf("re-claim own block %s: %w", info.Block, ce))
			}
			continue
		default:
			// Another node's claim. A home without a claim may be an
			// orphaned block or a free one; the claim loop finds out.
			if info.Claim != nil {
				ps.others[info.Block] = otherBlock{node: info.Claim.Node}
			}
			continue
		}
		if err := a.adoptBlock(ctx, ps, info.Block, info.ClaimRev); err != nil {
			return err
		}
	}
	return errors.Join(lost...)
}

// adoptBlock makes block one of ours at claimRev and loads its allocations.
func (a *Allocator) adoptBlock(ctx context.Context, ps *poolState, block netip.Prefix, claimRev int64) error {
	ba, err := allocator.NewBlockAlloc(ps.pool, block)
	if err != nil {
		return err
	}
	ob := &ownBlock{ba: ba, claimRev: claimRev}
	prev, had := ps.own[block]
	ps.own[block] = ob // loadBlock places records in own blocks
	if err := a.loadBlock(ctx, ps, block, ob); err != nil {
		if had {
			ps.own[block] = prev
		} else {
			delete(ps.own, block)
		}
		return err
	}
	delete(ps.others, block)
	delete(ps.claimsUnknown, block)
	return nil
}

// reloadBlock replaces the cached allocations of an own block with the
// store's. It is the repair path whenever a write finds the cache wrong.
// If a read fails the cache is left as it was: a stale entry costs a
// failed write later, a missing one would cost a running pod its address.
func (a *Allocator) reloadBlock(ctx context.Context, ps *poolState, block netip.Prefix) error {
	ob := ps.own[block]
	if ob == nil {
		return nil
	}
	return a.loadBlock(ctx, ps, block, ob)
}

// loadBlock reads block's allocations and the expiry of their leases, and
// only then replaces ob's bitmap and ps's index of the block, placing each
// record as a read-back does (settleAt).
func (a *Allocator) loadBlock(ctx context.Context, ps *poolState, block netip.Prefix, ob *ownBlock) error {
	allocs, err := a.cfg.Store.ListIPs(ctx, ps.pool.Name, block)
	if err != nil {
		return err
	}
	expiry, err := a.expiries(ctx, allocs)
	if err != nil {
		return err
	}
	ps.forgetBlock(block)
	ob.ba.Reset()
	now := a.cfg.Now()
	var newest *records.Allocation
	for i := range allocs {
		al := &allocs[i]
		ob.ba.Mark(al.Addr)
		switch {
		case al.State == records.StateKept, al.Borrowed && al.Node != a.cfg.Node:
		case al.ContainerID == "":
			a.log.Warn("unreadable allocation key in own block; its address stays taken", "pool", ps.pool.Name, "ip", al.Addr)
		default:
			if newest == nil || al.Since.After(newest.Since) {
				newest = al
			}
			if al.Node != a.cfg.Node {
				a.log.Warn("allocation of another node in own block", "pool", ps.pool.Name, "ip", al.Addr, "node", al.Node)
			}
			if others := ps.ofOwner(al.Owner.Key(), allocator.FamilyOf(al.Addr)); len(others) > 0 {
				a.log.Warn("owner holds more than one address of a family", "pool", ps.pool.Name, "owner", al.Owner.Key(), "ip", al.Addr, "also", others[0].Addr)
			}
			al.Seen = now
		}
		ps.settleAt(al.Addr, al, expiry[al.Lease], a.cfg.Node)
	}
	a.markHeld(block, ob)
	ps.markCooling(block, ob)
	for addr := range ps.planned {
		if block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
	if newest != nil {
		ob.ba.ResumeAfter(newest.Addr)
	}
	return nil
}
