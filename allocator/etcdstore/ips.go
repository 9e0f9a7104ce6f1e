package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// ListIPs implements records.Store.
func (s *Store) ListIPs(ctx context.Context, pool string, b netip.Prefix) ([]records.Allocation, error) {
	resp, err := s.kv.Get(ctx, BlockIPsPrefix(pool, b), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list allocations of block %s: %w", b, kvstore.Unavailable(err))
	}
	out := make([]records.Allocation, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		al, err := DecodeAllocation(pool, kv)
		if err != nil {
			// A key an operator wrote by hand must not stop the node: an
			// address it names is reported as taken by an unknown owner,
			// so it is never handed out; anything else under the prefix
			// only makes the block non-empty.
			_, addr, perr := parseIPKey(pool, string(kv.Key))
			if perr != nil {
				continue
			}
			al = records.Allocation{Pool: pool, Block: b, Addr: addr, Rev: kv.ModRevision, Lease: kv.Lease}
		}
		out = append(out, al)
	}
	return out, nil
}

// DecodeAllocation turns one allocation key-value of pool into an Allocation.
func DecodeAllocation(pool string, kv *mvccpb.KeyValue) (records.Allocation, error) {
	b, a, err := parseIPKey(pool, string(kv.Key))
	if err != nil {
		return records.Allocation{}, err
	}
	v, err := kvstore.Decode[records.Record](kv)
	if err != nil {
		return records.Allocation{}, err
	}
	return records.Allocation{Record: v.Value, Pool: pool, Block: b, Addr: a, Rev: kv.ModRevision, Lease: kv.Lease}, nil
}

// WriteIPs implements records.Store. Every write is fenced by its block's
// claim revision (invariant 2); a create also requires the address to be
// free and a confirm requires the reservation to be unchanged.
func (s *Store) WriteIPs(ctx context.Context, writes []records.IPWrite) (records.WriteResult, error) {
	return s.writeIPs(ctx, writes, nil, nil, nil)
}

