package allocator

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/internal/retry"
)

// Request asks for one address per family for an owner.
type Request struct {
	Pool  string
	Owner Owner
	// Families defaults to the families of IPs, or else every family of
	// the pool.
	Families []Family
	// IPs are requested static addresses, at most one per family.
	IPs []netip.Addr
	// Reserve writes a reservation (on a short lease) instead of a
	// permanent allocation; Confirm makes it permanent.
	Reserve bool
}

// Result is what an owner holds in a pool after a request.
type Result struct {
	Pool        string
	Allocations []Allocation
	// Expires is when the reservation lapses unless confirmed; zero for
	// permanent allocations.
	Expires time.Time
}

// Outcome is one request's answer in a batch.
type Outcome struct {
	Result Result
	Err    error
}

// plan is a request whose addresses are chosen (and marked in the block
// bitmaps) but not yet written.
type plan struct {
	ps     *poolState
	req    Request
	reused []*Allocation
	writes []IPWrite
}

// Allocate serves one request. A retried request for the same owner gets
// the same addresses back.
func (a *NodeAllocator) Allocate(ctx context.Context, req Request) (Result, error) {
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
func (a *NodeAllocator) AllocateBatch(ctx context.Context, reqs []Request) []Outcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]Outcome, 0, len(reqs))
	for chunk := range slices.Chunk(reqs, MaxBatch) {
		out = append(out, a.allocateChunk(ctx, chunk)...)
	}
	return out
}

func (a *NodeAllocator) allocateChunk(ctx context.Context, reqs []Request) []Outcome {
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
	var writes []IPWrite
	var later []int // a second request of an owner waits for the first
	planned := map[string]bool{}
	for i, r := range reqs {
		k := r.Pool + "\x00" + r.Owner.Key()
		if planned[k] {
			later = append(later, i)
			continue
		}
		planned[k] = true
		p, err := a.plan(ctx, r, pendErr)
		if err != nil {
			out[i].Err = err
			continue
		}
		plans[i] = p
		writes = append(writes, p.writes...)
	}
	defer func() {
		for _, i := range later {
			out[i].Result, out[i].Err = a.allocateOne(ctx, reqs[i])
		}
	}()
	res, err := a.cfg.Store.WriteIPs(ctx, writes)
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
				a.park(p.ps, p.writes)
			}
		}
		serr := a.settlePending(ctx)
		for i, p := range plans {
			if p == nil {
				continue
			}
			if r, ok := a.landed(p); ok {
				out[i].Result = r
				continue
			}
			if serr != nil {
				out[i].Err = fmt.Errorf("allocate in pool %s for %s: %w", p.req.Pool, p.req.Owner.Key(), serr)
				continue
			}
			out[i].Result, out[i].Err = a.allocateOne(ctx, p.req)
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
				out[i].Result, out[i].Err = a.allocateOne(ctx, p.req)
			}
		}
	}
	return out
}

