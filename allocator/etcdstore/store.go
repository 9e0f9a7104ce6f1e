// Package etcdstore keeps kvipam's allocation state in etcd: the key
// layout of docs/etcd-schema.md and the fenced transactions that uphold the
// invariants of docs/design.md. It implements allocator.Store.
package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// Store is the etcd-backed allocator.Store. It is safe for concurrent use.
type Store struct {
	cli *clientv3.Client
	res reservationLeases
	now func() time.Time
}

var _ allocator.Store = (*Store)(nil)

// Options tune a Store.
type Options struct {
	// ReservationTTL is the least time a reservation lives before its
	// lease can expire it. Default 2 minutes.
	ReservationTTL time.Duration
}

// New returns a Store over cli.
func New(cli *clientv3.Client, o Options) *Store {
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = 2 * time.Minute
	}
	return &Store{cli: cli, res: reservationLeases{cli: cli, ttl: o.ReservationTTL}, now: time.Now}
}

// EnsurePool implements allocator.Store. The pool is written only if no
// pool changed since the pools were read, so two pools with overlapping
// CIDRs cannot be created at once: overlapping pools would hand the same
// address out twice, once under each pool's keys.
func (s *Store) EnsurePool(ctx context.Context, p allocator.Pool) (allocator.Pool, error) {
	if err := p.Validate(); err != nil {
		return allocator.Pool{}, err
	}
	var out allocator.Pool
	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		pools, rev, err := kvstore.ListJSON[allocator.Pool](ctx, s.cli, PoolsPrefix())
		if err != nil {
			return err
		}
		var others []allocator.Pool
		for _, v := range pools {
			if v.Value.Name != p.Name {
				others = append(others, v.Value)
				continue
			}
			if err := allocator.CheckPoolUpdate(v.Value, p); err != nil {
				return err
			}
			if poolEqual(v.Value, p) {
				out = v.Value
				return nil
			}
		}
		if err := allocator.CheckDisjoint(p, others); err != nil {
			return err
		}
		val, err := kvstore.EncodeJSON(p)
		if err != nil {
			return err
		}
		resp, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(PoolsPrefix()), "<", rev+1).WithPrefix()).
			Then(clientv3.OpPut(PoolKey(p.Name), val)).
			Commit()
		if err != nil {
			return fmt.Errorf("write pool %s: %w", p.Name, err)
		}
		if !resp.Succeeded {
			return fmt.Errorf("write pool %s: pools changed: %w", p.Name, kvstore.ErrConflict)
		}
		out = p
		return nil
	})
	return out, err
}

func poolEqual(a, b allocator.Pool) bool {
	if a.Name != b.Name || a.BlockSizeV4 != b.BlockSizeV4 || a.BlockSizeV6 != b.BlockSizeV6 || len(a.CIDRs) != len(b.CIDRs) {
		return false
	}
	for i := range a.CIDRs {
		if a.CIDRs[i] != b.CIDRs[i] {
			return false
		}
	}
	return true
}

// GetPool implements allocator.Store.
func (s *Store) GetPool(ctx context.Context, name string) (allocator.Pool, error) {
	v, err := kvstore.GetJSON[allocator.Pool](ctx, s.cli, PoolKey(name))
	if errors.Is(err, kvstore.ErrNotFound) {
		return allocator.Pool{}, fmt.Errorf("pool %q: %w", name, allocator.ErrPoolNotFound)
	}
	return v.Value, err
}

// ListPools implements allocator.Store.
func (s *Store) ListPools(ctx context.Context) ([]allocator.Pool, error) {
	vs, _, err := kvstore.ListJSON[allocator.Pool](ctx, s.cli, PoolsPrefix())
	if err != nil {
		return nil, err
	}
	out := make([]allocator.Pool, len(vs))
	for i, v := range vs {
		out[i] = v.Value
	}
	return out, nil
}

