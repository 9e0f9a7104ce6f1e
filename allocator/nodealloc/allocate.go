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

// Request asks for one address per family for an owner.
type Request struct {
	Pool  string
	Owner records.Owner
	// Families defaults to the families of IPs, or else every family of
	// the pool.
	Families []allocator.Family
	// IPs are requested static addresses, at most one per family.
	IPs []netip.Addr
	// Reserve writes a reservation (on a short lease) instead of a
	// permanent allocation; Confirm makes it permanent.
	Reserve bool
	// Sticky, if set, makes the addresses follow an identity (sticky.go).
	Sticky *records.Sticky
}

// Result is what an owner holds in a pool after a request.
type Result struct {
	Pool        string
	Allocations []records.Allocation
	// Expires is when the reservation lapses unless confirmed; zero for
	// permanent allocations.
	Expires time.Time
}

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
	defer a.markBusy(reqs)()
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
	plans := make([]*plan, len(reqs))
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
		before := a.heldBy(r)
		p, err := a.plan(ctx, r, pendErr)
		if errors.Is(err, records.ErrUnavailable) {
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
		p.before = before
		plans[i] = p
		writes = append(writes, p.writes...)
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
				out[i].Result = a.commit(p, res)
			}
		}
	case outcomeUnknown(err):
		// The transaction may have committed: nothing is undone before a
		// read of etcd says what landed.
		for _, p := range plans {
			if p != nil {
				a.parkWrites(p.ps, p.writes)
			}
		}
		// On an error they stay parked: allocateOne settles them first.
		_ = a.settlePending(ctx)
		for i, p := range plans {
			if p == nil {
				continue
			}
			if r, ok := a.landed(p); ok {
				out[i].Result = r
				continue
			}
			// Not settled or not landed: tried again on its own,
			// which settles first, inside the request's deadline.
			out[i].Result, out[i].Err = a.allocateOne(ctx, p.req, p.before)
		}
	default:
		for _, p := range slices.Backward(plans) {
			if p != nil {
				a.undo(p)
			}
		}
		a.learn(ctx, err)
		for i, p := range plans {
			if p != nil {
				out[i].Result, out[i].Err = a.allocateOne(ctx, p.req, p.before)
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
		before = a.heldBy(req)
	}
	pol := a.cfg.WriteRetry
	// An etcd that did not answer in time (too many requests, a call
	// past its timeout, a read back that met a loaded etcd) is tried
	// again inside the request's deadline; settlePending, at the start
	// of each attempt, reads back what an earlier attempt left unknown.
	pol.Unavailable = true
	err := retry.Do(ctx, pol, func(ctx context.Context) error {
		if err := a.ready(); err != nil {
			return err
		}
		p, err := a.plan(ctx, req, a.settlePending(ctx))
		if err != nil {
			return err
		}
		res, err := a.write(ctx, p)
		for onlyTaken(err) && ctx.Err() == nil {
			a.undo(p)
			a.learn(ctx, err)
			if p, err = a.plan(ctx, req, a.settlePending(ctx)); err != nil {
				return err
			}
			res, err = a.write(ctx, p)
		}
		if err == nil {
			out = a.commit(p, res)
			return nil
		}
		if !outcomeUnknown(err) {
			a.undo(p)
			a.learn(ctx, err)
			return err
		}
		a.parkWrites(p.ps, p.writes)
		if serr := a.settlePending(ctx); serr != nil {
			return serr
		}
		if r, ok := a.landed(p); ok {
			out = r
			return nil
		}
		return err // it did not land; the caller may try again
	})
	if err != nil {
		// An attempt may have borrowed an address before a later one
		// failed: give it back, so the request leaves what it found.
		err = a.giveBackBorrowed(ctx, req, before, err)
		return Result{}, fmt.Errorf("allocate in pool %s for %s: %w", req.Pool, req.Owner.Key(), err)
	}
	return out, nil
}

