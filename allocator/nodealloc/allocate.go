package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// The ADD: a request is planned (package planner), the planner's needs
// met (a block claimed, an address borrowed, a binding read), its writes
// sent in one transaction with the batch's, and its reservation
// confirmed (confirm.go's half lives here too: it is the ADD's second
// write).

// Outcome is one request's answer in a batch.
type Outcome struct {
	Result Result
	Err    error
}

// Allocate serves one request. A retried request for the same owner gets
// the same addresses back.
func (a *Allocator) Allocate(ctx context.Context, req Request) (Result, error) {
	out := a.AllocateBatch(ctx, []Request{req})
	return out[0].Result, out[0].Err
}

// MaxBatch is the most requests AllocateBatch puts in one transaction.
// etcd refuses a transaction with more than --max-txn-ops (default 128)
// compares or operations; a dual-stack request is two writes and two
// compares, and each block adds a fence compare.
const MaxBatch = 48

// AllocateBatch serves many requests with one store transaction per
// MaxBatch requests. If a transaction fails (a race, a fence, a taken
// address), each of its requests is retried on its own so that one bad
// request cannot fail the others. Requests for the same owner in one
// batch are served in order.
func (a *Allocator) AllocateBatch(ctx context.Context, reqs []Request) []Outcome {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	defer a.flight.mark(reqs)()
	out := make([]Outcome, 0, len(reqs))
	for chunk := range slices.Chunk(reqs, MaxBatch) {
		out = append(out, a.allocateChunk(ctx, chunk)...)
	}
	return out
}

func (a *Allocator) allocateChunk(ctx context.Context, reqs []Request) []Outcome {
	out := make([]Outcome, len(reqs))
	if err := a.ready(); err != nil {
		for i := range out {
			out[i].Err = err
		}
		return out
	}
	// Earlier writes of unknown outcome are settled first, so that an
	// owner's retry finds the address that landed.
	pendErr := a.settlePending(ctx)
	plans := make([]*planner.Plan, len(reqs))
	var writes []records.IPWrite
	var later []int // a second request of an owner waits for the first
	var unavailable []int
	befores := map[int]map[netip.Addr]bool{}
	planned := map[string]bool{}
	for i, r := range reqs {
		k := r.Pool + "\x00" + r.Owner.Key()
		if planned[k] || r.Sticky != nil { // sticky ones go alone, with their binding
			planned[k] = true
			later = append(later, i)
			continue
		}
		planned[k] = true
		before := a.n.HeldBy(r)
		p, err := a.plan(ctx, r, pendErr, before)
		if errors.Is(err, retry.ErrUnavailable) {
			// etcd did not answer in time: the request is tried again on
			// its own, inside its deadline (allocateOne).
			unavailable = append(unavailable, i)
			befores[i] = before
			continue
		}
		if err != nil {
			out[i].Err = err
			continue
		}
		plans[i] = p
		writes = append(writes, p.Writes...)
	}
	defer func() {
		for _, i := range unavailable {
			out[i].Result, out[i].Err = a.allocateOne(ctx, reqs[i], befores[i])
		}
		for _, i := range later {
			out[i].Result, out[i].Err = a.allocateOne(ctx, reqs[i], nil)
		}
	}()
	var res records.WriteResult
	var err error
	if len(writes) > 0 { // else every address was reused, or written with its claim
		res, err = a.cfg.Store.WriteIPs(ctx, writes)
	}
	switch {
	case err == nil:
		for i, p := range plans {
			if p != nil {
				out[i].Result = a.n.Commit(p, res)
			}
		}
	case planner.OutcomeUnknown(err):
		// The transaction may have committed: nothing is undone before a
		// read of etcd says what landed.
		for _, p := range plans {
			if p != nil {
				a.n.ParkWrites(p.Writes)
			}
		}
		// On an error they stay parked: allocateOne settles them first.
		_ = a.settlePending(ctx)
		for i, p := range plans {
			if p == nil {
				continue
			}
			if r, ok := a.n.Landed(p); ok {
				out[i].Result = r
				continue
			}
			// Not settled or not landed: tried again on its own,
			// which settles first, inside the request's deadline.
			out[i].Result, out[i].Err = a.allocateOne(ctx, p.Req, p.Before)
		}
	default:
		for _, p := range slices.Backward(plans) {
			if p != nil {
				a.n.Undo(p)
			}
		}
		a.fence.lostIf(a.reads.learn(ctx, err))
		for i, p := range plans {
			if p != nil {
				out[i].Result, out[i].Err = a.allocateOne(ctx, p.Req, p.Before)
			}
		}
	}
	return out
}

