package nodealloc

import (
	"context"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
	"github.com/kvipam/kvipam/allocator/records"
)

// What the node holds, as the agent's API, metrics and watches see it
// and change it: each a call into the planner under mu.

// Usage is the node's share of one pool family, and the pool's size.
type Usage = planner.Usage

// Lookup returns what the owner holds, in every pool.
func (a *Allocator) Lookup(o records.Owner) []records.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n.Owned(o)
}

// Allocations returns every allocation this node holds, sorted by address.
func (a *Allocator) Allocations() []records.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n.Allocations()
}

// Usage reports per pool and family what this node owns and uses.
func (a *Allocator) Usage() []Usage {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n.Usage()
}

// UpdatePool takes a new or changed pool spec (the agent follows the
// pools in etcd): a pool created since Restore is served from then on;
// reservations, the disabled flag, the node selector, the reuse cooldown
// and new cidrs apply at once. A spec older than the one held is ignored.
func (a *Allocator) UpdatePool(p allocator.Pool) {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	a.n.Update(p)
}

// Pools returns the specs of every pool the allocator knows (all of
// etcd's, and a deleted one served as disabled), sorted by name.
func (a *Allocator) Pools() []allocator.Pool {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []allocator.Pool
	for _, ps := range a.n.Pools() {
		out = append(out, ps.Spec())
	}
	return out
}

// Pool returns the spec of a served pool as the allocator holds it.
func (a *Allocator) Pool(name string) (allocator.Pool, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if ps := a.n.Lookup(name); ps != nil {
		return ps.Spec(), true
	}
	return allocator.Pool{}, false
}

// Restored reports whether Restore has read the pools on the current
// lease; until then every request is answered with ErrLeaseLost.
func (a *Allocator) Restored() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.restored
}

// Serves reports whether the node takes new addresses in pool: it knows
// the pool, which is enabled and whose selector chooses the node.
func (a *Allocator) Serves(pool string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.n.Lookup(pool)
	return ps != nil && !a.n.Draining(ps)
}

// GiveBackEmpty gives every empty block of a disabled pool, of a pool
// whose selector no longer chooses the node, and of a pool's draining
// cidrs back to the pool, so that the pool can be deleted (the cidr
// removed) once its pods are gone, and other nodes can claim them. It
// reports how many it gave back.
func (a *Allocator) GiveBackEmpty(ctx context.Context, pool string) int {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	ps := a.n.Lookup(pool)
	if ps == nil {
		return 0
	}
	return a.claims.giveBackEmpty(ctx, ps)
}

// NoteLent applies what the agent's watch saw of a lent address's home
// in one of this node's blocks: another node holds addr (present), or
// gave it back. Either way etcd's create-if-absent stays the guard; this
// only keeps the node's books, and its next choice, right sooner.
//
// rev is the revision the loan was written at: a cached allocation older
// than the loan was taken over.
func (a *Allocator) NoteLent(pool string, addr netip.Addr, node string, rev int64, present bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	a.n.NoteLent(pool, addr, node, rev, present)
}

// ResetLent replaces what the node knows of the addresses of its own
// blocks that other nodes hold, by pool, with a complete listing (the
// agent's home watch listed again after a gap): a pool missing from lent
// has none. A loan the node knew of and the listing lacks was given back
// while no one watched; it is dropped as NoteLent drops a returned one.
// ResetLent returns the pools that had a loan dropped, whose blocks may
// now be empty (see GiveBackEmpty). Like NoteLent it only keeps the books:
// etcd's create-if-absent stays the guard.
func (a *Allocator) ResetLent(lent map[string]map[netip.Addr]Loan) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	return a.n.ResetLent(lent)
}
