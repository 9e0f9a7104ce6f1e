package planner

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Plan is a request being planned: its addresses are chosen (and marked
// in the block bitmaps) family by family, and Advance says what it needs
// from the store before it can go on. Done, its Writes (with Bind, for a
// sticky identity) are what the driver sends.
type Plan struct {
	ps  *Pool
	Req Request
	// Reused are allocations the owner holds already, or that were
	// written while planning (Lent).
	Reused []*records.Allocation
	Writes []records.IPWrite
	// Lent are addresses written while planning (borrowed, or with a
	// claim): a plan that fails later gives them back, so a refused
	// request leaves the owner with what it held before.
	Lent []*records.Allocation
	// Before is what the owner held when the request came in.
	Before map[netip.Addr]bool
	// Bind, for a sticky identity, is the binding written with the plan.
	Bind *records.Binding

	started bool
	fams    []allocator.Family
	static  map[allocator.Family]netip.Addr
	next    int // the family being planned: fams[next]
	stage   stage
	claimed netip.Prefix // the block claimed for the family
	answer  error        // the store's answer to the last need
	written *records.Allocation
	room    bool // a borrow found the node's own blocks have room
	// verified are the owner's reservations read back from etcd in this
	// plan before they are told again.
	verified map[netip.Addr]bool
	sticky   stickyPlan
}

// Pool is the pool the plan is for.
func (p *Plan) Pool() *Pool { return p.ps }

type stage int

const (
	stFresh       stage = iota // nothing asked yet for this family
	stRoomed                   // lent and kept addresses were read again
	stClaimed                  // a claim ended (claimed, written, or err)
	stBorrowed                 // a borrow ended
	stStaticClaim              // the static address's block was claimed
	stStaticThaw               // the static address's kept window was checked
	stStaticLoad               // the static address's block was read again
	stStaticLent               // the static address was borrowed
)

// NeedKind is what a plan needs from the store before it can go on.
type NeedKind int

const (
	// Done: the plan is complete; send its writes.
	Done NeedKind = iota
	// Reassert the owner's records etcd lost (Pool.Unasserted) first.
	Reassert
	// Room: read again the own blocks of Family that have lent
	// addresses, and free the kept addresses of Family whose windows
	// ended (the driver's thawKept).
	Room
	// Claim a block of Family (the claim loop), writing First with it;
	// fold with Claimed, Written or Failed.
	Claim
	// Borrow an address of Family from another node's block; fold with
	// Written, OwnRoom or Failed.
	Borrow
	// ClaimBlock claims Block, which holds a requested address; fold
	// with Claimed or Failed.
	ClaimBlock
	// ThawKept checks the kept windows of Family (the driver's thawKept).
	ThawKept
	// Reload reads own block Block again.
	Reload
	// BorrowAt borrows Addr in another node's Block, with First; fold
	// with Written or Failed.
	BorrowAt
	// ReadBinding reads the binding of the sticky identity; fold with
	// Binding.
	ReadBinding
	// ReadBack reads Refs back into the cache (the owner's bound
	// addresses it lost track of).
	ReadBack
	// ReadBound reads what etcd holds at Refs; fold with Bound.
	ReadBound
	// Fence gets this node's borrow fence; fold with Fence.
	Fence
	// Release releases Allocs, the owner's addresses that a takeover of
	// its identity's would double.
	Release
)

// Need is what Advance asks of the driver.
type Need struct {
	Kind   NeedKind
	Family allocator.Family
	Block  netip.Prefix
	Addr   netip.Addr
	First  *records.Record
	Refs   []records.IPRef
	Allocs []*records.Allocation
}

// Start begins planning r. pendErr is the error of the last attempt to
// settle writes of unknown outcome: an owner with such a write is refused
// until it is settled, since the write may hold its address.
func (n *Node) Start(r Request, pendErr error) (*Plan, error) {
	if err := r.Owner.Validate(); err != nil {
		return nil, err
	}
	ps, err := n.Pool(r.Pool)
	if err != nil {
		return nil, err
	}
	if ps.pendingFor(r.Owner.Key()) {
		return nil, fmt.Errorf("an earlier write for %s has an unknown outcome: %w", r.Owner.Key(), errors.Join(retry.ErrUnavailable, pendErr))
	}
	if r.Sticky != nil {
		if err := r.Sticky.Validate(); err != nil {
			return nil, err
		}
	}
	return &Plan{ps: ps, Req: r}, nil
}

// Advance plans on until the plan is done (Need.Kind Done) or needs the
// store. An error ends the plan: the driver abandons it (Undo, and gives
// back what it Lent).
func (n *Node) Advance(p *Plan) (Need, error) {
	ps := p.ps
	if !p.started {
		p.started = true
		if _, ok := ps.UnassertedFor(p.Req.Owner.Key()); ok {
			return Need{Kind: Reassert}, nil
		}
	}
	if p.Req.Sticky != nil && !p.sticky.ordinary {
		need, err := n.advanceSticky(p)
		if err != nil || need.Kind != Done || !p.sticky.ordinary {
			return need, err
		}
	}
	if p.fams == nil {
		fams, static, err := requestFamilies(ps.spec, p.Req)
		if err != nil {
			return Need{}, err
		}
		if s := p.sticky; s.ok && s.b.Alternate != nil && s.b.Owner.Key() == p.Req.Owner.Key() {
			// The owner's ADD retried during a live migration gets the
			// binding's addresses and no new one: the alternate was
			// admitted to those, and a new address would make the
			// binding drop it while the other records name it.
			fams = slices.DeleteFunc(fams, func(f allocator.Family) bool {
				return !slices.ContainsFunc(s.b.Addrs, func(a netip.Addr) bool { return allocator.FamilyOf(a) == f })
			})
		}
		p.fams, p.static = fams, static
	}
	for p.next < len(p.fams) {
		need, done, err := n.advanceFamily(p, p.fams[p.next])
		if err != nil {
			return Need{}, err
		}
		if !done {
			return need, nil
		}
		p.next++
		p.stage, p.claimed, p.answer, p.written, p.room = stFresh, netip.Prefix{}, nil, nil, false
	}
	if p.Req.Sticky != nil && p.Bind == nil {
		n.bindPlan(p)
	}
	return Need{Kind: Done}, nil
}

// advanceFamily plans family f of p, reporting done when it is planned.
func (n *Node) advanceFamily(p *Plan, f allocator.Family) (Need, bool, error) {
	ps, r := p.ps, p.Req
	want, isStatic := p.static[f]
	if p.stage == stFresh {
		if al := n.live(ps, r.Owner, f, netip.Addr{}); al != nil {
			if al.State == records.StateReserved && !p.verified[al.Addr] {
				// A reservation is told again only as etcd holds it: its
				// lease may have ended before the expiry the node was
				// given (revoked), and another node may hold the address
				// now. Only a retried ADD meets one, so the read is rare.
				if p.verified == nil {
					p.verified = map[netip.Addr]bool{}
				}
				p.verified[al.Addr] = true
				return Need{Kind: ReadBack, Refs: []records.IPRef{{Pool: al.Pool, Block: al.Block, Addr: al.Addr}}}, false, nil
			}
			if isStatic && want != al.Addr {
				return Need{}, false, fmt.Errorf("%w: %s already holds %s in pool %s, not %s", records.ErrBadRequest, r.Owner.Key(), al.Addr, ps.spec.Name, want)
			}
			p.Reused = append(p.Reused, al)
			return Need{}, true, nil
		}
		if ps.refused != nil {
			return Need{}, false, RefusedError(ps)
		}
		if ps.spec.Disabled {
			return Need{}, false, fmt.Errorf("%w: pool %s is disabled and hands out no new addresses (kvipamctl pool enable %s)", records.ErrPoolDisabled, ps.spec.Name, ps.spec.Name)
		}
		if !n.selected(ps) {
			// Neither a claim nor a borrow: the pool's blocks are for the
			// nodes its selector chooses.
			return Need{}, false, n.notSelected(ps)
		}
	}
	if isStatic {
		return n.advanceStatic(p, f, want)
	}
	switch p.stage {
	case stFresh:
		ps.thaw(n.now().Add(-ps.spec.Cooldown()))
		if b, addr, ok := ps.nextFree(f); ok {
			return n.planWrite(p, b, addr), true, nil
		}
		// Lapsed reservations, lent addresses given back and, last, the
		// oldest address still cooling free room before a new block is
		// claimed.
		for _, addr := range sortedAddrs(ps.expires) {
			if al := ps.byAddr[addr]; al != nil && allocator.FamilyOf(addr) == f {
				n.dropIfLapsed(ps, al)
			}
		}
		p.stage = stRoomed
		return Need{Kind: Room, Family: f}, false, nil
	case stRoomed:
		if al := n.live(ps, r.Owner, f, netip.Addr{}); al != nil {
			p.Reused = append(p.Reused, al) // read back with a block
			return Need{}, true, nil
		}
		if b, addr, ok := ps.nextFree(f); ok {
			return n.planWrite(p, b, addr), true, nil
		}
		for ps.thawOldest(f) {
			if b, addr, ok := ps.nextFree(f); ok {
				return n.planWrite(p, b, addr), true, nil
			}
		}
		if ps.AtBlockLimit(f) {
			// The pool's maxBlocksPerNode: no more blocks of f for this
			// node; it borrows, as when no block is left to claim.
			p.stage = stBorrowed
			return Need{Kind: Borrow, Family: f}, false, nil
		}
		first := n.NewRecord(r, false)
		p.stage = stClaimed
		return Need{Kind: Claim, Family: f, First: &first}, false, nil
	case stClaimed:
		var ee *records.ExhaustedError
		switch {
		case p.written != nil:
			return n.takeWritten(p), true, nil
		case errors.As(p.answer, &ee):
			p.stage = stBorrowed
			p.answer = nil
			return Need{Kind: Borrow, Family: f}, false, nil
		case p.answer != nil:
			return Need{}, false, p.answer
		}
		if al := n.live(ps, r.Owner, f, netip.Addr{}); al != nil {
			// A claim adopted on the way brought the owner's allocation
			// back: an earlier attempt's write whose answer was lost. It
			// is the owner's; a second is not planned.
			p.Reused = append(p.Reused, al)
			return Need{}, true, nil
		}
		ob := ps.own[p.claimed]
		if ob == nil {
			return Need{}, false, fmt.Errorf("claimed block %s is not this node's now: %w", p.claimed, retry.ErrConflict)
		}
		addr, ok := ob.ba.Next()
		if !ok {
			return Need{}, false, fmt.Errorf("claimed block %s has no free address", p.claimed)
		}
		return n.planWrite(p, p.claimed, addr), true, nil
	case stBorrowed:
		switch {
		case p.written != nil:
			return n.takeWritten(p), true, nil
		case p.answer != nil:
			return Need{}, false, p.answer
		case !p.room:
			return Need{}, false, fmt.Errorf("plan of %s: a borrow ended with no answer", r.Owner.Key())
		}
		// Own blocks have room again: plan normally.
		p.stage, p.room = stFresh, false
		return n.advanceFamily(p, f)
	}
	return Need{}, false, fmt.Errorf("plan of %s: stage %d out of order", r.Owner.Key(), p.stage)
}

// Claimed folds a claim's answer: block b is this node's now.
func (p *Plan) Claimed(b netip.Prefix) { p.claimed = b }

// Written folds an allocation the driver wrote for the family being
// planned (with a claim, or borrowed).
func (p *Plan) Written(al *records.Allocation) { p.written = al }

// Failed folds the error a claim or a borrow ended with.
func (p *Plan) Failed(err error) { p.answer = err }

// OwnRoom folds a borrow that found the node's own blocks have room after
// all: the family is planned again.
func (p *Plan) OwnRoom() { p.room = true }

func (n *Node) takeWritten(p *Plan) Need {
	p.Reused = append(p.Reused, p.written)
	p.Lent = append(p.Lent, p.written)
	return Need{}
}

// planWrite marks addr of own block b for p's owner and adds its write.
func (n *Node) planWrite(p *Plan, b netip.Prefix, addr netip.Addr) Need {
	ps := p.ps
	ob := ps.own[b]
	ob.ba.Mark(addr)
	ps.planned[addr] = true
	p.Writes = append(p.Writes, records.IPWrite{
		Pool: ps.spec.Name, Block: b, ClaimRev: ob.claimRev, Addr: addr, Reserve: p.Req.Reserve,
		Record: n.NewRecord(p.Req, false),
	})
	return Need{}
}

// NewRecord is the record of a new allocation for r.
func (n *Node) NewRecord(r Request, borrowed bool) records.Record {
	state := records.StateAllocated
	if r.Reserve {
		state = records.StateReserved
	}
	rec := records.Record{Owner: r.Owner, Node: n.name, State: state, Since: n.now().UTC(), Borrowed: borrowed}
	if r.Sticky != nil {
		rec.Identity, rec.WindowSeconds = r.Sticky.Identity, int64(r.Sticky.Window/time.Second)
	}
	return rec
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
//
// An allocated address comes before a reservation: the owner may hold
// both in one family for a moment, a reservation of an earlier try of
// its ADD that this node took for lapsed (its clock) while etcd still
// held it (its lease ends at the earliest when the node expects), read
// back on a conflict, next to the address the retry got and confirmed.
// The confirmed one is the pod's (found by TestModelNodeAllocator seed
// 1796279202506245316 at step 3171); the other lapses with its lease.
func (n *Node) live(ps *Pool, o records.Owner, f allocator.Family, except netip.Addr) *records.Allocation {
	var reserved *records.Allocation
	for _, al := range ps.ofOwner(o.Key(), f) {
		if al.Addr == except || n.dropIfLapsed(ps, al) {
			continue
		}
		if al.State != records.StateReserved {
			return al
		}
		if reserved == nil {
			reserved = al
		}
	}
	return reserved
}

// Live is live for the driver.
func (n *Node) Live(ps *Pool, o records.Owner, f allocator.Family, except netip.Addr) *records.Allocation {
	return n.live(ps, o, f, except)
}

// dropIfLapsed drops al from the cache if it is a reservation whose lease
// has ended, and reports whether it did. Every path that looks at a
// cached reservation (by owner, by address, or to make room) goes
// through it.
func (n *Node) dropIfLapsed(ps *Pool, al *records.Allocation) bool {
	exp, ok := ps.expires[al.Addr]
	if !ok || al.State != records.StateReserved || !n.now().After(exp) {
		return false
	}
	ps.drop(al)
	n.ended(al, "reservation lapsed")
	n.events = append(n.events, Event{Kind: Lapsed, Al: *al, End: exp})
	return true
}
