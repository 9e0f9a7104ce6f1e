package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// Operators' changes to a pool. Each is one compare-and-swap on the pool
// key; agents follow the pool key with a watch, and block claims are
// fenced by its revision, so no node claims a block under a spec that has
// changed since it read it.

// DeletedPool is the value of DeletedPoolKey: a pool an operator deleted.
type DeletedPool struct {
	Name      string    `json:"name"`
	DeletedAt time.Time `json:"deletedAt"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// ErrPoolInUse is returned when a cidr or a pool still holds allocations
// or block claims; the error names them.
var ErrPoolInUse = errors.New("pool in use")

// UpdatePool applies change to the stored pool and writes it back if
// nothing changed meanwhile. The result must still pass CheckPoolUpdate
// (no cidr removed, block sizes kept) and overlap no other pool.
func (s *Store) UpdatePool(ctx context.Context, name string, change func(p *allocator.Pool) error) (allocator.Pool, error) {
	var out allocator.Pool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		pools, rev, err := kvstore.ListJSON[allocator.Pool](ctx, s.kv, PoolsPrefix())
		if err != nil {
			return err
		}
		var cur *allocator.Pool
		var others []allocator.Pool
		for _, v := range pools {
			if v.Value.Name == name {
				cur = &v.Value
			} else {
				others = append(others, v.Value)
			}
		}
		if cur == nil {
			return fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
		}
		next := *cur
		next.CIDRs, next.Reserved, next.Draining = slices.Clone(cur.CIDRs), slices.Clone(cur.Reserved), slices.Clone(cur.Draining)
		if err := change(&next); err != nil {
			return err
		}
		if err := allocator.CheckPoolUpdate(*cur, next); err != nil {
			return err
		}
		if err := allocator.CheckDisjoint(next, others); err != nil {
			return err
		}
		return s.putPool(ctx, next, rev, &out)
	})
	return out, err
}

// putPool writes p if no pool changed after rev, and drops the mark of
// a deleted pool of p's name: an operator made it again. A pool that uses
// a feature of a later schema level is written only while every live
// node understands it (poolGate).
func (s *Store) putPool(ctx context.Context, p allocator.Pool, rev int64, out *allocator.Pool) error {
	val, err := kvstore.EncodeJSON(p)
	if err != nil {
		return err
	}
	gate, err := s.poolGate(ctx, p)
	if err != nil {
		return err
	}
	resp, err := s.kv.Txn(ctx).
		If(append(gate, clientv3.Compare(clientv3.ModRevision(PoolsPrefix()), "<", rev+1).WithPrefix())...).
		Then(clientv3.OpPut(PoolKey(p.Name), val), clientv3.OpDelete(DeletedPoolKey(p.Name))).
		Commit()
	if err != nil {
		return fmt.Errorf("write pool %s: %w", p.Name, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("write pool %s: pools changed: %w", p.Name, retry.ErrConflict)
	}
	*out = p
	out.Rev = resp.Header.Revision
	return nil
}

// ErrReservedInCIDR is returned by RemoveCIDR when reserved ranges lie
// inside the cidr and the caller did not say to drop them; the error
// names them.
var ErrReservedInCIDR = errors.New("reserved ranges inside the cidr")

// RemoveCIDR takes cidr out of a pool, refused while any block of it has
// a claim, a home or an allocation (ErrPoolInUse names them). The check
// and the write are one transaction: nothing under the pool's claims,
// homes or allocations may change between them. The cidr's drain mark
// goes with it. Reserved ranges inside the cidr are an operator's
// statement about its addresses: they are dropped only when
// dropReserved says so, and otherwise refused by name
// (ErrReservedInCIDR).
func (s *Store) RemoveCIDR(ctx context.Context, name string, cidr netip.Prefix, dropReserved bool) (allocator.Pool, error) {
	var out allocator.Pool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		p, snap, err := s.poolAndSnapshot(ctx, name)
		if err != nil {
			return err
		}
		if !slices.Contains(p.CIDRs, cidr) {
			return fmt.Errorf("remove cidr %s from pool %s: %w: the pool's cidrs are %s", cidr, name, records.ErrBadRequest, joinPrefixes(p.CIDRs))
		}
		if len(p.CIDRs) == 1 {
			return fmt.Errorf("remove cidr %s from pool %s: %w: it is the pool's last cidr; delete the pool instead", cidr, name, records.ErrBadRequest)
		}
		if use := useOf(snap, cidr); use.Any() {
			return fmt.Errorf("remove cidr %s from pool %s: %w: %s; drain it (kvipamctl pool drain-cidr %s %s), wait for its pods to go, and run drain-cidr again to see what is left",
				cidr, name, ErrPoolInUse, use, name, cidr)
		}
		next := p
		inside := func(r allocator.Reservation) bool { return cidr.Contains(r.Range.First) }
		var res []allocator.Reservation
		for _, r := range p.Reserved {
			if inside(r) {
				res = append(res, r)
			}
		}
		if len(res) > 0 && !dropReserved {
			return fmt.Errorf("remove cidr %s from pool %s: %w: %s; unreserve them, or remove the cidr with them (--drop-reservations)",
				cidr, name, ErrReservedInCIDR, ReservationList(res))
		}
		next.CIDRs = slices.DeleteFunc(slices.Clone(p.CIDRs), func(c netip.Prefix) bool { return c == cidr })
		next.Reserved = slices.DeleteFunc(slices.Clone(p.Reserved), inside)
		next.Draining = slices.DeleteFunc(slices.Clone(p.Draining), func(c netip.Prefix) bool { return c == cidr })
		if len(next.Draining) == 0 {
			next.Draining = nil
		}
		if err := next.Validate(); err != nil {
			return fmt.Errorf("remove cidr %s from pool %s: %w", cidr, name, err)
		}
		val, err := kvstore.EncodeJSON(next)
		if err != nil {
			return err
		}
		return s.commitIfQuiet(ctx, name, snap.Rev, []clientv3.Op{clientv3.OpPut(PoolKey(name), val)}, &out, next)
	})
	return out, err
}

// ReservationList names reserved ranges with their reasons, for an
// operator: "10.0.0.1 (gateway), 10.0.0.64/26".
func ReservationList(rs []allocator.Reservation) string {
	s := make([]string, len(rs))
	for i, r := range rs {
		s[i] = r.Range.String()
		if r.Reason != "" {
			s[i] += " (" + r.Reason + ")"
		}
	}
	return strings.Join(s, ", ")
}

// DeletePool deletes a pool, refused while it has a claim, a home or an
// allocation, or a namespace is bound to it. In the same transaction it
// marks the pool deleted (DeletedPoolKey), so that no agent's
// configuration seeds it again.
func (s *Store) DeletePool(ctx context.Context, name string) error {
	return retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		_, snap, err := s.poolAndSnapshot(ctx, name)
		if err != nil {
			return err
		}
		if use := useWhere(snap, func(netip.Prefix) bool { return true }); use.Any() {
			return fmt.Errorf("delete pool %s: %w: %s; disable the pool (kvipamctl pool disable), wait for its pods to go and run kvipamctl pool show to see what is left", name, ErrPoolInUse, use)
		}
		bs, err := s.NamespaceBindings(ctx)
		if err != nil {
			return err
		}
		var bound []string
		for _, b := range bs {
			if b.Pool == name {
				bound = append(bound, b.Namespace)
			}
		}
		if len(bound) > 0 {
			return fmt.Errorf("delete pool %s: %w: namespaces %s are bound to it (kvipamctl pool unbind-namespace)", name, ErrPoolInUse, strings.Join(bound, ", "))
		}
		mark, err := kvstore.EncodeJSON(DeletedPool{Name: name, DeletedAt: time.Now().UTC()})
		if err != nil {
			return err
		}
		var none allocator.Pool
		return s.commitIfQuiet(ctx, name, snap.Rev, []clientv3.Op{clientv3.OpDelete(PoolKey(name)), clientv3.OpPut(DeletedPoolKey(name), mark)}, &none, none)
	})
}

func (s *Store) poolAndSnapshot(ctx context.Context, name string) (allocator.Pool, records.PoolSnapshot, error) {
	snap, err := s.PoolSnapshot(ctx, name)
	if err != nil {
		return allocator.Pool{}, snap, err
	}
	resp, err := s.kv.Get(ctx, PoolKey(name), clientv3.WithRev(snap.Rev))
	if err != nil {
		return allocator.Pool{}, snap, fmt.Errorf("read pool %s: %w", name, kvstore.Unavailable(err))
	}
	if len(resp.Kvs) == 0 {
		return allocator.Pool{}, snap, fmt.Errorf("pool %q: %w", name, records.ErrPoolNotFound)
	}
	v, err := kvstore.Decode[allocator.Pool](resp.Kvs[0])
	return v.Value, snap, err
}

// commitIfQuiet applies ops if neither the pool nor anything under its
// claims, homes and allocations changed after rev.
func (s *Store) commitIfQuiet(ctx context.Context, name string, rev int64, ops []clientv3.Op, out *allocator.Pool, next allocator.Pool) error {
	quiet := func(prefix string) clientv3.Cmp {
		return clientv3.Compare(clientv3.ModRevision(prefix), "<", rev+1).WithPrefix()
	}
	gate, err := s.poolGate(ctx, next)
	if err != nil {
		return err
	}
	resp, err := s.kv.Txn(ctx).
		If(append(gate, clientv3.Compare(clientv3.ModRevision(PoolKey(name)), "<", rev+1), quiet(ClaimsPrefix(name)), quiet(HomesPrefix(name)), quiet(IPsPrefix(name)))...).
		Then(ops...).
		Commit()
	if err != nil {
		return fmt.Errorf("write pool %s: %w", name, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("write pool %s: the pool changed while it was checked: %w", name, retry.ErrConflict)
	}
	*out = next
	out.Rev = resp.Header.Revision
	return nil
}

func joinPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}
