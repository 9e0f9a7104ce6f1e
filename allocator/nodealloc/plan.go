package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// plan is a request whose addresses are chosen (and marked in the block
// bitmaps) but not yet written.
type plan struct {
	ps     *poolState
	req    Request
	reused []*records.Allocation
	writes []records.IPWrite
	// lent are addresses this plan borrowed, written at once: a plan
	// that fails later gives them back, so a refused request leaves the
	// owner with what it held before.
	lent []*records.Allocation
	// before is what the owner held when the request came in.
	before map[netip.Addr]bool
	// bind, for a sticky identity, is the binding written with the plan.
	bind *records.Binding
}

// plan chooses the request's addresses and marks them. pendErr is the
// error of the last attempt to settle writes of unknown outcome: an owner
// with such a write is refused until it is settled, since the write may
// hold its address.
func (a *Allocator) plan(ctx context.Context, r Request, pendErr error) (*plan, error) {
	if err := r.Owner.Validate(); err != nil {
		return nil, err
	}
	ps, err := a.poolState(r.Pool)
	if err != nil {
		return nil, err
	}
	if ps.pendingFor(r.Owner.Key()) {
		return nil, fmt.Errorf("an earlier write for %s has an unknown outcome: %w", r.Owner.Key(), errors.Join(records.ErrUnavailable, pendErr))
	}
	if err := a.reassertOwner(ctx, ps, r.Owner.Key()); err != nil {
		return nil, err
	}
	if r.Sticky != nil {
		return a.planSticky(ctx, ps, r, pendErr)
	}
	return a.planOrdinary(ctx, r, pendErr)
}

// planOrdinary plans the request's addresses in the node's blocks,
// claiming or borrowing as needed.
func (a *Allocator) planOrdinary(ctx context.Context, r Request, pendErr error) (*plan, error) {
	ps, err := a.poolState(r.Pool)
	if err != nil {
		return nil, err
	}
	fams, static, err := requestFamilies(ps.pool, r)
	if err != nil {
		return nil, err
	}
	p := &plan{ps: ps, req: r}
	for _, f := range fams {
		want, isStatic := static[f]
		if al := a.live(ps, r.Owner, f, netip.Addr{}); al != nil {
			if isStatic && want != al.Addr {
				return nil, a.abandon(ctx, p, fmt.Errorf("%w: %s already holds %s in pool %s, not %s", records.ErrBadRequest, r.Owner.Key(), al.Addr, ps.pool.Name, want))
			}
			p.reused = append(p.reused, al)
			continue
		}
		if ps.refused != nil {
			return nil, a.abandon(ctx, p, refusedErr(ps))
		}
		if ps.pool.Disabled {
			return nil, a.abandon(ctx, p, fmt.Errorf("%w: pool %s is disabled and hands out no new addresses (kvipamctl pool enable %s)", records.ErrPoolDisabled, ps.pool.Name, ps.pool.Name))
		}
		if !a.selected(ps) {
			// Neither a claim nor a borrow: the pool's blocks are for the
			// nodes its selector chooses.
			return nil, a.abandon(ctx, p, a.notSelected(ps))
		}
		var addr netip.Addr
		var block netip.Prefix
		var lent *records.Allocation
		if isStatic {
			if err := staticDrained(ps.pool, want); err != nil {
				return nil, a.abandon(ctx, p, err)
			}
			block, err = a.pickStatic(ctx, ps, want)
			addr = want
			if errors.Is(err, records.ErrNotOwned) {
				lent, err = a.borrowStatic(ctx, ps, r, block, want, err)
			}
		} else {
			block, addr, lent, err = a.pickOrBorrow(ctx, ps, r, f)
		}
		if err != nil {
			return nil, a.abandon(ctx, p, err)
		}
		if lent != nil { // written already: borrowed (borrow.go), or with a claim (claimBlock)
			p.reused = append(p.reused, lent)
			p.lent = append(p.lent, lent)
			continue
		}
		if al := a.live(ps, r.Owner, f, netip.Addr{}); al != nil && !isStatic {
			// A claim adopted on the way (tryClaim, refreshOthers) brought
			// the owner's allocation back: an earlier attempt's write whose
			// answer was lost. It is the owner's; a second is not planned.
			p.reused = append(p.reused, al)
			continue
		}
		ob := ps.own[block]
		ob.ba.Mark(addr)
		ps.planned[addr] = true
		p.writes = append(p.writes, records.IPWrite{
			Pool: ps.pool.Name, Block: block, ClaimRev: ob.claimRev, Addr: addr, Reserve: r.Reserve,
			Record: a.newRecord(r, false),
		})
	}
	return p, nil
}

