package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// The DEL: an owner's addresses released (each delete guarded by the
// revision the node last saw), a sticky owner's kept for its identity, a
// stale binding dropped, an empty block given back, and a lapse recorded.

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
// checks the binding too.
func (a *Allocator) ReleaseAs(ctx context.Context, o records.Owner, identity string) ([]records.Allocation, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	if identity != "" {
		a.n.CheckBinding(o, identity)
	}
	if err := a.flight.waitOwner(ctx, o.Key()); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	if !a.restored {
		return nil, fmt.Errorf("release %s: %w", o.Key(), records.ErrLeaseLost)
	}
	if err := a.settlePending(ctx); err != nil && a.n.AnyPending(o) {
		return nil, fmt.Errorf("release %s: %w", o.Key(), err)
	}
	var out []records.Allocation
	var errs []error
	for _, ps := range a.n.Pools() {
		var sticky []*records.Allocation
		held := ps.OfOwner(o.Key())
		cached, failed := len(held) > 0, len(errs)
		for _, al := range held {
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
			// Kept for the identity, not freed.
			if err := a.keep(ctx, ps, sticky); err != nil {
				errs = append(errs, err)
				continue
			}
			for _, al := range sticky {
				out = append(out, *al)
			}
		}
		if id, ok := ps.CheckingBinding(o.Key()); ok && len(errs) == failed {
			// Still cached, its release took the binding (DeleteIP)
			// or kept it (keep); gone from the cache, the binding is
			// checked here.
			if !cached {
				if err := a.dropBinding(ctx, ps, id, o, nil); err != nil {
					errs = append(errs, err)
					continue
				}
			}
			ps.BindingChecked(o.Key())
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
	defer a.voice.say()
	if err := a.flight.waitOwner(ctx, al.Owner.Key()); err != nil {
		return false, fmt.Errorf("release %s: %w", al.Addr, err)
	}
	if !a.restored {
		return false, fmt.Errorf("release %s: %w", al.Addr, records.ErrLeaseLost)
	}
	ps, err := a.n.Pool(al.Pool)
	if err != nil {
		return false, err
	}
	cur := ps.At(al.Addr)
	if cur != nil && cur.Rev == al.Rev && cur.Owner.Key() == al.Owner.Key() {
		if cur.Identity != "" && cur.State == records.StateAllocated {
			// A sticky owner's addresses are kept together, for its
			// identity.
			var sticky []*records.Allocation
			for _, x := range ps.OfOwner(cur.Owner.Key()) {
				if x.Identity == cur.Identity && x.State == records.StateAllocated {
					sticky = append(sticky, x)
				}
			}
			err = a.keep(ctx, ps, sticky)
		} else {
			// Still the cached allocation: release it as a DEL would.
			err = a.release(ctx, ps, cur)
		}
	} else {
		// Not (or no longer) cached as it was: delete only if etcd still
		// holds it at that revision; the cache has nothing of it to drop.
		if err = a.cfg.Store.DeleteIP(ctx, al); err == nil {
			a.n.Ended(&al, "released")
		} else if !errors.Is(err, retry.ErrConflict) {
			err = fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
		}
	}
	if errors.Is(err, retry.ErrConflict) {
		return false, nil
	}
	return err == nil, err
}

// release deletes al, guarded by its revision. A release of unknown
// outcome is settled from etcd.
func (a *Allocator) release(ctx context.Context, ps *planner.Pool, al *records.Allocation) error {
	err := a.cfg.Store.DeleteIP(ctx, *al)
	switch {
	case err == nil:
		a.n.Released(ps, al)
	case errors.Is(err, retry.ErrConflict):
		// Rewritten since we cached it: reload and report rather than
		// delete what we have not seen. If the block cannot be read
		// now, or is another node's (a borrowed address), the address
		// is read back before the next request (its owner's retried ADD
		// must not be answered from the cache).
		if !ps.Owns(al.Block) || a.reads.loadBlock(ctx, ps, al.Block, 0) != nil {
			a.n.Park(ps, al.Owner.Key(), "release", records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr})
		}
		return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
	default:
		a.n.Park(ps, al.Owner.Key(), "release", records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr})
		if serr := a.settlePending(ctx); serr != nil {
			return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), serr)
		}
		if ps.StillCached([]*records.Allocation{al}) != nil {
			return fmt.Errorf("release %s of %s: %w", al.Addr, al.Owner.Key(), err)
		}
		if al.Identity != "" && al.State != records.StateKept {
			// Settled as gone, it may not have been this delete that
			// took it (a lapse), nor the binding with it (DeleteIP).
			if err := a.dropBinding(ctx, ps, al.Identity, al.Owner, nil); err != nil {
				return err
			}
		}
	}
	a.claims.unclaim(ctx, ps, al.Block)
	return nil
}

