package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// keptAddr is an address of an own block kept for a sticky identity.
type keptAddr struct {
	identity string
	until    time.Time // when its lease ends; zero if unknown
}

// planSticky plans a request for a sticky identity: it takes over the
// identity's addresses (kept, or held by an earlier pod of the same name)
// by compare-and-swap, or plans new ones and binds them, in one
// transaction with the binding (WriteBound).
func (a *Allocator) planSticky(ctx context.Context, ps *poolState, r Request, pendErr error) (*plan, error) {
	if err := r.Sticky.Validate(); err != nil {
		return nil, err
	}
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.pool.Name, r.Sticky.Identity)
	if err != nil {
		return nil, err
	}
	for _, ip := range r.IPs {
		if ok && !slices.Contains(b.Addrs, ip.Unmap()) {
			return nil, fmt.Errorf("%w: requested ip %s conflicts with sticky identity %s, which holds %v (kvipamctl claim show %s --pool %s)",
				records.ErrBadRequest, ip, b.Identity, b.Addrs, b.Identity, ps.pool.Name)
		}
	}
	if ok && b.Owner.Key() == r.Owner.Key() {
		// A retry of the ADD that bound the identity: the binding's
		// addresses are this owner's in etcd; read them into the cache
		// if it lost track, so the retry gets them and not new ones.
		if err := a.syncBound(ctx, ps, b, r.Owner); err != nil {
			return nil, err
		}
	}
	if !ok || b.Owner.Key() == r.Owner.Key() {
		return a.planBound(ctx, ps, r, pendErr, b.Rev)
	}
	refs, cur, err := a.readBound(ctx, ps, b)
	if err != nil {
		return nil, err
	}
	if !b.Kept() && staleBinding(b, cur) {
		// The pod it names holds none of its addresses: its reservation
		// was released or lapsed before it ran. The identity starts
		// afresh, replacing the binding.
		a.log.Info("sticky binding names a container that holds nothing; replacing it", "identity", b.Identity, "owner", b.Owner.Key())
		return a.planBound(ctx, ps, r, pendErr, b.Rev)
	}
	if !b.Kept() && (b.Owner.Namespace != r.Owner.Namespace || b.Owner.Pod != r.Owner.Pod || b.Owner.Pod == "") {
		return nil, fmt.Errorf("%w: %s is held by pod %s/%s (%s on node %s); two live pods cannot share one identity",
			records.ErrIdentityInUse, r.Sticky.Identity, b.Owner.Namespace, b.Owner.Pod, b.Owner.Key(), b.Node)
	}
	if !a.selected(ps) {
		// The selector binds the identity too: its addresses are routed
		// where the pool's nodes are (a rack's BGP filters), so a pod
		// elsewhere neither borrows nor takes them over. They stay as
		// they are, for its next pod on a node the selector chooses.
		return nil, a.takeoverNotSelected(ps, b)
	}
	if ps.pool.Disabled {
		// Taking kept addresses back is not handing out new ones.
		a.log.Debug("sticky identity takes its addresses back in a disabled pool", "identity", b.Identity)
	}
	return a.planTakeover(ctx, ps, r, b, refs, cur)
}

// readBound reads what etcd holds at b's addresses.
func (a *Allocator) readBound(ctx context.Context, ps *poolState, b records.Binding) ([]records.IPRef, map[netip.Addr]records.Allocation, error) {
	refs := make([]records.IPRef, 0, len(b.Addrs))
	for _, addr := range b.Addrs {
		blk, ok := ps.pool.BlockFor(addr)
		if !ok {
			return nil, nil, fmt.Errorf("%w: sticky identity %s holds %s, which is not in pool %s any more", records.ErrBadRequest, b.Identity, addr, ps.pool.Name)
		}
		refs = append(refs, records.IPRef{Pool: ps.pool.Name, Block: blk, Addr: addr})
	}
	cur, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return nil, nil, err
	}
	return refs, cur, nil
}

// planBound plans the request in the node's blocks and binds what it
// gets to the identity, replacing the binding at rev (0: none).
func (a *Allocator) planBound(ctx context.Context, ps *poolState, r Request, pendErr error, rev int64) (*plan, error) {
	p, err := a.planOrdinary(ctx, r, pendErr)
	if err != nil {
		return nil, err
	}
	nb := records.Binding{Identity: r.Sticky.Identity, Owner: r.Owner, Node: a.cfg.Node, Since: a.cfg.Now().UTC(),
		WindowSeconds: int64(r.Sticky.Window / time.Second), Pool: ps.pool.Name, Rev: rev}
	for _, al := range p.reused {
		nb.Addrs = append(nb.Addrs, al.Addr)
	}
	for _, w := range p.writes {
		nb.Addrs = append(nb.Addrs, w.Addr)
	}
	slices.SortFunc(nb.Addrs, netip.Addr.Compare)
	p.bind = &nb
	return p, nil
}