// abandon undoes a plan that fails before its write: its marks, and
// the addresses it borrowed (a failed release leaves one to the owner,
// whose DEL or retry finds it).
func (a *Allocator) abandon(ctx context.Context, p *plan, cause error) error {
	a.undo(p)
	lent := p.lent
	p.lent = nil
	return a.giveBack(ctx, p.ps, lent, cause)
}

// giveBack releases borrowed addresses of a request that failed with
// cause. If one cannot be released the owner still holds it: the error
// then says try again, not a refusal.
func (a *Allocator) giveBack(ctx context.Context, ps *poolState, lent []*records.Allocation, cause error) error {
	var errs []error
	for _, al := range lent {
		if err := a.release(ctx, ps, al); err != nil {
			a.log.Warn("give back a borrowed address of a failed request", "pool", ps.pool.Name, "ip", al.Addr, "error", err)
			errs = append(errs, fmt.Errorf("%s: %w", al.Addr, err))
		}
	}
	if len(errs) > 0 {
		// The owner still holds what it borrowed: not a refusal any more.
		return fmt.Errorf("%v; a borrowed address could not be given back, try again: %w", cause, errors.Join(append([]error{records.ErrUnavailable}, errs...)...))
	}
	return cause
}

// pickOrBorrow chooses a free address of family f in the node's blocks,
// claiming a block if it must; when the pool has no block left it
// borrows one from another node's block, written at once.
func (a *Allocator) pickOrBorrow(ctx context.Context, ps *poolState, r Request, f allocator.Family) (netip.Prefix, netip.Addr, *records.Allocation, error) {
	first := a.newRecord(r, false)
	for {
		b, addr, written, err := a.pickFree(ctx, ps, f, &first)
		var ee *records.ExhaustedError
		if !errors.As(err, &ee) {
			return b, addr, written, err
		}
		al, err := a.borrow(ctx, ps, r, f)
		if !errors.Is(err, errOwnRoom) {
			return netip.Prefix{}, netip.Addr{}, al, err
		}
		if ctx.Err() != nil {
			return netip.Prefix{}, netip.Addr{}, nil, ctx.Err()
		}
	}
}

// requestFamilies resolves which families a request wants and its static
// addresses by family, rejecting anything the pool cannot serve.
func requestFamilies(p allocator.Pool, r Request) ([]allocator.Family, map[allocator.Family]netip.Addr, error) {
	static := map[allocator.Family]netip.Addr{}
	for _, ip := range r.IPs {
		ip = ip.Unmap()
		f := allocator.FamilyOf(ip)
		if _, dup := static[f]; dup {
			return nil, nil, fmt.Errorf("%w: two %s addresses requested", records.ErrBadRequest, f)
		}
		if !p.Contains(ip) {
			return nil, nil, fmt.Errorf("%w: requested ip %s is not in pool %s", records.ErrBadRequest, ip, p.Name)
		}
		static[f] = ip
	}
	fams := slices.Clone(r.Families)
	if len(fams) == 0 {
		for f := range static {
			fams = append(fams, f)
		}
		if len(fams) == 0 {
			fams = p.Families()
		}
	}
	slices.Sort(fams)
	if len(slices.Compact(fams)) != len(fams) {
		return nil, nil, fmt.Errorf("%w: a family is requested twice", records.ErrBadRequest)
	}
	for _, f := range fams {
		if p.BlockSize(f) == 0 {
			return nil, nil, fmt.Errorf("%w: pool %s has no %s range", records.ErrBadRequest, p.Name, f)
		}
	}
	for f, ip := range static {
		if !slices.Contains(fams, f) {
			return nil, nil, fmt.Errorf("%w: requested ip %s but family %s not requested", records.ErrBadRequest, ip, f)
		}
	}
	return fams, static, nil
}

// live returns the owner's (oldest) allocation of family f at another
// address than except (the zero address: any), dropping reservations that
// have lapsed. A dropped one may still be in the store for a moment; the
// write that reuses its address then fails and reloads the block.
func (a *Allocator) live(ps *poolState, o records.Owner, f allocator.Family, except netip.Addr) *records.Allocation {
	for _, al := range ps.ofOwner(o.Key(), f) {
		if al.Addr != except && !a.dropIfLapsed(ps, al) {
			return al
		}
	}
	return nil
}

// dropIfLapsed drops al from the cache if it is a reservation whose lease
// has ended, and reports whether it did. Every path that looks at a
// cached reservation (by owner, by address, or to make room) goes
// through it.
func (a *Allocator) dropIfLapsed(ps *poolState, al *records.Allocation) bool {
	exp, ok := ps.expires[al.Addr]
	if !ok || al.State != records.StateReserved || !a.cfg.Now().After(exp) {
		return false
	}
	ps.drop(al)
	a.logEnded(al, "reservation lapsed")
	a.lapsed.add(*al, exp)
	return true
}