// allocateOne plans and writes one request, retrying lost races. A race
// lost only to addresses taken meanwhile (by a borrower, or a node whose
// claim this one's cache did not know yet) teaches the node those
// addresses, so it is retried at once and does not count against
// WriteRetry: like the claim loop, it ends with an address, an exhausted
// pool or the caller's context.
//
// before is what the owner held when its request came in (nil: now).
func (a *Allocator) allocateOne(ctx context.Context, req Request, before map[netip.Addr]bool) (Result, error) {
	var out Result
	if before == nil {
		before = a.n.HeldBy(req)
	}
	pol := a.cfg.WriteRetry
	// An etcd that did not answer in time (too many requests, a call
	// past its timeout, a read back that met a loaded etcd) is tried
	// again inside the request's deadline; settlePending, at the start
	// of each attempt, reads back what an earlier attempt left unknown.
	pol.Unavailable = true
	// write sends a plan's writes, with its binding if it has one.
	write := func(ctx context.Context, p *planner.Plan) (records.WriteResult, error) {
		switch {
		case p.Bind != nil:
			return a.cfg.Store.WriteBound(ctx, *p.Bind, p.Writes)
		case len(p.Writes) == 0: // every address reused, or written with its claim
			return records.WriteResult{}, nil
		}
		return a.cfg.Store.WriteIPs(ctx, p.Writes)
	}
	err := retry.Do(ctx, pol, func(ctx context.Context) error {
		if err := a.ready(); err != nil {
			return err
		}
		p, err := a.plan(ctx, req, a.settlePending(ctx), before)
		if err != nil {
			return err
		}
		res, err := write(ctx, p)
		for planner.OnlyTaken(err) && ctx.Err() == nil {
			a.n.Undo(p)
			a.fence.lostIf(a.reads.learn(ctx, err))
			if p, err = a.plan(ctx, req, a.settlePending(ctx), before); err != nil {
				return err
			}
			res, err = write(ctx, p)
		}
		if err == nil {
			out = a.n.Commit(p, res)
			return nil
		}
		if !planner.OutcomeUnknown(err) {
			a.n.Undo(p)
			a.fence.lostIf(a.reads.learn(ctx, err))
			return err
		}
		a.n.ParkWrites(p.Writes)
		if serr := a.settlePending(ctx); serr != nil {
			return serr
		}
		if r, ok := a.n.Landed(p); ok {
			out = r
			return nil
		}
		return err // it did not land; the caller may try again
	})
	if err != nil {
		// An attempt may have borrowed an address before a later one
		// failed: give it back, so the request leaves what it found.
		err = a.giveBack(ctx, a.n.BorrowedSince(req, before), err)
		return Result{}, fmt.Errorf("allocate in pool %s for %s: %w", req.Pool, req.Owner.Key(), err)
	}
	return out, nil
}

// plan plans r with the planner, meeting each need it reports. pendErr is
// the error of the last attempt to settle writes of unknown outcome. A
// plan that fails is abandoned: its marks undone, what it borrowed given
// back. before is what the owner held when the request came in (Plan.Before).
func (a *Allocator) plan(ctx context.Context, r Request, pendErr error, before map[netip.Addr]bool) (*planner.Plan, error) {
	defer a.voice.say() // in order with the driver's own lines
	p, err := a.n.Start(r, pendErr)
	if err != nil {
		return nil, err
	}
	p.Before = before
	for {
		need, err := a.n.Advance(p)
		if err == nil && need.Kind == planner.Done {
			return p, nil
		}
		if err == nil {
			err = a.fulfil(ctx, p, need)
		}
		if err != nil {
			a.n.Undo(p)
			lent := p.Lent
			p.Lent = nil
			return nil, a.giveBack(ctx, lent, err)
		}
	}
}

