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
)

// Re-asserting what the node's endpoints hold. etcd restored from an
// older snapshot has lost every allocation made since: their pods still
// run with the addresses, which etcd now calls free. The agent compares
// its endpoints with etcd (Reassert) and writes back each missing
// allocation whose address lies in a block this node holds the claim on:
// the write is fenced by that claim, so nobody else can have allocated
// from the block meanwhile. An address free in a block another node
// claims was borrowed (borrow.go): it is borrowed again, by the same
// create-if-absent. An address held by another owner in etcd, or in
// another node's orphaned block, is a conflict: nothing is written, and
// the agent reports it. This node's own orphaned block means its lease
// is gone: Reassert answers ErrLeaseLost, and after Restore has
// re-claimed the block the next pass writes back. Until Reassert has
// run, the allocator keeps the endpoints' addresses out of its free
// lists (Config.Held), so it never hands one out again.

// HeldAddr is an address a local endpoint uses, and its owner; Identity
// and WindowSeconds are the sticky identity the address follows, if any
// (the endpoint's own record keeps them), so that a restarted node whose
// cache lost the record writes it back with its identity.
type HeldAddr struct {
	Owner         records.Owner
	Addr          netip.Addr
	Identity      string
	WindowSeconds int64
}

// Conflict is a held address that could not be re-asserted.
type Conflict struct {
	HeldAddr
	Pool   string
	Reason string
	// HeldBy is the allocation etcd has for the address, if any.
	HeldBy *records.Allocation
}

// Reassert checks every held address against the store and writes back
// the allocations that are missing from it where it may (see above). It
// returns the allocations it wrote back and the conflicts; an error means
// etcd could not be read or written (try again later).
func (a *Allocator) Reassert(ctx context.Context, held []HeldAddr) (restored []records.Allocation, conflicts []Conflict, err error) {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.ready(); err != nil {
		return nil, nil, err
	}
	return a.reassert(ctx, held)
}

// reassert is Reassert, called with allocMu and mu held on a node that
// is ready.
func (a *Allocator) reassert(ctx context.Context, held []HeldAddr) (restored []records.Allocation, conflicts []Conflict, err error) {
	type item struct {
		h     HeldAddr
		ps    *poolState
		block netip.Prefix
	}
	var items []item
	var refs []records.IPRef
	for _, h := range held {
		addr := h.Addr.Unmap()
		var it *item
		for _, ps := range a.pools {
			if b, ok := ps.pool.BlockFor(addr); ok {
				h.Addr = addr
				it = &item{h: h, ps: ps, block: b}
				break
			}
		}
		if it == nil {
			conflicts = append(conflicts, Conflict{HeldAddr: h, Reason: "the address is in none of this node's pools"})
			continue
		}
		items = append(items, *it)
		refs = append(refs, records.IPRef{Pool: it.ps.pool.Name, Block: it.block, Addr: addr})
	}
	if len(refs) == 0 {
		return nil, conflicts, nil
	}
	cur, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return nil, nil, fmt.Errorf("reassert: read allocations: %w", err)
	}
	// What each sticky owner's endpoint holds, per pool: a binding
	// written back names all of it (the cache may know none of it).
	bound := map[string][]netip.Addr{}
	for _, it := range items {
		if it.h.Identity != "" {
			k := it.ps.pool.Name + "/" + it.h.Owner.Key()
			bound[k] = append(bound[k], it.h.Addr)
		}
	}
	var errs []error
	var known []records.IPRef // the owner's in etcd, not (so) in the cache
	for _, it := range items {
		ps, addr := it.ps, it.h.Addr
		delete(ps.unasserted, addr) // settled below, or marked again
		if al, ok := cur[addr]; ok {
			switch c := ps.byAddr[addr]; {
			case al.Owner.Key() != it.h.Owner.Key():
				conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.pool.Name, HeldBy: &al,
					Reason: fmt.Sprintf("held by %s on node %s", al.Owner.Key(), al.Node)})
			case c == nil || c.Rev != al.Rev:
				known = append(known, records.IPRef{Pool: ps.pool.Name, Block: it.block, Addr: addr})
			}
			continue
		}
		if other := a.live(ps, it.h.Owner, allocator.FamilyOf(it.h.Addr), it.h.Addr); other != nil {
			// The owner holds another address of the family now (its
			// ADD was retried after this one's reservation was gone):
			// writing addr back would give it two.
			conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.pool.Name, HeldBy: other,
				Reason: fmt.Sprintf("%s holds %s of that family now", it.h.Owner.Key(), other.Addr)})
			continue
		}
		al, conflict, err := a.reassertOne(ctx, ps, it.h, it.block, bound[ps.pool.Name+"/"+it.h.Owner.Key()])
		switch {
		case conflict != nil:
			conflicts = append(conflicts, *conflict)
			// etcd holds nothing there and nothing may be written back:
			// the cache must not answer for it either (a retried ADD
			// would be told an address no record in etcd guards).
			if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == it.h.Owner.Key() {
				ps.forget(old)
				a.logEnded(old, "lost: etcd no longer has it and it cannot be written back ("+conflict.Reason+")")
			}
		case err != nil:
			errs = append(errs, fmt.Errorf("reassert %s: %w", addr, err))
			if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == it.h.Owner.Key() {
				ps.unasserted[addr] = old
			}
		default:
			restored = append(restored, *al)
			a.logReasserted(al)
		}
	}
	if len(known) > 0 {
		if err := a.readBack(ctx, known); err != nil {
			errs = append(errs, fmt.Errorf("reassert: read back: %w", err))
		}
	}
	return restored, conflicts, errors.Join(errs...)
}

