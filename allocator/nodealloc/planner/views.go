package planner

import (
	"maps"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Owned returns what the owner holds, in every pool.
func (n *Node) Owned(o records.Owner) []records.Allocation {
	var out []records.Allocation
	for _, ps := range n.Pools() {
		for _, al := range ps.byOwner[o.Key()] {
			out = append(out, *al)
		}
	}
	slices.SortFunc(out, func(x, y records.Allocation) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Allocations returns every allocation this node holds, sorted by address.
func (n *Node) Allocations() []records.Allocation {
	var out []records.Allocation
	for _, ps := range n.Pools() {
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
func (n *Node) Usage() []Usage {
	var out []Usage
	for _, name := range slices.Sorted(maps.Keys(n.pools)) {
		ps := n.pools[name]
		for _, f := range ps.spec.Families() {
			u := Usage{Pool: name, Family: f, Blocks: ps.sortedOwn(f), Size: ps.spec.Size(f), ReservedRanges: ps.spec.ReservedCount(f),
				Disabled: ps.spec.Disabled, Cooling: ps.coolingIn(f)}
			if ps.refused != nil {
				u.Refused = ps.refused.Error()
			}
			for _, b := range u.Blocks {
				ba := ps.own[b].ba
				u.Capacity += ba.Capacity() - len(ps.spec.ReservedOffsets(b))
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