// fulfil does what a plan needs of the store and folds the answer into
// it. An error ends the plan; an answer the planner judges (a claim or
// a borrow that failed) is folded.
func (a *Allocator) fulfil(ctx context.Context, p *planner.Plan, need planner.Need) error {
	ps, f := p.Pool(), need.Family
	switch need.Kind {
	case planner.Reassert:
		// Write back, as Reassert would, the owner's cached allocations
		// whose records etcd lost and a Reassert could not write back:
		// answered from the cache, a retried ADD would be told an
		// address etcd holds for nobody, which another node may hand
		// out. An address that cannot be written back (a conflict) is
		// forgotten, and the request plans anew; one that fails now
		// fails the request (try again).
		key := p.Req.Owner.Key()
		var held []HeldAddr
		for _, u := range ps.UnassertedOf(key) {
			held = append(held, HeldAddr{Owner: u.Owner, Addr: u.Addr, Identity: u.Identity, WindowSeconds: u.Window})
		}
		_, conflicts, err := a.reassert(ctx, held)
		for _, c := range conflicts {
			a.log.Warn("an address etcd lost cannot be written back; the owner's request plans anew", "owner", key, "ip", c.Addr, "reason", c.Reason)
		}
		if addr, ok := ps.UnassertedFor(key); ok {
			return fmt.Errorf("etcd lost the record of %s's %s, and it cannot be written back now: %w", key, addr, errors.Join(retry.ErrUnavailable, err))
		}
	case planner.Room:
		for _, b := range ps.LentBlocks(f) {
			if err := a.reads.loadBlock(ctx, ps, b, 0); err != nil {
				a.log.Warn("reload block with lent addresses", "pool", ps.Spec().Name, "block", b, "error", err)
			}
		}
		a.reads.thawKept(ctx, ps, f)
	case planner.ThawKept:
		a.reads.thawKept(ctx, ps, f)
	case planner.Reload:
		if err := a.reads.loadBlock(ctx, ps, need.Block, 0); err != nil {
			p.Failed(err)
		}
	case planner.Claim:
		b, al, err := a.claims.block(ctx, ps, f, need.First)
		switch {
		case err != nil:
			p.Failed(err)
		case al != nil:
			p.Written(al)
		default:
			p.Claimed(b)
		}
	case planner.ClaimBlock:
		if _, err := a.claims.claim(ctx, ps, need.Block, nil); err != nil {
			p.Failed(err)
		} else {
			p.Claimed(need.Block)
		}
	case planner.Borrow:
		al, err := a.borrow(ctx, ps, p.Req, f)
		switch {
		case errors.Is(err, errOwnRoom):
			p.OwnRoom()
			return ctx.Err()
		case err != nil:
			p.Failed(err)
		default:
			p.Written(al)
		}
	case planner.BorrowAt:
		if al, err := a.writeBorrowed(ctx, ps, need.Block, need.Addr, *need.First, p.Req.Reserve); err != nil {
			p.Failed(err)
		} else {
			p.Written(al)
		}
	case planner.ReadBinding:
		b, ok, err := a.cfg.Store.GetBinding(ctx, ps.Spec().Name, p.Req.Sticky.Identity)
		if err != nil {
			return err
		}
		p.Binding(b, ok)
	case planner.ReadBack:
		return a.reads.readBack(ctx, need.Refs)
	case planner.ReadBound:
		cur, err := a.cfg.Store.GetIPs(ctx, need.Refs)
		if err != nil {
			return err
		}
		p.Bound(cur)
	case planner.Release:
		for _, al := range need.Allocs {
			if err := a.release(ctx, ps, al); err != nil {
				return fmt.Errorf("release %s, which a takeover of its identity's addresses would double: %w", al.Addr, err)
			}
		}
	case planner.Fence:
		fence, err := a.fence.get(ctx)
		if err != nil {
			return err
		}
		p.Fence(fence)
	default:
		return fmt.Errorf("plan of %s: unknown need %d", p.Req.Owner.Key(), need.Kind)
	}
	return nil
}

// giveBack releases borrowed addresses of a request that failed with
// cause. If one cannot be released the owner still holds it: the error
// then says try again, not a refusal.
func (a *Allocator) giveBack(ctx context.Context, lent []*records.Allocation, cause error) error {
	var errs []error
	for _, al := range lent {
		ps := a.n.Lookup(al.Pool)
		if ps == nil {
			continue
		}
		if err := a.release(ctx, ps, al); err != nil {
			a.log.Warn("give back a borrowed address of a failed request", "pool", al.Pool, "ip", al.Addr, "error", err)
			errs = append(errs, fmt.Errorf("%s: %w", al.Addr, err))
		}
	}
	if len(errs) > 0 {
		// The owner still holds what it borrowed: not a refusal any more.
		return fmt.Errorf("%v; a borrowed address could not be given back, try again: %w", cause, errors.Join(append([]error{retry.ErrUnavailable}, errs...)...))
	}
	return cause
}