// writeIPs commits writes, with the extra compares and operations of a
// caller (a sticky binding) and the history records of the intervals it
// ends, in one transaction.
func (s *Store) writeIPs(ctx context.Context, writes []records.IPWrite, cmps []clientv3.Cmp, puts []clientv3.Op, ended []HistoryRecord) (records.WriteResult, error) {
	var res records.WriteResult
	var resLease clientv3.LeaseID
	reserve := false
	for _, w := range writes {
		reserve = reserve || (w.Reserve && w.PrevRev == 0)
	}
	if len(writes) == 0 && len(puts) == 0 {
		return res, nil
	}
	// What is written now will be released: its history lease, ahead.
	s.hist.Ahead()
	if reserve {
		lease, expires, err := s.res.get(ctx)
		if err != nil {
			return res, err
		}
		resLease = lease
		res.Expires = expires
	}
	var rewritten []string
	for _, w := range writes {
		if w.Borrowed && w.PrevRev != 0 {
			rewritten = append(rewritten, LentKey(w.Pool, w.Addr))
		}
	}
	lent, err := s.lentHomes(ctx, rewritten)
	if err != nil {
		return res, err
	}
	fenced := map[string]bool{}
	fence := func(c clientv3.Cmp, key string) {
		if !fenced[key] {
			fenced[key] = true
			cmps = append(cmps, c)
		}
	}
	for _, w := range writes {
		if w.Borrowed {
			// Fenced by the writer's own lease, into a block that still
			// has a home (held or orphaned, not released meanwhile).
			fk, hk := borrowerKey(w.Record.Node), HomeKey(w.Pool, w.Block)
			fence(kvstore.Unchanged(fk, w.ClaimRev), fk)
			fence(kvstore.Exists(hk), hk)
		} else {
			ck := ClaimKey(w.Pool, w.Block)
			fence(kvstore.Unchanged(ck, w.ClaimRev), ck)
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
		switch {
		case w.Borrowed:
			h := lent[LentKey(w.Pool, w.Addr)] // none for a new loan
			h.Node, h.Since = w.Record.Node, w.Record.Since
			home, err := kvstore.EncodeJSON(h)
			if err != nil {
				return res, err
			}
			puts = append(puts, clientv3.OpPut(LentKey(w.Pool, w.Addr), home, opts...))
		case w.PrevRev != 0 && w.Record.Identity != "":
			// A kept address taken over in the writer's own block: it is
			// no longer lent to anyone.
			puts = append(puts, clientv3.OpDelete(LentKey(w.Pool, w.Addr)))
		}
	}
	var resp *clientv3.TxnResponse
	err = s.hist.Commit(ctx, ended, func(hist []clientv3.Op) (err error) {
		resp, err = s.kv.Txn(ctx).If(cmps...).Then(append(slices.Clip(puts), hist...)...).Commit()
		return err
	})
	if s.reservationLeaseGone(ctx, err, resLease, true) {
		return res, fmt.Errorf("reservation lease gone: %w", retry.ErrConflict)
	}
	if err != nil {
		return res, fmt.Errorf("write %d allocations: %w", len(writes), kvstore.Unavailable(err))
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
func (s *Store) explainWrite(ctx context.Context, writes []records.IPWrite) error {
	var keys []string
	seen := map[string]bool{}
	for _, w := range writes {
		fk := ClaimKey(w.Pool, w.Block)
		if w.Borrowed {
			fk = borrowerKey(w.Record.Node)
		}
		for _, k := range []string{fk, HomeKey(w.Pool, w.Block), IPKey(w.Pool, w.Block, w.Addr)} {
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
	we := &records.WriteError{}
	fenced := map[netip.Prefix]bool{}
	for _, w := range writes {
		ip := modRev(IPKey(w.Pool, w.Block, w.Addr))
		taken := (w.PrevRev == 0 && ip != 0) || (w.PrevRev != 0 && ip != w.PrevRev)
		switch {
		case w.Borrowed && modRev(borrowerKey(w.Record.Node)) != w.ClaimRev:
			we.FenceLost = true
		case w.Borrowed && modRev(HomeKey(w.Pool, w.Block)) == 0 && !fenced[w.Block]:
			// The block was released (node remove deleted its home): no
			// address of it may be written, taken or not. Reported as
			// taken, the allocator would re-plan the same write at once,
			// without back-off, until its deadline.
			fenced[w.Block] = true
			we.Fenced = append(we.Fenced, w.Block)
		case !w.Borrowed && modRev(ClaimKey(w.Pool, w.Block)) != w.ClaimRev && !fenced[w.Block]:
			fenced[w.Block] = true
			we.Fenced = append(we.Fenced, w.Block)
		}
		if taken {
			we.Taken = append(we.Taken, w.Addr)
		}
	}
	if len(we.Fenced) == 0 && len(we.Taken) == 0 && !we.FenceLost {
		// Changed back between the write and the reads: still a lost race.
		return fmt.Errorf("write allocations: changed concurrently: %w", retry.ErrConflict)
	}
	return we
}

// maxTxnOps is etcd's default --max-txn-ops: the most operations one
// transaction may hold in each of its branches.
const maxTxnOps = 128

// getKeys reads keys in as few transactions as etcd allows (one, for up
// to maxTxnOps keys), and returns the ones that exist and the revision of
// the first read.
func (s *Store) getKeys(ctx context.Context, keys []string, opts ...clientv3.OpOption) (map[string]*mvccpb.KeyValue, int64, error) {
	out := make(map[string]*mvccpb.KeyValue, len(keys))
	var rev int64
	for chunk := range slices.Chunk(keys, maxTxnOps) {
		ops := make([]clientv3.Op, len(chunk))
		for i, k := range chunk {
			ops[i] = clientv3.OpGet(k, opts...)
		}
		resp, err := s.kv.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, 0, kvstore.Unavailable(err)
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

// GetIPs implements records.Store.
func (s *Store) GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error) {
	keys := make([]string, len(refs))
	for i, r := range refs {
		keys[i] = IPKey(r.Pool, r.Block, r.Addr)
	}
	got, _, err := s.getKeys(ctx, keys)
	if err != nil {
		return nil, fmt.Errorf("read %d allocations: %w", len(refs), err)
	}
	out := make(map[netip.Addr]records.Allocation, len(got))
	for i, r := range refs {
		kv := got[keys[i]]
		if kv == nil {
			continue
		}
		al, err := DecodeAllocation(r.Pool, kv)
		if err != nil {
			// Unreadable: an owner nobody can match, so the address is
			// known taken and never taken for ours.
			al = records.Allocation{Pool: r.Pool, Block: r.Block, Addr: r.Addr, Rev: kv.ModRevision, Lease: kv.Lease}
		}
		out[r.Addr] = al
	}
	return out, nil
}

// DeleteIP implements records.Store: the guarded delete and the history
// record of the interval it ends, in one transaction.
//
// An address of a sticky identity that is released, not kept (the
// reservation of an ADD that failed, or a request's borrowed address
// given back), takes the identity's binding with it when the binding
// names al's owner: the container it names never ran, and the identity's
// next pod must not be sent after addresses it does not hold. So does the
// release of one whose reservation lapsed before the DEL came (its key
// is gone already): the binding goes alone, if it still names al's owner.
func (s *Store) DeleteIP(ctx context.Context, al records.Allocation) error {
	also := releaseOps(al)
	var guards []clientv3.Cmp
	var bound *records.Binding
	if al.Identity != "" && al.State != records.StateKept {
		b, ok, err := s.GetBinding(ctx, al.Pool, al.Identity)
		if err != nil {
			return err
		}
		if ok && !b.Kept() && b.Owner.Key() == al.Owner.Key() {
			key := BindingKey(al.Pool, al.Identity)
			bound = &b
			guards = append(guards, kvstore.Unchanged(key, b.Rev))
			also = append(also, clientv3.OpDelete(key))
		}
	}
	deleted, err := s.deleteWithHistory(ctx, IPKey(al.Pool, al.Block, al.Addr), al.Rev, HistoryOf(al, s.now(), EndReleased), guards, also...)
	if err != nil || deleted || bound == nil {
		return err
	}
	// The key was gone already: the binding names a container that holds
	// nothing there.
	err = s.DropStaleBinding(ctx, *bound, []records.IPRef{{Pool: al.Pool, Block: al.Block, Addr: al.Addr}}, nil)
	if errors.Is(err, retry.ErrConflict) {
		return nil // changed meanwhile: someone else's now
	}
	return err
}

// releaseOps are what goes with an allocation's key when it is released:
// a borrowed address's home.
func releaseOps(al records.Allocation) []clientv3.Op {
	if al.Borrowed {
		return []clientv3.Op{clientv3.OpDelete(LentKey(al.Pool, al.Addr))}
	}
	return nil
}
