package planner

import (
	"maps"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Claims. The driver runs the claim loop (claim transactions, the listing
// of the pool's claims); the planner chooses the block to try and keeps
// what each answer taught.

// ChooseBlock picks the next block to try: the next block of the node's
// walk (allocator/blockwalk.go) that is neither its own nor known to be another's.
// A /32 (or /128) block that is a CIDR's network or broadcast address has
// nothing to hand out and is never claimed.
func (ps *Pool) ChooseBlock(node string, f allocator.Family) (netip.Prefix, bool) {
	w := ps.walks[f]
	if w == nil {
		w = allocator.NewBlockWalk(node, ps.spec, f)
		ps.walks[f] = w
	}
	single := (f == allocator.IPv4 && w.Bits() == 32) || (f == allocator.IPv6 && w.Bits() == 128)
	return w.Next(func(b netip.Prefix) bool {
		_, mine := ps.own[b]
		_, other := ps.others[b]
		return mine || other || (single && len(ps.spec.Excluded(b)) > 0)
	})
}

// Candidates lists the next k blocks ChooseBlock would pick, one after
// another, if each before were lost: what a node peeks at (the driver's
// claim loop) to skip blocks other nodes already hold.
func (ps *Pool) Candidates(node string, f allocator.Family, k int) []netip.Prefix {
	if _, ok := ps.ChooseBlock(node, f); !ok {
		return nil
	}
	w := ps.walks[f]
	single := (f == allocator.IPv4 && w.Bits() == 32) || (f == allocator.IPv6 && w.Bits() == 128)
	return w.Upcoming(k, func(b netip.Prefix) bool {
		_, mine := ps.own[b]
		_, other := ps.others[b]
		return mine || other || (single && len(ps.spec.Excluded(b)) > 0)
	})
}

// Peeked notes what a peek at blocks (PeekBlocks, which may lag) says:
// a block another node claims is skipped, as a lost claim would have
// taught. What the peek says of the node's own claims, or of blocks
// nobody claims, is not trusted: only a claim transaction tells.
func (ps *Pool) Peeked(infos map[netip.Prefix]records.BlockInfo, me string) int {
	n := 0
	for b, info := range infos {
		if _, mine := ps.own[b]; mine || info.Claim == nil || info.Claim.Node == me || ps.claimsUnknown[b] {
			continue
		}
		ps.noteOther(b, info.Claim.Node, false)
		n++
	}
	return n
}

// AtBlockLimit reports whether the node holds as many blocks of f as the
// pool's maxBlocksPerNode allows (0: no limit). A requested (static)
// address in a block nobody claims still claims it: the limit bounds
// what the node takes for itself, not what a pod asks for.
func (ps *Pool) AtBlockLimit(f allocator.Family) bool {
	limit := ps.spec.MaxBlocksPerNode
	if limit <= 0 {
		return false
	}
	held := 0
	for b := range ps.own {
		if allocator.FamilyOf(b.Addr()) == f {
			held++
		}
	}
	return held >= limit
}

// ClaimDraft is a claim about to be sent: the block's bitmap as the node
// will hold it, and the first address written with the claim, if any.
type ClaimDraft struct {
	Block netip.Prefix
	First *records.IPWrite
	ob    *ownBlock
}

// DraftClaim drafts a claim of b; first, if set, is written in the
// claim's transaction at the block's first free address.
func (n *Node) DraftClaim(ps *Pool, b netip.Prefix, first *records.Record) (*ClaimDraft, error) {
	ba, err := allocator.NewBlockAlloc(ps.spec, b)
	if err != nil {
		return nil, err
	}
	d := &ClaimDraft{Block: b, ob: &ownBlock{ba: ba}}
	n.markHeld(b, d.ob) // free in etcd, but an endpoint may still use some
	if first != nil {
		if addr, ok := ba.Next(); ok {
			d.First = &records.IPWrite{Pool: ps.spec.Name, Block: b, Addr: addr, Record: *first, Reserve: first.State == records.StateReserved}
		}
	}
	return d, nil
}

// ClaimWon makes d's block an own block at res's revision, and returns
// the allocation written with it, if any.
func (n *Node) ClaimWon(ps *Pool, d *ClaimDraft, res records.WriteResult) *records.Allocation {
	d.ob.claimRev = res.Rev
	ps.own[d.Block] = d.ob
	delete(ps.others, d.Block)
	delete(ps.claimsUnknown, d.Block)
	n.note(Info, "claimed block", "pool", ps.spec.Name, "block", d.Block, "rev", res.Rev)
	if d.First == nil {
		return nil
	}
	w := d.First
	d.ob.ba.Mark(w.Addr)
	al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: d.Block, Addr: w.Addr, Rev: res.Rev, Seen: n.now()}
	ps.remember(al, res.Expires)
	n.allocated(al)
	return al
}

// ClaimLost notes that b is claimed by node (or by nobody, holding
// allocations if nonEmpty): the walk moves on.
func (ps *Pool) ClaimLost(b netip.Prefix, node string, nonEmpty bool) {
	ps.noteOther(b, node, nonEmpty)
	if node != "" {
		delete(ps.claimsUnknown, b) // another's: an earlier claim did not land
	}
}

// ClaimUnknown notes a claim of b whose outcome is unknown: it is read
// back with the parked addresses (the driver's settleClaims).
func (ps *Pool) ClaimUnknown(b netip.Prefix) { ps.claimsUnknown[b] = true }

// ClaimsUnknown lists the blocks whose claims have an unknown outcome.
func (ps *Pool) ClaimsUnknown() []netip.Prefix {
	return slices.SortedFunc(maps.Keys(ps.claimsUnknown), func(x, y netip.Prefix) int { return x.Addr().Compare(y.Addr()) })
}

// ClaimSettled folds a claim of unknown outcome read back as info: it
// reports whether it is this node's on lease, to adopt; otherwise the
// block is no longer unknown, and another node's claim is noted.
func (ps *Pool) ClaimSettled(info records.BlockInfo, me string, lease int64) (adopt bool) {
	b := info.Block
	if _, mine := ps.own[b]; mine || !info.Owned(me) || info.ClaimLease != lease {
		delete(ps.claimsUnknown, b)
		if !mine && info.Claim != nil && !info.Owned(me) {
			ps.noteOther(b, info.Claim.Node, false)
		}
		return false
	}
	return true
}

// RefreshOthers replaces what the node knows of other nodes' blocks with
// a listing of the pool's claims, and returns the blocks claimed by this
// node on lease that it does not know it owns: its own claims whose
// answers were lost, to adopt.
func (ps *Pool) RefreshOthers(infos []records.BlockInfo, me string, lease int64) (adopt []records.BlockInfo) {
	prev := ps.others
	ps.others = map[netip.Prefix]otherBlock{}
	for _, info := range infos {
		if _, mine := ps.own[info.Block]; mine {
			continue
		}
		switch {
		case info.Owned(me) && info.ClaimLease == lease:
			adopt = append(adopt, info)
		case info.Claim != nil:
			ps.others[info.Block] = otherBlock{node: info.Claim.Node}
		case info.Home != nil && prev[info.Block].orphaned:
			// A home without a claim is an orphaned block or an expired
			// claim over an empty, free block; only a claim transaction can
			// tell, so keep what the last one said.
			ps.others[info.Block] = prev[info.Block]
		}
	}
	return adopt
}

// markHeld keeps the held addresses of block out of ob's free list: an
// endpoint still uses them though the store has no allocation (yet).
func (n *Node) markHeld(block netip.Prefix, ob *ownBlock) {
	if n.held == nil {
		return
	}
	for _, addr := range n.held() {
		if addr = addr.Unmap(); block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
}
