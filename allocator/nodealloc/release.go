package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// writeFence returns the revision that fences a write to al: its block's
// claim, or for a borrowed address the node's borrow fence.
func (a *Allocator) writeFence(ctx context.Context, ps *poolState, al *records.Allocation) (int64, error) {
	if al.Borrowed {
		return a.borrowFence(ctx)
	}
	ob := ps.own[al.Block]
	if ob == nil {
		// The block's claim was lost (a fenced write): no write is
		// fenced until Restore re-claims it.
		return 0, fmt.Errorf("block %s is not claimed by node %s now: %w", al.Block, a.cfg.Node, records.ErrLeaseLost)
	}
	return ob.claimRev, nil
}

// Release frees every address the owner holds, in every pool. Each delete
// is guarded by the revision the node last saw, so a stale release cannot
// free an address that was handed to someone else since. Releasing an
// owner that holds nothing succeeds; an owner with a write of unknown
// outcome that cannot be settled yet is refused (try again), since that
// write may hold an address.
func (a *Allocator) Release(ctx context.Context, o records.Owner) ([]records.Allocation, error) {
	return a.ReleaseAs(ctx, o, "")
}

// ReleaseAs releases o as Release does. identity, when not empty, is the
// sticky identity o's endpoint was added under: a binding that names o is
// then dropped even when the cache knows nothing of o (its records lost
// with a store, or lapsed, and not written back), as o holds none of its
// addresses once released. If the release fails, the runtime's retry
// checks the binding too (poolState.checkBinding).
func (a *Allocator) ReleaseAs(ctx context.Context, o records.Owner, identity string) ([]records.Allocation, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if identity != "" {
		for _, ps := range a.pools {
			ps.noteCheckBinding(o.Key(), identity)
		}
	}
	if err := a.waitOwner(ctx, o.Key()); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	if !a.restored {
		return nil, fmt.Errorf("release %s: %w", o.Key(), records.ErrLeaseLost)
	}
	if err := a.settlePending(ctx); err != nil && a.anyPending(o) {
		return nil, fmt.Errorf("release %s: %w", o.Key(), err)
	}
	var out []records.Allocation
	var errs []error
	for _, ps := range a.pools {
		var sticky []*records.Allocation
		cached, failed := len(ps.byOwner[o.Key()]) > 0, len(errs)
		for _, al := range slices.Clone(ps.byOwner[o.Key()]) {
			if al.Identity != "" && al.State == records.StateAllocated {
				sticky = append(sticky, al)
				continue
			}
			if err := a.release(ctx, ps, al); err != nil {
				errs = append(errs, err)
				continue
			}
			out = append(out, *al)
		}
		if len(sticky) > 0 {
			// Kept for the identity, not freed (stickyalloc.go).
			if err := a.keepOwner(ctx, ps, sticky); err != nil {
				errs = append(errs, err)
				continue
			}
			for _, al := range sticky {
				out = append(out, *al)
			}
		}
		if id, ok := ps.checkBinding[o.Key()]; ok && len(errs) == failed {
			// Still cached, its release took the binding (DeleteIP)
			// or kept it (keepOwner); gone from the cache, the binding
			// is checked here.
			if !cached {
				if err := a.dropBindingOf(ctx, ps, id, o); err != nil {
					errs = append(errs, err)
					continue
				}
			}
			delete(ps.checkBinding, o.Key())
		}
	}
	return out, errors.Join(errs...)
}

