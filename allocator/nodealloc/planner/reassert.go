package planner

import (
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// Re-asserting what the node's endpoints hold after etcd lost it (the
// driver's reassert.go says when and how): the records written back.

// reassertWindow is the window of a sticky binding written back for a
// record that does not carry its own (written before records did).
const reassertWindow = time.Hour

// ReassertRecord is the record written back for the allocation of owner
// o at addr (identity and window: its endpoint's): the cached one of its
// owner if the cache has it (identity and all), so the interval goes on;
// else a new one.
func (n *Node) ReassertRecord(ps *Pool, o records.Owner, addr netip.Addr, identity string, window int64) records.Record {
	rec := records.Record{Owner: o, Node: n.name, State: records.StateAllocated, Since: n.now().UTC(), Identity: identity, WindowSeconds: window}
	if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == o.Key() {
		rec = old.Record
		rec.Node, rec.State, rec.Borrowed = n.name, records.StateAllocated, false
	}
	// A live migration's alternate is the binding's to say
	// (ReassertBinding), not the cache's, which may be stale.
	rec.Alternate = nil
	return rec
}

// ReassertBinding decides how rec, of a sticky identity, is written back,
// given its binding as read (b, ok): with a new binding when etcd lost it
// too (naming held, what the owner's endpoint holds, and what the cache
// knows of the identity); as it is when the binding names the owner; and
// without its identity when the identity has moved on to another pod.
func (n *Node) ReassertBinding(ps *Pool, rec *records.Record, held []netip.Addr, b records.Binding, ok bool) *records.Binding {
	switch {
	case ok && b.Owner.Key() == rec.Owner.Key():
		// Written back as the binding has it: during a live migration,
		// naming its alternate.
		rec.Alternate = b.Alternate
		return nil
	case ok:
		n.note(Warn, "sticky identity moved on while etcd had lost a running pod's record; written back without it",
			"identity", rec.Identity, "owner", rec.Owner.Key(), "now", b.Owner.Key())
		rec.Identity, rec.WindowSeconds = "", 0
		return nil
	}
	window := rec.WindowSeconds
	if window == 0 {
		window = int64(reassertWindow / time.Second)
	}
	nb := &records.Binding{Identity: rec.Identity, Owner: rec.Owner, Node: n.name, Since: n.now().UTC(), WindowSeconds: window, Pool: ps.spec.Name}
	nb.Addrs = slices.Clone(held)
	for _, al := range ps.byOwner[rec.Owner.Key()] {
		if al.Identity == rec.Identity {
			nb.Addrs = append(nb.Addrs, al.Addr)
		}
	}
	slices.SortFunc(nb.Addrs, netip.Addr.Compare)
	nb.Addrs = slices.Compact(nb.Addrs)
	return nb
}

// Unasserted is one of the owner's cached allocations whose record etcd
// lost and a Reassert could not write back yet.
type Unasserted struct {
	Owner    records.Owner
	Addr     netip.Addr
	Identity string
	Window   int64
}

// UnassertedOf lists owner key's unasserted allocations in ps, in
// address order.
func (ps *Pool) UnassertedOf(key string) []Unasserted {
	var out []Unasserted
	for _, addr := range sortedAddrs(ps.unasserted) {
		if al := ps.unasserted[addr]; al.Owner.Key() == key {
			out = append(out, Unasserted{Owner: al.Owner, Addr: addr, Identity: al.Identity, Window: al.WindowSeconds})
		}
	}
	return out
}

// UnassertedFor returns an address the cache holds for owner key whose
// record etcd lost and a Reassert could not write back yet.
func (ps *Pool) UnassertedFor(key string) (netip.Addr, bool) {
	if u := ps.UnassertedOf(key); len(u) > 0 {
		return u[0].Addr, true
	}
	return netip.Addr{}, false
}

// Asserting clears addr's unasserted mark: a Reassert settles it.
func (ps *Pool) Asserting(addr netip.Addr) { delete(ps.unasserted, addr) }

// Unasserting marks the owner's cached allocation at addr as one etcd
// lost and that could not be written back (if the cache holds it for
// owner key).
func (ps *Pool) Unasserting(addr netip.Addr, key string) {
	if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == key {
		ps.unasserted[addr] = old
	}
}

// Lost forgets the owner's cached allocation at addr, which etcd lost
// and which cannot be written back (reason): the cache must not answer
// for it either.
func (n *Node) Lost(ps *Pool, addr netip.Addr, key, reason string) {
	if old := ps.byAddr[addr]; old != nil && old.Owner.Key() == key {
		ps.forget(old)
		n.ended(old, "lost: etcd no longer has it and it cannot be written back ("+reason+")")
	}
}

// ForgetBlock drops every cached allocation and unknown write in own
// block b: etcd holds nothing there (claimed again while free).
func (ps *Pool) ForgetBlock(b netip.Prefix) { ps.forgetBlock(b) }
