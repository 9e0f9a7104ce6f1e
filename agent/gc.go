package agent

import (
	"context"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/records"
)

// collector serves CNI GC requests. It is safe for concurrent use.
type collector struct {
	// allocs is a snapshot of this node's allocations.
	allocs interface{ Allocations() []records.Allocation }
	// releaser frees the chosen allocations if etcd still holds them as
	// they were in the snapshot.
	releaser interface {
		releaseAllocations(ctx context.Context, als []records.Allocation) ([]string, error)
	}
	grace    time.Duration
	released prometheus.Counter
	log      hclog.Logger

	// testHookDecided, if set, runs between the choice of what to
	// release and the releases, so a test can interleave a DEL and an ADD.
	testHookDecided func()
}

// collect serves a GC request: this node's allocations (in req.Pool, or
// every pool) whose owner is not a valid attachment are released, but only
// once the node has known them for the grace period (on the monotonic
// clock, so a step of the wall clock cannot make a fresh allocation look
// old), so an ADD that raced the caller's list of valid attachments is not
// collected. Each release is guarded in etcd by the revision seen in the
// snapshot GC decided on.
func (c *collector) collect(ctx context.Context, req api.GCRequest, now time.Time) (api.GCResponse, error) {
	valid := map[string]bool{}
	for _, at := range req.ValidAttachments {
		valid[api.Owner{ContainerID: at.ContainerID, IfName: at.IfName}.Key()] = true
	}
	var doomed []records.Allocation
	res := api.GCResponse{Released: []string{}}
	for _, al := range c.allocs.Allocations() {
		if (req.Pool != "" && al.Pool != req.Pool) || (req.Network != "" && al.Network != req.Network) || valid[al.Owner.Key()] {
			continue
		}
		if now.Sub(al.Seen) < c.grace {
			res.Deferred++
			continue
		}
		doomed = append(doomed, al)
	}
	if c.testHookDecided != nil {
		c.testHookDecided()
	}
	released, err := c.releaser.releaseAllocations(ctx, doomed)
	res.Released = append(res.Released, released...)
	c.released.Add(float64(len(released)))
	if len(released) > 0 {
		c.log.Info("gc released allocations", "count", len(released), "ips", released, "deferred", res.Deferred)
	}
	return res, err
}