// reassertOwner writes back, as Reassert would, the allocations the
// cache holds for owner key whose records etcd lost and a Reassert could
// not write back (poolState.unasserted), before a request of the owner
// is planned: answered from the cache, a retried ADD would be told an
// address etcd holds for nobody, which another node may hand out. An
// address that cannot be written back (a conflict) is forgotten, and the
// request plans anew; one that fails now fails the request (try again).
func (a *Allocator) reassertOwner(ctx context.Context, ps *poolState, key string) error {
	var held []HeldAddr
	for addr, al := range ps.unasserted {
		if al.Owner.Key() == key {
			held = append(held, HeldAddr{Owner: al.Owner, Addr: addr, Identity: al.Identity, WindowSeconds: al.WindowSeconds})
		}
	}
	if len(held) == 0 {
		return nil
	}
	slices.SortFunc(held, func(x, y HeldAddr) int { return x.Addr.Compare(y.Addr) }) // a seed replays the same writes
	_, conflicts, err := a.reassert(ctx, held)
	for _, c := range conflicts {
		a.log.Warn("an address etcd lost cannot be written back; the owner's request plans anew", "owner", key, "ip", c.Addr, "reason", c.Reason)
	}
	if addr, ok := ps.unassertedFor(key); ok {
		return fmt.Errorf("etcd lost the record of %s's %s, and it cannot be written back now: %w", key, addr, errors.Join(records.ErrUnavailable, err))
	}
	return nil
}

// unassertedFor returns an address the cache holds for owner key whose
// record etcd lost and a Reassert could not write back yet.
func (ps *poolState) unassertedFor(key string) (netip.Addr, bool) {
	for addr, al := range ps.unasserted {
		if al.Owner.Key() == key {
			return addr, true
		}
	}
	return netip.Addr{}, false
}

// reassertWindow is the window of a sticky binding written back for a
// record that does not carry its own (written before records did).
const reassertWindow = time.Hour

