// Package planner is the node allocator's mind without its hands: the
// node's cache of the pools it serves (the blocks it owns with their
// bitmaps, an index of the allocations in them, what is lent, kept,
// cooling, planned or of unknown outcome) and every decision made on it.
// It does no I/O: no context, no store, no logger. A decision returns data,
// the writes to send or what it needs first (a block to claim, a lender to
// borrow from, addresses to read back), and the driver (package nodealloc)
// does that and folds the answer back with an explicit function. What a
// log should say is returned as events (events.go).
//
// A Node is not safe for concurrent use: the driver's lock guards it.
package planner

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Node is one node's view of every pool it serves.
type Node struct {
	name   string
	labels map[string]string
	now    func() time.Time
	held   func() []netip.Addr
	pools  map[string]*Pool
	order  []*Pool // pools by name; changes only with the pools served
	events []Event
}

// NewNode is the planner of node name with labels; now reads the clock
// and held, if set, lists the addresses the node's endpoints use.
func NewNode(name string, labels map[string]string, now func() time.Time, held func() []netip.Addr) *Node {
	return &Node{name: name, labels: maps.Clone(labels), now: now, held: held, pools: map[string]*Pool{}}
}

// Now reads the node's clock.
func (n *Node) Now() time.Time { return n.now() }

// Pool returns the cache of a served pool.
func (n *Node) Pool(name string) (*Pool, error) {
	ps, ok := n.pools[name]
	if !ok {
		return nil, fmt.Errorf("pool %q is not served on node %s: no such pool in etcd (kvipamctl pool list): %w", name, n.name, records.ErrPoolNotFound)
	}
	return ps, nil
}

// Lookup returns the cache of a served pool, or nil.
func (n *Node) Lookup(name string) *Pool { return n.pools[name] }

// Pools lists the served pools by name. The slice is the node's own:
// read it, never change it.
func (n *Node) Pools() []*Pool { return n.order }

// Replace makes pools the served pools (a restore read them all).
func (n *Node) Replace(pools []*Pool) {
	n.pools = make(map[string]*Pool, len(pools))
	for _, ps := range pools {
		n.pools[ps.spec.Name] = ps
	}
	n.sortPools()
}

// serve adds ps to the served pools.
func (n *Node) serve(ps *Pool) {
	n.pools[ps.spec.Name] = ps
	n.sortPools()
}

func (n *Node) sortPools() {
	n.order = slices.SortedFunc(maps.Values(n.pools), func(x, y *Pool) int { return strings.Compare(x.spec.Name, y.spec.Name) })
}

// selected reports whether ps's node selector chooses this node: only
// then does the node take new blocks and addresses in it.
func (n *Node) selected(ps *Pool) bool { return ps.spec.Selects(n.labels) }

// Draining reports whether the node gives every empty block of ps back:
// the pool is disabled or refused, or its selector no longer chooses the
// node.
func (n *Node) Draining(ps *Pool) bool {
	return ps.spec.Disabled || ps.refused != nil || !n.selected(ps)
}

// givesBack reports whether own block b of ps goes back to the pool once
// empty, even if it is the node's last: the pool is draining (Draining),
// or b is in a draining cidr.
func (n *Node) givesBack(ps *Pool, b netip.Prefix) bool {
	return n.Draining(ps) || ps.spec.InDraining(b.Addr())
}

// Unclaimable reports whether own block b of ps goes back to the pool
// now: it holds nothing but cooling addresses, and either it gives back
// (givesBack) or the node keeps another block of its family that hands
// out addresses (a node keeps one block per family ready for the next
// pod).
func (n *Node) Unclaimable(ps *Pool, b netip.Prefix) bool {
	if ps.own[b] == nil || ps.holds(b) {
		return false
	}
	return n.givesBack(ps, b) || len(ps.servingOwn(allocator.FamilyOf(b.Addr()))) >= 2
}

// HeldSet is the set of addresses this node's endpoints use.
func (n *Node) HeldSet() map[netip.Addr]bool {
	out := map[netip.Addr]bool{}
	if n.held != nil {
		for _, h := range n.held() {
			out[h.Unmap()] = true
		}
	}
	return out
}

// labelText is the node's labels for an error message.
func (n *Node) labelText() string {
	if labels := allocator.FormatLabels(n.labels); labels != "" {
		return labels
	}
	return "none"
}

// ClaimRecord is the record of a claim this node writes now.
func (n *Node) ClaimRecord(bootID string) records.Claim {
	return records.Claim{Node: n.name, BootID: bootID, ClaimedAt: n.now().UTC()}
}

// AnyPending reports whether the owner has a parked write in any pool.
func (n *Node) AnyPending(o records.Owner) bool {
	for _, ps := range n.pools {
		if ps.pendingFor(o.Key()) {
			return true
		}
	}
	return false
}

// Parked lists the addresses of every call of unknown outcome, in every
// pool, in address order.
func (n *Node) Parked() []records.IPRef {
	var refs []records.IPRef
	for _, ps := range n.order {
		if len(ps.unknown) == 0 {
			continue
		}
		for _, addr := range sortedAddrs(ps.unknown) {
			refs = append(refs, ps.unknown[addr].ref)
		}
	}
	return refs
}

// CheckBinding notes, in every pool, that owner o's DEL checks the
// binding of sticky identity id (Pool.checkBinding).
func (n *Node) CheckBinding(o records.Owner, id string) {
	for _, ps := range n.pools {
		ps.noteCheckBinding(o.Key(), id)
	}
}

// confirmed forgets, in every pool, that o's DEL checks a binding: o is
// confirmed.
func (n *Node) confirmed(o records.Owner) {
	for _, ps := range n.pools {
		delete(ps.checkBinding, o.Key())
	}
}

// PoolOf returns the pool and block an address of this node's pools lies
// in.
func (n *Node) PoolOf(addr netip.Addr) (*Pool, netip.Prefix, bool) {
	for _, ps := range n.Pools() {
		if b, ok := ps.spec.BlockFor(addr); ok {
			return ps, b, true
		}
	}
	return nil, netip.Prefix{}, false
}
