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

// A requested (static) address: in an own block it is planned like any
// other, if free; in a block nobody claims, the block is claimed for it;
// in a block another live node claims, it is borrowed.

// advanceStatic plans the requested address want of family f.
func (n *Node) advanceStatic(p *Plan, f allocator.Family, want netip.Addr) (Need, bool, error) {
	ps := p.ps
	b, ob := ps.ownBlockOf(want)
	switch p.stage {
	case stFresh:
		if err := staticDrained(ps.spec, want); err != nil {
			return Need{}, false, err
		}
		if ob == nil {
			if other, ok := ps.others[b]; ok && other.node != "" {
				return n.borrowStatic(p, b, want, fmt.Errorf("requested ip %s is in block %s of node %s: %w", want, b, other.node, records.ErrNotOwned))
			}
			p.stage = stStaticClaim
			return Need{Kind: ClaimBlock, Block: b, Addr: want}, false, nil
		}
	case stStaticClaim:
		if err := p.answer; err != nil {
			p.answer = nil
			var ce *records.ClaimError
			if errors.As(err, &ce) {
				err = errors.Join(records.ErrNotOwned, err)
			}
			err = fmt.Errorf("requested ip %s: %w", want, err)
			if errors.Is(err, records.ErrNotOwned) {
				return n.borrowStatic(p, b, want, err)
			}
			return Need{}, false, err
		}
		if ob == nil {
			return Need{}, false, fmt.Errorf("requested ip %s: block %s is not this node's now: %w", want, b, retry.ErrConflict)
		}
	case stStaticLent:
		if err := p.answer; err != nil {
			if OnlyTaken(err) {
				return Need{}, false, fmt.Errorf("requested ip %s is held by another owner: %w", want, records.ErrIPInUse)
			}
			return Need{}, false, err
		}
		return n.takeWritten(p), true, nil
	}
	if p.stage < stStaticThaw {
		if slices.Contains(ps.spec.Excluded(b), want) {
			return Need{}, false, excludedErr(ps, want)
		}
		if al := ps.byAddr[want]; al != nil {
			n.dropIfLapsed(ps, al) // the create-if-absent write guards the rest
		}
		if _, kept := ps.kept[want]; kept {
			p.stage = stStaticThaw
			return Need{Kind: ThawKept, Family: f}, false, nil // its window may have ended
		}
		p.stage = stStaticThaw
	}
	if p.stage == stStaticThaw {
		if _, cooling := ps.cool.at[want]; cooling && ps.byAddr[want] == nil {
			delete(ps.cool.at, want) // asked for by name: no cooldown
			ob.ba.Unmark(want)
		}
		al := ps.byAddr[want]
		// A reservation of another owner, its write done: its lease may
		// have ended in etcd before this node's estimate of its end (read
		// at a restore, with a margin), so etcd is asked, not the cache.
		lapsing := al != nil && al.State == records.StateReserved && al.Owner.Key() != p.Req.Owner.Key() && !ps.planned[want]
		if ob.ba.IsUsed(want) && (!ps.writing(want) || lapsing) && !n.HeldSet()[want] {
			// Marked for no write of this node: kept for an identity or
			// lent, as last read (an operator may have released it since),
			// or for an endpoint that used want when the block was loaded
			// and has gone since, its DEL finding nothing to release; or a
			// reservation that may have lapsed. Read the block again
			// rather than refuse an address etcd may hold for nobody.
			p.stage = stStaticLoad
			return Need{Kind: Reload, Block: b}, false, nil
		}
		p.stage = stStaticLoad
	}
	if p.answer != nil {
		return Need{}, false, fmt.Errorf("requested ip %s: %w", want, p.answer)
	}
	if ob = ps.own[b]; ob == nil {
		return Need{}, false, fmt.Errorf("requested ip %s: block %s is not this node's now: %w", want, b, retry.ErrConflict)
	}
	if ob.ba.IsUsed(want) {
		holder := "another owner"
		if al := ps.byAddr[want]; al != nil {
			holder = al.Owner.Key()
		}
		if k, ok := ps.kept[want]; ok {
			holder = "sticky identity " + k.identity + " (kept until " + k.until.UTC().Format(time.RFC3339) + ")"
		}
		return Need{}, false, fmt.Errorf("requested ip %s is held by %s: %w", want, holder, records.ErrIPInUse)
	}
	return n.planWrite(p, b, want), true, nil
}

// borrowStatic decides on a requested address that lies in a block this
// node cannot claim (cause): a static request may name any address of
// the pool, so one in a block another live node claims is borrowed; one
// in an orphaned block is left to its gone node (cause).
func (n *Node) borrowStatic(p *Plan, b netip.Prefix, addr netip.Addr, cause error) (Need, bool, error) {
	ps := p.ps
	var ce *records.ClaimError
	other, known := ps.others[b]
	claimed := (errors.As(cause, &ce) && ce.ClaimedBy != "") || (known && other.node != "" && !other.orphaned)
	if !claimed {
		return Need{}, false, cause
	}
	if slices.Contains(ps.spec.Excluded(b), addr) {
		return Need{}, false, excludedErr(ps, addr)
	}
	rec := n.NewRecord(p.Req, true)
	p.stage = stStaticLent
	return Need{Kind: BorrowAt, Block: b, Addr: addr, First: &rec}, false, nil
}

func excludedErr(ps *Pool, addr netip.Addr) error {
	return fmt.Errorf("%w: requested ip %s is a network, broadcast or anycast address of pool %s", records.ErrBadRequest, addr, ps.spec.Name)
}

// staticDrained refuses a static request for an address of a draining
// cidr: the cidr is being retired, and a new address there would hold
// its removal up.
func staticDrained(p allocator.Pool, addr netip.Addr) error {
	c, ok := p.DrainingCIDR(addr)
	if !ok {
		return nil
	}
	return fmt.Errorf("%w: requested ip %s is in cidr %s of pool %s, which is draining and hands out no new address (kvipamctl pool undrain-cidr %s %s)",
		records.ErrBadRequest, addr, c, p.Name, p.Name, c)
}