// staleBinding reports whether none of b's addresses holds a record of
// b's owner (cur is what etcd holds at them).
func staleBinding(b records.Binding, cur map[netip.Addr]records.Allocation) bool {
	for _, addr := range b.Addrs {
		if c, ok := cur[addr]; ok && c.Owner.Key() == b.Owner.Key() {
			return false
		}
	}
	return true
}

// sweepBudget bounds how long a restore's sweep (sweepBindings) tries
// again what etcd refused or did not answer: the node serves nothing
// meanwhile, and a binding the sweep leaves is dropped by the DEL that
// names its identity, or replaced by the identity's next pod.
const sweepBudget = 2 * time.Second

// sweepRetry is the sweep's pace: a lost race, a refusal and a failure
// of unknown outcome are each tried again, from a fresh read, until
// sweepBudget ends.
var sweepRetry = retry.Policy{Unavailable: true}

// sweepBindings drops the bindings of ps that name a container of this
// node holding none of their addresses: a reservation that lapsed, or
// whose ADD failed, while the node restarted or lost its lease, so that
// no cache knows of the container and its DEL finds nothing to release
// (a binding of an identity that never comes back would stay for ever).
// A binding one of whose addresses an endpoint of this node uses
// (Config.Held) stays: its pod runs, and Reassert writes back what etcd
// lost of it. Restore calls it, with no request in flight on the node.
// What etcd refuses ("too many requests"), does not answer, or changes
// meanwhile is tried again from a fresh read, for sweepBudget; a binding
// it still cannot check or drop is left to the DEL that names its
// identity, or to the identity's next pod, which replaces it
// (planSticky).
func (a *Allocator) sweepBindings(ctx context.Context, ps *poolState) {
	ctx, cancel := context.WithTimeout(ctx, sweepBudget)
	defer cancel()
	var bs []records.Binding
	err := retry.Do(ctx, sweepRetry, func(ctx context.Context) (err error) {
		bs, err = a.cfg.Store.ListBindings(ctx, ps.pool.Name)
		return err
	})
	if err != nil {
		a.log.Warn("cannot list sticky bindings to drop stale ones", "pool", ps.pool.Name, "error", err)
		return
	}
	// One read of every address the node's bindings name.
	var mine []records.Binding
	refs := map[string][]records.IPRef{} // by identity
	var all []records.IPRef
	held := a.heldSet()
	for _, b := range bs {
		if b.Node != a.cfg.Node || b.Kept() || heldAny(b, held) {
			continue
		}
		for _, addr := range b.Addrs {
			if blk, ok := ps.pool.BlockFor(addr); ok {
				ref := records.IPRef{Pool: ps.pool.Name, Block: blk, Addr: addr}
				refs[b.Identity] = append(refs[b.Identity], ref)
				all = append(all, ref)
			}
		}
		mine = append(mine, b)
	}
	if len(mine) == 0 {
		return
	}
	var cur map[netip.Addr]records.Allocation
	err = retry.Do(ctx, sweepRetry, func(ctx context.Context) (err error) {
		cur, err = a.cfg.Store.GetIPs(ctx, all)
		return err
	})
	if err != nil {
		a.log.Warn("cannot read sticky bindings' addresses to drop stale ones", "pool", ps.pool.Name, "error", err)
		return
	}
	for _, b := range mine {
		again := false
		err := retry.Do(ctx, sweepRetry, func(ctx context.Context) error {
			if again {
				return a.dropStillStale(ctx, ps, b.Identity, b.Owner, held)
			}
			again = true
			return a.dropStale(ctx, ps, b, refs[b.Identity], cur)
		})
		if err != nil {
			a.log.Warn("stale sticky binding left to the DEL that names its identity, or to its next pod", "pool", ps.pool.Name, "identity", b.Identity, "owner", b.Owner.Key(), "error", err)
		}
	}
}

// heldAny reports whether an endpoint of this node uses one of b's
// addresses (held: Allocator.heldSet).
func heldAny(b records.Binding, held map[netip.Addr]bool) bool {
	return slices.ContainsFunc(b.Addrs, func(x netip.Addr) bool { return held[x] })
}

// dropStale drops b if the container it names holds none of its
// addresses as cur shows them (staleBinding), guarded by what was read
// at refs; a binding that changed meanwhile is a lost race
// (records.ErrConflict).
func (a *Allocator) dropStale(ctx context.Context, ps *poolState, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) error {
	if !staleBinding(b, cur) {
		return nil
	}
	if err := a.cfg.Store.DropStaleBinding(ctx, b, refs, cur); err != nil {
		return err
	}
	a.log.Info("dropped a sticky binding whose container holds none of its addresses", "pool", ps.pool.Name, "identity", b.Identity, "owner", b.Owner.Key())
	return nil
}

