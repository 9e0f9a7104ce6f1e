package allocator

import (
	"net/netip"
	"slices"
)

// Lookup returns what the owner holds, in every pool.
func (a *NodeAllocator) Lookup(o Owner) []Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Allocation
	for _, ps := range a.pools {
		for _, al := range ps.byOwner[o.Key()] {
			out = append(out, *al)
		}
	}
	slices.SortFunc(out, func(x, y Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Allocations returns every allocation this node holds, sorted by address.
func (a *NodeAllocator) Allocations() []Allocation {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Allocation
	for _, ps := range a.pools {
		for _, al := range ps.byAddr {
			out = append(out, *al)
		}
	}
	slices.SortFunc(out, func(x, y Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Usage is the node's share of one pool family.
type Usage struct {
	Pool     string
	Family   Family
	Blocks   []netip.Prefix
	Capacity int // allocatable addresses in own blocks
	Used     int
	Reserved int
}

// Usage reports per pool and family what this node owns and uses.
func (a *NodeAllocator) Usage() []Usage {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Usage
	for _, name := range a.cfg.Pools {
		ps := a.pools[name]
		if ps == nil {
			continue
		}
		for _, f := range ps.pool.Families() {
			u := Usage{Pool: name, Family: f, Blocks: ps.sortedOwn(f)}
			for _, b := range u.Blocks {
				u.Capacity += ps.own[b].ba.Capacity()
				u.Used += ps.own[b].ba.Used()
			}
			for addr, al := range ps.byAddr {
				if FamilyOf(addr) == f && al.State == StateReserved {
					u.Reserved++
				}
			}
			out = append(out, u)
		}
	}
	return out
}

// UpdatePool takes a changed spec of a served pool (the agent follows the
// pools in etcd): reservations, the disabled flag and new cidrs apply at
// once. A spec older than the one held is ignored.
func (a *NodeAllocator) UpdatePool(p Pool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[p.Name]
	if ps == nil || (p.Rev != 0 && p.Rev < ps.pool.Rev) {
		return
	}
	ps.setPool(p)
	a.log.Info("pool spec changed", "pool", p.Name, "rev", p.Rev, "disabled", p.Disabled, "reserved", len(p.Reserved), "cidrs", len(p.CIDRs))
}

// Pool returns the spec of a served pool as the allocator holds it.
func (a *NodeAllocator) Pool(name string) (Pool, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[name]
	if ps == nil {
		return Pool{}, false
	}
	return ps.pool, true
}
