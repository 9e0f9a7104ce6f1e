package nodealloc

import (
	"context"
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
	// family, and those in reserved ranges. Disabled is the pool's flag.
	Size, ReservedRanges uint64
	Disabled             bool
}

// Usage reports per pool and family what this node owns and uses.
func (a *Allocator) Usage() []Usage {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Usage
	for _, name := range a.cfg.Pools {
		ps := a.pools[name]
		if ps == nil {
			continue
		}
		for _, f := range ps.pool.Families() {
			u := Usage{Pool: name, Family: f, Blocks: ps.sortedOwn(f), Size: ps.pool.Size(f), ReservedRanges: ps.pool.ReservedCount(f),
				Disabled: ps.pool.Disabled, Cooling: ps.coolingIn(f)}
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

// UpdatePool takes a changed spec of a served pool (the agent follows the
// pools in etcd): reservations, the disabled flag and new cidrs apply at
// once. A spec older than the one held is ignored.
func (a *Allocator) UpdatePool(p allocator.Pool) {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[p.Name]
	if ps == nil || (p.Rev != 0 && p.Rev < ps.pool.Rev) {
		return
	}
	ps.setPool(p)
	a.log.Info("pool spec changed", "pool", p.Name, "rev", p.Rev, "disabled", p.Disabled, "reserved", len(p.Reserved), "cidrs", len(p.CIDRs))
}

// GiveBackEmpty gives every empty block of a disabled pool back to the
// pool, so that the pool can be deleted once its pods are gone. It
// reports how many it gave back.
func (a *Allocator) GiveBackEmpty(ctx context.Context, pool string) int {
	a.allocMu.Lock()
	defer a.allocMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[pool]
	if ps == nil || !ps.pool.Disabled {
		return 0
	}
	n := len(ps.own)
	for _, f := range []allocator.Family{allocator.IPv4, allocator.IPv6} {
		for _, b := range ps.sortedOwn(f) {
			a.maybeUnclaim(ctx, ps, b)
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
