package agent

import (
	"context"
	"time"

	"github.com/kvipam/kvipam/allocator"
)

// confirmBatcher is the group commit of endpoint creates: the confirms
// (reservation made permanent) of concurrent ADDs queue, and one goroutine
// hands whatever is queued to ConfirmBatch, one etcd transaction for all.
// A lone confirm goes out at once; confirms that arrive while a batch is
// in flight form the next one. Without it a burst of ADDs waits for one
// fsync'd etcd write after another.
type confirmBatcher struct {
	alloc interface {
		ConfirmBatch(ctx context.Context, owners []allocator.Owner) []allocator.ConfirmOutcome
	}
	max int
	// timeout is the etcd budget of one batch, detached from the callers'
	// contexts so one caller giving up cannot fail the others.
	timeout time.Duration
	in      chan *confirmItem
}

type confirmItem struct {
	ctx  context.Context
	o    allocator.Owner
	done chan allocator.ConfirmOutcome
}

func newConfirmBatcher(a *allocator.NodeAllocator, max int, timeout time.Duration) *confirmBatcher {
	return &confirmBatcher{alloc: a, max: max, timeout: timeout, in: make(chan *confirmItem, max)}
}

// run serves batches until ctx ends.
func (b *confirmBatcher) run(ctx context.Context) {
	for {
		var items []*confirmItem
		select {
		case <-ctx.Done():
			return
		case it := <-b.in:
			items = append(items, it)
		}
	queued:
		for len(items) < b.max {
			select {
			case it := <-b.in:
				items = append(items, it)
			default:
				break queued
			}
		}
		b.serve(items)
	}
}

func (b *confirmBatcher) serve(items []*confirmItem) {
	live := items[:0]
	for _, it := range items {
		if it.ctx.Err() != nil {
			it.done <- allocator.ConfirmOutcome{Err: it.ctx.Err()}
			continue
		}
		live = append(live, it)
	}
	if len(live) == 0 {
		return
	}
	owners := make([]allocator.Owner, len(live))
	for i, it := range live {
		owners[i] = it.o
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	out := b.alloc.ConfirmBatch(ctx, owners)
	for i, it := range live {
		it.done <- out[i]
	}
}

// confirm queues one owner's confirm and waits for its outcome.
func (b *confirmBatcher) confirm(ctx context.Context, o allocator.Owner) ([]allocator.Allocation, error) {
	it := &confirmItem{ctx: ctx, o: o, done: make(chan allocator.ConfirmOutcome, 1)}
	select {
	case b.in <- it:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case out := <-it.done:
		return out.Allocations, out.Err
	case <-ctx.Done():
		// The batch may still confirm it: the plugin's rollback
		// releases the owner either way.
		return nil, ctx.Err()
	}
}

// batchedConfirms is the endpoint manager's allocator with its confirms
// going through the group commit.
type batchedConfirms struct {
	endpointAllocator
	batch *confirmBatcher
}

func (c batchedConfirms) Confirm(ctx context.Context, o allocator.Owner) ([]allocator.Allocation, error) {
	return c.batch.confirm(ctx, o)
}
