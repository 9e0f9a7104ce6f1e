package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

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
			if errors.Is(o.Err, records.ErrUnavailable) {
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
	out := make([]ConfirmOutcome, len(owners))
	// An owner whose allocation is in flight is confirmed after it
	// (waitOwner lets go of mu): wait until none of them is.
	for again := true; again; {
		again = false
		for i, o := range owners {
			if out[i].Err != nil || !a.busy[o.Key()] {
				continue
			}
			again = true
			if err := a.waitOwner(ctx, o.Key()); err != nil {
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
	plans := make([]confirmPlan, len(owners))
	var writes []records.IPWrite
	for i, o := range owners {
		if out[i].Err != nil {
			continue
		}
		if settleErr != nil && a.anyPending(o) {
			out[i].Err = fmt.Errorf("confirm %s: %w", o.Key(), settleErr)
			continue
		}
		plans[i], out[i].Err = a.planConfirm(ctx, o)
		writes = append(writes, plans[i].writes...)
	}
	if len(writes) == 0 {
		for i, o := range owners {
			if out[i].Err == nil {
				out[i].Allocations, out[i].Err = a.finishConfirm(o, plans[i])
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
			out[i].Allocations, out[i].Err = a.finishConfirm(o, plans[i])
		case len(owners) > 1 && !outcomeUnknown(err) && !errors.Is(err, records.ErrRefused):
			// Nothing was written, and not for etcd's load (which a
			// transaction per owner would only add to): each owner on
			// its own. One whose reservation the refusal showed gone
			// (dropped from the cache) is told so, as Confirm would.
			out[i].Allocations, out[i].Err = a.confirmAlone(ctx, o)
			if errors.Is(out[i].Err, records.ErrNotFound) && len(plans[i].writes) > 0 {
				out[i].Err = fmt.Errorf("confirm %s: %w: %w", o.Key(), records.ErrReservationGone, err)
			}
		default:
			out[i].Err = fmt.Errorf("confirm %s: %w", o.Key(), err)
		}
	}
	return out
}

// confirmPlan is one owner's part of a confirm: the writes that make its
// reservations permanent, and its allocations that already are.
type confirmPlan struct {
	writes []records.IPWrite
	done   []records.Allocation
}

func (a *Allocator) planConfirm(ctx context.Context, o records.Owner) (confirmPlan, error) {
	var p confirmPlan
	for _, ps := range a.pools {
		for _, al := range slices.Clone(ps.byOwner[o.Key()]) {
			if al.State != records.StateReserved {
				if ps.unasserted[al.Addr] == al {
					// etcd lost it: not answered from the cache until a
					// Reassert (or the owner's next ADD) writes it back.
					return p, fmt.Errorf("confirm %s: etcd lost the record of %s, and it is not written back yet: %w", o.Key(), al.Addr, records.ErrUnavailable)
				}
				if al.Identity != "" {
					// A later container of its identity may have taken
					// it over from another node: ask etcd, not the cache.
					if err := a.readBack(ctx, refsOf([]*records.Allocation{al})); err != nil {
						return p, fmt.Errorf("confirm %s: read back %s: %w", o.Key(), al.Addr, err)
					}
					if al = ps.byAddr[al.Addr]; al == nil || al.Owner.Key() != o.Key() {
						continue
					}
				}
				p.done = append(p.done, *al)
				continue
			}
			if a.dropIfLapsed(ps, al) {
				return p, fmt.Errorf("confirm %s: %s: %w", o.Key(), al.Addr, records.ErrReservationGone)
			}
			fence, err := a.writeFence(ctx, ps, al)
			if err != nil {
				return p, fmt.Errorf("confirm %s: %s: %w", o.Key(), al.Addr, err)
			}
			rec := al.Record
			rec.State, rec.Since = records.StateAllocated, a.cfg.Now().UTC()
			if o.Namespace != "" || o.Pod != "" {
				rec.Namespace, rec.Pod = o.Namespace, o.Pod
			}
			p.writes = append(p.writes, records.IPWrite{Pool: ps.pool.Name, Block: al.Block, ClaimRev: fence, Addr: al.Addr, Record: rec, PrevRev: al.Rev, Borrowed: al.Borrowed})
		}
	}
	if len(p.writes) == 0 && len(p.done) == 0 {
		return p, fmt.Errorf("confirm %s: %w", o.Key(), records.ErrNotFound)
	}
	return p, nil
}

// writeConfirms writes confirms and applies what etcd answered to the
// cache: the new records on success; on an unknown outcome the writes are
// parked and settled from etcd, and nil is returned once they are.
func (a *Allocator) writeConfirms(ctx context.Context, writes []records.IPWrite) error {
	res, err := a.cfg.Store.WriteIPs(ctx, writes)
	switch {
	case err == nil:
		for _, w := range writes {
			al := a.pools[w.Pool].byAddr[w.Addr]
			al.Record, al.Rev, al.Lease = w.Record, res.Rev, 0
			delete(a.pools[w.Pool].expires, w.Addr)
		}
		return nil
	case outcomeUnknown(err):
		for _, w := range writes {
			a.parkWrites(a.pools[w.Pool], []records.IPWrite{w})
		}
		if serr := a.settlePending(ctx); serr != nil {
			return serr
		}
		for _, w := range writes {
			if al := a.pools[w.Pool].byAddr[w.Addr]; al != nil && al.State == records.StateReserved && al.Owner.Key() == w.Record.Owner.Key() {
				// It did not land, and the reservation stands: the answer
				// is etcd's (too many requests: try again), not a lapse.
				return err
			}
		}
		return nil
	default:
		a.learn(ctx, err)
		var we *records.WriteError
		if errors.As(err, &we) {
			return fmt.Errorf("%w: %w", records.ErrReservationGone, err)
		}
		return err
	}
}

// confirmAlone confirms one owner in its own transaction.
func (a *Allocator) confirmAlone(ctx context.Context, o records.Owner) ([]records.Allocation, error) {
	p, err := a.planConfirm(ctx, o)
	if err != nil {
		return nil, err
	}
	if len(p.writes) > 0 {
		if err := a.writeConfirms(ctx, p.writes); err != nil {
			return nil, fmt.Errorf("confirm %s: %w", o.Key(), err)
		}
	}
	return a.finishConfirm(o, p)
}

// finishConfirm reports o's allocations once its writes are applied (or
// settled): each must now hold the record that was written.
func (a *Allocator) finishConfirm(o records.Owner, p confirmPlan) ([]records.Allocation, error) {
	done := slices.Clone(p.done)
	for _, w := range p.writes {
		al := a.pools[w.Pool].byAddr[w.Addr]
		if al == nil || !sameRecord(al.Record, w.Record) {
			return nil, fmt.Errorf("confirm %s: %s: %w", o.Key(), w.Addr, records.ErrReservationGone)
		}
		done = append(done, *al)
	}
	for _, ps := range a.pools {
		delete(ps.checkBinding, o.Key())
	}
	slices.SortFunc(done, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return done, nil
}