// unclaim gives an empty block back to the pool when the planner
// says it goes (planner.Node.Unclaimable): a node that shrinks does not
// hoard blocks, yet keeps one block per family ready for the next pod; a
// disabled pool, one whose selector no longer chooses the node, and a
// draining cidr get every empty block back.
func (c claimer) unclaim(ctx context.Context, ps *planner.Pool, b netip.Prefix) {
	if !c.n.Unclaimable(ps, b) || c.ready() != nil {
		return
	}
	if err := c.st.Unclaim(ctx, ps.Spec().Name, b, ps.ClaimRev(b)); err != nil {
		c.log.Debug("keep empty block", "pool", ps.Spec().Name, "block", b, "reason", err)
		return
	}
	c.n.Unclaimed(ps, b)
}

// giveBackEmpty unclaims the empty own blocks of ps that go back
// (planner.Node.GivingBack), by the one path a release takes (unclaim). Addresses
// kept for sticky identities whose windows have ended are freed first: no
// release empties a block they were the last of.
func (c claimer) giveBackEmpty(ctx context.Context, ps *planner.Pool) int {
	n := 0
	for _, f := range []allocator.Family{allocator.IPv4, allocator.IPv6} {
		blocks := c.n.GivingBack(ps, f)
		if len(blocks) > 0 {
			c.reads.thawKept(ctx, ps, f)
		}
		for _, b := range blocks {
			if c.unclaim(ctx, ps, b); !ps.Owns(b) {
				n++
			}
		}
	}
	return n
}

// keep keeps the owner's sticky allocations als (one identity) for the
// identity instead of freeing them. If the identity has moved on (a
// later pod took the addresses over) there is nothing of this owner to
// keep: the cache learns who holds them now (read back) and the release
// succeeds; one still this owner's as it was is an error to retry. If
// etcd lost the records (restored from an older snapshot before a
// reassert wrote them back) the binding still names the owner, who holds
// none of its addresses: it goes (dropBinding), whether the keep was
// refused for it or its outcome was settled from etcd.
//
// A record still the owner's but rewritten meanwhile by another node (a
// live migration's second owner admitted or gone: migrate.go) is read
// back and kept at its new revision: it was not taken over.
func (a *Allocator) keep(ctx context.Context, ps *planner.Pool, als []*records.Allocation) error {
	for attempt := 0; ; attempt++ {
		err := a.keepOnce(ctx, ps, als)
		if !errors.Is(err, errRewritten) || attempt == 3 {
			return err
		}
		als = ps.OfOwnerAt(als)
	}
}

// errRewritten is a keep refused for records rewritten in place: still
// the owner's, at a new revision.
var errRewritten = fmt.Errorf("sticky records rewritten meanwhile, still the owner's: %w", retry.ErrConflict)

func (a *Allocator) keepOnce(ctx context.Context, ps *planner.Pool, als []*records.Allocation) error {
	identity, owner := als[0].Identity, als[0].Owner
	takenOver := func() error {
		if err := a.reads.readBack(ctx, planner.RefsOf(als)); err != nil {
			return err
		}
		if al := ps.StillCached(als); al != nil {
			return fmt.Errorf("keep %s: changed concurrently: %w", al.Addr, retry.ErrConflict)
		}
		for _, al := range als {
			a.log.Info("late release of a sticky address a later pod holds now, or etcd lost: nothing released", "ip", al.Addr, "owner", al.Owner.Key(), "identity", al.Identity)
		}
		return nil
	}
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.Spec().Name, identity)
	if err != nil {
		return err
	}
	if ok && b.Alternate != nil {
		// A live migration: the addresses go to the alternate, or the
		// alternate goes (migrate.go).
		handled, err := a.leave(ctx, ps, identity, owner)
		if err != nil {
			return fmt.Errorf("release %s of sticky identity %s during a live migration: %w", owner.Key(), identity, err)
		}
		if handled {
			return takenOver()
		}
		if b, ok, err = a.cfg.Store.GetBinding(ctx, ps.Spec().Name, identity); err != nil {
			return err
		}
	}
	if !ok || b.Owner.Key() != owner.Key() {
		return takenOver()
	}
	vals := make([]records.Allocation, len(als))
	for i, al := range als {
		vals[i] = *al
	}
	end, err := a.cfg.Store.Keep(ctx, b, vals)
	switch {
	case errors.Is(err, retry.ErrConflict):
		if err := takenOver(); err != nil {
			return err
		}
		if fresh := ps.OfOwnerAt(als); len(fresh) == len(als) {
			return errRewritten
		}
		return a.dropBinding(ctx, ps, identity, owner, nil)
	case planner.OutcomeUnknown(err):
		a.n.Park(ps, owner.Key(), "keep", planner.RefsOf(als)...)
		if serr := a.settlePending(ctx); serr != nil {
			return fmt.Errorf("keep %s for sticky identity %s: %w", owner.Key(), identity, serr)
		}
		if still := ps.StillCached(als); still != nil {
			return fmt.Errorf("keep %s for sticky identity %s: %w", owner.Key(), identity, err)
		}
		// Settled: kept (the binding says so), or etcd had lost them
		// and the binding, which names the owner, goes.
		if err := a.dropBinding(ctx, ps, identity, owner, nil); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("keep %s for sticky identity %s: %w", owner.Key(), identity, err)
	default:
		a.n.Kept(ps, als, identity, end)
	}
	for _, al := range als {
		a.n.Ended(al, "kept for sticky identity "+identity)
	}
	return nil
}

