package agent

import (
	"time"

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

// leaks is leakCandidates for the running agent.
func (a *Agent) leaks() map[string]int {
	if a.alloc == nil || a.endpoints == nil {
		return nil
	}
	owners := map[string]bool{}
	for _, ep := range a.endpoints.list() {
		owners[ep.Owner.Key()] = true
	}
	return leakCandidates(a.alloc.Allocations(), owners, a.cfg.poolNames(), a.cfg.GCGrace.Duration, time.Now())
}
