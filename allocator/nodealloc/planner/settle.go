package planner

import (
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// A store call that fails with anything but a definite conflict (a
// deadline, a lost connection, a leader change) has an unknown outcome:
// etcd may have applied it. Treating it as failed would undo a write that
// landed; retrying would then give the owner a second address while the
// first stays in etcd. So every such call, of whatever kind (a create, a
// batch, a confirm, a release, a borrow, a keep, a takeover, a reassert),
// is settled one way: its addresses are parked (they stay marked, and the
// owner's requests wait), then read back, and the cache at each address is
// rebuilt from what etcd holds there, indexed by the record's own owner
// (settleAt). Whether the call landed is then read off the cache, never
// guessed from the shape of the write: a takeover that landed leaves the
// address indexed under its new owner, whoever was cached there before.

// Park records a call of unknown outcome that wrote or deleted refs for
// the owner whose key is owner. Their addresses stay marked until settled.
func (n *Node) Park(ps *Pool, owner, what string, refs ...records.IPRef) {
	for _, ref := range refs {
		delete(ps.planned, ref.Addr)
		ps.unknown[ref.Addr] = pending{ref: ref, owner: owner}
		n.note(Warn, what+" outcome unknown; settling it from etcd before the address is reused", "pool", ps.spec.Name, "ip", ref.Addr, "owner", owner)
	}
}

// ParkWrites parks writes of unknown outcome.
func (n *Node) ParkWrites(writes []records.IPWrite) {
	for _, w := range writes {
		if ps := n.pools[w.Pool]; ps != nil {
			n.Park(ps, w.Record.Owner.Key(), "write", records.IPRef{Pool: w.Pool, Block: w.Block, Addr: w.Addr})
		}
	}
}

// RefsOf names the keys of als.
func RefsOf(als []*records.Allocation) []records.IPRef {
	refs := make([]records.IPRef, len(als))
	for i, al := range als {
		refs[i] = records.IPRef{Pool: al.Pool, Block: al.Block, Addr: al.Addr}
	}
	return refs
}

// ReadBack folds a read of refs: got is what etcd holds at them, exp when
// their leases end. Parked calls at those addresses are settled with them,
// and the cache at each address is what etcd holds (settleAddr).
func (n *Node) ReadBack(refs []records.IPRef, got map[netip.Addr]records.Allocation, exp map[int64]time.Time) {
	now := n.now()
	var held map[netip.Addr]bool // the endpoints' addresses, read once if needed
	heldAt := func(addr netip.Addr) bool {
		if held == nil {
			held = n.HeldSet()
		}
		return held[addr]
	}
	for _, ref := range refs {
		ps := n.pools[ref.Pool]
		if ps == nil {
			continue
		}
		delete(ps.unknown, ref.Addr)
		var cur *records.Allocation
		if al, ok := got[ref.Addr]; ok {
			al.Seen = now
			cur = &al
		}
		n.settleAddr(ps, ref.Addr, cur, exp, heldAt)
	}
}

// settleAddr makes the cache at addr what etcd holds there (cur, or nil
// for nothing; exp the expiry of leases). An allocation the cache held at
// addr that etcd no longer has was released: its address cools. The bit
// of an own block's address stays marked while anything holds it.
func (n *Node) settleAddr(ps *Pool, addr netip.Addr, cur *records.Allocation, exp map[int64]time.Time, held func(netip.Addr) bool) {
	var until time.Time
	if cur != nil {
		until = exp[cur.Lease]
	}
	dropped := ps.settleAt(addr, cur, until, n.name)
	if dropped != nil && (cur == nil || dropped.Owner.Key() != cur.Owner.Key()) {
		how := "released"
		if cur != nil {
			how = "ended: etcd holds " + cur.Owner.Key() + " there now"
		}
		n.ended(dropped, how)
	}
	if cur != nil && cur.Node == n.name && cur.ContainerID != "" && (dropped == nil || dropped.Rev != cur.Rev) && cur.State != records.StateKept {
		n.note(Info, "settled from etcd", "pool", ps.spec.Name, "ip", addr, "owner", cur.Owner.Key(), "state", cur.State)
	}
	if cur != nil {
		return
	}
	// An allocation the cache held there was released: free (or cool) its
	// address as a release that answered would, whether or not its
	// endpoint is gone yet. An address nothing was cached at stays taken
	// while an endpoint uses it (held).
	_, ob := ps.ownBlockOf(addr)
	switch {
	case ob == nil || ps.planned[addr]:
	case dropped != nil && ps.spec.Cooldown() > 0:
		ps.coolAt(addr, n.now())
	case dropped != nil || ps.cool.at[addr].IsZero() && !held(addr):
		ob.ba.Unmark(addr)
	}
}

// Settle makes the cache at addr of ps what etcd holds (cur: a record
// this node just wrote, permanent).
func (n *Node) Settle(ps *Pool, cur *records.Allocation) {
	ps.settleAt(cur.Addr, cur, time.Time{}, n.name)
}

// Learned is what a failed write taught: own blocks whose claim moved
// are given up (their cached allocations stay known); the own blocks
// where addresses were found taken are to be read again (Taken, by
// block).
type Learned struct {
	Pool  *Pool
	Block netip.Prefix
	Addr  netip.Addr
}

// Learn folds a write refused by etcd: blocks fenced are lost, and it
// returns the own blocks to read again for the addresses found taken.
func (n *Node) Learn(we *records.WriteError) []Learned {
	var out []Learned
	for _, ps := range n.Pools() {
		for _, b := range we.Fenced {
			if _, ok := ps.own[b]; ok {
				n.note(Warn, "lost claim on block (fenced write)", "pool", ps.spec.Name, "block", b)
				ps.LoseBlock(b)
			}
		}
		for _, addr := range we.Taken {
			if b, ob := ps.ownBlockOf(addr); ob != nil {
				out = append(out, Learned{Pool: ps, Block: b, Addr: addr})
			}
		}
	}
	return out
}

// MarkTaken marks addr taken in its own block: a read that would have
// said so failed, and the next choice must not pick it again.
func (ps *Pool) MarkTaken(addr netip.Addr) {
	if _, ob := ps.ownBlockOf(addr); ob != nil {
		ob.ba.Mark(addr)
	}
}

// LoseBlock gives up an own block whose claim this node no longer holds:
// nothing more is written into it. Its cached allocations stay known, so a
// DEL still releases them (a release is guarded by the allocation's own
// revision, not by the claim) and a retried ADD still finds them; Restore
// re-claims the block if it is still this node's home.
func (ps *Pool) LoseBlock(b netip.Prefix) {
	delete(ps.own, b)
	ps.others[b] = otherBlock{node: "?"}
}

// Wrote caches a write etcd applied at res (a borrow, or a write sent on
// its own), and returns its allocation.
func (n *Node) Wrote(ps *Pool, w records.IPWrite, res records.WriteResult) *records.Allocation {
	al := &records.Allocation{Record: w.Record, Pool: w.Pool, Block: w.Block, Addr: w.Addr, Rev: res.Rev, Seen: n.now()}
	ps.remember(al, res.Expires)
	n.allocated(al)
	return al
}
