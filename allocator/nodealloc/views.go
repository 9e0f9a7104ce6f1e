package nodealloc

import (
	"context"
	"maps"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Lookup returns what the owner holds, in every pool.
func (a *Allocator) Lookup(o records.Owner) []records.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []records.Allocation
	for _, ps := range a.pools {
		for _, al := range ps.byOwner[o.Key()] {
			out = append(out, *al)
		}
	}
	slices.SortFunc(out, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Allocations returns every allocation this node holds, sorted by address.
func (a *Allocator) Allocations() []records.Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []records.Allocation
	for _, ps := range a.pools {
		for _, al := range ps.byAddr {
			out = append(out, *al)
		}
	}
	slices.SortFunc(out, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Usage is the node's share of one pool family, and the pool's size.
type Usage struct {
	Pool   string
	Family allocator.Family
	Blocks []netip.Prefix
	// Capacity is what the own blocks can ever hand out automatically
	// (reserved ranges left out); Free what they can hand out now.
	Capacity, Free int
	// Used counts the addresses the node holds, Reserved those of them
	// that are reservations of unfinished ADDs, Borrowed those in other
	// nodes' blocks. Lent counts addresses of own blocks that other nodes
	// hold, Cooling released addresses waiting out the reuse cooldown.
	Used, Reserved, Borrowed, Lent, Cooling int
	// Sticky counts the addresses the node's pods hold for sticky
	// identities (Identities of them), Kept those of its blocks kept for
	// one between pods.
	Sticky, Identities, Kept int
	// Size and ReservedRanges are the pool's: its addresses of the
	// family, and those in reserved ranges. Disabled is the pool's flag;
	// Refused why the node refuses the pool's spec ("" when it does not).
	Size, ReservedRanges uint64
	Disabled             bool
	Refused              string
}

// Usage reports per pool and family what this node owns and uses.
func (a *Allocator) Usage() []Usage {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Usage
	for _, name := range slices.Sorted(maps.Keys(a.pools)) {
		ps := a.pools[name]
		for _, f := range ps.pool.Families() {
			u := Usage{Pool: name, Family: f, Blocks: ps.sortedOwn(f), Size: ps.pool.Size(f), ReservedRanges: ps.pool.ReservedCount(f),
				Disabled: ps.pool.Disabled, Cooling: ps.coolingIn(f)}
			if ps.refused != nil {
				u.Refused = ps.refused.Error()
			}
			for _, b := range u.Blocks {
				ba := ps.own[b].ba
				u.Capacity += ba.Capacity() - len(ps.pool.ReservedOffsets(b))
				u.Free += ba.Free()
			}
			ids := map[string]bool{}
			for addr, al := range ps.byAddr {
				if allocator.FamilyOf(addr) != f {
					continue
				}
				if al.Identity != "" {
					ids[al.Identity] = true
				}
				u.Used++
				if al.State == records.StateReserved {
					u.Reserved++
				}
				if al.Borrowed {
					u.Borrowed++
				}
				if al.Identity != "" {
					u.Sticky++
				}
			}
			for addr := range ps.lent {
				if allocator.FamilyOf(addr) == f {
					u.Lent++
				}
			}
			for addr := range ps.kept {
				if allocator.FamilyOf(addr) == f {
					u.Kept++
				}
			}
			u.Identities = len(ids)
			out = append(out, u)
		}
	}
	return out
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
	ps := a.pools[p.Name]
	if ps == nil {
		// New in etcd: the node holds nothing in it, since a pool is
		// deleted only once nothing is left in it.
		ps = newPoolState(p)
		a.pools[p.Name] = ps
		if ps.refused != nil {
			a.logRefused(ps)
			return
		}
		a.log.Info("serving a new pool", "pool", p.Name, "rev", p.Rev, "cidrs", len(p.CIDRs), "node_selector", p.NodeSelector, "selected", p.Selects(a.labels))
		return
	}
	if p.Rev != 0 && p.Rev < ps.pool.Rev {
		return
	}
	was := ps.refused
	ps.setPool(p)
	if ps.refused != nil && (was == nil || was.Error() != ps.refused.Error()) {
		a.logRefused(ps)
	}
	// A shorter cooldown frees at once what has cooled long enough.
	ps.thaw(a.cfg.Now().Add(-p.Cooldown()))
	a.log.Info("pool spec changed", "pool", p.Name, "rev", p.Rev, "disabled", p.Disabled, "reserved", len(p.Reserved), "cidrs", len(p.CIDRs),
		"node_selector", p.NodeSelector, "selected", p.Selects(a.labels), "reuse_cooldown", p.Cooldown())
}

// Pools returns the specs of every pool the allocator knows (all of
// etcd's, and a deleted one served as disabled), sorted by name.
func (a *Allocator) Pools() []allocator.Pool {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]allocator.Pool, 0, len(a.pools))
	for _, name := range slices.Sorted(maps.Keys(a.pools)) {
		out = append(out, a.pools[name].pool)
	}
	return out
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
	ps := a.pools[pool]
	return ps != nil && !a.draining(ps)
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
	ps := a.pools[pool]
	if ps == nil {
		return 0
	}
	return a.giveBackEmpty(ctx, ps)
}

// giveBackEmpty unclaims the empty own blocks of ps that go back
// (givesBack), by the one path a release takes (maybeUnclaim). Addresses
// kept for sticky identities whose windows have ended are freed first
// (thawKept): no release empties a block they were the last of.
func (a *Allocator) giveBackEmpty(ctx context.Context, ps *poolState) int {
	n := len(ps.own)
	for _, f := range []allocator.Family{allocator.IPv4, allocator.IPv6} {
		if slices.ContainsFunc(ps.sortedOwn(f), func(b netip.Prefix) bool { return a.givesBack(ps, b) }) {
			a.thawKept(ctx, ps, f)
		}
		for _, b := range ps.sortedOwn(f) {
			if a.givesBack(ps, b) {
				a.maybeUnclaim(ctx, ps, b)
			}
		}
	}
	return n - len(ps.own)
}

// Pool returns the spec of a served pool as the allocator holds it.
func (a *Allocator) Pool(name string) (allocator.Pool, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[name]
	if ps == nil {
		return allocator.Pool{}, false
	}
	return ps.pool, true
}