// dropStillStale reads identity id's binding again and drops it if it
// still names owner o, is not kept, uses none of the addresses in held,
// and o holds none of its addresses (dropStale). A drop that lost a race
// or whose outcome is unknown is tried again this way: the binding may
// have moved on to another pod (then it is not o's to drop), or gone
// (the drop landed), or only one of its addresses changed while it
// still names o, which must not be left behind.
func (a *Allocator) dropStillStale(ctx context.Context, ps *poolState, id string, o records.Owner, held map[netip.Addr]bool) error {
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.pool.Name, id)
	if err != nil || !ok || b.Kept() || b.Owner.Key() != o.Key() || heldAny(b, held) {
		return err
	}
	refs, cur, err := a.readBound(ctx, ps, b)
	switch {
	case errors.Is(err, records.ErrBadRequest):
		return nil // it names an address out of the pool now: left to kvipamctl check
	case err != nil:
		return err
	}
	return a.dropStale(ctx, ps, b, refs, cur)
}

// dropBindingOf drops identity id's binding if it names owner o, is not
// kept, and o holds none of its addresses (dropStillStale), for o's DEL;
// a drop that loses a race is read again.
func (a *Allocator) dropBindingOf(ctx context.Context, ps *poolState, id string, o records.Owner) error {
	err := retry.Do(ctx, retry.Default, func(ctx context.Context) error { return a.dropStillStale(ctx, ps, id, o, nil) })
	if err != nil {
		return fmt.Errorf("release %s: drop the binding of sticky identity %s: %w", o.Key(), id, err)
	}
	return nil
}

// syncBound reads into the cache the addresses of b, which names owner o,
// that the cache does not know as o's.
func (a *Allocator) syncBound(ctx context.Context, ps *poolState, b records.Binding, o records.Owner) error {
	var refs []records.IPRef
	for _, addr := range b.Addrs {
		if al := ps.byAddr[addr]; al != nil && al.Owner.Key() == o.Key() {
			continue
		}
		if blk, ok := ps.pool.BlockFor(addr); ok {
			refs = append(refs, records.IPRef{Pool: ps.pool.Name, Block: blk, Addr: addr})
		}
	}
	if len(refs) == 0 {
		return nil
	}
	return a.readBack(ctx, refs)
}

// planTakeover plans the writes that give b's addresses to r's owner:
// each compares the record found at refs (cur: kept for the identity, or
// the earlier pod's) and is fenced like any write, into an own block or
// borrowed.
func (a *Allocator) planTakeover(ctx context.Context, ps *poolState, r Request, b records.Binding, refs []records.IPRef, cur map[netip.Addr]records.Allocation) (*plan, error) {
	p := &plan{ps: ps, req: r}
	now := a.cfg.Now().UTC()
	for _, ref := range refs {
		rec := records.Record{Owner: r.Owner, Node: a.cfg.Node, State: records.StateAllocated, Since: now, Identity: b.Identity, WindowSeconds: int64(r.Sticky.Window / time.Second)}
		w := records.IPWrite{Pool: ps.pool.Name, Block: ref.Block, Addr: ref.Addr, Record: rec}
		if c, ok := cur[ref.Addr]; ok {
			mine := c.Identity == b.Identity && (c.State == records.StateKept || c.Owner.Key() == b.Owner.Key())
			if !mine {
				return nil, fmt.Errorf("sticky identity %s: its address %s is held by %s on node %s: %w", b.Identity, ref.Addr, c.Owner.Key(), c.Node, records.ErrIPInUse)
			}
			w.PrevRev = c.Rev
			if c.State != records.StateKept {
				w.Ends = &c
			}
		}
		if ob := ps.own[ref.Block]; ob != nil {
			w.ClaimRev = ob.claimRev
			ob.ba.Mark(ref.Addr)
			ps.planned[ref.Addr] = true
		} else {
			fence, err := a.borrowFence(ctx)
			if err != nil {
				a.undo(p)
				return nil, err
			}
			w.ClaimRev, w.Borrowed, w.Record.Borrowed = fence, true, true
		}
		p.writes = append(p.writes, w)
	}
	nb := b
	nb.Owner, nb.Node, nb.Since, nb.WindowSeconds = r.Owner, a.cfg.Node, now, int64(r.Sticky.Window/time.Second)
	p.bind = &nb
	a.log.Info("sticky identity takes its addresses over", "identity", b.Identity, "ips", b.Addrs, "from_node", b.Node, "kept", b.Kept())
	return p, nil
}

