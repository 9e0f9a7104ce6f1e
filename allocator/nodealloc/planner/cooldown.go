package planner

import (
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Reuse cooldown. A released address is not handed out again for the
// pool's cooldown (allocator.Pool.Cooldown: a pool setting in etcd, the
// same for every node, which follows an operator's change), so that what
// others still remember of its last pod (a DNS cache, a peer's conntrack
// entry, a late packet) does not reach the next one. Next-fit already walks a block before it comes
// back to an address; the cooldown holds when the block is nearly full.
// It yields when nothing else in the node's blocks is free: the oldest
// released address is handed out rather than more of the pool taken.

// coolQueue holds the addresses released and still cooling, oldest first.
// Their bits stay marked in the block bitmaps.
type coolQueue struct {
	queue []coolEntry
	at    map[netip.Addr]time.Time
}

type coolEntry struct {
	addr netip.Addr
	at   time.Time
}

// dropReleased drops al from the cache after its release; with cool its
// address cools from now before it is free again.
func (ps *Pool) dropReleased(al *records.Allocation, cool bool, now time.Time) {
	_, ob := ps.ownBlockOf(al.Addr)
	if !cool || ob == nil {
		ps.drop(al)
		return
	}
	ps.forget(al)
	ps.coolAt(al.Addr, now)
}

// coolAt starts addr's cooldown at now; its bit stays marked.
func (ps *Pool) coolAt(addr netip.Addr, now time.Time) {
	if ps.cool.at == nil {
		ps.cool.at = map[netip.Addr]time.Time{}
	}
	ps.cool.at[addr] = now
	ps.cool.queue = append(ps.cool.queue, coolEntry{addr: addr, at: now})
}

// thaw frees the addresses that began cooling at or before cutoff.
func (ps *Pool) thaw(cutoff time.Time) {
	for len(ps.cool.queue) > 0 && !ps.cool.queue[0].at.After(cutoff) {
		ps.unfreeze(ps.cool.queue[0])
		ps.cool.queue = ps.cool.queue[1:]
	}
}

// thawOldest frees the oldest cooling address of family f, and reports
// whether there was one.
func (ps *Pool) thawOldest(f allocator.Family) bool {
	for {
		i := slices.IndexFunc(ps.cool.queue, func(e coolEntry) bool { return allocator.FamilyOf(e.addr) == f })
		if i < 0 {
			return false
		}
		e := ps.cool.queue[i]
		ps.cool.queue = slices.Delete(ps.cool.queue, i, i+1)
		if ps.unfreeze(e) {
			return true
		}
	}
}

// unfreeze ends e's cooldown if it is still the address's current one,
// and reports whether the address became free.
func (ps *Pool) unfreeze(e coolEntry) bool {
	if at, ok := ps.cool.at[e.addr]; !ok || !at.Equal(e.at) {
		return false // re-cooled or taken since
	}
	delete(ps.cool.at, e.addr)
	if ps.byAddr[e.addr] != nil {
		return false
	}
	_, ob := ps.ownBlockOf(e.addr)
	return ob != nil && ob.ba.Unmark(e.addr)
}

// markCooling marks the cooling addresses of block in ob again after the
// block was read from the store.
func (ps *Pool) markCooling(block netip.Prefix, ob *ownBlock) {
	for addr := range ps.cool.at {
		if block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
}

// holds reports whether own block b holds anything but cooling
// addresses: an allocation, a lent address, a write planned or of unknown
// outcome, or an address an endpoint uses.
func (ps *Pool) holds(b netip.Prefix) bool {
	ob := ps.own[b]
	if ob == nil {
		return false
	}
	cooling := 0
	for addr := range ps.cool.at {
		if b.Contains(addr) && ps.byAddr[addr] == nil {
			cooling++
		}
	}
	return ob.ba.Used() > cooling
}

// coolingIn counts the cooling addresses of family f.
func (ps *Pool) coolingIn(f allocator.Family) int {
	n := 0
	for addr := range ps.cool.at {
		if allocator.FamilyOf(addr) == f {
			n++
		}
	}
	return n
}