// heldBy lists the addresses the request's owner holds in its pool.
func (a *Allocator) heldBy(req Request) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if ps := a.pools[req.Pool]; ps != nil {
		for _, al := range ps.byOwner[req.Owner.Key()] {
			out[al.Addr] = true
		}
	}
	return out
}

// giveBackBorrowed releases what the owner borrowed since before, after
// its request failed with cause (giveBack).
func (a *Allocator) giveBackBorrowed(ctx context.Context, req Request, before map[netip.Addr]bool, cause error) error {
	ps := a.pools[req.Pool]
	if ps == nil {
		return cause
	}
	var lent []*records.Allocation
	for _, al := range ps.byOwner[req.Owner.Key()] {
		if al.Borrowed && !before[al.Addr] {
			lent = append(lent, al)
		}
	}
	return a.giveBack(ctx, ps, lent, cause)
}

// write sends a plan's writes, with its binding if it has one.
func (a *Allocator) write(ctx context.Context, p *plan) (records.WriteResult, error) {
	if p.bind != nil {
		return a.cfg.Store.WriteBound(ctx, *p.bind, p.writes)
	}
	if len(p.writes) == 0 { // every address reused, or written with its claim
		return records.WriteResult{}, nil
	}
	return a.cfg.Store.WriteIPs(ctx, p.writes)
}

// onlyTaken reports whether a write failed only because addresses it
// created were taken: nothing was fenced.
func onlyTaken(err error) bool {
	var we *records.WriteError
	return errors.As(err, &we) && len(we.Fenced) == 0 && !we.FenceLost && len(we.Taken) > 0
}

// commit records a written plan and builds its result.
func (a *Allocator) commit(p *plan, res records.WriteResult) Result {
	seen := a.cfg.Now()
	for _, w := range p.writes {
		delete(p.ps.planned, w.Addr)
		delete(p.ps.kept, w.Addr)
		if !w.Borrowed {
			delete(p.ps.lent, w.Addr)
		}
		al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: w.Block, Addr: w.Addr, Rev: res.Rev, Seen: seen}
		p.ps.remember(al, res.Expires)
		a.logAllocated(al)
	}
	return a.result(p)
}

// landed reports whether a plan whose write had an unknown outcome landed,
// as settled into the cache, and if so its result. Only addresses tell: a
// binding written alone (each address reused, or written with its claim)
// is not in the cache, so such a plan has not landed as far as the cache
// knows; the next attempt reads the binding (planSticky) and writes it
// again if it must.
func (a *Allocator) landed(p *plan) (Result, bool) {
	if p.bind != nil && len(p.writes) == 0 {
		return Result{}, false
	}
	for _, w := range p.writes {
		if al := p.ps.byAddr[w.Addr]; al == nil || !sameRecord(al.Record, w.Record) {
			return Result{}, false
		}
	}
	return a.result(p), true
}

// result is the answer of a plan whose writes are in the cache. A sticky
// owner told a reservation is noted until its confirm or DEL
// (poolState.checkBinding).
func (a *Allocator) result(p *plan) Result {
	if p.req.Sticky != nil && p.req.Reserve {
		p.ps.noteCheckBinding(p.req.Owner.Key(), p.req.Sticky.Identity)
	}
	out := Result{Pool: p.ps.pool.Name}
	als := slices.Clone(p.reused)
	for _, w := range p.writes {
		if al := p.ps.byAddr[w.Addr]; al != nil {
			als = append(als, al)
		}
	}
	for _, al := range als {
		out.Allocations = append(out.Allocations, *al)
		if exp, ok := p.ps.expires[al.Addr]; ok && al.State == records.StateReserved {
			out.Expires = exp
		}
	}
	slices.SortFunc(out.Allocations, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

func (a *Allocator) undo(p *plan) {
	for _, w := range p.writes {
		delete(p.ps.planned, w.Addr)
		if ob := p.ps.own[w.Block]; ob != nil {
			ob.ba.Unmark(w.Addr)
		}
	}
	p.writes = nil
}
