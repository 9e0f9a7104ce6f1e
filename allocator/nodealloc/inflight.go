package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// A claim's etcd round trips without the lock.
//
// An Allocator has two locks. allocMu serializes everything that plans
// addresses, claims blocks or changes the node's blocks or pool specs:
// AllocateBatch, Restore, Reassert, UpdatePool, GiveBackEmpty. mu guards
// the cache, and everything else (releases, confirms, views, lent
// addresses seen by the watch) takes only mu. allocMu is taken first.
//
// An allocation lets go of mu, and only mu, while a claim it makes is in
// etcd (the claim transaction, and the listing of the pool's claims
// before the walk is tried again): a node's DELs, confirms and views do
// not wait for a claim, which on a loaded etcd takes long. Nothing that
// plans or claims can run meanwhile (allocMu), so no other claim starts,
// and the walk, the pool spec and the node's lease stay as the
// allocation left them. What can run keeps the allocation's state:
//
//   - addresses planned and not yet written stay marked, and a block
//     read again keeps them marked (loadBlock); a block holding them is
//     never given back (holds);
//   - the allocation's owners are busy: a release or a confirm of one of
//     them waits for the allocation to end (waitOwner), as it waited for
//     the lock before, so a DEL releases what its ADD got;
//   - a block a concurrent call finds lost (a fenced write) is lost to
//     the allocation too: its write into it is fenced, and retried.

// inflight is the allocation in flight, and the rule above.
type inflight struct {
	mu *sync.Mutex // the Allocator's mu
	// busy holds the owners of the allocation in flight, and done is
	// closed when it ends; both nil between allocations.
	busy map[string]bool
	done chan struct{}
}

// mark makes reqs' owners busy until the returned function, called with
// mu held, ends the allocation. Called with allocMu and mu held.
func (f *inflight) mark(reqs []Request) func() {
	f.busy = make(map[string]bool, len(reqs))
	for _, r := range reqs {
		f.busy[r.Owner.Key()] = true
	}
	f.done = make(chan struct{})
	return func() {
		close(f.done)
		f.busy, f.done = nil, nil
	}
}

// offLock runs f, one of a claim's etcd round trips, without mu if an
// allocation (AllocateBatch) is what holds allocMu; otherwise (Restore,
// Reassert) with it. Called with mu held; returns with it held.
func (f *inflight) offLock(call func()) {
	if f.busy == nil {
		call()
		return
	}
	f.mu.Unlock()
	defer f.mu.Lock()
	call()
}

// waitOwner waits, without mu, while the allocation in flight serves the
// owner whose key is key: a release or a confirm of that owner comes
// after it. Called with mu held; returns with it held. If ctx ends first,
// the error wraps ErrUnavailable: try again.
func (f *inflight) waitOwner(ctx context.Context, key string) error {
	for f.busy[key] {
		done := f.done
		f.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
		}
		f.mu.Lock()
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%s is being allocated: %w", key, errors.Join(retry.ErrUnavailable, err))
		}
	}
	return nil
}