// allocateOne plans and writes one request, retrying lost races.
func (a *NodeAllocator) allocateOne(ctx context.Context, req Request) (Result, error) {
	var out Result
	err := retry.Do(ctx, a.cfg.WriteRetry, func(ctx context.Context) error {
		if err := a.ready(); err != nil {
			return err
		}
		p, err := a.plan(ctx, req, a.settlePending(ctx))
		if err != nil {
			return err
		}
		res, err := a.cfg.Store.WriteIPs(ctx, p.writes)
		if err == nil {
			out = a.commit(p, res)
			return nil
		}
		if !outcomeUnknown(err) {
			a.undo(p)
			a.learn(ctx, err)
			return err
		}
		a.park(p.ps, p.writes)
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
		return Result{}, fmt.Errorf("allocate in pool %s for %s: %w", req.Pool, req.Owner.Key(), err)
	}
	return out, nil
}

// plan chooses the request's addresses and marks them. pendErr is the
// error of the last attempt to settle writes of unknown outcome: an owner
// with such a write is refused until it is settled, since the write may
// hold its address.
func (a *NodeAllocator) plan(ctx context.Context, r Request, pendErr error) (*plan, error) {
	if err := r.Owner.Validate(); err != nil {
		return nil, err
	}
	ps, err := a.poolState(r.Pool)
	if err != nil {
		return nil, err
	}
	if ps.pendingFor(r.Owner.Key()) {
		return nil, fmt.Errorf("an earlier write for %s has an unknown outcome: %w", r.Owner.Key(), errors.Join(ErrUnavailable, pendErr))
	}
	fams, static, err := requestFamilies(ps.pool, r)
	if err != nil {
		return nil, err
	}
	p := &plan{ps: ps, req: r}
	for _, f := range fams {
		want, isStatic := static[f]
		if al := a.live(ps, r.Owner, f); al != nil {
			if isStatic && want != al.Addr {
				a.undo(p)
				return nil, fmt.Errorf("%w: %s already holds %s in pool %s, not %s", ErrBadRequest, r.Owner.Key(), al.Addr, ps.pool.Name, want)
			}
			p.reused = append(p.reused, al)
			continue
		}
		var addr netip.Addr
		var block netip.Prefix
		if isStatic {
			block, err = a.pickStatic(ctx, ps, want)
			addr = want
		} else {
			block, addr, err = a.pickFree(ctx, ps, f)
		}
		if err != nil {
			a.undo(p)
			return nil, err
		}
		ob := ps.own[block]
		ob.ba.Mark(addr)
		state := StateAllocated
		if r.Reserve {
			state = StateReserved
		}
		p.writes = append(p.writes, IPWrite{
			Pool: ps.pool.Name, Block: block, ClaimRev: ob.claimRev, Addr: addr, Reserve: r.Reserve,
			Record: Record{Owner: r.Owner, Node: a.cfg.Node, State: state, Since: a.cfg.Now().UTC()},
		})
	}
	return p, nil
}

// requestFamilies resolves which families a request wants and its static
// addresses by family, rejecting anything the pool cannot serve.
func requestFamilies(p Pool, r Request) ([]Family, map[Family]netip.Addr, error) {
	static := map[Family]netip.Addr{}
	for _, ip := range r.IPs {
		ip = ip.Unmap()
		f := FamilyOf(ip)
		if _, dup := static[f]; dup {
			return nil, nil, fmt.Errorf("%w: two %s addresses requested", ErrBadRequest, f)
		}
		if !p.Contains(ip) {
			return nil, nil, fmt.Errorf("%w: requested ip %s is not in pool %s", ErrBadRequest, ip, p.Name)
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
		return nil, nil, fmt.Errorf("%w: a family is requested twice", ErrBadRequest)
	}
	for _, f := range fams {
		if p.BlockSize(f) == 0 {
			return nil, nil, fmt.Errorf("%w: pool %s has no %s range", ErrBadRequest, p.Name, f)
		}
	}
	for f, ip := range static {
		if !slices.Contains(fams, f) {
			return nil, nil, fmt.Errorf("%w: requested ip %s but family %s not requested", ErrBadRequest, ip, f)
		}
	}
	return fams, static, nil
}

// live returns the owner's (oldest) allocation of family f, dropping
// reservations that have lapsed. A dropped one may still be in the store
// for a moment; the write that reuses its address then fails and reloads
// the block.
func (a *NodeAllocator) live(ps *poolState, o Owner, f Family) *Allocation {
	for _, al := range ps.ofOwner(o.Key(), f) {
		if !a.dropIfLapsed(ps, al) {
			return al
		}
	}
	return nil
}

// dropIfLapsed drops al from the cache if it is a reservation whose lease
// has ended, and reports whether it did. Every path that looks at a
// cached reservation (by owner, by address, or to make room) goes
// through it.
func (a *NodeAllocator) dropIfLapsed(ps *poolState, al *Allocation) bool {
	exp, ok := ps.expires[al.Addr]
	if !ok || al.State != StateReserved || !a.cfg.Now().After(exp) {
		return false
	}
	a.drop(ps, al)
	return true
}

// drop removes al from the cache and frees its address in the bitmap.
func (a *NodeAllocator) drop(ps *poolState, al *Allocation) {
	ps.forget(al)
	if _, ob := ps.ownBlockOf(al.Addr); ob != nil {
		ob.ba.Unmark(al.Addr)
	}
}

func (a *NodeAllocator) pickFree(ctx context.Context, ps *poolState, f Family) (netip.Prefix, netip.Addr, error) {
	if b, addr, ok := ps.nextFree(f); ok {
		return b, addr, nil
	}
	// Lapsed reservations free room before a new block is claimed.
	for addr := range ps.expires {
		if al := ps.byAddr[addr]; al != nil && FamilyOf(addr) == f {
			a.dropIfLapsed(ps, al)
		}
	}
	if b, addr, ok := ps.nextFree(f); ok {
		return b, addr, nil
	}
	b, err := a.claimBlock(ctx, ps, f)
	if err != nil {
		return netip.Prefix{}, netip.Addr{}, err
	}
	addr, ok := ps.own[b].ba.Next()
	if !ok {
		return netip.Prefix{}, netip.Addr{}, fmt.Errorf("claimed block %s has no free address", b)
	}
	return b, addr, nil
}

func (a *NodeAllocator) pickStatic(ctx context.Context, ps *poolState, addr netip.Addr) (netip.Prefix, error) {
	b, ob := ps.ownBlockOf(addr)
	if ob == nil {
		if other, ok := ps.others[b]; ok && other.node != "" {
			return b, fmt.Errorf("requested ip %s is in block %s of node %s: %w", addr, b, other.node, ErrNotOwned)
		}
		if err := a.claimSpecific(ctx, ps, b); err != nil {
			return b, fmt.Errorf("requested ip %s: %w", addr, err)
		}
		ob = ps.own[b]
	}
	if slices.Contains(ps.pool.Excluded(b), addr) {
		return b, fmt.Errorf("%w: requested ip %s is a network, broadcast or anycast address of pool %s", ErrBadRequest, addr, ps.pool.Name)
	}
	if al := ps.byAddr[addr]; al != nil {
		a.dropIfLapsed(ps, al) // the create-if-absent write guards the rest
	}
	if ob.ba.IsUsed(addr) {
		holder := "another owner"
		if al := ps.byAddr[addr]; al != nil {
			holder = al.Owner.Key()
		}
		return b, fmt.Errorf("requested ip %s is held by %s: %w", addr, holder, ErrIPInUse)
	}
	return b, nil
}

// commit records a written plan and builds its result.
func (a *NodeAllocator) commit(p *plan, res WriteResult) Result {
	seen := time.Now()
	for _, w := range p.writes {
		al := &Allocation{Record: w.Record, Pool: w.Pool, Block: w.Block, Addr: w.Addr, Rev: res.Rev, Seen: seen}
		p.ps.remember(al, res.Expires)
	}
	r, _ := a.landed(p)
	return r
}

// landed builds the result of a plan whose writes are all in the cache as
// the owner's; ok is false if one is not.
func (a *NodeAllocator) landed(p *plan) (Result, bool) {
	out := Result{Pool: p.ps.pool.Name}
	als := slices.Clone(p.reused)
	for _, w := range p.writes {
		al := p.ps.byAddr[w.Addr]
		if al == nil || !sameRecord(al.Record, w.Record) {
			return Result{}, false
		}
		als = append(als, al)
	}
	for _, al := range als {
		out.Allocations = append(out.Allocations, *al)
		if exp, ok := p.ps.expires[al.Addr]; ok && al.State == StateReserved {
			out.Expires = exp
		}
	}
	slices.SortFunc(out.Allocations, func(x, y Allocation) int { return x.Addr.Compare(y.Addr) })
	return out, true
}

func (a *NodeAllocator) undo(p *plan) {
	for _, w := range p.writes {
		if ob := p.ps.own[w.Block]; ob != nil {
			ob.ba.Unmark(w.Addr)
		}
	}
	p.writes = nil
}

// learn corrects the cache from a failed write: blocks whose claim moved
// are no longer ours; addresses found taken are reloaded from the store.
// If a reload fails, the taken addresses are at least marked, so the retry
// does not pick them again.
func (a *NodeAllocator) learn(ctx context.Context, err error) {
	var we *WriteError
	if !errors.As(err, &we) {
		return
	}
	for _, ps := range a.pools {
		for _, b := range we.Fenced {
			if _, ok := ps.own[b]; ok {
				a.log.Warn("lost claim on block (fenced write)", "pool", ps.pool.Name, "block", b)
				a.loseBlock(ps, b)
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
func (a *NodeAllocator) loseBlock(ps *poolState, b netip.Prefix) {
	delete(ps.own, b)
	ps.others[b] = otherBlock{node: "?"}
}
