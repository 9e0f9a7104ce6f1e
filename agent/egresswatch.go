package agent

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/foundation/syncloop"
)

// masquerader makes a node's masquerade rules say a plan (egressnft.go);
// changed reports whether the kernel's rules changed.
type masquerader interface {
	program(plan egressPlan) (changed bool, err error)
}

// egressWatch keeps the node's masquerade rules equal to what the pools
// in etcd say: it follows every pool (its own watch, beside poolWatch's:
// every pool's CIDRs count, not only those this node serves) and kicks a
// sync loop, which programs the plan and retries what failed. The pool
// handlers run on the watch's goroutine, the sync on the loop's; mu
// guards what they share.
type egressWatch struct {
	def   bool           // a pool that sets none masquerades (egressDefault)
	never []netip.Prefix // egress.nonMasqueradeCIDRs
	prog  masquerader
	log   hclog.Logger
	loop  syncloop.Loop

	mu     sync.Mutex
	pools  map[string]allocator.Pool
	listed bool
}

func newEgressWatch(routing string, never []netip.Prefix, prog masquerader, log hclog.Logger) *egressWatch {
	return &egressWatch{def: egressDefault(routing), never: never, prog: prog, log: log,
		loop: syncloop.New("masquerade rules", log), pools: map[string]allocator.Pool{}}
}

// run follows src's pools and keeps the rules in step until ctx ends.
func (e *egressWatch) run(ctx context.Context, src poolSource) {
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { _ = src.WatchPools(ctx, e) })
	e.loop.Run(ctx, e.sync)
}

// Reset takes the pools listed as all there are.
func (e *egressWatch) Reset(all []allocator.Pool) {
	e.mu.Lock()
	e.pools = map[string]allocator.Pool{}
	for _, p := range all {
		e.pools[p.Name] = p
	}
	e.listed = true
	e.mu.Unlock()
	e.loop.Changed()
}

// Put takes a pool's new spec.
func (e *egressWatch) Put(p allocator.Pool) {
	e.mu.Lock()
	e.pools[p.Name] = p
	e.mu.Unlock()
	e.loop.Changed()
}

// Delete forgets a deleted pool (it was empty: etcdstore refuses to
// delete a pool that holds addresses).
func (e *egressWatch) Delete(p allocator.Pool) {
	e.mu.Lock()
	delete(e.pools, p.Name)
	e.mu.Unlock()
	e.loop.Changed()
}

// sync programs the plan of the pools known now; nothing before the
// first listing, which would remove rules the listing puts back.
func (e *egressWatch) sync() (bool, error) {
	e.mu.Lock()
	if !e.listed {
		e.mu.Unlock()
		return false, nil
	}
	pools := slices.Collect(maps.Values(e.pools))
	e.mu.Unlock()
	slices.SortFunc(pools, func(a, b allocator.Pool) int { return strings.Compare(a.Name, b.Name) })
	plan := planEgress(pools, e.def, e.never)
	changed, err := e.prog.program(plan)
	if err != nil {
		return true, err
	}
	if changed {
		var masq []string
		for _, p := range pools {
			if p.MasqueradeOr(e.def) {
				masq = append(masq, p.Name)
			}
		}
		e.log.Info("masquerade rules changed", "pools", masq,
			"sources", slices.Concat(rangeStrings(plan.srcV4), rangeStrings(plan.srcV6)),
			"never_to", slices.Concat(rangeStrings(plan.keepV4), rangeStrings(plan.keepV6)))
	}
	return true, nil
}
