package planner

import (
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Loading a block: the driver reads its allocations and the expiry of
// their leases; the planner places them.

// Owns reports whether b is an own block of ps.
func (ps *Pool) Owns(b netip.Prefix) bool { return ps.own[b] != nil }

// ClaimRev is the revision of the node's claim on own block b (0: not
// own).
func (ps *Pool) ClaimRev(b netip.Prefix) int64 {
	if ob := ps.own[b]; ob != nil {
		return ob.claimRev
	}
	return 0
}

// Load replaces own block block's bitmap and ps's index of it with allocs
// (read from the store; expiry: when their leases end). Not own: nothing.
func (n *Node) Load(ps *Pool, block netip.Prefix, allocs []records.Allocation, expiry map[int64]time.Time) {
	if ob := ps.own[block]; ob != nil {
		n.load(ps, block, ob, allocs, expiry)
	}
}

// Adopt makes block one of ps's own at claimRev, holding allocs.
func (n *Node) Adopt(ps *Pool, block netip.Prefix, claimRev int64, allocs []records.Allocation, expiry map[int64]time.Time) error {
	ba, err := allocator.NewBlockAlloc(ps.spec, block)
	if err != nil {
		return err
	}
	ob := &ownBlock{ba: ba, claimRev: claimRev}
	ps.own[block] = ob // load places records in own blocks
	n.load(ps, block, ob, allocs, expiry)
	delete(ps.others, block)
	delete(ps.claimsUnknown, block)
	return nil
}

// load places each record as a read-back does (settleAt).
func (n *Node) load(ps *Pool, block netip.Prefix, ob *ownBlock, allocs []records.Allocation, expiry map[int64]time.Time) {
	ps.forgetBlock(block)
	ob.ba.Reset()
	now := n.now()
	var newest *records.Allocation
	for i := range allocs {
		al := &allocs[i]
		ob.ba.Mark(al.Addr)
		switch {
		case al.State == records.StateKept, al.Borrowed && al.Node != n.name:
		case al.ContainerID == "":
			n.note(Warn, "unreadable allocation key in own block; its address stays taken", "pool", ps.spec.Name, "ip", al.Addr)
		default:
			if newest == nil || al.Since.After(newest.Since) {
				newest = al
			}
			if al.Node != n.name {
				n.note(Warn, "allocation of another node in own block", "pool", ps.spec.Name, "ip", al.Addr, "node", al.Node)
			}
			if others := ps.ofOwner(al.Owner.Key(), allocator.FamilyOf(al.Addr)); len(others) > 0 {
				n.note(Warn, "owner holds more than one address of a family", "pool", ps.spec.Name, "owner", al.Owner.Key(), "ip", al.Addr, "also", others[0].Addr)
			}
			al.Seen = now
		}
		ps.settleAt(al.Addr, al, expiry[al.Lease], n.name)
	}
	n.markHeld(block, ob)
	ps.markCooling(block, ob)
	for addr := range ps.planned {
		if block.Contains(addr) {
			ob.ba.Mark(addr)
		}
	}
	if newest != nil {
		ob.ba.ResumeAfter(newest.Addr)
	}
}