// reassertRecord is the record written back for h: the cached one of its
// owner if the cache has it (identity and all), so the interval goes on;
// else a new one.
func (a *Allocator) reassertRecord(ps *poolState, h HeldAddr) records.Record {
	rec := records.Record{Owner: h.Owner, Node: a.cfg.Node, State: records.StateAllocated, Since: a.cfg.Now().UTC(),
		Identity: h.Identity, WindowSeconds: h.WindowSeconds}
	if old := ps.byAddr[h.Addr]; old != nil && old.Owner.Key() == h.Owner.Key() {
		rec = old.Record
		rec.Node, rec.State, rec.Borrowed = a.cfg.Node, records.StateAllocated, false
	}
	return rec
}

// reassertBinding decides how a record of a sticky identity is written
// back: with its binding when etcd lost that too (bind, naming held, what
// the owner's endpoint holds, and what the cache knows of the identity),
// as it is when the binding names the owner, and without its identity when
// the identity has moved on to another pod.
func (a *Allocator) reassertBinding(ctx context.Context, ps *poolState, rec *records.Record, held []netip.Addr) (*records.Binding, error) {
	if rec.Identity == "" {
		return nil, nil
	}
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.pool.Name, rec.Identity)
	switch {
	case err != nil:
		return nil, err
	case ok && b.Owner.Key() == rec.Owner.Key():
		return nil, nil
	case ok:
		a.log.Warn("sticky identity moved on while etcd had lost a running pod's record; written back without it",
			"identity", rec.Identity, "owner", rec.Owner.Key(), "now", b.Owner.Key())
		rec.Identity, rec.WindowSeconds = "", 0
		return nil, nil
	}
	window := rec.WindowSeconds
	if window == 0 {
		window = int64(reassertWindow / time.Second)
	}
	nb := &records.Binding{Identity: rec.Identity, Owner: rec.Owner, Node: a.cfg.Node, Since: a.cfg.Now().UTC(), WindowSeconds: window, Pool: ps.pool.Name}
	nb.Addrs = slices.Clone(held)
	for _, al := range ps.byOwner[rec.Owner.Key()] {
		if al.Identity == rec.Identity {
			nb.Addrs = append(nb.Addrs, al.Addr)
		}
	}
	slices.SortFunc(nb.Addrs, netip.Addr.Compare)
	nb.Addrs = slices.Compact(nb.Addrs)
	return nb, nil
}

// reassertOne writes back the allocation of h, missing from etcd, in
// block: fenced by this node's claim on it (claimed again if it is free),
// or borrowed again from the node that claims it. A write of unknown
// outcome is settled like any other. bound is what h's owner's endpoint
// holds in ps: a binding written back names it.
func (a *Allocator) reassertOne(ctx context.Context, ps *poolState, h HeldAddr, block netip.Prefix, bound []netip.Addr) (*records.Allocation, *Conflict, error) {
	addr := h.Addr
	rec := a.reassertRecord(ps, h)
	for attempt := 0; attempt < 2; attempt++ {
		ob, err := a.ownForReassert(ctx, ps, block)
		var nb *notOwnError
		switch {
		case errors.As(err, &nb) && nb.claimedBy != "":
			// A borrowed address: borrow it again.
			rec.Borrowed = true
			al, err := a.writeBorrowed(ctx, ps, block, addr, rec, false)
			if err != nil {
				return nil, nil, fmt.Errorf("borrowed from node %s: %w", nb.claimedBy, err)
			}
			return al, nil, nil
		case errors.As(err, &nb):
			return nil, &Conflict{HeldAddr: h, Pool: ps.pool.Name, Reason: nb.Error()}, nil
		case err != nil:
			return nil, nil, err
		}
		bind, err := a.reassertBinding(ctx, ps, &rec, bound)
		if err != nil {
			return nil, nil, err
		}
		w := records.IPWrite{Pool: ps.pool.Name, Block: block, ClaimRev: ob.claimRev, Addr: addr, Record: rec}
		var res records.WriteResult
		if bind != nil {
			res, err = a.cfg.Store.WriteBound(ctx, *bind, []records.IPWrite{w})
		} else {
			res, err = a.cfg.Store.WriteIPs(ctx, []records.IPWrite{w})
		}
		var we *records.WriteError
		switch {
		case errors.As(err, &we) && len(we.Fenced) > 0:
			// Our claim is gone: etcd lost it too (made after the
			// snapshot), or our lease ended with it. Give the block up
			// (what the cache knows of it stays: etcd may still hold
			// it, and a DEL must free it) and claim it again if it is
			// free; if it is our orphaned home, only Restore takes it.
			ps.loseBlock(block)
			continue
		case errors.Is(err, records.ErrConflict):
			// Written by someone meanwhile: the next pass reads who.
			return nil, nil, fmt.Errorf("taken meanwhile: %w", err)
		case outcomeUnknown(err):
			a.parkWrites(ps, []records.IPWrite{w})
			if serr := a.settlePending(ctx); serr != nil {
				return nil, nil, serr
			}
			if al := ps.byAddr[addr]; al != nil && sameRecord(al.Record, rec) {
				return al, nil, nil
			}
			return nil, nil, err
		case err != nil:
			// Refused before it was applied (etcd's load): nothing
			// written; the next pass tries again.
			return nil, nil, err
		}
		al := &records.Allocation{Record: rec, Pool: ps.pool.Name, Block: block, Addr: addr, Rev: res.Rev, Seen: a.cfg.Now()}
		ps.settleAt(addr, al, time.Time{}, a.cfg.Node)
		return al, nil, nil
	}
	return nil, nil, fmt.Errorf("block %s's claim changed twice: %w", block, records.ErrConflict)
}

