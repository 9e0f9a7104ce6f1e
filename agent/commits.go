package agent

import (
	"context"

	"github.com/kvipam/kvipam/allocator"
)

// allocate serves one allocation request through the group commit.
func (a *Agent) allocate(ctx context.Context, req allocator.Request) (allocator.Result, error) {
	o, err := a.batch.do(ctx, req)
	if err != nil {
		return allocator.Result{}, err
	}
	return o.Result, o.Err
}

// batchedConfirms is the endpoint manager's allocator with its confirms
// going through a group commit (allocator.ConfirmBatch): without it a
// burst of ADDs waits for one fsync'd etcd write after another.
type batchedConfirms struct {
	endpointAllocator
	batch *groupCommit[allocator.Owner, allocator.ConfirmOutcome]
}

func (c batchedConfirms) Confirm(ctx context.Context, o allocator.Owner) ([]allocator.Allocation, error) {
	out, err := c.batch.do(ctx, o)
	if err != nil {
		return nil, err
	}
	return out.Allocations, out.Err
}
