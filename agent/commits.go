package agent

import (
	"context"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// allocate serves one allocation request through the group commit.
// allocationBatches commits a group commit's allocate requests through
// the node allocator, one transaction per batch.
type allocationBatches struct {
	alloc interface {
		AllocateBatch(ctx context.Context, reqs []nodealloc.Request) []nodealloc.Outcome
	}
}

func (b allocationBatches) commitBatch(ctx context.Context, reqs []nodealloc.Request) []nodealloc.Outcome {
	return b.alloc.AllocateBatch(ctx, reqs)
}

func (allocationBatches) failedOutcome(err error) nodealloc.Outcome {
	return nodealloc.Outcome{Err: err}
}

// confirmBatches commits a group commit's confirms, one transaction per
// batch.
type confirmBatches struct {
	alloc interface {
		ConfirmBatch(ctx context.Context, owners []records.Owner) []nodealloc.ConfirmOutcome
	}
}

func (b confirmBatches) commitBatch(ctx context.Context, owners []records.Owner) []nodealloc.ConfirmOutcome {
	return b.alloc.ConfirmBatch(ctx, owners)
}

func (confirmBatches) failedOutcome(err error) nodealloc.ConfirmOutcome {
	return nodealloc.ConfirmOutcome{Err: err}
}

// queuedAllocations serves one allocate request through the group commit.
type queuedAllocations struct {
	batch *groupCommit[nodealloc.Request, nodealloc.Outcome]
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
// going through a group commit (allocator.ConfirmBatch): without it a
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