// claimer claims blocks for the node: the claim loop, one claim, and
// (release.go) giving an empty block back. It needs the store's claims,
// the planner, the cache reader (a claim of its own found is adopted,
// its block loaded), the inflight rule (a claim's round trips leave mu)
// and the node's lease; its caller holds allocMu and mu.
type claimer struct {
	n      *planner.Node
	st     Store
	reads  cacheReader
	flight *inflight
	log    hclog.Logger
	node   string
	bootID string
	retry  retry.Policy
	lease  func() int64
	ready  func() error // whether the node may write now
}

// block claims one more block of family f for this node. It tries
// the candidates of the node's block walk until one claim transaction
// succeeds. It does not read the pool's claims first: the node learned
// them at restore, and learns every block taken since from the claim that
// loses its race to it (which marks the block taken, so the loop makes
// progress; it has no attempt budget). Only when no candidate is left
// does it read the claims once more (a block may have been freed, or a
// race that said "changed concurrently" may have been transient), and it
// reports the pool exhausted only if that read leaves nothing to try. A
// claim of unknown outcome leaves its block neither own nor taken, so the
// walk stays on it and the next claim tries it again first: a claim found
// to be this node's own, on its lease, is adopted. No read of every claim
// is needed, which matters most when etcd is slow enough that many claims
// time out at once. The caller's context bounds the whole.
//
// first, if set, is the record of the request the block is claimed for:
// the claim writes it at the block's first free address in its own
// transaction (records.Claim.First), and written is that allocation.
func (c claimer) block(ctx context.Context, ps *planner.Pool, f allocator.Family, first *records.Record) (b netip.Prefix, written *records.Allocation, err error) {
	fresh := false                // the claims were read since the last lost race
	lost := false                 // the last claim lost to another node's
	if b, ok := ps.Roomy(f); ok { // an adopted claim whose answer was lost
		return b, nil, nil
	}
	var got netip.Prefix
	err = retry.Do(ctx, c.retry, func(ctx context.Context) error {
		if lost {
			lost = false
			c.peek(ctx, ps, f)
		}
		cand, ok := ps.ChooseBlock(c.node, f)
		if !ok && !fresh {
			// Re-read which blocks other nodes hold, without mu. A claim
			// of this node on its current lease that the node does not
			// know is its own claim whose answer was lost: adopted.
			var infos []records.BlockInfo
			var err error
			pool := ps.Spec().Name
			c.flight.offLock(func() { infos, err = c.st.ListBlocks(ctx, pool) })
			if err != nil {
				return err
			}
			for _, info := range ps.RefreshOthers(infos, c.node, c.lease()) {
				c.log.Info("adopting own claim whose answer was lost", "pool", pool, "block", info.Block, "rev", info.ClaimRev)
				if err := c.reads.loadBlock(ctx, ps, info.Block, info.ClaimRev); err != nil {
					return err
				}
			}
			fresh = true
			if b, ok := ps.Roomy(f); ok {
				got = b
				return nil
			}
			cand, ok = ps.ChooseBlock(c.node, f)
		}
		if !ok {
			return ps.Exhausted(f)
		}
		al, err := c.claim(ctx, ps, cand, first)
		if err != nil {
			var ce *records.ClaimError
			lost = errors.As(err, &ce) && ce.ClaimedBy != "" && ce.ClaimedBy != c.node
			fresh = false
			return err
		}
		got, written = cand, al
		return nil
	})
	return got, written, err
}

// peekBlocks is how many of its next candidates a node peeks at after a
// lost claim.
const peekBlocks = 8

