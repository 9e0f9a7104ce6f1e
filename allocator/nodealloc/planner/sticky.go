package planner

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// A sticky identity's request takes over the identity's addresses (kept,
// or held by an earlier pod of the same name) by compare-and-swap, or
// plans new ones and binds them, in one transaction with the binding
// (WriteBound).

// keptAddr is an address of an own block kept for a sticky identity.
type keptAddr struct {
	identity string
	until    time.Time // when its lease ends; zero if unknown
}

// stickyPlan is what a sticky request learned of its identity so far.
type stickyPlan struct {
	stage    stickyStage
	b        records.Binding
	ok       bool // the identity has a binding
	refs     []records.IPRef
	cur      map[netip.Addr]records.Allocation
	fence    int64
	ordinary bool  // planned in the node's blocks, then bound (bindPlan)
	rev      int64 // the binding replaced (0: none)
}

type stickyStage int

const (
	skRead   stickyStage = iota // the binding is to be read
	skSynced                    // read (Binding); the owner's addresses read back if it is its
	skBound                     // what etcd holds at its addresses was read (Bound)
	skFenced                    // the borrow fence was read (Fence)
)

// Binding folds the identity's binding as read (ok: it has one).
func (p *Plan) Binding(b records.Binding, ok bool) { p.sticky.b, p.sticky.ok = b, ok }

// Bound folds what etcd holds at the binding's addresses.
func (p *Plan) Bound(cur map[netip.Addr]records.Allocation) { p.sticky.cur = cur }

// Fence folds the node's borrow fence.
func (p *Plan) Fence(rev int64) { p.sticky.fence = rev }

// advanceSticky decides what a sticky request does with its identity's
// binding: it ends Done with ordinary set (plan in the node's blocks and
// bind), Done with the takeover's writes, or a need.
func (n *Node) advanceSticky(p *Plan) (Need, error) {
	ps, r, s := p.ps, p.Req, &p.sticky
	switch s.stage {
	case skRead:
		s.stage = skSynced
		return Need{Kind: ReadBinding}, nil
	case skSynced:
		b, ok := s.b, s.ok
		for _, ip := range r.IPs {
			if ok && !slices.Contains(b.Addrs, ip.Unmap()) {
				return Need{}, fmt.Errorf("%w: requested ip %s conflicts with sticky identity %s, which holds %v (kvipamctl claim show %s --pool %s)",
					records.ErrBadRequest, ip, b.Identity, b.Addrs, b.Identity, ps.spec.Name)
			}
		}
		if !ok || b.Owner.Key() == r.Owner.Key() {
			s.ordinary, s.rev = true, b.Rev
			if ok {
				// A retry of the ADD that bound the identity: the
				// binding's addresses are this owner's in etcd; read
				// them into the cache if it lost track, so the retry
				// gets them and not new ones.
				if refs := n.unsynced(ps, b, r.Owner); len(refs) > 0 {
					// They were the owner's before this request: not
					// borrowed by it, nor given back if it fails (a live
					// migration's cut-over made them its on another
					// node's write, which this node has not learned).
					for _, ref := range refs {
						if p.Before != nil {
							p.Before[ref.Addr] = true
						}
					}
					return Need{Kind: ReadBack, Refs: refs}, nil
				}
			}
			return Need{Kind: Done}, nil
		}
		refs, err := boundRefs(ps, b)
		if err != nil {
			return Need{}, err
		}
		s.refs, s.stage = refs, skBound
		return Need{Kind: ReadBound, Refs: refs}, nil
	case skBound:
		b := s.b
		if !b.Kept() && StaleBinding(b, s.cur) {
			// The pod it names holds none of its addresses: its
			// reservation was released or lapsed before it ran. The
			// identity starts afresh, replacing the binding.
			n.note(Info, "sticky binding names a container that holds nothing; replacing it", "identity", b.Identity, "owner", b.Owner.Key())
			s.ordinary, s.rev = true, b.Rev
			return Need{Kind: Done}, nil
		}
		if !b.Kept() && (b.Owner.Namespace != r.Owner.Namespace || b.Owner.Pod != r.Owner.Pod || b.Owner.Pod == "") {
			return Need{}, fmt.Errorf("%w: %s is held by pod %s/%s (%s on node %s); two live pods cannot share one identity",
				records.ErrIdentityInUse, r.Sticky.Identity, b.Owner.Namespace, b.Owner.Pod, b.Owner.Key(), b.Node)
		}
		if !n.selected(ps) {
			// The selector binds the identity too: its addresses are
			// routed where the pool's nodes are (a rack's BGP filters),
			// so a pod elsewhere neither borrows nor takes them over.
			// They stay as they are, for its next pod on a node the
			// selector chooses.
			return Need{}, n.takeoverNotSelected(ps, b)
		}
		if ps.spec.Disabled {
			// Taking kept addresses back is not handing out new ones.
			n.note(Debug, "sticky identity takes its addresses back in a disabled pool", "identity", b.Identity)
		}
		if stray := strays(ps, r.Owner, b); len(stray) > 0 {
			// The owner holds addresses of its own in the families the
			// takeover gives it (an earlier try's write that landed,
			// its answer lost, read back at a restart): taken over too,
			// it would hold two of a family. They go first.
			return Need{Kind: Release, Allocs: stray}, nil
		}
		s.stage = skFenced
		for _, ref := range s.refs {
			if ps.own[ref.Block] == nil && s.fence == 0 {
				return Need{Kind: Fence}, nil
			}
		}
		fallthrough
	case skFenced:
		return n.takeover(p)
	}
	return Need{}, fmt.Errorf("sticky plan of %s: stage %d out of order", r.Owner.Key(), s.stage)
}

