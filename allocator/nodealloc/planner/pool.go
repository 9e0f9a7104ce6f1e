package planner

import (
	"cmp"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Pool is this node's view of one pool: the blocks it owns with their
// bitmaps, and an index of the allocations in them. It is a cache of etcd,
// rebuilt by Restore and corrected whenever a write finds it wrong; it does
// no I/O. The Allocator's lock guards it.
type Pool struct {
	spec allocator.Pool
	// refused is why pool's spec is invalid (Validate), nil when it is
	// valid. A pool written to etcd before a rule that refuses it (a
	// special range) still reaches the node: it hands out nothing new,
	// and pods keep what they hold in it.
	refused error
	own     map[netip.Prefix]*ownBlock
	// others are blocks the node must not try to claim: claimed by another
	// node, or orphaned. It is refreshed from the store before each claim.
	others map[netip.Prefix]otherBlock
	// byOwner holds every allocation of an owner. An owner normally has
	// one per family; more is an anomaly that Release must still undo
	// whole, so the index never drops one.
	byOwner map[string][]*records.Allocation
	byAddr  map[netip.Addr]*records.Allocation
	expires map[netip.Addr]time.Time // reservations' expiry
	// unknown holds store calls whose outcome is unknown: the call failed
	// without saying whether the transaction committed. Their addresses
	// stay marked in the bitmap, so no one else gets them, until a read
	// of etcd settles them (settle.go).
	unknown map[netip.Addr]pending
	// claimsUnknown are blocks whose claim transaction has an unknown
	// outcome; the claim is read back with the parked addresses
	// (settleClaims): held by this node on its lease, the block is
	// adopted, else the entry is dropped.
	claimsUnknown map[netip.Prefix]bool
	// lent are addresses of own blocks that other nodes hold (borrowed,
	// borrow.go, nodealloc/allocate.go), by holder; they stay marked in the bitmaps.
	lent map[netip.Addr]string
	// planned are addresses chosen for writes not yet sent: a block read
	// again while a batch is planned keeps them marked.
	planned map[netip.Addr]bool
	cool    coolQueue // released addresses cooling (cooldown.go)
	// kept are own-block addresses kept for a sticky identity between
	// its pods (sticky.go); they stay marked.
	kept map[netip.Addr]keptAddr
	// checkBinding are sticky owners whose DEL checks their identity's
	// binding (dropBindingOf) even when the cache holds nothing of them,
	// and their identities: those told a reservation not yet confirmed
	// (if it is gone before the confirm, it lapsed or its lease ended,
	// the cache forgets it), and those whose DEL named an identity and
	// failed (ReleaseAs), so that the runtime's retry still checks it.
	checkBinding map[string]string
	// unasserted are cached allocations of the node's endpoints whose
	// records etcd lost and a Reassert could not write back yet: no
	// record guards them, so their owners' requests wait (reassert.go).
	unasserted map[netip.Addr]*records.Allocation
	// walks are the node's block walks, by family (allocator/blockwalk.go); a
	// changed pool starts them again.
	walks map[allocator.Family]*allocator.BlockWalk
}

// pending is a store call of unknown outcome, whatever its kind (a create,
// a confirm, a release, a borrow, a keep, a takeover, a reassert): the
// address it wrote or deleted, and the owner whose request waits on it.
// It is settled by reading the address back (settlePending), never by
// guessing from the write's shape what landed.
type pending struct {
	ref   records.IPRef
	owner string
}

type ownBlock struct {
	ba       *allocator.BlockAlloc
	claimRev int64
}

type otherBlock struct {
	node     string // claim holder, "" if unclaimed
	orphaned bool   // unclaimed but holding allocations
}

func NewPool(p allocator.Pool) *Pool {
	return &Pool{
		spec:    p,
		refused: p.Validate(),
		own:     map[netip.Prefix]*ownBlock{},
		others:  map[netip.Prefix]otherBlock{},
		walks:   map[allocator.Family]*allocator.BlockWalk{},
		byOwner: map[string][]*records.Allocation{},
		byAddr:  map[netip.Addr]*records.Allocation{},
		expires: map[netip.Addr]time.Time{},
		unknown: map[netip.Addr]pending{},
		lent:    map[netip.Addr]string{},
		planned: map[netip.Addr]bool{},
		kept:    map[netip.Addr]keptAddr{},

		checkBinding:  map[string]string{},
		claimsUnknown: map[netip.Prefix]bool{},
		unasserted:    map[netip.Addr]*records.Allocation{},
	}
}

// maxCheckBinding bounds Pool.checkBinding: an ADD that is neither
// confirmed nor DELed, or a failed DEL never retried, leaves its entry,
// and beyond the bound an arbitrary one goes (its binding is then left to
// the identity's next pod, or to the next restore's sweep).
const maxCheckBinding = 4096

// noteCheckBinding records that owner o's DEL checks the binding of
// sticky identity id.
func (ps *Pool) noteCheckBinding(o, id string) {
	if _, ok := ps.checkBinding[o]; !ok && len(ps.checkBinding) >= maxCheckBinding {
		for k := range ps.checkBinding {
			delete(ps.checkBinding, k)
			break
		}
	}
	ps.checkBinding[o] = id
}

// remember indexes al; expires is the reservation expiry if known. An
// allocation already indexed at the same address is replaced. An
// owner's allocations are indexed in address order.
func (ps *Pool) remember(al *records.Allocation, expires time.Time) {
	if old := ps.byAddr[al.Addr]; old != nil {
		ps.forget(old)
	}
	k := al.Owner.Key()
	// In address order, whatever order they were learnt in (a settle
	// or a reassert goes through a map): a release and a lookup answer
	// in one order, and a seed replays.
	i, _ := slices.BinarySearchFunc(ps.byOwner[k], al.Addr, func(x *records.Allocation, a netip.Addr) int { return x.Addr.Compare(a) })
	ps.byOwner[k] = slices.Insert(ps.byOwner[k], i, al)
	ps.byAddr[al.Addr] = al
	if al.State == records.StateReserved && !expires.IsZero() {
		ps.expires[al.Addr] = expires
	}
}

// writing reports whether addr is marked in its own block for what this
// node holds or writes: an allocation, a planned write or one of unknown
// outcome. Other marks (an address lent to another node, kept for a
// sticky identity, an endpoint's at the block's load) stand for records
// others write and delete (an operator's release among them), which the
// cache learns of only by reading.
func (ps *Pool) writing(addr netip.Addr) bool {
	_, unknown := ps.unknown[addr]
	return ps.byAddr[addr] != nil || ps.planned[addr] || unknown
}

// forget drops al from the indexes (not from the block bitmap).
func (ps *Pool) forget(al *records.Allocation) {
	k := al.Owner.Key()
	if i := slices.Index(ps.byOwner[k], al); i >= 0 {
		ps.byOwner[k] = slices.Delete(ps.byOwner[k], i, i+1)
		if len(ps.byOwner[k]) == 0 {
			delete(ps.byOwner, k)
		}
	}
	if ps.byAddr[al.Addr] == al {
		delete(ps.byAddr, al.Addr)
		delete(ps.expires, al.Addr)
	}
	if ps.unasserted[al.Addr] == al {
		delete(ps.unasserted, al.Addr)
	}
}

// settleAt makes the cache at addr hold what etcd holds there: cur, or
// nothing (nil). A record is indexed by its own owner, whatever the cache
// held at the address before: a record of this node (me) that the cache
// did not know is adopted, a kept record is known as kept (until its
// lease ends, until), another node's borrowed record as lent. It returns
// the allocation it dropped from the cache, if any; an unchanged one
// (same revision) stays as it is. The bit of an own block's address is
// marked when etcd holds it; when etcd does not, the caller decides
// whether it is free (held by an endpoint, cooling).
func (ps *Pool) settleAt(addr netip.Addr, cur *records.Allocation, until time.Time, me string) (dropped *records.Allocation) {
	old := ps.byAddr[addr]
	if old != nil && cur != nil && old.Rev == cur.Rev {
		return nil
	}
	if old != nil {
		ps.forget(old)
	}
	delete(ps.kept, addr)
	delete(ps.lent, addr)
	if cur == nil {
		return old
	}
	_, ob := ps.ownBlockOf(addr)
	switch {
	case cur.State == records.StateKept:
		if ob != nil {
			ps.kept[addr] = keptAddr{identity: cur.Identity, until: until}
		}
	case cur.ContainerID == "": // unreadable: the address stays taken
	case cur.Borrowed && cur.Node != me:
		if ob != nil {
			ps.lent[addr] = cur.Node
		}
	case cur.Node != me && ob == nil:
		// Another node's address in a block that is not ours.
	default:
		ps.remember(cur, until)
	}
	if ob != nil {
		ob.ba.Mark(addr)
	}
	return old
}

// forgetBlock drops every cached allocation and unknown write in b.
func (ps *Pool) forgetBlock(b netip.Prefix) {
	for addr, al := range ps.byAddr {
		if b.Contains(addr) {
			ps.forget(al)
		}
	}
	for addr := range ps.unknown {
		if b.Contains(addr) {
			delete(ps.unknown, addr)
		}
	}
	for addr := range ps.lent {
		if b.Contains(addr) {
			delete(ps.lent, addr)
		}
	}
	for addr := range ps.kept {
		if b.Contains(addr) {
			delete(ps.kept, addr)
		}
	}
}

// setPool replaces the pool spec (an operator changed it) and applies its
// reservations to the own blocks.
func (ps *Pool) setPool(p allocator.Pool) {
	ps.spec = p
	ps.refused = p.Validate()
	clear(ps.walks)
	for b, ob := range ps.own {
		ob.ba.SetReserved(p.ReservedOffsets(b))
	}
}

// ofOwner returns the owner's allocations of family f, oldest first.
func (ps *Pool) ofOwner(key string, f allocator.Family) []*records.Allocation {
	var out []*records.Allocation
	for _, al := range ps.byOwner[key] {
		if allocator.FamilyOf(al.Addr) == f {
			out = append(out, al)
		}
	}
	slices.SortFunc(out, func(x, y *records.Allocation) int { return cmp.Compare(x.Rev, y.Rev) })
	return out
}

// pendingFor reports whether the owner has a store call of unknown outcome.
func (ps *Pool) pendingFor(key string) bool {
	for _, p := range ps.unknown {
		if p.owner == key {
			return true
		}
	}
	return false
}

func (ps *Pool) noteOther(b netip.Prefix, node string, nonEmpty bool) {
	ps.others[b] = otherBlock{node: node, orphaned: node == "" && nonEmpty}
}

// ownBlockOf returns the own block holding addr.
func (ps *Pool) ownBlockOf(addr netip.Addr) (netip.Prefix, *ownBlock) {
	b, ok := ps.spec.BlockFor(addr)
	if !ok {
		return netip.Prefix{}, nil
	}
	return b, ps.own[b]
}

// sortedOwn lists own blocks of family f in address order, so allocation
// fills blocks in a stable order.
func (ps *Pool) sortedOwn(f allocator.Family) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(ps.own))
	for b := range ps.own {
		if allocator.FamilyOf(b.Addr()) == f {
			out = append(out, b)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr().Less(out[j].Addr()) })
	return out
}

