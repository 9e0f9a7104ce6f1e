package allocator

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
)

// Re-asserting what the node's endpoints hold. etcd restored from an
// older snapshot has lost every allocation made since: their pods still
// run with the addresses, which etcd now calls free. The agent compares
// its endpoints with etcd (Reassert) and writes back each missing
// allocation whose address lies in a block this node holds the claim on:
// the write is fenced by that claim, so nobody else can have allocated
// from the block meanwhile. An address free in a block another node
// claims was borrowed (borrow.go): it is borrowed again, by the same
// create-if-absent. An address held by another owner in etcd, or in an
// orphaned block, is a conflict: nothing is written, and the agent
// reports it. Until Reassert has run, the allocator keeps
// the endpoints' addresses out of its free lists (NodeConfig.Held), so it
// never hands one out again.

// HeldAddr is an address a local endpoint uses, and its owner.
type HeldAddr struct {
	Owner Owner
	Addr  netip.Addr
}

// Conflict is a held address that could not be re-asserted.
type Conflict struct {
	HeldAddr
	Pool   string
	Reason string
	// HeldBy is the allocation etcd has for the address, if any.
	HeldBy *Allocation
}

// Reassert checks every held address against the store and writes back
// the allocations that are missing from it where it may (see above). It
// returns the allocations it wrote back and the conflicts; an error means
// etcd could not be read or written (try again later).
func (a *NodeAllocator) Reassert(ctx context.Context, held []HeldAddr) (restored []Allocation, conflicts []Conflict, err error) {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.ready(); err != nil {
		return nil, nil, err
	}
	type item struct {
		h     HeldAddr
		ps    *poolState
		block netip.Prefix
	}
	var items []item
	var refs []IPRef
	for _, h := range held {
		addr := h.Addr.Unmap()
		var it *item
		for _, ps := range a.pools {
			if b, ok := ps.pool.BlockFor(addr); ok {
				it = &item{h: HeldAddr{Owner: h.Owner, Addr: addr}, ps: ps, block: b}
				break
			}
		}
		if it == nil {
			conflicts = append(conflicts, Conflict{HeldAddr: h, Reason: "the address is in none of this node's pools"})
			continue
		}
		items = append(items, *it)
		refs = append(refs, IPRef{Pool: it.ps.pool.Name, Block: it.block, Addr: addr})
	}
	if len(refs) == 0 {
		return nil, conflicts, nil
	}
	cur, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return nil, nil, fmt.Errorf("reassert: read allocations: %w", err)
	}
	var errs []error
	for _, it := range items {
		ps, addr := it.ps, it.h.Addr
		if al, ok := cur[addr]; ok {
			if al.Owner.Key() != it.h.Owner.Key() {
				conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.pool.Name, HeldBy: &al,
					Reason: fmt.Sprintf("held by %s on node %s", al.Owner.Key(), al.Node)})
			}
			continue
		}
		rec := Record{Owner: it.h.Owner, Node: a.cfg.Node, State: StateAllocated, Since: a.cfg.Now().UTC()}
		if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == it.h.Owner.Key() {
			rec.Since = old.Since // the interval goes on
		}
		var res WriteResult
		var werr error
		lender := ""
		for attempt := 0; attempt < 2; attempt++ {
			ob, err := a.ownForReassert(ctx, ps, it.block)
			var nb *notOwnError
			if errors.As(err, &nb) && nb.claimedBy != "" {
				lender = nb.claimedBy // a borrowed address: borrow it again
				break
			}
			if err != nil {
				werr = err
				break
			}
			res, werr = a.cfg.Store.WriteIPs(ctx, []IPWrite{{Pool: ps.pool.Name, Block: it.block, ClaimRev: ob.claimRev, Addr: addr, Record: rec}})
			var we *WriteError
			if errors.As(werr, &we) && len(we.Fenced) > 0 {
				// etcd lost our claim too (made after the snapshot):
				// forget it and claim the block again if it is free.
				ps.forgetBlock(it.block)
				delete(ps.own, it.block)
				werr = fmt.Errorf("block %s's claim changed twice: %w", it.block, ErrConflict) // the next pass tries again
				continue
			}
			break
		}
		if lender != "" {
			rec.Borrowed = true
			al, err := a.writeBorrowed(ctx, ps, it.block, addr, rec, false)
			if err != nil {
				errs = append(errs, fmt.Errorf("reassert %s borrowed from node %s: %w", addr, lender, err))
				continue
			}
			restored = append(restored, *al)
			a.logReasserted(al)
			continue
		}
		var we *WriteError
		var nb *notOwnError
		switch {
		case errors.As(werr, &nb):
			conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.pool.Name, Reason: nb.Error()})
			continue
		case errors.As(werr, &we):
			// Written by someone meanwhile: the next pass reads who.
			errs = append(errs, fmt.Errorf("reassert %s: taken meanwhile: %w", addr, ErrConflict))
			continue
		case werr != nil:
			errs = append(errs, fmt.Errorf("reassert %s: %w", addr, werr))
			continue
		}
		ob := ps.own[it.block]
		al := &Allocation{Record: rec, Pool: ps.pool.Name, Block: it.block, Addr: addr, Rev: res.Rev, Seen: a.cfg.Now()}
		if old := ps.byAddr[addr]; old != nil {
			ps.forget(old)
		}
		ps.remember(al, res.Expires)
		ob.ba.Mark(addr)
		restored = append(restored, *al)
		a.logReasserted(al)
	}
	return restored, conflicts, errors.Join(errs...)
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
func (a *NodeAllocator) ownForReassert(ctx context.Context, ps *poolState, block netip.Prefix) (*ownBlock, error) {
	if ob := ps.own[block]; ob != nil {
		return ob, nil
	}
	err := a.tryClaim(ctx, ps, block)
	var ce *ClaimError
	switch {
	case err == nil:
		a.log.Warn("claimed a free block again: an endpoint uses it though etcd had no claim", "pool", ps.pool.Name, "block", block)
		return ps.own[block], nil
	case errors.As(err, &ce) && ce.ClaimedBy != "":
		return nil, &notOwnError{reason: fmt.Sprintf("block %s is claimed by node %s", block, ce.ClaimedBy), claimedBy: ce.ClaimedBy}
	case errors.As(err, &ce):
		return nil, &notOwnError{reason: fmt.Sprintf("block %s is not this node's: it holds allocations and no claim", block)}
	}
	return nil, err
}

// markHeld keeps the held addresses of block out of ob's free list: an
// endpoint still uses them though the store has no allocation (yet).
func (a *NodeAllocator) markHeld(block netip.Prefix, ob *ownBlock) {
	if a.cfg.Held == nil {
		return
	}
	for _, addr := range a.cfg.Held() {
		if addr = addr.Unmap(); block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
}
