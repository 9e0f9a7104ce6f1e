package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Restore and reassert: the node's state read back from the store after
// a start or a lost lease, stale bindings swept, and what the node's
// endpoints hold written back after etcd lost it.

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
	defer a.voice.say()
	a.restored = false
	a.lease = lease
	a.fence.rev = 0
	specs, err := a.cfg.Store.ListPools(ctx)
	if err != nil {
		return fmt.Errorf("restore: list pools: %w", err)
	}
	pools := make([]*planner.Pool, 0, len(specs))
	for _, p := range specs {
		ps := a.n.Read(p)
		// A re-claim that loses a race (the old lease expired between the
		// listing and the compare) is retried on a fresh listing.
		if err := retry.Do(ctx, a.cfg.RestoreRetry, func(ctx context.Context) error { return a.restorePool(ctx, ps) }); err != nil {
			return fmt.Errorf("restore pool %s: %w", p.Name, err)
		}
		// The addresses this node holds in other nodes' blocks.
		lent, err := a.cfg.Store.ListLent(ctx, p.Name)
		if err != nil {
			return fmt.Errorf("restore pool %s: borrowed addresses: %w", p.Name, err)
		}
		if refs := a.n.BorrowedRefs(ps, lent); len(refs) > 0 {
			got, err := a.cfg.Store.GetIPs(ctx, refs)
			if err != nil {
				return fmt.Errorf("restore pool %s: borrowed addresses: %w", p.Name, err)
			}
			var als []records.Allocation
			for _, al := range got {
				if al.Node == a.cfg.Node && al.ContainerID != "" && al.State != records.StateKept {
					als = append(als, al)
				}
			}
			exp, err := a.reads.expiries(ctx, als)
			if err != nil {
				return fmt.Errorf("restore pool %s: borrowed addresses: %w", p.Name, err)
			}
			a.n.Borrowed(ps, got, exp)
		}
		pools = append(pools, ps)
	}
	a.n.Replace(pools)
	a.restored = true
	for _, ps := range pools {
		a.sweepBindings(ctx, ps)
	}
	// A pool that is disabled, or whose selector no longer chooses this
	// node (relabelled while it was away), gets its empty blocks back;
	// so do a pool's draining cidrs.
	for _, ps := range pools {
		a.claims.giveBackEmpty(ctx, ps)
	}
	return nil
}

