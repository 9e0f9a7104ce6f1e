package memstore

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// What an operator does to the store, and what a test of a whole
// cluster does to it, outside the node allocator's records.Store: each
// is one atomic step, as etcdstore's pool commands are one compare-and-
// swap each (kvipamctl's release and node remove are several
// transactions on etcd; here each is one step). The test drives them
// on the fake clock like everything else.

// ErrPoolInUse is returned when a cidr or a pool still holds claims,
// homes or allocations (etcdstore.ErrPoolInUse).
var ErrPoolInUse = errors.New("pool in use")

// ErrPoolDeleted is returned by SeedPool for a pool an operator deleted
// (etcdstore.ErrPoolDeleted).
var ErrPoolDeleted = errors.New("pool deleted by an operator")

// Lent is a lent address's home: the node holding it and the home's
// revision, as a watch of the homes delivers it.
type Lent struct {
	Node string
	Rev  int64
}

// LentAt returns pool's lent addresses with their homes' revisions.
func (s *Store) LentAt(pool string) map[netip.Addr]Lent {
	s.lock()
	defer s.mu.Unlock()
	out := map[netip.Addr]Lent{}
	for k, e := range s.lent {
		if k.pool == pool {
			out[k.addr] = Lent{Node: dec[records.Home](e).Node, Rev: e.rev}
		}
	}
	return out
}

// LeaseAlive reports whether lease id exists: a session's Lost is its
// negation.
func (s *Store) LeaseAlive(id int64) bool {
	s.lock()
	defer s.mu.Unlock()
	_, ok := s.lease[id]
	return ok
}

// Lose deletes the allocation at addr and its lent home, leaving no
// history: an etcd restored from a snapshot older than the write.
func (s *Store) Lose(pool string, addr netip.Addr) {
	s.lock()
	defer s.mu.Unlock()
	tx := s.begin()
	for bk, m := range s.ips {
		if _, ok := m[addr]; ok && bk.pool == pool {
			s.ips.del(tx, ipKey{pool, bk.block, addr})
			break
		}
	}
	del(tx, s.lent, addrKey{pool, addr})
	tx.end()
}