// peek reads, with a read that may lag (PeekBlocks: no consensus round,
// no raft entry), the claims of the node's next candidates of family f,
// so the walk skips those other nodes already hold. It runs after a
// claim lost its race: nodes are starting at once, and every block taken
// meanwhile would otherwise cost a claim transaction (a raft entry
// applied on every member, won or lost) to learn of. When thousands of
// nodes start together half the claims lose (BenchmarkClaimStorm:
// 10,000 nodes on 16,384 blocks); the losers' next choices meet blocks
// already taken. A peek that fails, or is stale, costs only the claims
// it would have saved: the claim transaction decides.
func (c claimer) peek(ctx context.Context, ps *planner.Pool, f allocator.Family) {
	cands := ps.Candidates(c.node, f, peekBlocks)
	if len(cands) == 0 {
		return
	}
	var infos map[netip.Prefix]records.BlockInfo
	var err error
	pool := ps.Spec().Name
	c.flight.offLock(func() { infos, err = c.st.PeekBlocks(ctx, pool, cands) })
	if err != nil {
		c.log.Debug("peek at the next blocks to claim", "pool", pool, "error", err)
		return
	}
	ps.Peeked(infos, c.node)
}

// claim runs one claim transaction for b and, if it wins, makes b an own
// block. A lost race is noted in the pool's cache and returned. A claim
// found held by this node on its current lease is this node's own earlier
// claim whose answer was lost (an unknown outcome): it is adopted, not
// counted as taken. An allocation lets go of mu while the transaction is
// in etcd (inflight.go).
//
// first, if set, is written in the claim's transaction at the block's
// first free address, and returned as written. If the claim's outcome is
// unknown that address is parked: the owner's next attempt reads back
// whether it landed before anything else is planned for it.
func (c claimer) claim(ctx context.Context, ps *planner.Pool, b netip.Prefix, first *records.Record) (*records.Allocation, error) {
	d, err := c.n.DraftClaim(ps, b, first)
	if err != nil {
		return nil, err
	}
	rec := c.n.ClaimRecord(c.bootID)
	rec.PoolRev, rec.First = ps.Spec().Rev, d.First
	pool, lease := ps.Spec().Name, c.lease()
	var res records.WriteResult
	c.flight.offLock(func() { res, err = c.st.Claim(ctx, pool, b, rec, lease) })
	var ce *records.ClaimError
	switch {
	case errors.As(err, &ce) && ce.PoolChanged:
		// An operator changed the pool since it was read: read it again
		// (a removed cidr is then not tried again).
		p, perr := c.st.GetPool(ctx, pool)
		if perr != nil {
			return nil, perr
		}
		ps.SetSpec(p)
		return nil, err
	case errors.As(err, &ce) && ce.ClaimedBy == c.node && ce.ClaimLease == lease:
		c.log.Info("adopting own claim whose answer was lost", "pool", pool, "block", b, "rev", ce.ClaimRev)
		return nil, c.reads.loadBlock(ctx, ps, b, ce.ClaimRev)
	case errors.As(err, &ce):
		ps.ClaimLost(b, ce.ClaimedBy, ce.NonEmpty)
		return nil, err
	case planner.OutcomeUnknown(err):
		// Read back with the parked addresses (settlePending).
		ps.ClaimUnknown(b)
		if w := d.First; w != nil {
			c.n.Park(ps, w.Record.Owner.Key(), "claim with first address", records.IPRef{Pool: w.Pool, Block: b, Addr: w.Addr})
		}
		return nil, err
	case err != nil:
		return nil, err
	}
	return c.n.ClaimWon(ps, d, res), nil
}

// Borrowing. The write of a borrowed address is the same create-if-absent
// on the address key that makes every allocation safe, so the block's
// owner and the borrower can never both hold an address; instead of the
// block's claim it is fenced by the borrower's own fence key on its node
// lease (a node whose lease is gone borrows nothing), and it needs the
// block to have a home (a block released meanwhile is not written into).
// With it the store writes the address's home, naming the borrower, which
// every node routes as a host route. The block's owner learns of a lent
// address from its failed create or its next read of the block, and gets
// it back when the borrower releases it. The planner's borrow.go chooses
// what to borrow.

// errOwnRoom says the node's own blocks have room again (a block freed
// for claiming, a lent address returned): plan normally.
var errOwnRoom = errors.New("own blocks have room")

// maxCoolingProbe bounds the addresses whose last release a borrower
// reads in one round trip, and lenderBlocksProbed the blocks it reads
// them in, before it takes the address released longest ago.
const (
	maxCoolingProbe    = 64
	lenderBlocksProbed = 4
)

