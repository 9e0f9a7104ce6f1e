package planner

import (
	"errors"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// What a plan's write did, folded into the cache: written (Commit),
// refused (Undo), or of unknown outcome and settled (Landed).

// Undo unmarks what p planned and not yet wrote.
func (n *Node) Undo(p *Plan) {
	for _, w := range p.Writes {
		delete(p.ps.planned, w.Addr)
		if ob := p.ps.own[w.Block]; ob != nil {
			ob.ba.Unmark(w.Addr)
		}
	}
	p.Writes = nil
}

// Commit records a written plan and builds its result.
func (n *Node) Commit(p *Plan, res records.WriteResult) Result {
	seen := n.now()
	for _, w := range p.Writes {
		delete(p.ps.planned, w.Addr)
		delete(p.ps.kept, w.Addr)
		if !w.Borrowed {
			delete(p.ps.lent, w.Addr)
		}
		al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: w.Block, Addr: w.Addr, Rev: res.Rev, Seen: seen}
		p.ps.remember(al, res.Expires)
		n.allocated(al)
	}
	return n.result(p)
}

// Landed reports whether a plan whose write had an unknown outcome landed,
// as settled into the cache, and if so its result. Only addresses tell: a
// binding written alone (each address reused, or written with its claim)
// is not in the cache, so such a plan has not landed as far as the cache
// knows; the next attempt reads the binding and writes it again if it
// must.
func (n *Node) Landed(p *Plan) (Result, bool) {
	if p.Bind != nil && len(p.Writes) == 0 {
		return Result{}, false
	}
	for _, w := range p.Writes {
		if al := p.ps.byAddr[w.Addr]; al == nil || !SameRecord(al.Record, w.Record) {
			return Result{}, false
		}
	}
	return n.result(p), true
}

// result is the answer of a plan whose writes are in the cache. A sticky
// owner told a reservation is noted until its confirm or DEL
// (Pool.checkBinding).
func (n *Node) result(p *Plan) Result {
	if p.Req.Sticky != nil && p.Req.Reserve {
		p.ps.noteCheckBinding(p.Req.Owner.Key(), p.Req.Sticky.Identity)
	}
	out := Result{Pool: p.ps.spec.Name}
	als := slices.Clone(p.Reused)
	for _, w := range p.Writes {
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

// HeldBy lists the addresses the request's owner holds in its pool.
func (n *Node) HeldBy(r Request) map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if ps := n.pools[r.Pool]; ps != nil {
		for _, al := range ps.byOwner[r.Owner.Key()] {
			out[al.Addr] = true
		}
	}
	return out
}

// BorrowedSince lists what r's owner borrowed that it did not hold in
// before.
func (n *Node) BorrowedSince(r Request, before map[netip.Addr]bool) []*records.Allocation {
	ps := n.pools[r.Pool]
	if ps == nil {
		return nil
	}
	var lent []*records.Allocation
	for _, al := range ps.byOwner[r.Owner.Key()] {
		if al.Borrowed && !before[al.Addr] {
			lent = append(lent, al)
		}
	}
	return lent
}

// SameRecord reports whether two records are one write's.
func SameRecord(x, y records.Record) bool {
	return x.Owner == y.Owner && x.Node == y.Node && x.State == y.State && x.Since.Equal(y.Since)
}

// OnlyTaken reports whether a write failed only because addresses it
// created were taken: nothing was fenced.
func OnlyTaken(err error) bool {
	var we *records.WriteError
	return errors.As(err, &we) && len(we.Fenced) == 0 && !we.FenceLost && len(we.Taken) > 0
}

// OutcomeUnknown reports whether a failed write may have been applied.
// Conflicts (failed compares, a reservation lease etcd no longer has) and
// writes the store refused before acting on them (retry.ErrRefused:
// etcd's "too many requests") wrote nothing.
func OutcomeUnknown(err error) bool {
	return err != nil && !errors.Is(err, retry.ErrConflict) && !errors.Is(err, retry.ErrRefused)
}