// UpdatePool applies change to the stored pool and stores the result if
// it passes CheckPoolUpdate and overlaps no other pool (etcdstore's
// UpdatePool); it drops the pool's deleted mark.
func (s *Store) UpdatePool(name string, change func(p *allocator.Pool) error) (allocator.Pool, error) {
	s.lock()
	defer s.mu.Unlock()
	var cur *allocator.Pool
	var others []allocator.Pool
	for _, v := range s.listPools() {
		if v.Name == name {
			cur = &v
		} else {
			others = append(others, v)
		}
	}
	if cur == nil {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	cur.Rev = 0
	next := *cur
	next.CIDRs, next.Reserved, next.Draining = slices.Clone(cur.CIDRs), slices.Clone(cur.Reserved), slices.Clone(cur.Draining)
	if err := change(&next); err != nil {
		return allocator.Pool{}, err
	}
	if err := allocator.CheckPoolUpdate(*cur, next); err != nil {
		return allocator.Pool{}, err
	}
	if err := allocator.CheckDisjoint(next, others); err != nil {
		return allocator.Pool{}, err
	}
	return s.putPool(next), nil
}

func (s *Store) putPool(p allocator.Pool) allocator.Pool {
	tx := s.begin()
	put(tx, s.pools, p.Name, p, 0)
	delete(s.deleted, p.Name)
	p.Rev = tx.end()
	return p
}

// inUse reports whether anything of pool lies in cidr (every cidr when
// cidr is invalid): a claim, a home, an allocation or a lent address.
func (s *Store) inUse(pool string, cidr netip.Prefix) bool {
	in := func(b netip.Prefix) bool { return !cidr.IsValid() || cidr.Overlaps(b) }
	for k := range s.claims {
		if k.pool == pool && in(k.block) {
			return true
		}
	}
	for k := range s.homes {
		if k.pool == pool && in(k.block) {
			return true
		}
	}
	for k := range s.ips {
		if k.pool == pool && in(k.block) {
			return true
		}
	}
	for k := range s.lent {
		if k.pool == pool && (!cidr.IsValid() || cidr.Contains(k.addr)) {
			return true
		}
	}
	return false
}

// RemoveCIDR takes cidr out of a pool, with the reserved ranges and the
// drain mark inside it, refused while anything lies in it
// (etcdstore's RemoveCIDR with dropReserved).
func (s *Store) RemoveCIDR(name string, cidr netip.Prefix) (allocator.Pool, error) {
	s.lock()
	defer s.mu.Unlock()
	e, ok := s.pools[name]
	if !ok {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	p := dec[allocator.Pool](e)
	if !slices.Contains(p.CIDRs, cidr) || len(p.CIDRs) == 1 {
		return allocator.Pool{}, fmt.Errorf("remove cidr %s from pool %s: %w", cidr, name, records.ErrBadRequest)
	}
	if s.inUse(name, cidr) {
		return allocator.Pool{}, fmt.Errorf("remove cidr %s from pool %s: %w", cidr, name, ErrPoolInUse)
	}
	p.CIDRs = slices.DeleteFunc(p.CIDRs, func(c netip.Prefix) bool { return c == cidr })
	p.Reserved = slices.DeleteFunc(p.Reserved, func(r allocator.Reservation) bool { return cidr.Contains(r.Range.First) })
	p.Draining = slices.DeleteFunc(p.Draining, func(c netip.Prefix) bool { return c == cidr })
	if len(p.Draining) == 0 {
		p.Draining = nil
	}
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, err
	}
	return s.putPool(p), nil
}

// DeletePool deletes a pool nothing lies in and marks it deleted, so
// that no seed makes it again (etcdstore's DeletePool).
func (s *Store) DeletePool(name string) error {
	s.lock()
	defer s.mu.Unlock()
	if _, ok := s.pools[name]; !ok {
		return fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	if s.inUse(name, netip.Prefix{}) {
		return fmt.Errorf("delete pool %s: %w", name, ErrPoolInUse)
	}
	tx := s.begin()
	del(tx, s.pools, name)
	s.deleted[name] = true
	tx.changed = true
	tx.end()
	return nil
}

// PoolDeleted reports whether an operator deleted pool name.
func (s *Store) PoolDeleted(name string) bool {
	s.lock()
	defer s.mu.Unlock()
	return s.deleted[name]
}

// ReleaseOwner releases every allocation of owner o in every pool, kept
// ones too, with their lent homes, as kvipamctl release --owner does
// for the owner of a node that is gone, and the bindings as it does
// (dropBindings). The history says the operator released them. It
// returns how many allocations went.
func (s *Store) ReleaseOwner(o records.Owner, gone string) int {
	s.lock()
	defer s.mu.Unlock()
	tx := s.begin()
	dropped := map[ipKey]records.Allocation{}
	for _, k := range s.ipKeysWhere(func(al records.Allocation) bool { return al.Owner.Key() == o.Key() }) {
		dropped[k] = s.dropIP(tx, k, endOperator)
	}
	s.dropBindings(tx, dropped, gone, func(b records.Binding) bool { return b.Owner.Key() == o.Key() })
	tx.end()
	return len(dropped)
}

// RemoveNode frees the blocks of a node that is gone, as kvipamctl node
// remove does: for every block the node claims, or whose home it is
// while no other node claims it, its claim, every allocation in it but
// those other nodes borrowed, and its home unless one of those stays;
// then the bindings as dropBindings says, those the node wrote in scope.
func (s *Store) RemoveNode(node string) {
	s.lock()
	defer s.mu.Unlock()
	tx := s.begin()
	var blocks []blockKey
	for k := range s.homes {
		_, claimed := s.claims[k]
		if dec[records.Home](s.homes[k]).Node == node && !claimed {
			blocks = append(blocks, k)
		}
	}
	for k, e := range s.claims {
		if dec[records.Claim](e).Node != node {
			continue
		}
		del(tx, s.claims, k)
		if h, ok := s.homes[k]; !ok || dec[records.Home](h).Node == node {
			blocks = append(blocks, k)
		}
	}
	dropped := map[ipKey]records.Allocation{}
	for _, b := range blocks {
		lent := false
		for _, k := range s.ips.keys(b.pool, b.block) {
			if al := s.allocation(k); al.Borrowed && al.Node != node {
				lent = true
				continue
			}
			dropped[k] = s.dropIP(tx, k, endOperator)
		}
		if !lent {
			del(tx, s.homes, b)
		}
	}
	s.dropBindings(tx, dropped, node, func(b records.Binding) bool { return b.Node == node })
	s.endAlternatesOn(tx, node, dropped)
	tx.end()
}

// endAlternatesOn ends the live migrations whose second owner runs on
// node, as inspect's withAlternatesEnded plans them for node remove: the
// binding and the records naming the alternate lose it, unless a record
// of the binding went with the node's blocks (dropped).
func (s *Store) endAlternatesOn(tx *batch, node string, dropped map[ipKey]records.Allocation) {
	for _, k := range s.bindingKeys() {
		b := s.binding(k)
		if b.Alternate == nil || b.Alternate.Node != node {
			continue
		}
		var cur []records.Allocation
		touched := false
		for _, a := range b.Addrs {
			for ik := range dropped {
				touched = touched || (ik.pool == k.pool && ik.addr == a)
			}
			if ik, ok := s.keyOf(k.pool, a); ok {
				if al := s.allocation(ik); al.Identity == b.Identity && al.Alternate != nil {
					cur = append(cur, al)
				}
			}
		}
		if !touched {
			s.dropAlternate(tx, b, cur, endOperator)
		}
	}
}

// keyOf is the key of a's allocation in pool, if there is one.
func (s *Store) keyOf(pool string, a netip.Addr) (ipKey, bool) {
	for bk, m := range s.ips {
		if _, ok := m[a]; ok && bk.pool == pool {
			return ipKey{pool, bk.block, a}, true
		}
	}
	return ipKey{}, false
}

// bindingKeys are the bindings' keys in order.
func (s *Store) bindingKeys() []bindKey {
	var keys []bindKey
	for k := range s.bindings {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b bindKey) int { return strings.Compare(a.pool+"/"+a.identity, b.pool+"/"+b.identity) })
	return keys
}

// dropBindings deletes the bindings an operator's release takes with
// it, as inspect's withBindings plans them: a binding some of whose
// addresses went (dropped) goes, with the rest of its identity's
// addresses (kept for it, or held by the pod it names) unless a live
// node's (a node other than gone); and a binding in scope that is not
// kept and whose pod holds none of its addresses goes too.
func (s *Store) dropBindings(tx *batch, dropped map[ipKey]records.Allocation, gone string, scope func(records.Binding) bool) {
	for _, k := range s.bindingKeys() {
		b := s.binding(k)
		hit := false
		for ik, al := range dropped {
			if ik.pool == k.pool && al.Identity == b.Identity && slices.Contains(b.Addrs, ik.addr) {
				hit = true
			}
		}
		if hit {
			for _, a := range b.Addrs {
				ik, ok := s.keyOf(k.pool, a)
				if !ok {
					continue
				}
				al := s.allocation(ik)
				if al.Identity != b.Identity || (al.State != records.StateKept && al.Owner.Key() != b.Owner.Key()) || al.Node != gone {
					continue
				}
				dropped[ik] = s.dropIP(tx, ik, endOperator)
			}
			del(tx, s.bindings, k)
			continue
		}
		if b.Kept() || !scope(b) {
			continue
		}
		holds := false
		for _, a := range b.Addrs {
			if ik, ok := s.keyOf(k.pool, a); ok && s.allocation(ik).Owner.Key() == b.Owner.Key() {
				holds = true
			}
		}
		if !holds {
			del(tx, s.bindings, k)
		}
	}
}

// endOperator is the history's reason for an operator's release.
const endOperator = "released-by-operator"

// ipKeysWhere lists the allocations keep chooses, in key order.
func (s *Store) ipKeysWhere(keep func(records.Allocation) bool) []ipKey {
	var out []ipKey
	for bk, m := range s.ips {
		for a := range m {
			k := ipKey{bk.pool, bk.block, a}
			if keep(s.allocation(k)) {
				out = append(out, k)
			}
		}
	}
	sortIPKeys(out)
	return out
}

// dropIP deletes the allocation at k, its lent home if borrowed, and
// records the interval's end. It returns what it deleted.
func (s *Store) dropIP(tx *batch, k ipKey, reason string) records.Allocation {
	al := s.allocation(k)
	s.ips.del(tx, k)
	if al.Borrowed {
		del(tx, s.lent, addrKey{k.pool, k.addr})
	}
	if al.State != records.StateKept {
		s.record(tx, s.historyOf(al, s.now, reason))
	}
	return al
}

// PoolIPs returns every allocation of pool, kept ones too, in key
// order: what a checker reads of the whole pool.
func (s *Store) PoolIPs(pool string) []records.Allocation {
	s.lock()
	defer s.mu.Unlock()
	keys := s.ips.keys(pool, netip.Prefix{})
	out := make([]records.Allocation, 0, len(keys))
	for _, k := range keys {
		out = append(out, s.allocation(k))
	}
	return out
}

// Interval is one ended interval of an address in IP history, as
// etcdstore.History reads it: who held it, on which node, and how it
// ended.
type Interval struct {
	Owner  records.Owner
	Node   string
	Reason string
}

// HistoryOf returns the ended intervals of addr in pool, oldest end
// first.
func (s *Store) HistoryOf(pool string, addr netip.Addr) []Interval {
	s.lock()
	defer s.mu.Unlock()
	var out []Interval
	for _, h := range s.history[addrKey{pool, addr}] {
		out = append(out, Interval{Owner: h.owner, Node: h.node, Reason: h.reason})
	}
	return out
}