// borrow finds an address of family f for r in another node's block and
// writes it. It ends with the allocation, errOwnRoom, a rich
// ExhaustedError built from one read of the whole pool, or an error.
//
// The address is in the fullest block, and depends on the owner, so that
// nodes borrowing at once seldom pick the same one. With a reuse cooldown
// it skips addresses released less than the cooldown ago (the pool's,
// which is the lender's too; the lender's cooling addresses live in its
// memory, so the release times come from IP history), and takes the one
// released longest ago only when every candidate is cooling, as the
// lender itself does.
func (a *Allocator) borrow(ctx context.Context, ps *planner.Pool, r Request, f allocator.Family) (*records.Allocation, error) {
	var got *records.Allocation
	pool := ps.Spec().Name
	err := retry.Do(ctx, a.cfg.ClaimRetry, func(ctx context.Context) error {
		snap, err := a.cfg.Store.PoolSnapshot(ctx, pool)
		if err != nil {
			return err
		}
		// Room of its own after all: a block free to claim, or an own
		// block holding fewer addresses than the node has marked (a lent
		// address came back; the block is read again).
		if ps.HasClaimable(f, snap) {
			return errOwnRoom
		}
		room := false
		for _, b := range ps.Shrunk(f, snap) {
			if err := a.reads.loadBlock(ctx, ps, b, 0); err == nil && !room {
				_, room = ps.Roomy(f)
			}
		}
		if room {
			return errOwnRoom
		}
		cands := a.n.Lendables(ps, f, snap, r.Owner)
		if len(cands) == 0 {
			e := records.ExplainExhausted(ctx, a.cfg.Store, ps.Spec(), f, snap)
			if ps.AtBlockLimit(f) {
				e.MaxBlocks = ps.Spec().MaxBlocksPerNode
			}
			return e
		}
		b, addr := cands[0].Block, cands[0].Free[0]
		if cooldown := ps.Spec().Cooldown(); cooldown > 0 {
			b, addr = coolest(ctx, a.cfg.Store, a.log, pool, cands, a.cfg.Now().Add(-cooldown))
		}
		got, err = a.writeBorrowed(ctx, ps, b, addr, a.n.NewRecord(r, true), r.Reserve)
		return err
	})
	return got, err
}

// coolest picks among cands the first address released before cutoff,
// or else the one released longest ago, reading release times from IP
// history; if they cannot be read, the cooldown is ignored.
func coolest(ctx context.Context, st records.Loans, log hclog.Logger, pool string, cands []planner.Lendable, cutoff time.Time) (netip.Prefix, netip.Addr) {
	var oldest netip.Addr
	var oldestBlock netip.Prefix
	var oldestAt time.Time
	for _, c := range cands[:min(len(cands), lenderBlocksProbed)] {
		order := c.Free[:min(len(c.Free), maxCoolingProbe)]
		last, err := st.LastReleased(ctx, pool, order)
		if err != nil {
			log.Debug("read release times of lendable addresses; ignoring the cooldown", "pool", pool, "block", c.Block, "error", err)
			return c.Block, order[0]
		}
		addr, ok, old, at := planner.PickLendable(order, last, cutoff)
		if ok {
			return c.Block, addr
		}
		if !oldest.IsValid() || at.Before(oldestAt) {
			oldest, oldestBlock, oldestAt = old, c.Block, at
		}
	}
	return oldestBlock, oldest
}

// writeBorrowed writes rec at addr of another node's block b, fenced by
// this node's borrow fence, and caches it. A lost race wraps ErrConflict;
// a write of unknown outcome is settled from etcd first.
func (a *Allocator) writeBorrowed(ctx context.Context, ps *planner.Pool, b netip.Prefix, addr netip.Addr, rec records.Record, reserve bool) (*records.Allocation, error) {
	fence, err := a.fence.get(ctx)
	if err != nil {
		return nil, err
	}
	w := records.IPWrite{Pool: ps.Spec().Name, Block: b, ClaimRev: fence, Addr: addr, Record: rec, Reserve: reserve, Borrowed: true}
	res, err := a.cfg.Store.WriteIPs(ctx, []records.IPWrite{w})
	var we *records.WriteError
	switch {
	case err == nil:
		return a.n.Wrote(ps, w, res), nil
	case errors.As(err, &we) && we.FenceLost:
		a.fence.rev = 0
		return nil, fmt.Errorf("borrow %s: %w", addr, errors.Join(records.ErrLeaseLost, err))
	case !planner.OutcomeUnknown(err):
		return nil, fmt.Errorf("borrow %s: %w", addr, err)
	}
	a.n.ParkWrites([]records.IPWrite{w})
	if serr := a.settlePending(ctx); serr != nil {
		return nil, serr
	}
	if al := ps.At(addr); al != nil && planner.SameRecord(al.Record, rec) {
		return al, nil
	}
	return nil, fmt.Errorf("borrow %s: %w", addr, err)
}