// keepOwner keeps the owner's sticky allocations als (one identity) for
// the identity instead of freeing them. If the identity has moved on (a
// later pod took the addresses over) there is nothing of this owner to
// keep: the cache learns who holds them now and the release succeeds.
// If etcd lost the records (restored from an older snapshot before a
// reassert wrote them back) the binding still names the owner, who holds
// none of its addresses: it goes (dropBindingOf), whether the keep was
// refused for it or its outcome was settled from etcd.
func (a *Allocator) keepOwner(ctx context.Context, ps *poolState, als []*records.Allocation) error {
	identity := als[0].Identity
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.pool.Name, identity)
	if err != nil {
		return err
	}
	if !ok || b.Owner.Key() != als[0].Owner.Key() {
		return a.dropTakenOver(ctx, ps, als)
	}
	vals := make([]records.Allocation, len(als))
	for i, al := range als {
		vals[i] = *al
	}
	end, err := a.cfg.Store.Keep(ctx, b, vals)
	switch {
	case errors.Is(err, records.ErrConflict):
		if err := a.dropTakenOver(ctx, ps, als); err != nil {
			return err
		}
		return a.dropBindingOf(ctx, ps, identity, als[0].Owner)
	case outcomeUnknown(err):
		a.park(ps, als[0].Owner.Key(), "keep", refsOf(als)...)
		if serr := a.settlePending(ctx); serr != nil {
			return fmt.Errorf("keep %s for sticky identity %s: %w", als[0].Owner.Key(), identity, serr)
		}
		if still := ps.stillCached(als); still != nil {
			return fmt.Errorf("keep %s for sticky identity %s: %w", als[0].Owner.Key(), identity, err)
		}
		// Settled: kept (the binding says so), or etcd had lost them
		// and the binding, which names the owner, goes.
		if err := a.dropBindingOf(ctx, ps, identity, als[0].Owner); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("keep %s for sticky identity %s: %w", als[0].Owner.Key(), identity, err)
	default:
		for _, al := range als {
			ps.forget(al)
			if _, ob := ps.ownBlockOf(al.Addr); ob != nil {
				ps.kept[al.Addr] = keptAddr{identity: identity, until: end}
			}
		}
	}
	for _, al := range als {
		a.logEnded(al, "kept for sticky identity "+identity)
	}
	return nil
}

// stillCached returns the first of als that the cache still holds as it
// was (same owner, same revision): etcd did not change it. The cache may
// hold it as another *Allocation: a block reloaded meanwhile (a claim
// whose answer was lost, adopted in the same settle) indexes its records
// anew.
func (ps *poolState) stillCached(als []*records.Allocation) *records.Allocation {
	for _, al := range als {
		if cur := ps.byAddr[al.Addr]; cur != nil && cur.Rev == al.Rev && cur.Owner.Key() == al.Owner.Key() {
			return al
		}
	}
	return nil
}

// dropTakenOver reads als back from etcd and settles the cache from it:
// the ones another owner holds now (taken over by a later pod of the
// identity, or kept), or etcd lost, leave the owner; any still this
// owner's as it was is an error to retry.
func (a *Allocator) dropTakenOver(ctx context.Context, ps *poolState, als []*records.Allocation) error {
	if err := a.readBack(ctx, refsOf(als)); err != nil {
		return err
	}
	if al := ps.stillCached(als); al != nil {
		return fmt.Errorf("keep %s: changed concurrently: %w", al.Addr, records.ErrConflict)
	}
	for _, al := range als {
		a.log.Info("late release of a sticky address a later pod holds now, or etcd lost: nothing released", "ip", al.Addr, "owner", al.Owner.Key(), "identity", al.Identity)
	}
	return nil
}

// thawKept frees own-block addresses whose kept window has ended, once
// etcd confirms the record is gone.
func (a *Allocator) thawKept(ctx context.Context, ps *poolState, f allocator.Family) {
	now := a.cfg.Now()
	var refs []records.IPRef
	for addr, k := range ps.kept {
		if allocator.FamilyOf(addr) == f && !k.until.IsZero() && now.After(k.until) {
			b, _ := ps.pool.BlockFor(addr)
			refs = append(refs, records.IPRef{Pool: ps.pool.Name, Block: b, Addr: addr})
		}
	}
	if len(refs) == 0 {
		return
	}
	cur, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return
	}
	for _, ref := range refs {
		if c, still := cur[ref.Addr]; still {
			if c.State != records.StateKept {
				delete(ps.kept, ref.Addr) // taken over: someone holds it now
			}
			continue
		}
		delete(ps.kept, ref.Addr)
		if _, ob := ps.ownBlockOf(ref.Addr); ob != nil && ps.byAddr[ref.Addr] == nil && !ps.planned[ref.Addr] {
			ob.ba.Unmark(ref.Addr)
		}
	}
}