// ListBlocks implements allocator.Store. Claims and homes are read in one
// transaction so they describe the same revision.
func (s *Store) ListBlocks(ctx context.Context, pool string) ([]allocator.BlockInfo, error) {
	resp, err := s.cli.Txn(ctx).Then(
		clientv3.OpGet(ClaimsPrefix(pool), clientv3.WithPrefix()),
		clientv3.OpGet(HomesPrefix(pool), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, fmt.Errorf("list blocks of pool %s: %w", pool, err)
	}
	byBlock := map[netip.Prefix]*allocator.BlockInfo{}
	var order []netip.Prefix
	get := func(b netip.Prefix) *allocator.BlockInfo {
		bi, ok := byBlock[b]
		if !ok {
			bi = &allocator.BlockInfo{Block: b}
			byBlock[b] = bi
			order = append(order, b)
		}
		return bi
	}
	// An undecodable claim or home counts as another node's, so the block
	// is left alone; a key that names no block cannot collide with one.
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		b, c, err := decodeBlockKV[allocator.Claim](kv, ClaimsPrefix(pool))
		if errors.Is(err, errBadBlockKey) {
			continue
		}
		if err != nil {
			c = allocator.Claim{Node: UnknownNode}
		}
		bi := get(b)
		bi.Claim, bi.ClaimRev, bi.ClaimLease = &c, kv.ModRevision, kv.Lease
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		b, h, err := decodeBlockKV[allocator.Home](kv, HomesPrefix(pool))
		if errors.Is(err, errBadBlockKey) {
			continue
		}
		if err != nil {
			h = allocator.Home{Node: UnknownNode}
		}
		bi := get(b)
		bi.Home, bi.HomeRev = &h, kv.ModRevision
	}
	out := make([]allocator.BlockInfo, 0, len(order))
	for _, b := range order {
		out = append(out, *byBlock[b])
	}
	return out, nil
}

// UnknownNode stands for the owner of a claim or home whose value cannot
// be decoded.
const UnknownNode = "?"

var errBadBlockKey = errors.New("key names no block")

func decodeBlockKV[T any](kv *mvccpb.KeyValue, prefix string) (netip.Prefix, T, error) {
	var zero T
	name, err := lastSegment(string(kv.Key), prefix)
	if err != nil {
		return netip.Prefix{}, zero, fmt.Errorf("%w: %w", errBadBlockKey, err)
	}
	b, err := allocator.ParseBlockName(name)
	if err != nil {
		return netip.Prefix{}, zero, fmt.Errorf("key %s: %w: %w", kv.Key, errBadBlockKey, err)
	}
	v, err := kvstore.Decode[T](kv)
	return b, v.Value, err
}

// Claim implements allocator.Store: one transaction, "claim absent and
// block empty", that writes the claim on the node's lease and the home.
func (s *Store) Claim(ctx context.Context, pool string, b netip.Prefix, c allocator.Claim, lease int64) (int64, error) {
	ck, hk, ips := ClaimKey(pool, b), HomeKey(pool, b), BlockIPsPrefix(pool, b)
	claim, err := kvstore.EncodeJSON(c)
	if err != nil {
		return 0, err
	}
	home, err := kvstore.EncodeJSON(allocator.Home{Node: c.Node, Since: c.ClaimedAt})
	if err != nil {
		return 0, err
	}
	resp, err := s.cli.Txn(ctx).
		If(kvstore.Absent(ck), kvstore.PrefixEmpty(ips)).
		Then(clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(lease))), clientv3.OpPut(hk, home)).
		Else(clientv3.OpGet(ck), clientv3.OpGet(ips, clientv3.WithPrefix(), clientv3.WithCountOnly()), clientv3.OpGet(hk)).
		Commit()
	if err != nil {
		return 0, fmt.Errorf("claim block %s of pool %s: %w", b, pool, leaseErr(err))
	}
	if resp.Succeeded {
		return resp.Header.Revision, nil
	}
	return 0, claimError(b, resp)
}

// claimError explains a failed claim from the Else reads: claim, ip count, home.
func claimError(b netip.Prefix, resp *clientv3.TxnResponse) error {
	ce := &allocator.ClaimError{Block: b}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if v, err := kvstore.Decode[allocator.Claim](kvs[0]); err == nil {
			ce.ClaimedBy = v.Value.Node
		} else {
			ce.ClaimedBy = UnknownNode
		}
		ce.ClaimRev, ce.ClaimLease = kvs[0].ModRevision, kvs[0].Lease
	}
	ce.NonEmpty = resp.Responses[1].GetResponseRange().Count > 0
	if kvs := resp.Responses[2].GetResponseRange().Kvs; len(kvs) > 0 {
		if v, err := kvstore.Decode[allocator.Home](kvs[0]); err == nil {
			ce.HomeNode = v.Value.Node
		}
	}
	return ce
}

