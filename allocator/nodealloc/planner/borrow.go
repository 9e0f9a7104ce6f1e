package planner

import (
	"cmp"
	"hash/fnv"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Borrowing. A node whose blocks are full and that can claim no block
// takes single addresses from blocks other nodes hold, rather than fail a
// pod while the pool has free addresses (the driver, nodealloc/allocate.go, says how
// the write is fenced). Here: whether the node has room of its own after
// all, and which address to borrow.

// enumerateLimit is the largest family (in blocks) that hasClaimable
// lists whole; in larger ones the claim loop's walk finds a block.
const enumerateLimit = 1 << 16

// HasClaimable reports whether snap shows a block of family f that a
// claim could take: no claim, no allocations, an address to hand out.
func (ps *Pool) HasClaimable(f allocator.Family, snap records.PoolSnapshot) bool {
	if ps.AtBlockLimit(f) {
		return false // the node may claim no more (maxBlocksPerNode)
	}
	busy := map[netip.Prefix]bool{}
	for _, bi := range snap.Blocks {
		if bi.Claim != nil {
			busy[bi.Block] = true
		}
	}
	for b, used := range snap.Used {
		if len(used) > 0 {
			busy[b] = true
		}
	}
	if ps.spec.BlockCount(f) > enumerateLimit {
		return true // too many to list; the claim loop probes
	}
	bits := ps.spec.BlockSize(f)
	for _, c := range ps.spec.ServingCIDRsOf(f) {
		for i := range allocator.BlockCount(c, bits) {
			b, err := allocator.BlockAt(c, bits, i)
			if err == nil && !busy[b] && len(ps.spec.Excluded(b))+len(ps.spec.ReservedOffsets(b)) < allocator.BlockSize(b) {
				return true
			}
		}
	}
	return false
}

// Shrunk lists the own blocks of family f that hand out addresses and
// hold fewer addresses in snap than the node has marked: a lent address
// came back, so they are read again.
func (ps *Pool) Shrunk(f allocator.Family, snap records.PoolSnapshot) []netip.Prefix {
	var out []netip.Prefix
	for _, b := range ps.servingOwn(f) {
		if len(snap.Used[b]) < ps.own[b].ba.Used() {
			out = append(out, b)
		}
	}
	return out
}

// Roomy returns an own block of family f with a free address to hand
// out (none in a draining cidr).
func (ps *Pool) Roomy(f allocator.Family) (netip.Prefix, bool) { return ps.roomy(f) }

// Lendable is another node's block with free addresses, as a borrower
// sees it: how many it holds, and its free addresses in the order this
// borrower tries them.
type Lendable struct {
	Block netip.Prefix
	used  int
	Free  []netip.Addr
}

// Lendables lists the blocks of family f that live nodes other than this
// one claim and that have a free address (none held by an endpoint of
// this node, none of unknown outcome), fullest first, so that blocks
// nearly empty can still be given back to the pool. Each block's free
// addresses start at one that depends on owner o, so that nodes borrowing
// at once seldom pick the same one.
func (n *Node) Lendables(ps *Pool, f allocator.Family, snap records.PoolSnapshot, o records.Owner) []Lendable {
	held := n.HeldSet()
	var cands []Lendable
	for _, bi := range snap.Blocks {
		b := bi.Block
		// Only blocks a live node claims: an orphaned block is its gone
		// node's until kvipamctl node remove frees it whole.
		if _, own := ps.own[b]; own || allocator.FamilyOf(b.Addr()) != f || bi.Claim == nil || bi.Claim.Node == n.name {
			continue
		}
		if ps.spec.InDraining(b.Addr()) {
			continue // a draining cidr lends nothing new either
		}
		ba, err := allocator.NewBlockAlloc(ps.spec, b)
		if err != nil {
			continue
		}
		for _, u := range snap.Used[b] {
			ba.Mark(u.Addr)
		}
		c := Lendable{Block: b, used: len(snap.Used[b])}
		for ba.Free() > 0 {
			addr, ok := ba.Next()
			if !ok {
				break
			}
			ba.Mark(addr)
			if _, parked := ps.unknown[addr]; !held[addr] && !parked {
				c.Free = append(c.Free, addr)
			}
		}
		if len(c.Free) > 0 {
			cands = append(cands, c)
		}
	}
	slices.SortFunc(cands, func(x, y Lendable) int {
		if c := cmp.Compare(y.used, x.used); c != 0 {
			return c
		}
		return x.Block.Addr().Compare(y.Block.Addr())
	})
	h := fnv.New64a()
	h.Write([]byte(n.name + "\x00" + o.Key()))
	seed := h.Sum64()
	for i, c := range cands {
		start := int(seed % uint64(len(c.Free)))
		cands[i].Free = append(slices.Clone(c.Free[start:]), c.Free[:start]...)
	}
	return cands
}

// PickLendable picks, among addrs of a lendable block, the first released
// before cutoff or never (last: when each was last released); failing
// that, it reports the one released longest ago and when.
func PickLendable(addrs []netip.Addr, last map[netip.Addr]time.Time, cutoff time.Time) (addr netip.Addr, ok bool, oldest netip.Addr, oldestAt time.Time) {
	for _, a := range addrs {
		at, released := last[a]
		if !released || at.Before(cutoff) {
			return a, true, netip.Addr{}, time.Time{}
		}
		if !oldest.IsValid() || at.Before(oldestAt) {
			oldest, oldestAt = a, at
		}
	}
	return netip.Addr{}, false, oldest, oldestAt
}
