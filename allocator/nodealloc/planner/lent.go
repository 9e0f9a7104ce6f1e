package planner

import (
	"net/netip"

	"github.com/kvipam/kvipam/allocator/records"
)

// ResetLent replaces what the node knows of the addresses of its own
// blocks that other nodes hold, by pool, with a complete listing: a pool
// missing from lent has none. A loan the node knew of and the listing
// lacks was given back while no one watched; it is dropped as NoteLent
// drops a returned one. It returns the pools that had a loan dropped.
func (n *Node) ResetLent(lent map[string]map[netip.Addr]Loan) []string {
	var changed []string
	for _, ps := range n.Pools() {
		name := ps.spec.Name
		listed := lent[name]
		dropped := false
		for _, addr := range sortedAddrs(ps.lent) {
			if _, ok := listed[addr]; !ok {
				ps.dropLent(addr)
				dropped = true
			}
		}
		for _, addr := range sortedAddrs(listed) {
			loan := listed[addr]
			if loan.Node == n.name {
				continue
			}
			if al := ps.noteLent(addr, loan); al != nil {
				n.ended(al, "taken over by node "+loan.Node)
			}
		}
		if dropped {
			changed = append(changed, name)
		}
	}
	return changed
}

// NoteLent applies what the agent's watch saw of a lent address's home
// in one of this node's blocks: another node holds addr (present), or
// gave it back.
func (n *Node) NoteLent(pool string, addr netip.Addr, node string, rev int64, present bool) {
	ps := n.pools[pool]
	if ps == nil {
		return
	}
	_, ob := ps.ownBlockOf(addr)
	if ob == nil || node == n.name {
		return
	}
	if present {
		if al := ps.noteLent(addr, Loan{Node: node, Rev: rev}); al != nil {
			n.ended(al, "taken over by node "+node)
		}
		return
	}
	if _, ok := ps.lent[addr]; ok {
		ps.dropLent(addr)
	}
}

// Loan is another node's hold on an address of this node's block: the
// node, and the revision its home was written at.
type Loan struct {
	Node string
	Rev  int64
}

// noteLent records the loan of addr, an address of an own block, and
// returns the allocation the cache held there if the loan is newer, which
// it forgets: a loan of an own block's address is written only by a
// create-if-absent or by a sticky takeover that compared the record there,
// so a cached record older than the loan is gone from etcd (a later
// container of its identity took it over from another node). A late watch
// event of a loan older than the cached record changes nothing of it. A
// write of unknown outcome at addr is left to its settling.
func (ps *Pool) noteLent(addr netip.Addr, loan Loan) *records.Allocation {
	_, ob := ps.ownBlockOf(addr)
	if ob == nil {
		return nil
	}
	al := ps.byAddr[addr]
	if al != nil && loan.Rev <= al.Rev {
		return nil // the loan ended before the cached record was written
	}
	ps.lent[addr] = loan.Node
	ob.ba.Mark(addr)
	if _, parked := ps.unknown[addr]; al == nil || parked {
		return nil
	}
	ps.forget(al)
	return al
}

// dropLent forgets a loan given back, and frees its address unless the
// node uses it (cached, planned, of unknown outcome or kept).
func (ps *Pool) dropLent(addr netip.Addr) {
	delete(ps.lent, addr)
	_, ob := ps.ownBlockOf(addr)
	if ob == nil {
		return
	}
	_, parked := ps.unknown[addr]
	_, kept := ps.kept[addr]
	if ps.byAddr[addr] == nil && !ps.planned[addr] && !parked && !kept {
		ob.ba.Unmark(addr)
	}
}