// restorePool makes ps match the store for one listing. Blocks already
// adopted by an earlier pass are kept. It returns an error wrapping
// ErrConflict if one of the node's own non-empty blocks could not be
// re-claimed in this pass.
func (a *Allocator) restorePool(ctx context.Context, ps *planner.Pool) error {
	pool := ps.Spec().Name
	infos, err := a.cfg.Store.ListBlocks(ctx, pool)
	if err != nil {
		return err
	}
	var lost []error
	for _, info := range infos {
		switch a.n.RestoreStep(ps, info, a.lease.ID()) {
		case planner.Skip:
			continue
		case planner.AdoptBlock:
		case planner.Reclaim:
			rev, err := a.cfg.Store.Reclaim(ctx, pool, info, a.n.ClaimRecord(a.cfg.BootID), a.lease.ID())
			var ce *records.ClaimError
			if errors.As(err, &ce) {
				ps.ClaimLost(info.Block, ce.ClaimedBy, ce.NonEmpty)
				if ce.NonEmpty {
					a.log.Warn("could not re-claim own block that holds allocations", "pool", pool, "block", info.Block, "reason", ce.Error())
					lost = append(lost, fmt.Errorf("re-claim own block %s: %w", info.Block, err))
				}
				continue
			}
			if err != nil {
				return err
			}
			a.log.Info("re-claimed block", "pool", pool, "block", info.Block, "orphaned", info.Claim == nil)
			info.ClaimRev = rev
		case planner.HomeTaken:
			// If the block holds allocations, this node cannot serve
			// its pods.
			ips, err := a.cfg.Store.ListIPs(ctx, pool, info.Block)
			if err != nil {
				return err
			}
			if len(ips) > 0 {
				ce := &records.ClaimError{Block: info.Block, ClaimedBy: info.Claim.Node, NonEmpty: true, HomeNode: a.cfg.Node}
				a.log.Error("own block that holds allocations is claimed by another node", "pool", pool, "block", info.Block, "claimed_by", info.Claim.Node, "allocations", len(ips))
				lost = append(lost, fmt.Errorf("re-claim own block %s: %w", info.Block, ce))
			}
			continue
		}
		if err := a.reads.loadBlock(ctx, ps, info.Block, info.ClaimRev); err != nil {
			return err
		}
	}
	return errors.Join(lost...)
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
// (the planner's sticky.go).
func (a *Allocator) sweepBindings(ctx context.Context, ps *planner.Pool) {
	ctx, cancel := context.WithTimeout(ctx, sweepBudget)
	defer cancel()
	var bs []records.Binding
	err := retry.Do(ctx, sweepRetry, func(ctx context.Context) (err error) {
		bs, err = a.cfg.Store.ListBindings(ctx, ps.Spec().Name)
		return err
	})
	if err != nil {
		a.log.Warn("cannot list sticky bindings to drop stale ones", "pool", ps.Spec().Name, "error", err)
		return
	}
	// One read of every address the node's bindings name.
	var mine []records.Binding
	refs := map[string][]records.IPRef{} // by identity
	var all []records.IPRef
	held := a.n.HeldSet()
	for _, b := range bs {
		if b.Node != a.cfg.Node || b.Kept() || planner.HeldAny(b, held) {
			continue
		}
		for _, addr := range b.Addrs {
			if blk, ok := ps.Spec().BlockFor(addr); ok {
				ref := records.IPRef{Pool: ps.Spec().Name, Block: blk, Addr: addr}
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
		a.log.Warn("cannot read sticky bindings' addresses to drop stale ones", "pool", ps.Spec().Name, "error", err)
		return
	}
	for _, b := range mine {
		err := a.dropBinding(ctx, ps, b.Identity, b.Owner, &sweepRead{b: b, refs: refs[b.Identity], cur: cur, held: held})
		if err != nil {
			a.log.Warn("stale sticky binding left to the DEL that names its identity, or to its next pod", "pool", ps.Spec().Name, "identity", b.Identity, "owner", b.Owner.Key(), "error", err)
		}
	}
}

// Re-asserting what the node's endpoints hold. etcd restored from an
// older snapshot has lost every allocation made since: their pods still
// run with the addresses, which etcd now calls free. The agent compares
// its endpoints with etcd (Reassert) and writes back each missing
// allocation whose address lies in a block this node holds the claim on:
// the write is fenced by that claim, so nobody else can have allocated
// from the block meanwhile. An address free in a block another node
// claims was borrowed (allocate.go): it is borrowed again, by the same
// create-if-absent. An address held by another owner in etcd, or in
// another node's orphaned block, is a conflict: nothing is written, and
// the agent reports it; an address whose record names the owner as its
// live migration's alternate (cut over away) is held, and read back. This node's own orphaned block means its lease
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
	defer a.voice.say()
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
		ps    *planner.Pool
		block netip.Prefix
	}
	var items []item
	var refs []records.IPRef
	for _, h := range held {
		addr := h.Addr.Unmap()
		ps, b, ok := a.n.PoolOf(addr)
		if !ok {
			conflicts = append(conflicts, Conflict{HeldAddr: h, Reason: "the address is in none of this node's pools"})
			continue
		}
		h.Addr = addr
		it := item{h: h, ps: ps, block: b}
		items = append(items, it)
		refs = append(refs, records.IPRef{Pool: ps.Spec().Name, Block: b, Addr: addr})
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
			k := it.ps.Spec().Name + "/" + it.h.Owner.Key()
			bound[k] = append(bound[k], it.h.Addr)
		}
	}
	var errs []error
	var known []records.IPRef // the owner's in etcd, not (so) in the cache
	for _, it := range items {
		ps, addr := it.ps, it.h.Addr
		ps.Asserting(addr) // settled below, or marked again
		if al, ok := cur[addr]; ok {
			switch c := ps.At(addr); {
			case al.Alternate != nil && al.Alternate.Owner.Key() == it.h.Owner.Key() && al.Owner.Key() != it.h.Owner.Key():
				// Cut over away: held as the alternate; the cache learns who forwards.
				if c == nil || c.Rev != al.Rev {
					known = append(known, records.IPRef{Pool: ps.Spec().Name, Block: it.block, Addr: addr})
				}
			case al.Owner.Key() != it.h.Owner.Key():
				conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.Spec().Name, HeldBy: &al,
					Reason: fmt.Sprintf("held by %s on node %s", al.Owner.Key(), al.Node)})
			case c == nil || c.Rev != al.Rev:
				known = append(known, records.IPRef{Pool: ps.Spec().Name, Block: it.block, Addr: addr})
			}
			continue
		}
		if other := a.n.Live(ps, it.h.Owner, allocator.FamilyOf(it.h.Addr), it.h.Addr); other != nil {
			// The owner holds another address of the family now (its
			// ADD was retried after this one's reservation was gone):
			// writing addr back would give it two.
			conflicts = append(conflicts, Conflict{HeldAddr: it.h, Pool: ps.Spec().Name, HeldBy: other,
				Reason: fmt.Sprintf("%s holds %s of that family now", it.h.Owner.Key(), other.Addr)})
			continue
		}
		al, conflict, err := a.reassertOne(ctx, ps, it.h, it.block, bound[ps.Spec().Name+"/"+it.h.Owner.Key()])
		switch {
		case conflict != nil:
			conflicts = append(conflicts, *conflict)
			// etcd holds nothing there and nothing may be written back:
			// the cache must not answer for it either (a retried ADD
			// would be told an address no record in etcd guards).
			a.n.Lost(ps, addr, it.h.Owner.Key(), conflict.Reason)
		case err != nil:
			errs = append(errs, fmt.Errorf("reassert %s: %w", addr, err))
			ps.Unasserting(addr, it.h.Owner.Key())
		default:
			restored = append(restored, *al)
			a.n.Reasserted(al)
		}
	}
	if len(known) > 0 {
		if err := a.reads.readBack(ctx, known); err != nil {
			errs = append(errs, fmt.Errorf("reassert: read back: %w", err))
		}
	}
	return restored, conflicts, errors.Join(errs...)
}

