package agent

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// groupCommit is the agent's group commit: concurrent requests queue on a
// channel and one goroutine hands each queue-full to commit, one etcd
// transaction per batch. Requests that arrive while a batch is in flight
// form the next one. With a wait, when callers are on their way to the
// queue (entered do, not yet taken), the batch is also held open for
// them, up to wait, because a fast etcd can otherwise drain the queue one
// request at a time; a lone request goes out at once. Allocations use it
// with a wait, endpoint creates' confirms without.
type groupCommit[R, O any] struct {
	batches batchCommitter[R, O]
	// sizes, if set, sees each batch's size.
	sizes prometheus.Observer
	max   int
	in    chan *groupItem[R, O]
	// timeout is the least etcd budget of one batch; it runs to its most
	// patient caller's deadline when that is later. It is detached from
	// the callers' contexts so one caller giving up cannot fail the others.
	timeout time.Duration
	wait    time.Duration
	// coming counts callers that entered do and whose item no batch has
	// taken yet.
	coming atomic.Int64
}

// batchCommitter commits one batch of a group commit: one outcome per
// request, in order.
type batchCommitter[R, O any] interface {
	commitBatch(ctx context.Context, reqs []R) []O
}

// batchFunc is a batch method as a batchCommitter: the node allocator's
// AllocateBatch and ConfirmBatch.
type batchFunc[R, O any] func(ctx context.Context, reqs []R) []O

func (f batchFunc[R, O]) commitBatch(ctx context.Context, reqs []R) []O { return f(ctx, reqs) }

type groupItem[R, O any] struct {
	ctx  context.Context
	req  R
	done chan O
}

func newGroupCommit[R, O any](batches batchCommitter[R, O], max int, wait, timeout time.Duration) *groupCommit[R, O] {
	return &groupCommit[R, O]{batches: batches, max: max, in: make(chan *groupItem[R, O], max), wait: wait, timeout: timeout}
}

// run serves batches until ctx ends. Its owner (the agent) waits for it.
func (b *groupCommit[R, O]) run(ctx context.Context) {
	for {
		var first *groupItem[R, O]
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
func (b *groupCommit[R, O]) fill(ctx context.Context, first *groupItem[R, O]) []*groupItem[R, O] {
	items := []*groupItem[R, O]{first}
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

func (b *groupCommit[R, O]) serve(items []*groupItem[R, O]) {
	// Callers that gave up (do has returned their context's error) are
	// dropped before the transaction.
	live := items[:0]
	for _, it := range items {
		if it.ctx.Err() == nil {
			live = append(live, it)
		}
	}
	if len(live) == 0 {
		return
	}
	reqs := make([]R, len(live))
	for i, it := range live {
		reqs[i] = it.req
	}
	// The batch may work as long as its most patient caller waits, and at
	// least timeout: a caller's own deadline is the bound of its retries.
	deadline := time.Now().Add(b.timeout)
	for _, it := range live {
		if d, ok := it.ctx.Deadline(); ok && d.After(deadline) {
			deadline = d
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	out := b.batches.commitBatch(ctx, reqs)
	if b.sizes != nil {
		b.sizes.Observe(float64(len(live)))
	}
	for i, it := range live {
		it.done <- out[i]
	}
}

// do queues one request and waits for its outcome, or returns ctx's
// error when the caller gives up first. The batch may still write it:
// a retried allocation of the same owner gets the same addresses back
// and an abandoned reservation expires with its lease; a confirm's ADD
// is rolled back by the plugin, which releases the owner.
func (b *groupCommit[R, O]) do(ctx context.Context, req R) (O, error) {
	it := &groupItem[R, O]{ctx: ctx, req: req, done: make(chan O, 1)}
	var zero O
	b.coming.Add(1)
	select {
	case b.in <- it:
	case <-ctx.Done():
		b.coming.Add(-1)
		return zero, ctx.Err()
	}
	select {
	case o := <-it.done:
		return o, nil
	case <-ctx.Done():
		return zero, ctx.Err()
	}
}
