package nodealloc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// A store call that fails with anything but a definite conflict (a
// deadline, a lost connection, a leader change) has an unknown outcome:
// etcd may have applied it. Treating it as failed would undo a write that
// landed; retrying would then give the owner a second address while the
// first stays in etcd. So every such call, of whatever kind (a create, a
// batch, a confirm, a release, a borrow, a keep, a takeover, a reassert),
// is settled one way: its addresses are parked (they stay marked, and the
// owner's requests wait), then read back, and the cache at each address is
// rebuilt from what etcd holds there, indexed by the record's own owner
// (settleAt). Whether the call landed is then read off the cache, never
// guessed from the shape of the write: a takeover that landed leaves the
// address indexed under its new owner, whoever was cached there before.

// outcomeUnknown reports whether a failed write may have been applied.
// Conflicts (failed compares, a reservation lease etcd no longer has) and
// writes the store refused before acting on them (records.ErrRefused:
// etcd's "too many requests") wrote nothing.
func outcomeUnknown(err error) bool {
	return err != nil && !errors.Is(err, records.ErrConflict) && !errors.Is(err, records.ErrRefused)
}

// park records a call of unknown outcome that wrote or deleted refs for
// the owner whose key is owner. Their addresses stay marked until settled.
func (a *Allocator) park(ps *poolState, owner, what string, refs ...records.IPRef) {
	for _, ref := range refs {
		delete(ps.planned, ref.Addr)
		ps.unknown[ref.Addr] = pending{ref: ref, owner: owner}
		a.log.Warn(what+" outcome unknown; settling it from etcd before the address is reused", "pool", ps.pool.Name, "ip", ref.Addr, "owner", owner)
	}
}

// parkWrites parks writes of unknown outcome.
func (a *Allocator) parkWrites(ps *poolState, writes []records.IPWrite) {
	for _, w := range writes {
		a.park(ps, w.Record.Owner.Key(), "write", records.IPRef{Pool: w.Pool, Block: w.Block, Addr: w.Addr})
	}
}

// refsOf names the keys of als.
func refsOf(als []*records.Allocation) []records.IPRef {
	refs := make([]records.IPRef, len(als))
	for i, al := range als {
		refs[i] = records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr}
	}
	return refs
}

// settlePending reads back every parked call's addresses, in one round
// trip, and rebuilds the cache at each from what etcd holds; then the
// claims of unknown outcome (settleClaims). If etcd cannot be read the
// calls stay parked and the error wraps ErrUnavailable.
func (a *Allocator) settlePending(ctx context.Context) error {
	var refs []records.IPRef
	for _, ps := range a.pools {
		for _, p := range ps.unknown {
			refs = append(refs, p.ref)
		}
	}
	// Settled (and cooled) in address order, not the map's.
	slices.SortFunc(refs, func(x, y records.IPRef) int { return cmp.Or(strings.Compare(x.Pool, y.Pool), x.Addr.Compare(y.Addr)) })
	if len(refs) > 0 {
		if err := a.readBack(ctx, refs); err != nil {
			return fmt.Errorf("%w: read back %d writes of unknown outcome: %w", records.ErrUnavailable, len(refs), err)
		}
	}
	a.settleClaims(ctx)
	return nil
}

// settleClaims reads back the claims of unknown outcome
// (poolState.claimsUnknown), as a parked address is read back: a claim
// held by this node on its current lease is adopted (its block's
// allocations read, the first address a claim carried among them), so
// the node writes into the block, gives it back when it empties, and
// does not keep it until a restart; a block claimed by nobody, or by
// another node, is dropped from the set. Without this a claim whose
// first address was read back, and its owner answered from it, was
// adopted only if the walk came back to its block. No owner waits on a
// claim, so an error is only logged: the claim stays unknown and the
// next settle reads it again. A block adopted empty (its first address
// released meanwhile) goes back as a release would have given it.
func (a *Allocator) settleClaims(ctx context.Context) {
	for _, ps := range a.pools {
		if len(ps.claimsUnknown) == 0 {
			continue
		}
		blocks := slices.Collect(maps.Keys(ps.claimsUnknown))
		got, err := a.cfg.Store.GetBlocks(ctx, ps.pool.Name, blocks)
		if err != nil {
			a.log.Warn("read back claims of unknown outcome; trying again at the next settle", "pool", ps.pool.Name, "blocks", len(blocks), "error", err)
			continue
		}
		for _, b := range blocks {
			info := got[b]
			if _, mine := ps.own[b]; mine || !info.Owned(a.cfg.Node) || info.ClaimLease != a.lease.ID() {
				delete(ps.claimsUnknown, b)
				if !mine && info.Claim != nil && !info.Owned(a.cfg.Node) {
					ps.noteOther(b, info.Claim.Node, false)
				}
				continue
			}
			a.log.Info("adopting own claim whose answer was lost", "pool", ps.pool.Name, "block", b, "rev", info.ClaimRev)
			if err := a.adoptBlock(ctx, ps, b, info.ClaimRev); err != nil {
				a.log.Warn("adopt own claim whose answer was lost; trying again at the next settle", "pool", ps.pool.Name, "block", b, "error", err)
				continue
			}
			a.maybeUnclaim(ctx, ps, b)
		}
	}
}

// readBack reads refs from etcd, with the expiry of their leases, and
// settles the cache at each address (settleAddr); parked calls at those
// addresses are settled with them. On an error nothing changes.
func (a *Allocator) readBack(ctx context.Context, refs []records.IPRef) error {
	got, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return err
	}
	als := make([]records.Allocation, 0, len(got))
	for _, al := range got {
		als = append(als, al)
	}
	exp, err := a.expiries(ctx, als)
	if err != nil {
		return err
	}
	now := a.cfg.Now()
	for _, ref := range refs {
		ps := a.pools[ref.Pool]
		if ps == nil {
			continue
		}
		delete(ps.unknown, ref.Addr)
		var cur *records.Allocation
		if al, ok := got[ref.Addr]; ok {
			al.Seen = now
			cur = &al
		}
		a.settleAddr(ps, ref.Addr, cur, exp)
	}
	return nil
}