// reassertOne writes back the allocation of h, missing from etcd, in
// block: fenced by this node's claim on it (claimed again if it is free
// in etcd: no claim, no allocations; then nobody else can hold an address
// in it, and the node's endpoints that use it keep their addresses), or
// borrowed again from the node that claims it. A block that holds
// allocations without a claim is not taken: a conflict, or, if it is
// this node's own orphaned block, its lease is gone (Restore re-claims
// it). A write of unknown outcome is settled like any other. bound is
// what h's owner's endpoint holds in ps: a binding written back names it.
func (a *Allocator) reassertOne(ctx context.Context, ps *planner.Pool, h HeldAddr, block netip.Prefix, bound []netip.Addr) (*records.Allocation, *Conflict, error) {
	addr, pool := h.Addr, ps.Spec().Name
	rec := a.n.ReassertRecord(ps, h.Owner, addr, h.Identity, h.WindowSeconds)
	for attempt := 0; attempt < 2; attempt++ {
		if !ps.Owns(block) {
			_, err := a.claims.claim(ctx, ps, block, nil)
			var ce *records.ClaimError
			switch {
			case err == nil:
				a.log.Warn("claimed a free block again: an endpoint uses it though etcd had no claim", "pool", pool, "block", block)
				// Free in etcd: nothing the cache still knew of it is held.
				ps.ForgetBlock(block)
			case errors.As(err, &ce) && ce.ClaimedBy != "":
				// A borrowed address: borrow it again.
				rec.Borrowed = true
				al, err := a.writeBorrowed(ctx, ps, block, addr, rec, false)
				if err != nil {
					return nil, nil, fmt.Errorf("borrowed from node %s: %w", ce.ClaimedBy, err)
				}
				return al, nil, nil
			case errors.As(err, &ce) && ce.NonEmpty && ce.HomeNode == a.cfg.Node:
				return nil, nil, fmt.Errorf("block %s is this node's but has no claim: %w", block, records.ErrLeaseLost)
			case errors.As(err, &ce):
				return nil, &Conflict{HeldAddr: h, Pool: pool, Reason: fmt.Sprintf("block %s is not this node's: it holds allocations and no claim", block)}, nil
			default:
				return nil, nil, err
			}
		}
		var bind *records.Binding
		if rec.Identity != "" {
			b, ok, err := a.cfg.Store.GetBinding(ctx, pool, rec.Identity)
			if err != nil {
				return nil, nil, err
			}
			bind = a.n.ReassertBinding(ps, &rec, bound, b, ok)
		}
		w := records.IPWrite{Pool: pool, Block: block, ClaimRev: ps.ClaimRev(block), Addr: addr, Record: rec}
		var res records.WriteResult
		var err error
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
			ps.LoseBlock(block)
			continue
		case errors.Is(err, retry.ErrConflict):
			// Written by someone meanwhile: the next pass reads who.
			return nil, nil, fmt.Errorf("taken meanwhile: %w", err)
		case planner.OutcomeUnknown(err):
			a.n.ParkWrites([]records.IPWrite{w})
			if serr := a.settlePending(ctx); serr != nil {
				return nil, nil, serr
			}
			if al := ps.At(addr); al != nil && planner.SameRecord(al.Record, rec) {
				return al, nil, nil
			}
			return nil, nil, err
		case err != nil:
			// Refused before it was applied (etcd's load): nothing
			// written; the next pass tries again.
			return nil, nil, err
		}
		al := &records.Allocation{Record: rec, Pool: pool, Block: block, Addr: addr, Rev: res.Rev, Seen: a.cfg.Now()}
		a.n.Settle(ps, al)
		return al, nil, nil
	}
	return nil, nil, fmt.Errorf("block %s's claim changed twice: %w", block, retry.ErrConflict)
}