// roomy returns an own block of family f with a free address to hand
// out (none in a draining cidr).
func (ps *Pool) roomy(f allocator.Family) (netip.Prefix, bool) {
	for _, b := range ps.servingOwn(f) {
		if ps.own[b].ba.Free() > 0 {
			return b, true
		}
	}
	return netip.Prefix{}, false
}

// nextFree chooses a free address of family f in the own blocks that
// hand out new addresses (servingOwn).
func (ps *Pool) nextFree(f allocator.Family) (netip.Prefix, netip.Addr, bool) {
	for _, b := range ps.servingOwn(f) {
		if ob := ps.own[b]; ob.ba.Free() > 0 {
			if addr, ok := ob.ba.Next(); ok {
				return b, addr, true
			}
		}
	}
	return netip.Prefix{}, netip.Addr{}, false
}

func (ps *Pool) exhausted(f allocator.Family) error {
	e := &records.ExhaustedError{Pool: ps.spec.Name, Family: f, Blocks: ps.spec.BlockCount(f), Size: ps.spec.Size(f), Reserved: ps.spec.ReservedCount(f)}
	for b := range ps.own {
		if allocator.FamilyOf(b.Addr()) == f {
			e.Claimed++
		}
	}
	for b, o := range ps.others {
		if allocator.FamilyOf(b.Addr()) != f {
			continue
		}
		if o.orphaned {
			e.Orphaned++
		} else {
			e.Claimed++
		}
	}
	return e
}

// sortedAddrs lists m's addresses in order.
func sortedAddrs[V any](m map[netip.Addr]V) []netip.Addr {
	return slices.SortedFunc(maps.Keys(m), netip.Addr.Compare)
}

// drop removes al from the cache and frees its address in the bitmap.
func (ps *Pool) drop(al *records.Allocation) {
	ps.forget(al)
	if _, ob := ps.ownBlockOf(al.Addr); ob != nil {
		ob.ba.Unmark(al.Addr)
	}
}

// servingOwn lists the own blocks of family f outside the pool's
// draining cidrs, in address order: those hand out new addresses.
func (ps *Pool) servingOwn(f allocator.Family) []netip.Prefix {
	return slices.DeleteFunc(ps.sortedOwn(f), func(b netip.Prefix) bool { return ps.spec.InDraining(b.Addr()) })
}

// Spec is the pool's spec as the node holds it.
func (ps *Pool) Spec() allocator.Pool { return ps.spec }

// Exhausted is the error of a family with no block left to claim.
func (ps *Pool) Exhausted(f allocator.Family) error { return ps.exhausted(f) }

// SetSpec replaces the pool's spec with p, read again from the store.
func (ps *Pool) SetSpec(p allocator.Pool) { ps.setPool(p) }