// expiries asks etcd, once per lease, when the leases of als end: those
// of reservations and of kept records. A reservation read back from the
// store expires with its lease, so a retried ADD after a restart does not
// get one that has already lapsed.
func (a *Allocator) expiries(ctx context.Context, als []records.Allocation) (map[int64]time.Time, error) {
	out := map[int64]time.Time{}
	for _, al := range als {
		if _, done := out[al.Lease]; al.Lease != 0 && !done {
			exp, err := a.leaseEnd(ctx, al.Lease)
			if err != nil {
				return nil, err
			}
			out[al.Lease] = exp
		}
	}
	return out, nil
}

// leaseEnd is when a lease read back from the store has surely ended:
// LeaseExpiry answers in whole seconds, as etcd's TTL does, so the lease
// may last up to a second past it. Taken as the end, it let a
// reservation read back look lapsed while etcd still held it, and its
// owner's next request got a second address of the family
// (TestModelSimulated, seed 20261202).
func (a *Allocator) leaseEnd(ctx context.Context, lease int64) (time.Time, error) {
	exp, err := a.cfg.Store.LeaseExpiry(ctx, lease)
	if err != nil {
		return time.Time{}, err
	}
	return exp.Add(time.Second), nil
}

// settleAddr makes the cache at addr what etcd holds there (cur, or nil
// for nothing; exp the expiry of leases). An allocation the cache held at
// addr that etcd no longer has was released: its address cools. The bit
// of an own block's address stays marked while anything holds it.
func (a *Allocator) settleAddr(ps *poolState, addr netip.Addr, cur *records.Allocation, exp map[int64]time.Time) {
	var until time.Time
	if cur != nil {
		until = exp[cur.Lease]
	}
	dropped := ps.settleAt(addr, cur, until, a.cfg.Node)
	if dropped != nil && (cur == nil || dropped.Owner.Key() != cur.Owner.Key()) {
		how := "released"
		if cur != nil {
			how = "ended: etcd holds " + cur.Owner.Key() + " there now"
		}
		a.logEnded(dropped, how)
	}
	if cur != nil && cur.Node == a.cfg.Node && cur.ContainerID != "" && (dropped == nil || dropped.Rev != cur.Rev) && cur.State != records.StateKept {
		a.log.Info("settled from etcd", "pool", ps.pool.Name, "ip", addr, "owner", cur.Owner.Key(), "state", cur.State)
	}
	if cur != nil {
		return
	}
	// An allocation the cache held there was released: free (or cool) its
	// address as a release that answered would, whether or not its
	// endpoint is gone yet. An address nothing was cached at stays taken
	// while an endpoint uses it (Config.Held).
	_, ob := ps.ownBlockOf(addr)
	switch {
	case ob == nil || ps.planned[addr]:
	case dropped != nil && ps.pool.Cooldown() > 0:
		ps.coolAt(addr, a.cfg.Now())
	case dropped != nil || ps.cool.at[addr].IsZero() && !a.held(addr):
		ob.ba.Unmark(addr)
	}
}

// held reports whether an endpoint of this node uses addr (Config.Held).
func (a *Allocator) held(addr netip.Addr) bool { return a.heldSet()[addr] }

// heldSet is the set of addresses this node's endpoints use (Config.Held).
func (a *Allocator) heldSet() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if a.cfg.Held != nil {
		for _, h := range a.cfg.Held() {
			out[h.Unmap()] = true
		}
	}
	return out
}

// sameRecord reports whether two records are one write's.
func sameRecord(x, y records.Record) bool {
	return x.Owner == y.Owner && x.Node == y.Node && x.State == y.State && x.Since.Equal(y.Since)
}

// anyPending reports whether the owner has a parked write in any pool.
func (a *Allocator) anyPending(o records.Owner) bool {
	for _, ps := range a.pools {
		if ps.pendingFor(o.Key()) {
			return true
		}
	}
	return false
}

// learn corrects the cache from a failed write: blocks whose claim moved
// are no longer ours; addresses found taken are reloaded from the store.
// If a reload fails, the taken addresses are at least marked, so the retry
// does not pick them again.
func (a *Allocator) learn(ctx context.Context, err error) {
	var we *records.WriteError
	if !errors.As(err, &we) {
		return
	}
	if we.FenceLost {
		a.fenceRev = 0
	}
	for _, ps := range a.pools {
		for _, b := range we.Fenced {
			if _, ok := ps.own[b]; ok {
				a.log.Warn("lost claim on block (fenced write)", "pool", ps.pool.Name, "block", b)
				ps.loseBlock(b)
			}
		}
		for _, addr := range we.Taken {
			b, ob := ps.ownBlockOf(addr)
			if ob == nil {
				continue
			}
			if err := a.reloadBlock(ctx, ps, b); err != nil {
				a.log.Warn("reload block", "pool", ps.pool.Name, "block", b, "error", err)
				ob.ba.Mark(addr)
			}
		}
	}
}

// loseBlock gives up an own block whose claim this node no longer holds:
// nothing more is written into it. Its cached allocations stay known, so a
// DEL still releases them (a release is guarded by the allocation's own
// revision, not by the claim) and a retried ADD still finds them; Restore
// re-claims the block if it is still this node's home.
func (ps *poolState) loseBlock(b netip.Prefix) {
	delete(ps.own, b)
	ps.others[b] = otherBlock{node: "?"}
}
