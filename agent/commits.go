package agent

import (
	"context"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// queuedAllocations serves one allocate request through the group commit.
type queuedAllocations struct {
	batch *groupCommit[nodealloc.Request, nodealloc.Outcome]
	// migrations admits live migrations' targets, one at a time: they
	// are rare, and each reads and rewrites another pod's records.
	migrations interface {
		Admit(ctx context.Context, req nodealloc.Request) (nodealloc.Result, bool, error)
	}
}

// Admit admits a live migration's target (nodealloc.Allocator.Admit).
func (q queuedAllocations) Admit(ctx context.Context, req nodealloc.Request) (nodealloc.Result, bool, error) {
	return q.migrations.Admit(ctx, req)
}

// Allocate queues req for the next batch and waits for its outcome.
func (q queuedAllocations) Allocate(ctx context.Context, req nodealloc.Request) (nodealloc.Result, error) {
	o, err := q.batch.do(ctx, req)
	if err != nil {
		return nodealloc.Result{}, err
	}
	return o.Result, o.Err
}

// batchedConfirms is the endpoint manager's allocator with its confirms
// going through a group commit (nodealloc's Allocator.ConfirmBatch): without it a
// burst of ADDs waits for one fsync'd etcd write after another.
type batchedConfirms struct {
	endpointAllocator
	batch *groupCommit[records.Owner, nodealloc.ConfirmOutcome]
}

func (c batchedConfirms) Confirm(ctx context.Context, o records.Owner) ([]records.Allocation, error) {
	out, err := c.batch.do(ctx, o)
	if err != nil {
		return nil, err
	}
	return out.Allocations, out.Err
}