// Reclaim implements allocator.Store. The home must still be c.Node's at
// prev.HomeRev; the claim must be absent (orphaned block) or unchanged since
// prev (this node's claim on an older lease).
func (s *Store) Reclaim(ctx context.Context, pool string, prev allocator.BlockInfo, c allocator.Claim, lease int64) (int64, error) {
	b := prev.Block
	if prev.Home == nil || prev.Home.Node != c.Node {
		return 0, fmt.Errorf("reclaim block %s: home is not node %s: %w", b, c.Node, allocator.ErrNotOwned)
	}
	ck, hk, ips := ClaimKey(pool, b), HomeKey(pool, b), BlockIPsPrefix(pool, b)
	claim, err := kvstore.EncodeJSON(c)
	if err != nil {
		return 0, err
	}
	claimCmp := kvstore.Absent(ck)
	if prev.Claim != nil {
		claimCmp = kvstore.Unchanged(ck, prev.ClaimRev)
	}
	resp, err := s.cli.Txn(ctx).
		If(claimCmp, kvstore.Unchanged(hk, prev.HomeRev)).
		Then(clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(lease)))).
		Else(clientv3.OpGet(ck), clientv3.OpGet(ips, clientv3.WithPrefix(), clientv3.WithCountOnly()), clientv3.OpGet(hk)).
		Commit()
	if err != nil {
		return 0, fmt.Errorf("reclaim block %s of pool %s: %w", b, pool, leaseErr(err))
	}
	if resp.Succeeded {
		return resp.Header.Revision, nil
	}
	return 0, claimError(b, resp)
}

// leaseErr marks a write refused for a lease etcd no longer has: the node
// lease expired before the node noticed.
func leaseErr(err error) error {
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return errors.Join(allocator.ErrLeaseLost, err)
	}
	return err
}

