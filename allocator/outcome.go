package allocator

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// A write whose store call fails with anything but a definite conflict
// (a deadline, a lost connection, a leader change) has an unknown outcome:
// etcd may have applied the transaction. Treating it as failed would undo
// a write that landed; retrying would then give the owner a second
// address while the first stays in etcd. So the allocator parks such
// writes, keeps their addresses marked, and settles them by reading etcd
// before anything else is decided for their owners. A create-if-absent
// write can be told apart from anyone else's by its record, which carries
// the owner and a timestamp of nanosecond precision.

// outcomeUnknown reports whether a failed write may have been applied.
// Conflicts (failed compares, a reservation lease etcd no longer has) are
// refusals: nothing was written.
func outcomeUnknown(err error) bool {
	return err != nil && !errors.Is(err, ErrConflict)
}

// park records writes of unknown outcome. Their addresses stay marked.
func (a *NodeAllocator) park(ps *poolState, writes []IPWrite) {
	for _, w := range writes {
		delete(ps.planned, w.Addr)
		ps.unknown[w.Addr] = pending{write: w}
		a.log.Warn("write outcome unknown; settling it from etcd before the address is reused", "pool", ps.pool.Name, "ip", w.Addr, "owner", w.Record.Owner.Key())
	}
}

// parkDelete records the delete of al, of unknown outcome. al stays cached
// (and its address marked) until settled: an owner's retried ADD must not
// be answered with an address that may be gone from etcd.
func (a *NodeAllocator) parkDelete(ps *poolState, al *Allocation) {
	ps.unknown[al.Addr] = pending{del: al}
	a.log.Warn("delete outcome unknown; settling it from etcd", "pool", ps.pool.Name, "ip", al.Addr, "owner", al.Owner.Key())
}

// settlePending reads back every parked write, in one round trip, and
// makes the cache match what landed. If etcd cannot be read the writes
// stay parked and the error wraps ErrUnavailable.
func (a *NodeAllocator) settlePending(ctx context.Context) error {
	var refs []IPRef
	for _, ps := range a.pools {
		for _, p := range ps.unknown {
			refs = append(refs, p.ref())
		}
	}
	if len(refs) == 0 {
		return nil
	}
	got, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return fmt.Errorf("%w: read back %d writes of unknown outcome: %w", ErrUnavailable, len(refs), err)
	}
	for _, ps := range a.pools {
		for addr, p := range ps.unknown {
			delete(ps.unknown, addr)
			cur, ok := got[addr]
			if p.del != nil {
				a.settleDelete(ctx, ps, p.del, cur, ok)
				continue
			}
			a.settle(ctx, ps, p.write, cur, ok)
		}
	}
	return nil
}

// settle applies what etcd holds at w's address (cur, if ok) to the cache.
func (a *NodeAllocator) settle(ctx context.Context, ps *poolState, w IPWrite, cur Allocation, ok bool) {
	b, ob := ps.ownBlockOf(w.Addr)
	mine := ok && sameRecord(cur.Record, w.Record)
	switch {
	case w.PrevRev == 0 && mine: // the create landed
		var exp time.Time
		if cur.Lease != 0 {
			// Without the expiry the reservation just never lapses in the
			// cache; etcd still expires it and a reload notices.
			exp, _ = a.cfg.Store.LeaseExpiry(ctx, cur.Lease)
		}
		cur.Seen = time.Now()
		ps.remember(&cur, exp)
		a.logAllocated(&cur)
		a.log.Info("write of unknown outcome had landed", "pool", ps.pool.Name, "ip", w.Addr, "owner", w.Record.Owner.Key())
	case w.PrevRev == 0 && !ok: // it did not land
		if ob != nil {
			ob.ba.Unmark(w.Addr)
		}
	case mine: // a confirm landed
		if al := ps.byAddr[w.Addr]; al != nil {
			al.Record, al.Rev, al.Lease = cur.Record, cur.Rev, 0
			delete(ps.expires, w.Addr)
		}
	case w.PrevRev != 0 && ok && cur.Rev == w.PrevRev: // a confirm that did not land
	default:
		// Someone else's write, or the reservation is gone: the cache is
		// wrong about this address, so read the block again.
		if ob != nil {
			if err := a.reloadBlock(ctx, ps, b); err != nil {
				a.log.Warn("reload block", "pool", ps.pool.Name, "block", b, "error", err)
			}
		}
	}
}

// settleDelete applies what etcd holds at al's address (cur, if ok) after
// a delete of al whose outcome was unknown.
func (a *NodeAllocator) settleDelete(ctx context.Context, ps *poolState, al *Allocation, cur Allocation, ok bool) {
	if ok && cur.Rev == al.Rev {
		return // not deleted: the owner still holds it
	}
	if ps.byAddr[al.Addr] == al {
		a.dropReleased(ps, al)
		a.logEnded(al, "released")
	}
	if ok { // rewritten since: the cache does not know by whom
		if b, ob := ps.ownBlockOf(al.Addr); ob != nil {
			if err := a.reloadBlock(ctx, ps, b); err != nil {
				a.log.Warn("reload block", "pool", ps.pool.Name, "block", b, "error", err)
				ob.ba.Mark(al.Addr)
			}
		}
	}
}

// sameRecord reports whether two records are one write's.
func sameRecord(x, y Record) bool {
	return x.Owner == y.Owner && x.Node == y.Node && x.State == y.State && x.Since.Equal(y.Since)
}

// anyPending reports whether the owner has a parked write in any pool.
func (a *NodeAllocator) anyPending(o Owner) bool {
	for _, ps := range a.pools {
		if ps.pendingFor(o.Key()) {
			return true
		}
	}
	return false
}
