package planner

import (
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// What a release, a keep and a block given back do to the cache, once
// etcd said they landed.

// At returns the allocation the cache holds at addr, or nil.
func (ps *Pool) At(addr netip.Addr) *records.Allocation { return ps.byAddr[addr] }

// OfOwner returns (a copy of) every allocation the owner whose key is
// key holds in ps.
func (ps *Pool) OfOwner(key string) []*records.Allocation { return slices.Clone(ps.byOwner[key]) }

// Released drops al, deleted from etcd, from the cache; its address
// cools for the pool's cooldown before it is free again.
func (n *Node) Released(ps *Pool, al *records.Allocation) {
	ps.dropReleased(al, ps.spec.Cooldown() > 0, n.now())
	n.ended(al, "released")
}

// Kept drops als, kept in etcd for sticky identity until end, from the
// owner: their own-block addresses stay marked, kept for the identity.
func (n *Node) Kept(ps *Pool, als []*records.Allocation, identity string, end time.Time) {
	for _, al := range als {
		ps.forget(al)
		if _, ob := ps.ownBlockOf(al.Addr); ob != nil {
			ps.kept[al.Addr] = keptAddr{identity: identity, until: end}
		}
	}
}

// StillCached returns the first of als that the cache still holds as it
// was (same owner, same revision): etcd did not change it. The cache may
// hold it as another *Allocation: a block reloaded meanwhile (a claim
// whose answer was lost, adopted in the same settle) indexes its records
// anew.
func (ps *Pool) StillCached(als []*records.Allocation) *records.Allocation {
	for _, al := range als {
		if cur := ps.byAddr[al.Addr]; cur != nil && cur.Rev == al.Rev && cur.Owner.Key() == al.Owner.Key() {
			return al
		}
	}
	return nil
}

// OfOwnerAt is the cache's allocations at als' addresses that are still
// their owner's, sticky and allocated (at whatever revision).
func (ps *Pool) OfOwnerAt(als []*records.Allocation) []*records.Allocation {
	var out []*records.Allocation
	for _, al := range als {
		if cur := ps.byAddr[al.Addr]; cur != nil && cur.Owner.Key() == al.Owner.Key() && cur.Identity == al.Identity && cur.State == records.StateAllocated {
			out = append(out, cur)
		}
	}
	return out
}

// CheckingBinding returns the sticky identity whose binding the DEL of
// the owner whose key is key checks (Pool.checkBinding).
func (ps *Pool) CheckingBinding(key string) (string, bool) {
	id, ok := ps.checkBinding[key]
	return id, ok
}

// BindingChecked forgets that the owner's DEL checks a binding.
func (ps *Pool) BindingChecked(key string) { delete(ps.checkBinding, key) }

// Unclaimed drops own block b, given back to the pool.
func (n *Node) Unclaimed(ps *Pool, b netip.Prefix) {
	delete(ps.own, b)
	for addr := range ps.cool.at {
		if b.Contains(addr) {
			delete(ps.cool.at, addr) // not ours to hand out any more
		}
	}
	n.note(Info, "released empty block", "pool", ps.spec.Name, "block", b)
}

// GivingBack lists the own blocks of family f that go back once empty
// (givesBack), in address order.
func (n *Node) GivingBack(ps *Pool, f allocator.Family) []netip.Prefix {
	return slices.DeleteFunc(ps.sortedOwn(f), func(b netip.Prefix) bool { return !n.givesBack(ps, b) })
}

// KeptEnded names the own-block addresses of family f kept for sticky
// identities whose windows have ended, to read back (KeptRead).
func (n *Node) KeptEnded(ps *Pool, f allocator.Family) []records.IPRef {
	now := n.now()
	var refs []records.IPRef
	for _, addr := range sortedAddrs(ps.kept) {
		if k := ps.kept[addr]; allocator.FamilyOf(addr) == f && !k.until.IsZero() && now.After(k.until) {
			b, _ := ps.spec.BlockFor(addr)
			refs = append(refs, records.IPRef{Pool: ps.spec.Name, Block: b, Addr: addr})
		}
	}
	return refs
}

// KeptRead folds what etcd holds at kept addresses whose windows ended:
// those gone are free, those taken over someone else's.
func (n *Node) KeptRead(ps *Pool, refs []records.IPRef, cur map[netip.Addr]records.Allocation) {
	for _, ref := range refs {
		if c, still := cur[ref.Addr]; still {
			if c.State != records.StateKept {
				delete(ps.kept, ref.Addr) // taken over: someone holds it now
			}
			continue
		}
		delete(ps.kept, ref.Addr)
		if _, ob := ps.ownBlockOf(ref.Addr); ob != nil && ps.byAddr[ref.Addr] == nil && !ps.planned[ref.Addr] {
			ob.ba.Unmark(ref.Addr)
		}
	}
}

// LentBlocks lists the own blocks of family f that have lent addresses,
// in address order: the borrower may have given some back.
func (ps *Pool) LentBlocks(f allocator.Family) []netip.Prefix {
	var out []netip.Prefix
	for _, addr := range sortedAddrs(ps.lent) {
		if b, ob := ps.ownBlockOf(addr); ob != nil && allocator.FamilyOf(addr) == f && !slices.Contains(out, b) {
			out = append(out, b)
		}
	}
	return out
}