// strays lists what owner o holds in ps, in the families of b's
// addresses, at addresses b does not name.
func strays(ps *Pool, o records.Owner, b records.Binding) []*records.Allocation {
	fams := map[allocator.Family]bool{}
	for _, a := range b.Addrs {
		fams[allocator.FamilyOf(a)] = true
	}
	var out []*records.Allocation
	for _, al := range ps.byOwner[o.Key()] {
		if fams[allocator.FamilyOf(al.Addr)] && !slices.Contains(b.Addrs, al.Addr) {
			out = append(out, al)
		}
	}
	return out
}

// unsynced names b's addresses, which name owner o, that the cache does
// not know as o's.
func (n *Node) unsynced(ps *Pool, b records.Binding, o records.Owner) []records.IPRef {
	var refs []records.IPRef
	for _, addr := range b.Addrs {
		if al := ps.byAddr[addr]; al != nil && al.Owner.Key() == o.Key() {
			continue
		}
		if blk, ok := ps.spec.BlockFor(addr); ok {
			refs = append(refs, records.IPRef{Pool: ps.spec.Name, Block: blk, Addr: addr})
		}
	}
	return refs
}

// boundRefs names the keys of b's addresses.
func boundRefs(ps *Pool, b records.Binding) ([]records.IPRef, error) {
	refs := make([]records.IPRef, 0, len(b.Addrs))
	for _, addr := range b.Addrs {
		blk, ok := ps.spec.BlockFor(addr)
		if !ok {
			return nil, fmt.Errorf("%w: sticky identity %s holds %s, which is not in pool %s any more", records.ErrBadRequest, b.Identity, addr, ps.spec.Name)
		}
		refs = append(refs, records.IPRef{Pool: ps.spec.Name, Block: blk, Addr: addr})
	}
	return refs, nil
}

// BoundRefs names the keys of b's addresses in ps.
func (ps *Pool) BoundRefs(b records.Binding) ([]records.IPRef, error) { return boundRefs(ps, b) }

