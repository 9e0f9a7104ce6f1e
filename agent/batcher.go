package agent

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/kvipam/kvipam/allocator"
)

// batcher is the group commit: concurrent allocation requests queue on a
// channel and one goroutine hands each queue-full to AllocateBatch, one
// etcd transaction per batch. Requests that arrive while a batch is in
// flight form the next one. When callers are on their way to the queue
// (entered allocate, not yet taken), the batcher also holds the batch open
// for them, up to wait, because a fast etcd can otherwise drain the queue
// one request at a time; a lone request goes out at once.
type batcher struct {
	alloc *allocator.NodeAllocator
	max   int
	in    chan *batchItem
	m     *metrics
	// timeout is the etcd budget of one batch. It is detached from the
	// callers' contexts so one caller giving up cannot fail the others.
	timeout time.Duration
	wait    time.Duration
	// coming counts callers that entered allocate and whose item no batch
	// has taken yet.
	coming atomic.Int64
}

type batchItem struct {
	ctx  context.Context
	req  allocator.Request
	done chan allocator.Outcome
}

func newBatcher(a *allocator.NodeAllocator, max int, wait, timeout time.Duration, m *metrics) *batcher {
	return &batcher{alloc: a, max: max, in: make(chan *batchItem, max), m: m, wait: wait, timeout: timeout}
}

// run serves batches until ctx ends. Its owner (the agent) waits for it.
func (b *batcher) run(ctx context.Context) {
	for {
		var first *batchItem
		select {
		case <-ctx.Done():
			return
		case first = <-b.in:
		}
		b.coming.Add(-1)
		b.serve(b.fill(ctx, first))
	}
}

// fill collects a batch behind first: whatever is queued, and under load
// whatever arrives within the wait window, up to max.
func (b *batcher) fill(ctx context.Context, first *batchItem) []*batchItem {
	items := []*batchItem{first}
	var window <-chan time.Time
	for len(items) < b.max {
		select {
		case it := <-b.in:
			b.coming.Add(-1)
			items = append(items, it)
			continue
		default:
		}
		if b.wait <= 0 || b.coming.Load() <= 0 {
			return items // nobody else is on the way
		}
		if window == nil {
			t := time.NewTimer(b.wait)
			defer t.Stop()
			window = t.C
		}
		select {
		case it := <-b.in:
			b.coming.Add(-1)
			items = append(items, it)
		case <-window:
			return items
		case <-ctx.Done():
			return items
		}
	}
	return items
}

func (b *batcher) serve(items []*batchItem) {
	// Callers that gave up are dropped before the transaction.
	live := items[:0]
	for _, it := range items {
		if it.ctx.Err() != nil {
			it.done <- allocator.Outcome{Err: it.ctx.Err()}
			continue
		}
		live = append(live, it)
	}
	if len(live) == 0 {
		return
	}
	reqs := make([]allocator.Request, len(live))
	for i, it := range live {
		reqs[i] = it.req
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	out := b.alloc.AllocateBatch(ctx, reqs)
	b.m.batch.Observe(float64(len(live)))
	for i, it := range live {
		it.done <- out[i]
	}
}

// allocate queues one request and waits for its outcome.
func (b *batcher) allocate(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	it := &batchItem{ctx: ctx, req: req, done: make(chan allocator.Outcome, 1)}
	b.coming.Add(1)
	select {
	case b.in <- it:
	case <-ctx.Done():
		b.coming.Add(-1)
		return allocator.Result{}, ctx.Err()
	}
	select {
	case o := <-it.done:
		return o.Result, o.Err
	case <-ctx.Done():
		// The batch may still write it; a retried request with the same
		// owner gets the same addresses back, and an abandoned
		// reservation expires with its lease.
		return allocator.Result{}, ctx.Err()
	}
}