// drop removes al from the cache and frees its address in the bitmap.
func (ps *poolState) drop(al *records.Allocation) {
	ps.forget(al)
	if _, ob := ps.ownBlockOf(al.Addr); ob != nil {
		ob.ba.Unmark(al.Addr)
	}
}

// pickFree chooses a free address of family f in the node's blocks,
// claiming a block if none has one. first, if set, is the request's
// record: a block claimed for it is claimed with it (claimBlock), and
// written is then the allocation the claim wrote.
func (a *Allocator) pickFree(ctx context.Context, ps *poolState, f allocator.Family, first *records.Record) (b netip.Prefix, addr netip.Addr, written *records.Allocation, err error) {
	ps.thaw(a.cfg.Now().Add(-ps.pool.Cooldown()))
	if b, addr, ok := ps.nextFree(f); ok {
		return b, addr, nil, nil
	}
	// Lapsed reservations, lent addresses given back and, last, the
	// oldest address still cooling free room before a new block is
	// claimed.
	for _, addr := range slices.SortedFunc(maps.Keys(ps.expires), netip.Addr.Compare) { // lapses recorded in one order
		if al := ps.byAddr[addr]; al != nil && allocator.FamilyOf(addr) == f {
			a.dropIfLapsed(ps, al)
		}
	}
	a.reloadLent(ctx, ps, f)
	a.thawKept(ctx, ps, f)
	if b, addr, ok := ps.nextFree(f); ok {
		return b, addr, nil, nil
	}
	for ps.thawOldest(f) {
		if b, addr, ok := ps.nextFree(f); ok {
			return b, addr, nil, nil
		}
	}
	b, written, err = a.claimBlock(ctx, ps, f, first)
	switch {
	case err != nil:
		return netip.Prefix{}, netip.Addr{}, nil, err
	case written != nil:
		return b, written.Addr, written, nil
	}
	addr, ok := ps.own[b].ba.Next()
	if !ok {
		return netip.Prefix{}, netip.Addr{}, nil, fmt.Errorf("claimed block %s has no free address", b)
	}
	return b, addr, nil, nil
}

func (a *Allocator) pickStatic(ctx context.Context, ps *poolState, addr netip.Addr) (netip.Prefix, error) {
	b, ob := ps.ownBlockOf(addr)
	if ob == nil {
		if other, ok := ps.others[b]; ok && other.node != "" {
			return b, fmt.Errorf("requested ip %s is in block %s of node %s: %w", addr, b, other.node, records.ErrNotOwned)
		}
		if err := a.claimSpecific(ctx, ps, b); err != nil {
			return b, fmt.Errorf("requested ip %s: %w", addr, err)
		}
		ob = ps.own[b]
	}
	if slices.Contains(ps.pool.Excluded(b), addr) {
		return b, fmt.Errorf("%w: requested ip %s is a network, broadcast or anycast address of pool %s", records.ErrBadRequest, addr, ps.pool.Name)
	}
	if al := ps.byAddr[addr]; al != nil {
		a.dropIfLapsed(ps, al) // the create-if-absent write guards the rest
	}
	if _, kept := ps.kept[addr]; kept {
		a.thawKept(ctx, ps, allocator.FamilyOf(addr)) // its window may have ended
	}
	if _, cooling := ps.cool.at[addr]; cooling && ps.byAddr[addr] == nil {
		delete(ps.cool.at, addr) // asked for by name: no cooldown
		ob.ba.Unmark(addr)
	}
	if ob.ba.IsUsed(addr) && !ps.writing(addr) && !a.held(addr) {
		// Marked for no write of this node: kept for an identity or
		// lent, as last read (an operator may have released it since),
		// or for an endpoint that used addr when the block was loaded
		// and has gone since, its DEL finding nothing to release. Read
		// the block again rather than refuse an address etcd may hold
		// for nobody.
		if err := a.reloadBlock(ctx, ps, b); err != nil {
			return b, fmt.Errorf("requested ip %s: %w", addr, err)
		}
		if ob = ps.own[b]; ob == nil {
			return b, fmt.Errorf("requested ip %s: block %s is not this node's now: %w", addr, b, records.ErrConflict)
		}
	}
	if ob.ba.IsUsed(addr) {
		holder := "another owner"
		if al := ps.byAddr[addr]; al != nil {
			holder = al.Owner.Key()
		}
		if k, ok := ps.kept[addr]; ok {
			holder = "sticky identity " + k.identity + " (kept until " + k.until.UTC().Format(time.RFC3339) + ")"
		}
		return b, fmt.Errorf("requested ip %s is held by %s: %w", addr, holder, records.ErrIPInUse)
	}
	return b, nil
}