// ReleaseAllocation frees al only if etcd still holds it as it was read:
// same address, same revision, hence same owner. It is how GC releases
// what it decided on from an earlier snapshot: if the owner was deleted
// and the address handed to someone else since, nothing is released. It
// reports whether al is gone from etcd.
func (a *Allocator) ReleaseAllocation(ctx context.Context, al records.Allocation) (bool, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.waitOwner(ctx, al.Owner.Key()); err != nil {
		return false, fmt.Errorf("release %s: %w", al.Addr, err)
	}
	if !a.restored {
		return false, fmt.Errorf("release %s: %w", al.Addr, records.ErrLeaseLost)
	}
	ps, err := a.poolState(al.Pool)
	if err != nil {
		return false, err
	}
	cur := ps.byAddr[al.Addr]
	if cur != nil && cur.Rev == al.Rev && cur.Owner.Key() == al.Owner.Key() && cur.Identity != "" && cur.State == records.StateAllocated {
		// A sticky owner's addresses are kept together, for its identity.
		var sticky []*records.Allocation
		for _, x := range ps.byOwner[cur.Owner.Key()] {
			if x.Identity == cur.Identity && x.State == records.StateAllocated {
				sticky = append(sticky, x)
			}
		}
		if err := a.keepOwner(ctx, ps, sticky); err != nil {
			if errors.Is(err, records.ErrConflict) {
				return false, nil
			}
			return false, err
		}
		return true, nil
	}
	if cur != nil && cur.Rev == al.Rev && cur.Owner.Key() == al.Owner.Key() {
		// Still the cached allocation: release it as a DEL would.
		if err := a.release(ctx, ps, cur); err != nil {
			if errors.Is(err, records.ErrConflict) {
				return false, nil
			}
			return false, err
		}
		return true, nil
	}
	// Not (or no longer) cached as it was: delete only if etcd still
	// holds it at that revision; the cache has nothing of it to drop.
	err = a.cfg.Store.DeleteIP(ctx, al)
	if errors.Is(err, records.ErrConflict) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
	}
	a.logEnded(&al, "released")
	return true, nil
}

func (a *Allocator) release(ctx context.Context, ps *poolState, al *records.Allocation) error {
	err := a.cfg.Store.DeleteIP(ctx, *al)
	switch {
	case err == nil:
		ps.dropReleased(al, ps.pool.Cooldown() > 0, a.cfg.Now())
		a.logEnded(al, "released")
	case errors.Is(err, records.ErrConflict):
		// Rewritten since we cached it: reload and report rather than
		// delete what we have not seen. If the block cannot be read
		// now, or is another node's (a borrowed address), the address
		// is read back before the next request (its owner's retried ADD
		// must not be answered from the cache).
		if _, ob := ps.ownBlockOf(al.Addr); ob == nil || a.reloadBlock(ctx, ps, al.Block) != nil {
			a.park(ps, al.Owner.Key(), "release", records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr})
		}
		return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
	default:
		a.park(ps, al.Owner.Key(), "release", records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr})
		if serr := a.settlePending(ctx); serr != nil {
			return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), serr)
		}
		if ps.stillCached([]*records.Allocation{al}) != nil {
			return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
		}
		if al.Identity != "" && al.State != records.StateKept {
			// Settled as gone, it may not have been this delete that
			// took it (a lapse), nor the binding with it (DeleteIP).
			if err := a.dropBindingOf(ctx, ps, al.Identity, al.Owner); err != nil {
				return err
			}
		}
	}
	a.maybeUnclaim(ctx, ps, al.Block)
	return nil
}

// maybeUnclaim gives an empty block back to the pool when the node has
// another of the same family that hands out addresses, so a node that
// shrinks does not hoard blocks, yet always keeps one block per family
// ready for the next pod; a disabled pool (being drained), one whose
// selector no longer chooses the node, and a draining cidr (drain.go)
// get every empty block back.
func (a *Allocator) maybeUnclaim(ctx context.Context, ps *poolState, b netip.Prefix) {
	ob := ps.own[b]
	keepReady := !a.givesBack(ps, b) && len(ps.servingOwn(allocator.FamilyOf(b.Addr()))) < 2
	if ob == nil || ps.holds(b) || keepReady || a.ready() != nil {
		return
	}
	if err := a.cfg.Store.Unclaim(ctx, ps.pool.Name, b, ob.claimRev); err != nil {
		a.log.Debug("keep empty block", "pool", ps.pool.Name, "block", b, "reason", err)
		return
	}
	delete(ps.own, b)
	for addr := range ps.cool.at {
		if b.Contains(addr) {
			delete(ps.cool.at, addr) // not ours to hand out any more
		}
	}
	a.log.Info("released empty block", "pool", ps.pool.Name, "block", b)
}
