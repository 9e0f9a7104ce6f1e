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

// Reads that fold into the cache, and the settling of calls of unknown
// outcome (the planner's settle.go says why every such call is settled
// by reading it back, whatever its kind).

// cacheReader reads from the store what the planner's cache needs and
// folds it in: read-backs and block loads. It needs the store's reads
// and the planner, nothing else; its caller holds mu.
type cacheReader struct {
	st Store
	n  *planner.Node
}

// readBack reads refs from etcd, with the expiry of their leases, and
// settles the cache at each address; parked calls at those addresses are
// settled with them. On an error nothing changes.
func (r cacheReader) readBack(ctx context.Context, refs []records.IPRef) error {
	got, err := r.st.GetIPs(ctx, refs)
	if err != nil {
		return err
	}
	als := make([]records.Allocation, 0, len(got))
	for _, al := range got {
		als = append(als, al)
	}
	exp, err := r.expiries(ctx, als)
	if err != nil {
		return err
	}
	r.n.ReadBack(refs, got, exp)
	return nil
}

// expiries asks etcd, once per lease, when the leases of als end: those
// of reservations and of kept records. A reservation read back from the
// store expires with its lease, so a retried ADD after a restart does not
// get one that has already lapsed.
//
// A lease is taken to end a second after the time the store answers:
// LeaseExpiry answers in whole seconds, as etcd's TTL does, so the lease
// may last up to a second past it. Taken as the end, it let a
// reservation read back look lapsed while etcd still held it, and its
// owner's next request got a second address of the family (found by
// TestModelSimulated, seed 20261202).
func (r cacheReader) expiries(ctx context.Context, als []records.Allocation) (map[int64]time.Time, error) {
	out := map[int64]time.Time{}
	for _, al := range als {
		if _, done := out[al.Lease]; al.Lease != 0 && !done {
			exp, err := r.st.LeaseExpiry(ctx, al.Lease)
			if err != nil {
				return nil, err
			}
			out[al.Lease] = exp.Add(time.Second)
		}
	}
	return out, nil
}

// loadBlock reads block's allocations and the expiry of their leases, and
// only then replaces the cache of the block: an own block's (claimRev 0),
// or a block adopted as own at claimRev. It is the repair path whenever a
// write finds the cache wrong. If a read fails the cache is left as it
// was: a stale entry costs a failed write later, a missing one would cost
// a running pod its address.
func (r cacheReader) loadBlock(ctx context.Context, ps *planner.Pool, block netip.Prefix, claimRev int64) error {
	if claimRev == 0 && !ps.Owns(block) {
		return nil
	}
	allocs, err := r.st.ListIPs(ctx, ps.Spec().Name, block)
	if err != nil {
		return err
	}
	expiry, err := r.expiries(ctx, allocs)
	if err != nil {
		return err
	}
	if claimRev == 0 {
		r.n.Load(ps, block, allocs, expiry)
		return nil
	}
	return r.n.Adopt(ps, block, claimRev, allocs, expiry)
}

// thawKept frees own-block addresses of family f whose kept window has
// ended, once etcd confirms the record is gone.
func (r cacheReader) thawKept(ctx context.Context, ps *planner.Pool, f allocator.Family) {
	refs := r.n.KeptEnded(ps, f)
	if len(refs) == 0 {
		return
	}
	if cur, err := r.st.GetIPs(ctx, refs); err == nil {
		r.n.KeptRead(ps, refs, cur)
	}
}

// settlePending reads back every parked call's addresses, in one round
// trip, and rebuilds the cache at each from what etcd holds; then the
// claims of unknown outcome. If etcd cannot be read the calls stay parked
// and the error wraps ErrUnavailable.
//
// A claim of unknown outcome is read back as a parked address is: held by
// this node on its current lease it is adopted (its block's allocations
// read, the first address a claim carried among them), so the node writes
// into the block, gives it back when it empties, and does not keep it
// until a restart; a block claimed by nobody, or by another node, is
// dropped from the set. No owner waits on a claim, so an error there is
// only logged: the claim stays unknown and the next settle reads it
// again. A block adopted empty (its first address released meanwhile)
// goes back as a release would have given it.
func (a *Allocator) settlePending(ctx context.Context) error {
	defer a.voice.say()
	if refs := a.n.Parked(); len(refs) > 0 {
		if err := a.reads.readBack(ctx, refs); err != nil {
			return fmt.Errorf("%w: read back %d writes of unknown outcome: %w", retry.ErrUnavailable, len(refs), err)
		}
	}
	for _, ps := range a.n.Pools() {
		blocks := ps.ClaimsUnknown()
		if len(blocks) == 0 {
			continue
		}
		got, err := a.cfg.Store.GetBlocks(ctx, ps.Spec().Name, blocks)
		if err != nil {
			a.log.Warn("read back claims of unknown outcome; trying again at the next settle", "pool", ps.Spec().Name, "blocks", len(blocks), "error", err)
			continue
		}
		for _, b := range blocks {
			info := got[b]
			info.Block = b
			if !ps.ClaimSettled(info, a.cfg.Node, a.lease.ID()) {
				continue
			}
			a.log.Info("adopting own claim whose answer was lost", "pool", ps.Spec().Name, "block", b, "rev", info.ClaimRev)
			if err := a.reads.loadBlock(ctx, ps, b, info.ClaimRev); err != nil {
				a.log.Warn("adopt own claim whose answer was lost; trying again at the next settle", "pool", ps.Spec().Name, "block", b, "error", err)
				continue
			}
			a.claims.unclaim(ctx, ps, b)
		}
	}
	return nil
}

// learn corrects the cache from a failed write: blocks whose claim moved
// are no longer ours; blocks where addresses were found taken are read
// again. If a read fails, the taken address is at least marked, so the
// retry does not pick it again. It reports whether the write found the
// node's borrow fence gone.
func (r cacheReader) learn(ctx context.Context, err error) (fenceLost bool) {
	var we *records.WriteError
	if !errors.As(err, &we) {
		return false
	}
	for _, l := range r.n.Learn(we) {
		if err := r.loadBlock(ctx, l.Pool, l.Block, 0); err != nil {
			r.n.Note(planner.Warn, "reload block", "pool", l.Pool.Spec().Name, "block", l.Block, "error", err)
			l.Pool.MarkTaken(l.Addr)
		}
	}
	return we.FenceLost
}