// dropBinding drops identity id's binding if the container it names, o,
// holds none of its addresses and it is not kept, for o's DEL; a drop
// that loses a race, or whose outcome is unknown, is tried again from a
// fresh read. The binding may have moved on to another pod meanwhile
// (then it is not o's to drop), or gone (the drop landed), or only one
// of its addresses changed while it still names o, which must not be
// left behind. A restore's sweep (sweep set) leaves bindings one of whose
// addresses its endpoints use, tries again for the sweep's budget, and
// starts from what it read of all bindings at once.
func (a *Allocator) dropBinding(ctx context.Context, ps *planner.Pool, id string, o records.Owner, sweep *sweepRead) error {
	pol, read, held := retry.Default, (*sweepRead)(nil), map[netip.Addr]bool(nil)
	if sweep != nil {
		pol, read, held = sweepRetry, sweep, sweep.held
	}
	err := retry.Do(ctx, pol, func(ctx context.Context) error {
		if read == nil {
			b, ok, err := a.cfg.Store.GetBinding(ctx, ps.Spec().Name, id)
			if err == nil && ok && sweep == nil && b.Alternate != nil {
				// A live migration's pod leaves (migrate.go).
				if _, err := a.leave(ctx, ps, id, o); err != nil {
					return err
				}
				b, ok, err = a.cfg.Store.GetBinding(ctx, ps.Spec().Name, id)
			}
			if err != nil || !ok || b.Kept() || b.Owner.Key() != o.Key() || planner.HeldAny(b, held) {
				return err
			}
			refs, err := ps.BoundRefs(b)
			if errors.Is(err, records.ErrBadRequest) {
				return nil // it names an address out of the pool now: left to kvipamctl check
			}
			cur, err := a.cfg.Store.GetIPs(ctx, refs)
			if err != nil {
				return err
			}
			read = &sweepRead{b: b, refs: refs, cur: cur}
		}
		r := read
		read = nil // a try again reads afresh
		if !planner.StaleBinding(r.b, r.cur) {
			return nil
		}
		if err := a.cfg.Store.DropStaleBinding(ctx, r.b, r.refs, r.cur); err != nil {
			return err
		}
		a.log.Info("dropped a sticky binding whose container holds none of its addresses", "pool", ps.Spec().Name, "identity", id, "owner", o.Key())
		return nil
	})
	if err != nil && sweep == nil {
		return fmt.Errorf("release %s: drop the binding of sticky identity %s: %w", o.Key(), id, err)
	}
	return err
}

// sweepRead is a binding and what etcd held at its addresses, as a
// restore's sweep read them, and the addresses the node's endpoints use.
type sweepRead struct {
	b    records.Binding
	refs []records.IPRef
	cur  map[netip.Addr]records.Allocation
	held map[netip.Addr]bool
}

// RecordLapses writes the reservations this node saw lapse to IP history.
// Those the store does not yet see as lapsed, or could not record, are
// kept for the next call. The agent calls it on every reconciler pass.
func (a *Allocator) RecordLapses(ctx context.Context) error {
	todo := a.lapsed.take()
	var later []lapse
	var errs []error
	for i, x := range todo {
		if ctx.Err() != nil {
			later = append(later, todo[i:]...)
			break
		}
		done, err := a.cfg.Store.RecordLapsed(ctx, x.al, x.end)
		switch {
		case err != nil:
			errs = append(errs, err)
			later = append(later, x)
		case !done && a.cfg.Now().Sub(x.end) < lapseGiveUp:
			later = append(later, x)
		case !done:
			a.log.Warn("reservation still in the store long after its lease should have ended; not recorded as lapsed",
				"pool", x.al.Pool, "ip", x.al.Addr, "owner", x.al.Owner.Key(), "end", x.end)
		}
	}
	a.lapsed.putBack(later)
	a.lapsed.mu.Lock()
	if n := a.lapsed.dropped; n > 0 {
		a.lapsed.dropped = 0
		a.log.Warn("lapsed reservations not recorded in IP history: too many waiting", "dropped", n)
	}
	a.lapsed.mu.Unlock()
	return errors.Join(errs...)
}
