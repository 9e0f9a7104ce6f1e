package planner

import (
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// RestoreStep is what a restore does with one block of a pool's listing.
type RestoreStep int

const (
	// Skip: adopted already, or another node's (noted).
	Skip RestoreStep = iota
	// AdoptBlock: claimed by this node on its current lease; load it.
	AdoptBlock
	// Reclaim: this node's home, claimed on an earlier lease or orphaned;
	// re-claim it on the current lease, then load it.
	Reclaim
	// HomeTaken: home here, claim elsewhere. No claim transaction writes
	// that (a claim needs an empty block and moves the home): it was
	// written by hand. Never taken over; if the block holds allocations,
	// this node cannot serve its pods.
	HomeTaken
)

// RestoreStep decides what a restore does with info, a block of ps's
// listing, on the node's lease.
func (n *Node) RestoreStep(ps *Pool, info records.BlockInfo, lease int64) RestoreStep {
	if _, done := ps.own[info.Block]; done {
		return Skip
	}
	me := n.name
	home := info.Home != nil && info.Home.Node == me
	switch {
	case info.Owned(me) && info.ClaimLease == lease:
		return AdoptBlock
	case home && (info.Claim == nil || info.Claim.Node == me):
		return Reclaim
	case home:
		ps.others[info.Block] = otherBlock{node: info.Claim.Node}
		return HomeTaken
	}
	// Another node's claim. A home without a claim may be an orphaned
	// block or a free one; the claim loop finds out.
	if info.Claim != nil {
		ps.others[info.Block] = otherBlock{node: info.Claim.Node}
	}
	return Skip
}

// Borrowed folds this node's allocations in other nodes' blocks of ps,
// read at a restore (exp: when their leases end).
func (n *Node) Borrowed(ps *Pool, got map[netip.Addr]records.Allocation, exp map[int64]time.Time) {
	now := n.now()
	for _, addr := range sortedAddrs(got) {
		al := got[addr]
		if al.Node != n.name || al.ContainerID == "" || al.State == records.StateKept {
			continue
		}
		al.Seen = now
		ps.remember(&al, exp[al.Lease])
	}
}

// BorrowedRefs names the addresses lent lists (address: holder) that this
// node holds in blocks not its own.
func (n *Node) BorrowedRefs(ps *Pool, lent map[netip.Addr]string) []records.IPRef {
	var refs []records.IPRef
	for _, addr := range sortedAddrs(lent) {
		b, ok := ps.spec.BlockFor(addr)
		if lent[addr] != n.name || !ok {
			continue
		}
		if _, own := ps.own[b]; !own {
			refs = append(refs, records.IPRef{Pool: ps.spec.Name, Block: b, Addr: addr})
		}
	}
	return refs
}

// Read is the cache of pool p as a restore reads it: nothing held yet.
// A refused spec is reported at ERROR: an operator must fix or delete it.
func (n *Node) Read(p allocator.Pool) *Pool {
	ps := NewPool(p)
	n.refusal(ps)
	return ps
}

func (n *Node) refusal(ps *Pool) {
	if ps.refused != nil {
		n.note(Error, "pool refused: its spec in etcd is invalid; it hands out nothing new, pods keep what they hold in it (kvipamctl pool show)",
			"pool", ps.spec.Name, "rev", ps.spec.Rev, "reason", ps.refused)
	}
}

// Update takes a new or changed pool spec (the agent follows the pools
// in etcd): a pool created since the restore is served from then on;
// reservations, the disabled flag, the node selector, the reuse cooldown
// and new cidrs apply at once. A spec older than the one held is ignored.
func (n *Node) Update(p allocator.Pool) {
	ps := n.pools[p.Name]
	if ps == nil {
		// New in etcd: the node holds nothing in it, since a pool is
		// deleted only once nothing is left in it.
		ps = n.Read(p)
		n.serve(ps)
		if ps.refused == nil {
			n.note(Info, "serving a new pool", "pool", p.Name, "rev", p.Rev, "cidrs", len(p.CIDRs), "node_selector", p.NodeSelector, "selected", n.selected(ps))
		}
		return
	}
	if p.Rev != 0 && p.Rev < ps.spec.Rev {
		return
	}
	was := ps.refused
	ps.setPool(p)
	if ps.refused != nil && (was == nil || was.Error() != ps.refused.Error()) {
		n.refusal(ps)
	}
	// A shorter cooldown frees at once what has cooled long enough.
	ps.thaw(n.now().Add(-p.Cooldown()))
	n.note(Info, "pool spec changed", "pool", p.Name, "rev", p.Rev, "disabled", p.Disabled, "reserved", len(p.Reserved), "cidrs", len(p.CIDRs),
		"node_selector", p.NodeSelector, "selected", n.selected(ps), "reuse_cooldown", p.Cooldown())
}