// fence is this node's borrow fence: the revision of its fence key on
// its current lease, 0 until the first borrow and after the fence was
// found lost (a new lease, a write that said so).
type fence struct {
	st    records.Loans
	claim func() records.Claim // the fence's record
	lease func() int64
	rev   int64
}

// get returns the fence's revision, writing the fence the first time.
func (f *fence) get(ctx context.Context) (int64, error) {
	if f.rev != 0 {
		return f.rev, nil
	}
	c := f.claim()
	rev, err := f.st.FenceBorrower(ctx, c, f.lease())
	if err != nil {
		return 0, fmt.Errorf("borrow fence of node %s: %w", c.Node, err)
	}
	f.rev = rev
	return rev, nil
}

// lostIf forgets the fence if lost: a write found it gone.
func (f *fence) lostIf(lost bool) {
	if lost {
		f.rev = 0
	}
}

// Confirm makes the owner's reservations permanent, in every pool, with
// one fenced transaction. Confirming what is already permanent is a no-op.
// A confirm whose outcome is unknown is settled from etcd, so a retried
// confirm succeeds when the first one landed.
func (a *Allocator) Confirm(ctx context.Context, o records.Owner) ([]records.Allocation, error) {
	out := a.ConfirmBatch(ctx, []records.Owner{o})
	return out[0].Allocations, out[0].Err
}

// ConfirmOutcome is one owner's answer from ConfirmBatch.
type ConfirmOutcome struct {
	Allocations []records.Allocation
	Err         error
}

// ConfirmBatch confirms several owners' reservations (group commit): one
// fenced transaction for all of them, as Confirm does for one. If etcd
// refuses that transaction (a reservation lapsed or changed, a fence
// moved), nothing of it was written, and each owner is confirmed on its
// own, so one owner's failure is not the others'. Outcomes are in the
// order of owners. An owner whose confirm etcd did not answer in time (too
// many requests, a write or its read back past the call timeout) is
// confirmed again inside ctx's deadline, as an allocation is: the confirm
// is the second half of the runtime's ADD, and a retried confirm finds
// what an earlier one wrote.
func (a *Allocator) ConfirmBatch(ctx context.Context, owners []records.Owner) []ConfirmOutcome {
	out := make([]ConfirmOutcome, len(owners))
	todo := make([]int, len(owners))
	for i := range todo {
		todo[i] = i
	}
	_ = retry.Do(ctx, retry.Policy{Attempts: 1, Unavailable: true}, func(ctx context.Context) error {
		sub := make([]records.Owner, len(todo))
		for j, i := range todo {
			sub[j] = owners[i]
		}
		var again []int
		for j, o := range a.confirmBatchOnce(ctx, sub) {
			out[todo[j]] = o
			if errors.Is(o.Err, retry.ErrUnavailable) {
				again = append(again, todo[j])
			}
		}
		if todo = again; len(todo) > 0 {
			return out[todo[0]].Err
		}
		return nil
	})
	return out
}

