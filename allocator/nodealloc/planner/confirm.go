package planner

import (
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// ConfirmPlan is one owner's part of a confirm: the writes that make its
// reservations permanent, and its allocations that already are.
type ConfirmPlan struct {
	Writes []records.IPWrite
	Done   []records.Allocation
}

// ConfirmNeeds says what a confirm of o reads first: the owner's
// permanent sticky allocations (a later container of its identity may
// have taken one over from another node: etcd says, not the cache), and
// whether a reservation it confirms is borrowed (fenced by the node's
// borrow fence).
func (n *Node) ConfirmNeeds(o records.Owner) (readBack []records.IPRef, fence bool) {
	for _, ps := range n.Pools() {
		for _, al := range ps.byOwner[o.Key()] {
			switch {
			case al.State != records.StateReserved && al.Identity != "" && ps.unasserted[al.Addr] != al:
				readBack = append(readBack, records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr})
			case al.State == records.StateReserved && al.Borrowed:
				fence = true
			}
		}
	}
	return readBack, fence
}

// PlanConfirm plans o's confirm; fence is the node's borrow fence (0 if
// ConfirmNeeds asked for none).
func (n *Node) PlanConfirm(o records.Owner, fence int64) (ConfirmPlan, error) {
	var p ConfirmPlan
	for _, ps := range n.Pools() {
		for _, al := range slices.Clone(ps.byOwner[o.Key()]) {
			if al.State != records.StateReserved {
				if ps.unasserted[al.Addr] == al {
					// etcd lost it: not answered from the cache until a
					// Reassert (or the owner's next ADD) writes it back.
					return p, fmt.Errorf("confirm %s: etcd lost the record of %s, and it is not written back yet: %w", o.Key(), al.Addr, retry.ErrUnavailable)
				}
				p.Done = append(p.Done, *al)
				continue
			}
			if n.dropIfLapsed(ps, al) {
				return p, fmt.Errorf("confirm %s: %s: %w", o.Key(), al.Addr, records.ErrReservationGone)
			}
			rev := fence
			if !al.Borrowed {
				if rev = ps.ClaimRev(al.Block); rev == 0 {
					// The block's claim was lost (a fenced write): no
					// write is fenced until Restore re-claims it.
					return p, fmt.Errorf("confirm %s: %s: block %s is not claimed by node %s now: %w", o.Key(), al.Addr, al.Block, n.name, records.ErrLeaseLost)
				}
			}
			rec := al.Record
			rec.State, rec.Since = records.StateAllocated, n.now().UTC()
			if o.Namespace != "" || o.Pod != "" {
				rec.Namespace, rec.Pod = o.Namespace, o.Pod
			}
			p.Writes = append(p.Writes, records.IPWrite{Pool: ps.spec.Name, Block: al.Block, ClaimRev: rev, Addr: al.Addr, Record: rec, PrevRev: al.Rev, Borrowed: al.Borrowed})
		}
	}
	if len(p.Writes) == 0 && len(p.Done) == 0 {
		return p, fmt.Errorf("confirm %s: %w", o.Key(), records.ErrNotFound)
	}
	return p, nil
}

// ConfirmsWritten folds confirms etcd applied at res.
func (n *Node) ConfirmsWritten(writes []records.IPWrite, res records.WriteResult) {
	for _, w := range writes {
		ps := n.pools[w.Pool]
		al := ps.byAddr[w.Addr]
		al.Record, al.Rev, al.Lease = w.Record, res.Rev, 0
		delete(ps.expires, w.Addr)
	}
}

// StillReserved reports whether a confirm whose outcome was unknown, and
// is settled, did not land while the reservation stands.
func (n *Node) StillReserved(writes []records.IPWrite) bool {
	for _, w := range writes {
		if al := n.pools[w.Pool].byAddr[w.Addr]; al != nil && al.State == records.StateReserved && al.Owner.Key() == w.Record.Owner.Key() {
			return true
		}
	}
	return false
}

// FinishConfirm reports o's allocations once its writes are applied (or
// settled): each must now hold the record that was written.
func (n *Node) FinishConfirm(o records.Owner, p ConfirmPlan) ([]records.Allocation, error) {
	done := slices.Clone(p.Done)
	for _, w := range p.Writes {
		al := n.pools[w.Pool].byAddr[w.Addr]
		if al == nil || !SameRecord(al.Record, w.Record) {
			return nil, fmt.Errorf("confirm %s: %s: %w", o.Key(), w.Addr, records.ErrReservationGone)
		}
		done = append(done, *al)
	}
	n.confirmed(o)
	slices.SortFunc(done, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return done, nil
}