// bindPlan binds what an ordinary plan of a sticky request got to its
// identity, replacing the binding at the revision read (0: none).
func (n *Node) bindPlan(p *Plan) {
	r := p.Req
	nb := records.Binding{Identity: r.Sticky.Identity, Owner: r.Owner, Node: n.name, Since: n.now().UTC(),
		WindowSeconds: int64(r.Sticky.Window / time.Second), Pool: p.ps.spec.Name, Rev: p.sticky.rev}
	if old := p.sticky.b; p.sticky.rev != 0 {
		// The binding replaced: what a newer version wrote in it stays,
		// and in its owner's, if that is this owner.
		nb.Unknown = old.Unknown
		if old.Owner.Key() == r.Owner.Key() {
			nb.Owner.Unknown = old.Owner.Unknown
		}
	}
	for _, al := range p.Reused {
		nb.Addrs = append(nb.Addrs, al.Addr)
	}
	for _, w := range p.Writes {
		nb.Addrs = append(nb.Addrs, w.Addr)
	}
	slices.SortFunc(nb.Addrs, netip.Addr.Compare)
	if old := p.sticky.b; p.sticky.rev != 0 && old.Alternate != nil && old.Owner.Key() == r.Owner.Key() &&
		len(p.Writes) == 0 && slices.Equal(nb.Addrs, old.Addrs) {
		// The owner's ADD retried during a live migration: its records,
		// reused as they are, name the alternate still, and so does
		// the binding (records.Alternate).
		nb.Alternate = old.Alternate
	}
	p.Bind = &nb
}

// takeover plans the writes that give the binding's addresses to the
// request's owner: each compares the record found there (kept for the
// identity, or the earlier pod's) and is fenced like any write, into an
// own block or borrowed.
func (n *Node) takeover(p *Plan) (Need, error) {
	ps, r, s := p.ps, p.Req, &p.sticky
	b := s.b
	now := n.now().UTC()
	var writes []records.IPWrite
	for _, ref := range s.refs {
		rec := records.Record{Owner: r.Owner, Node: n.name, State: records.StateAllocated, Since: now, Identity: b.Identity, WindowSeconds: int64(r.Sticky.Window / time.Second)}
		w := records.IPWrite{Pool: ps.spec.Name, Block: ref.Block, Addr: ref.Addr, Record: rec}
		if c, ok := s.cur[ref.Addr]; ok {
			mine := c.Identity == b.Identity && (c.State == records.StateKept || c.Owner.Key() == b.Owner.Key())
			if !mine {
				return Need{}, fmt.Errorf("sticky identity %s: its address %s is held by %s on node %s: %w", b.Identity, ref.Addr, c.Owner.Key(), c.Node, records.ErrIPInUse)
			}
			w.PrevRev = c.Rev
			// The record read is rewritten: what a newer version
			// wrote in it stays.
			w.Record.Unknown = c.Unknown
			if c.State != records.StateKept {
				w.Ends = &c
			}
		}
		if ob := ps.own[ref.Block]; ob != nil {
			w.ClaimRev = ob.claimRev
		} else {
			w.ClaimRev, w.Borrowed, w.Record.Borrowed = s.fence, true, true
		}
		writes = append(writes, w)
	}
	for _, w := range writes {
		if ob := ps.own[w.Block]; ob != nil && !w.Borrowed {
			ob.ba.Mark(w.Addr)
			ps.planned[w.Addr] = true
		}
	}
	p.Writes = writes
	nb := b
	nb.Owner, nb.Node, nb.Since, nb.WindowSeconds = r.Owner, n.name, now, int64(r.Sticky.Window/time.Second)
	// A takeover ends any live migration of the identity: the records
	// written name no alternate, nor does the binding.
	nb.Alternate = nil
	p.Bind = &nb
	n.note(Info, "sticky identity takes its addresses over", "identity", b.Identity, "ips", b.Addrs, "from_node", b.Node, "kept", b.Kept())
	return Need{Kind: Done}, nil
}

// StaleBinding reports whether none of b's addresses holds a record of
// b's owner (cur is what etcd holds at them).
func StaleBinding(b records.Binding, cur map[netip.Addr]records.Allocation) bool {
	for _, addr := range b.Addrs {
		if c, ok := cur[addr]; ok && c.Owner.Key() == b.Owner.Key() {
			return false
		}
	}
	return true
}

// HeldAny reports whether an address of b is in held.
func HeldAny(b records.Binding, held map[netip.Addr]bool) bool {
	return slices.ContainsFunc(b.Addrs, func(x netip.Addr) bool { return held[x] })
}