// notOwnError says why a held address's block cannot be this node's;
// claimedBy is the node that claims it, if one does.
type notOwnError struct{ reason, claimedBy string }

func (e *notOwnError) Error() string { return e.reason }

// ownForReassert returns block as one of this node's, claiming it if it is
// free in etcd (no claim, no allocations): then nobody else can hold an
// address in it, and the node's endpoints that use it keep their
// addresses. A block another node claims, or that holds allocations
// without a claim, is not taken: the reason says so.
func (a *Allocator) ownForReassert(ctx context.Context, ps *poolState, block netip.Prefix) (*ownBlock, error) {
	if ob := ps.own[block]; ob != nil {
		return ob, nil
	}
	_, err := a.tryClaim(ctx, ps, block, nil)
	var ce *records.ClaimError
	switch {
	case err == nil:
		a.log.Warn("claimed a free block again: an endpoint uses it though etcd had no claim", "pool", ps.pool.Name, "block", block)
		// Free in etcd: nothing the cache still knew of it is held.
		ps.forgetBlock(block)
		return ps.own[block], nil
	case errors.As(err, &ce) && ce.ClaimedBy != "":
		return nil, &notOwnError{reason: fmt.Sprintf("block %s is claimed by node %s", block, ce.ClaimedBy), claimedBy: ce.ClaimedBy}
	case errors.As(err, &ce) && ce.NonEmpty && ce.HomeNode == a.cfg.Node:
		// Our own block, orphaned: the lease its claim was on is gone
		// (this node's, though the lease keeper may not know yet).
		// Restore re-claims it; the pods that use it keep their
		// addresses.
		return nil, fmt.Errorf("block %s is this node's but has no claim: %w", block, records.ErrLeaseLost)
	case errors.As(err, &ce):
		return nil, &notOwnError{reason: fmt.Sprintf("block %s is not this node's: it holds allocations and no claim", block)}
	}
	return nil, err
}

// markHeld keeps the held addresses of block out of ob's free list: an
// endpoint still uses them though the store has no allocation (yet).
func (a *Allocator) markHeld(block netip.Prefix, ob *ownBlock) {
	if a.cfg.Held == nil {
		return
	}
	for _, addr := range a.cfg.Held() {
		if addr = addr.Unmap(); block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
}