// confirmBatchOnce is one attempt of ConfirmBatch.
func (a *Allocator) confirmBatchOnce(ctx context.Context, owners []records.Owner) []ConfirmOutcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	out := make([]ConfirmOutcome, len(owners))
	// An owner whose allocation is in flight is confirmed after it
	// (waitOwner lets go of mu): wait until none of them is.
	for again := true; again; {
		again = false
		for i, o := range owners {
			if out[i].Err != nil || !a.flight.busy[o.Key()] {
				continue
			}
			again = true
			if err := a.flight.waitOwner(ctx, o.Key()); err != nil {
				out[i].Err = fmt.Errorf("confirm: %w", err)
			}
		}
	}
	if err := a.ready(); err != nil {
		for i := range out {
			if out[i].Err == nil {
				out[i].Err = err
			}
		}
		return out
	}
	settleErr := a.settlePending(ctx)
	plans := make([]planner.ConfirmPlan, len(owners))
	var writes []records.IPWrite
	for i, o := range owners {
		if out[i].Err != nil {
			continue
		}
		if settleErr != nil && a.n.AnyPending(o) {
			out[i].Err = fmt.Errorf("confirm %s: %w", o.Key(), settleErr)
			continue
		}
		plans[i], out[i].Err = a.planConfirm(ctx, o)
		writes = append(writes, plans[i].Writes...)
	}
	if len(writes) == 0 {
		for i, o := range owners {
			if out[i].Err == nil {
				out[i].Allocations, out[i].Err = a.n.FinishConfirm(o, plans[i])
			}
		}
		return out
	}
	err := a.writeConfirms(ctx, writes)
	for i, o := range owners {
		if out[i].Err != nil {
			continue
		}
		switch {
		case err == nil:
			out[i].Allocations, out[i].Err = a.n.FinishConfirm(o, plans[i])
		case len(owners) > 1 && !planner.OutcomeUnknown(err) && !errors.Is(err, retry.ErrRefused):
			// Nothing was written, and not for etcd's load (which a
			// transaction per owner would only add to): each owner on
			// its own. One whose reservation the refusal showed gone
			// (dropped from the cache) is told so, as Confirm would.
			p, perr := a.planConfirm(ctx, o)
			if perr == nil && len(p.Writes) > 0 {
				if perr = a.writeConfirms(ctx, p.Writes); perr != nil {
					perr = fmt.Errorf("confirm %s: %w", o.Key(), perr)
				}
			}
			if out[i].Allocations, out[i].Err = nil, perr; perr == nil {
				out[i].Allocations, out[i].Err = a.n.FinishConfirm(o, p)
			}
			if errors.Is(out[i].Err, records.ErrNotFound) && len(plans[i].Writes) > 0 {
				out[i].Err = fmt.Errorf("confirm %s: %w: %w", o.Key(), records.ErrReservationGone, err)
			}
		default:
			out[i].Err = fmt.Errorf("confirm %s: %w", o.Key(), err)
		}
	}
	return out
}

// planConfirm plans o's confirm, after what it must read first: the
// owner's permanent sticky allocations (a later container of its
// identity may have taken one over from another node: etcd says, not the
// cache), and the borrow fence if a reservation is borrowed.
func (a *Allocator) planConfirm(ctx context.Context, o records.Owner) (planner.ConfirmPlan, error) {
	refs, needFence := a.n.ConfirmNeeds(o)
	if len(refs) > 0 {
		if err := a.reads.readBack(ctx, refs); err != nil {
			return planner.ConfirmPlan{}, fmt.Errorf("confirm %s: read back %s: %w", o.Key(), refs[0].Addr, err)
		}
	}
	var fence int64
	if needFence {
		var err error
		if fence, err = a.fence.get(ctx); err != nil {
			return planner.ConfirmPlan{}, fmt.Errorf("confirm %s: %w", o.Key(), err)
		}
	}
	return a.n.PlanConfirm(o, fence)
}

// writeConfirms writes confirms and applies what etcd answered to the
// cache: the new records on success; on an unknown outcome the writes are
// parked and settled from etcd, and nil is returned once they are.
func (a *Allocator) writeConfirms(ctx context.Context, writes []records.IPWrite) error {
	res, err := a.cfg.Store.WriteIPs(ctx, writes)
	switch {
	case err == nil:
		a.n.ConfirmsWritten(writes, res)
		return nil
	case planner.OutcomeUnknown(err):
		a.n.ParkWrites(writes)
		if serr := a.settlePending(ctx); serr != nil {
			return serr
		}
		if a.n.StillReserved(writes) {
			// It did not land, and the reservation stands: the answer
			// is etcd's (too many requests: try again), not a lapse.
			return err
		}
		return nil
	default:
		a.fence.lostIf(a.reads.learn(ctx, err))
		var we *records.WriteError
		if errors.As(err, &we) {
			return fmt.Errorf("%w: %w", records.ErrReservationGone, err)
		}
		return err
	}
}
