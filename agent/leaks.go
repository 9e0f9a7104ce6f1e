package agent

import (
	"time"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// leakCandidates counts, per served pool, the addresses this node holds
// whose owner has no endpoint here although it has had one for longer than
// the GC grace period: what a leak looks like before GC or the reconciler
// collects it. Only networks whose pods have endpoints on this node count
// (the kvipam plugin's); kvipam-ipam's allocations have none by design.
func leakCandidates(als []records.Allocation, endpointOwners map[string]bool, pools []string, grace time.Duration, now time.Time) map[string]int {
	nets := map[string]bool{}
	for _, al := range als {
		if endpointOwners[al.Owner.Key()] {
			nets[al.Network] = true
		}
	}
	out := map[string]int{}
	for _, p := range pools {
		out[p] = 0
	}
	for _, al := range als {
		if endpointOwners[al.Owner.Key()] || al.State != records.StateAllocated || !nets[al.Network] || now.Sub(al.Seen) < grace {
			continue
		}
		out[al.Pool]++
	}
	return out
}

// leakCounter counts the running agent's leak candidates
// (leakCandidates) at scrape time.
type leakCounter struct {
	alloc interface {
		Allocations() []records.Allocation
		Pools() []allocator.Pool
	}
	endpoints interface{ list() []api.Endpoint }
	grace     time.Duration
}

func (c leakCounter) leaks() map[string]int {
	owners := map[string]bool{}
	for _, ep := range c.endpoints.list() {
		owners[ep.Owner.Key()] = true
	}
	var pools []string
	for _, p := range c.alloc.Pools() {
		pools = append(pools, p.Name)
	}
	return leakCandidates(c.alloc.Allocations(), owners, pools, c.grace, time.Now())
}