// Unclaim implements allocator.Store.
func (s *Store) Unclaim(ctx context.Context, pool string, b netip.Prefix, claimRev int64) error {
	ck, hk := ClaimKey(pool, b), HomeKey(pool, b)
	resp, err := s.cli.Txn(ctx).
		If(kvstore.Unchanged(ck, claimRev), kvstore.PrefixEmpty(BlockIPsPrefix(pool, b))).
		Then(clientv3.OpDelete(ck), clientv3.OpDelete(hk)).
		Commit()
	if err != nil {
		return fmt.Errorf("release block %s of pool %s: %w", b, pool, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("release block %s of pool %s: claim changed or block not empty: %w", b, pool, allocator.ErrConflict)
	}
	return nil
}

// ListIPs implements allocator.Store.
func (s *Store) ListIPs(ctx context.Context, pool string, b netip.Prefix) ([]allocator.Allocation, error) {
	resp, err := s.cli.Get(ctx, BlockIPsPrefix(pool, b), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list allocations of block %s: %w", b, err)
	}
	out := make([]allocator.Allocation, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		al, err := DecodeAllocation(pool, kv)
		if err != nil {
			// A key an operator wrote by hand must not stop the node: an
			// address it names is reported as taken by an unknown owner,
			// so it is never handed out; anything else under the prefix
			// only makes the block non-empty.
			_, addr, perr := ParseIPKey(pool, string(kv.Key))
			if perr != nil {
				continue
			}
			al = allocator.Allocation{Pool: pool, Block: b, Addr: addr, Rev: kv.ModRevision, Lease: kv.Lease}
		}
		out = append(out, al)
	}
	return out, nil
}

// DecodeAllocations turns allocation key-values of pool into Allocations.
func DecodeAllocations(pool string, kvs []*mvccpb.KeyValue) ([]allocator.Allocation, error) {
	out := make([]allocator.Allocation, 0, len(kvs))
	for _, kv := range kvs {
		a, err := DecodeAllocation(pool, kv)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// DecodeAllocation turns one allocation key-value of pool into an Allocation.
func DecodeAllocation(pool string, kv *mvccpb.KeyValue) (allocator.Allocation, error) {
	b, a, err := ParseIPKey(pool, string(kv.Key))
	if err != nil {
		return allocator.Allocation{}, err
	}
	v, err := kvstore.Decode[allocator.Record](kv)
	if err != nil {
		return allocator.Allocation{}, err
	}
	return allocator.Allocation{Record: v.Value, Pool: pool, Block: b, Addr: a, Rev: kv.ModRevision, Lease: kv.Lease}, nil
}

// WriteIPs implements allocator.Store. Every write is fenced by its block's
// claim revision (invariant 2); a create also requires the address to be
// free and a confirm requires the reservation to be unchanged.
func (s *Store) WriteIPs(ctx context.Context, writes []allocator.IPWrite) (allocator.WriteResult, error) {
	var res allocator.WriteResult
	var resLease clientv3.LeaseID
	reserve := false
	for _, w := range writes {
		reserve = reserve || (w.Reserve && w.PrevRev == 0)
	}
	if len(writes) == 0 {
		return res, nil
	}
	if reserve {
		lease, expires, err := s.res.get(ctx)
		if err != nil {
			return res, err
		}
		resLease = lease
		res.Expires = expires
	}
	type fence struct {
		pool  string
		block netip.Prefix
	}
	fenced := map[fence]bool{}
	var cmps []clientv3.Cmp
	var puts []clientv3.Op
	for _, w := range writes {
		f := fence{w.Pool, w.Block}
		if !fenced[f] {
			fenced[f] = true
			cmps = append(cmps, kvstore.Unchanged(ClaimKey(w.Pool, w.Block), w.ClaimRev))
		}
		key := IPKey(w.Pool, w.Block, w.Addr)
		if w.PrevRev == 0 {
			cmps = append(cmps, kvstore.Absent(key))
		} else {
			cmps = append(cmps, kvstore.Unchanged(key, w.PrevRev))
		}
		val, err := kvstore.EncodeJSON(w.Record)
		if err != nil {
			return res, err
		}
		// A put without a lease detaches any, so confirming a reservation
		// makes it permanent.
		var opts []clientv3.OpOption
		if w.Reserve && w.PrevRev == 0 {
			opts = append(opts, clientv3.WithLease(resLease))
		}
		puts = append(puts, clientv3.OpPut(key, val, opts...))
	}
	resp, err := s.cli.Txn(ctx).If(cmps...).Then(puts...).Commit()
	if reserve && errors.Is(err, rpctypes.ErrLeaseNotFound) {
		// The shared reservation lease expired or was revoked: a retry
		// grants a new one.
		s.res.drop(resLease)
		return res, fmt.Errorf("reservation lease gone: %w", allocator.ErrConflict)
	}
	if err != nil {
		return res, fmt.Errorf("write %d allocations: %w", len(writes), err)
	}
	if resp.Succeeded {
		res.Rev = resp.Header.Revision
		return res, nil
	}
	return res, s.explainWrite(ctx, writes)
}

// explainWrite finds out which checks of a failed WriteIPs failed. It
// reads after the fact, on the failure path only, so the write itself
// carries no Else operations (which count against etcd's --max-txn-ops);
// the reads go in one round trip.
func (s *Store) explainWrite(ctx context.Context, writes []allocator.IPWrite) error {
	var keys []string
	seen := map[string]bool{}
	for _, w := range writes {
		for _, k := range []string{ClaimKey(w.Pool, w.Block), IPKey(w.Pool, w.Block, w.Addr)} {
			if !seen[k] {
				seen[k] = true
				keys = append(keys, k)
			}
		}
	}
	got, _, err := s.getKeys(ctx, keys)
	if err != nil {
		return fmt.Errorf("explain failed write: %w", err)
	}
	modRev := func(k string) int64 {
		if kv := got[k]; kv != nil {
			return kv.ModRevision
		}
		return 0
	}
	we := &allocator.WriteError{}
	fenced := map[netip.Prefix]bool{}
	for _, w := range writes {
		if modRev(ClaimKey(w.Pool, w.Block)) != w.ClaimRev && !fenced[w.Block] {
			fenced[w.Block] = true
			we.Fenced = append(we.Fenced, w.Block)
		}
		ip := modRev(IPKey(w.Pool, w.Block, w.Addr))
		if (w.PrevRev == 0 && ip != 0) || (w.PrevRev != 0 && ip != w.PrevRev) {
			we.Taken = append(we.Taken, w.Addr)
		}
	}
	if len(we.Fenced) == 0 && len(we.Taken) == 0 {
		// Changed back between the write and the reads: still a lost race.
		return fmt.Errorf("write allocations: changed concurrently: %w", allocator.ErrConflict)
	}
	return we
}

// maxTxnOps is etcd's default --max-txn-ops: the most operations one
// transaction may hold in each of its branches.
const maxTxnOps = 128

// getKeys reads keys in as few transactions as etcd allows (one, for up
// to maxTxnOps keys), and returns the ones that exist and the revision of
// the first read.
func (s *Store) getKeys(ctx context.Context, keys []string) (map[string]*mvccpb.KeyValue, int64, error) {
	out := make(map[string]*mvccpb.KeyValue, len(keys))
	var rev int64
	for chunk := range slices.Chunk(keys, maxTxnOps) {
		ops := make([]clientv3.Op, len(chunk))
		for i, k := range chunk {
			ops[i] = clientv3.OpGet(k)
		}
		resp, err := s.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, 0, err
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				out[string(kv.Key)] = kv
			}
		}
	}
	return out, rev, nil
}

// GetIPs implements allocator.Store.
func (s *Store) GetIPs(ctx context.Context, refs []allocator.IPRef) (map[netip.Addr]allocator.Allocation, error) {
	keys := make([]string, len(refs))
	for i, r := range refs {
		keys[i] = IPKey(r.Pool, r.Block, r.Addr)
	}
	got, _, err := s.getKeys(ctx, keys)
	if err != nil {
		return nil, fmt.Errorf("read %d allocations: %w", len(refs), err)
	}
	out := make(map[netip.Addr]allocator.Allocation, len(got))
	for i, r := range refs {
		kv := got[keys[i]]
		if kv == nil {
			continue
		}
		al, err := DecodeAllocation(r.Pool, kv)
		if err != nil {
			// Unreadable: an owner nobody can match, so the address is
			// known taken and never taken for ours.
			al = allocator.Allocation{Pool: r.Pool, Block: r.Block, Addr: r.Addr, Rev: kv.ModRevision, Lease: kv.Lease}
		}
		out[r.Addr] = al
	}
	return out, nil
}

// LeaseExpiry implements allocator.Store.
func (s *Store) LeaseExpiry(ctx context.Context, lease int64) (time.Time, error) {
	resp, err := s.cli.TimeToLive(ctx, clientv3.LeaseID(lease))
	if err != nil {
		return time.Time{}, fmt.Errorf("read lease %x: %w", lease, err)
	}
	return s.now().Add(time.Duration(max(resp.TTL, 0)) * time.Second), nil
}

// DeleteIP implements allocator.Store.
func (s *Store) DeleteIP(ctx context.Context, pool string, b netip.Prefix, a netip.Addr, rev int64) error {
	return kvstore.DeleteAt(ctx, s.cli, IPKey(pool, b, a), rev)
}

// reservationLeases shares one lease among the reservations made within a
// short window, so a reservation costs no extra round trip. The lease is
// granted for ttl plus the window, so every reservation lives at least ttl.
type reservationLeases struct {
	cli     *clientv3.Client
	ttl     time.Duration
	mu      sync.Mutex
	id      clientv3.LeaseID
	granted time.Time
	expires time.Time
}

func (r *reservationLeases) get(ctx context.Context) (clientv3.LeaseID, time.Time, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := time.Now()
	window := r.ttl / 4
	if r.id != 0 && now.Sub(r.granted) < window {
		return r.id, r.expires, nil
	}
	secs := int64((r.ttl + window + time.Second - 1) / time.Second)
	resp, err := r.cli.Grant(ctx, secs)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("grant reservation lease: %w", err)
	}
	r.id, r.granted, r.expires = resp.ID, now, now.Add(time.Duration(resp.TTL)*time.Second)
	return r.id, r.expires, nil
}

// drop forgets lease id (etcd no longer knows it), so the next get grants anew.
func (r *reservationLeases) drop(id clientv3.LeaseID) {
	r.mu.Lock()
	if r.id == id {
		r.id = 0
	}
	r.mu.Unlock()
}
