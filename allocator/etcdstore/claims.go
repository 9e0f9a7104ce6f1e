package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// ListBlocks implements allocator.Store. Claims and homes are read in one
// transaction so they describe the same revision.
func (s *Store) ListBlocks(ctx context.Context, pool string) ([]records.BlockInfo, error) {
	resp, err := s.claims.Txn(ctx).Then(
		clientv3.OpGet(ClaimsPrefix(pool), clientv3.WithPrefix()),
		clientv3.OpGet(HomesPrefix(pool), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, fmt.Errorf("list blocks of pool %s: %w", pool, kvstore.Unavailable(err))
	}
	return blockInfos(pool, resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs), nil
}

// blockInfos joins a pool's claims and block homes by block. Lent
// addresses' homes, one level deeper, are not blocks and are skipped.
func blockInfos(pool string, claims, homes []*mvccpb.KeyValue) []records.BlockInfo {
	byBlock := map[netip.Prefix]*records.BlockInfo{}
	var order []netip.Prefix
	get := func(b netip.Prefix) *records.BlockInfo {
		bi, ok := byBlock[b]
		if !ok {
			bi = &records.BlockInfo{Block: b}
			byBlock[b] = bi
			order = append(order, b)
		}
		return bi
	}
	// An undecodable claim or home counts as another node's, so the block
	// is left alone; a key that names no block cannot collide with one.
	for _, kv := range claims {
		b, c, err := decodeBlockKV[records.Claim](kv, ClaimsPrefix(pool))
		if errors.Is(err, errBadBlockKey) {
			continue
		}
		if err != nil {
			c = records.Claim{Node: UnknownNode}
		}
		bi := get(b)
		bi.Claim, bi.ClaimRev, bi.ClaimLease = &c, kv.ModRevision, kv.Lease
	}
	for _, kv := range homes {
		b, h, err := decodeBlockKV[records.Home](kv, HomesPrefix(pool))
		if errors.Is(err, errBadBlockKey) {
			continue
		}
		if err != nil {
			h = records.Home{Node: UnknownNode}
		}
		bi := get(b)
		bi.Home, bi.HomeRev = &h, kv.ModRevision
	}
	out := make([]records.BlockInfo, 0, len(order))
	for _, b := range order {
		out = append(out, *byBlock[b])
	}
	return out
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

// Claim implements allocator.Store: one transaction. Its outer compare
// is "no candidate claimed on this lease" (else it reads the candidates'
// claims: an earlier claim of the caller, whose answer was lost, took
// one); then, for each candidate in turn, "claim absent and block empty"
// writes the claim on the lease, the home and the candidate's first
// allocation if it has one, else reads why (claimReads) and tries the
// next candidate, a transaction nested in the one before.
func (s *Store) Claim(ctx context.Context, pool string, cands []records.Candidate, c records.Claim, lease int64) (records.ClaimResult, error) {
	res := records.ClaimResult{Won: -1}
	if len(cands) == 0 || len(cands) > records.MaxCandidates {
		return res, fmt.Errorf("%w: a claim tries 1 to %d blocks, not %d", records.ErrBadRequest, records.MaxCandidates, len(cands))
	}
	claim, err := kvstore.EncodeJSON(c)
	if err != nil {
		return res, err
	}
	home, err := kvstore.EncodeJSON(records.Home{Node: c.Node, Since: c.ClaimedAt})
	if err != nil {
		return res, err
	}
	var next *clientv3.Op // the transaction of the candidates after this one
	for i := len(cands) - 1; i >= 0; i-- {
		cmps, puts, err := claimOps(pool, cands[i], claim, home, c.PoolRev, lease)
		if err != nil {
			return res, err
		}
		elseOps := claimReads(pool, cands[i].Block)
		if next != nil {
			elseOps = append(elseOps, *next)
		}
		op := clientv3.OpTxn(cmps, puts, elseOps)
		next = &op
	}
	notMine := make([]clientv3.Cmp, len(cands))
	mine := make([]clientv3.Op, len(cands))
	for i, cand := range cands {
		ck := ClaimKey(pool, cand.Block)
		notMine[i] = clientv3.Compare(clientv3.LeaseValue(ck), "!=", lease)
		mine[i] = clientv3.OpGet(ck)
	}
	resp, err := s.claims.Txn(ctx).If(notMine...).Then(*next).Else(mine...).Commit()
	if err != nil {
		return res, fmt.Errorf("claim a block of %d in pool %s: %w", len(cands), pool, leaseErr(kvstore.Unavailable(err)))
	}
	if !resp.Succeeded {
		// Candidates this lease holds: only those are explained.
		var own records.ClaimErrors
		for i, r := range resp.Responses {
			if kvs := r.GetResponseRange().Kvs; len(kvs) > 0 && kvs[0].Lease == lease {
				own = append(own, claimFound(cands[i].Block, kvs[0]))
			}
		}
		res.Lost = own
		return res, own
	}
	t := resp.Responses[0].GetResponseTxn()
	for i := range cands {
		if t.Succeeded {
			res.Won, res.Rev = i, resp.Header.Revision
			return res, nil
		}
		res.Lost = append(res.Lost, claimError(cands[i].Block, t.Responses, c.PoolRev))
		if i+1 < len(cands) {
			t = t.Responses[claimReadKinds].GetResponseTxn()
		}
	}
	return res, records.ClaimErrors(res.Lost)
}

// claimOps are one candidate's compares and writes.
func claimOps(pool string, cand records.Candidate, claim, home string, poolRev, lease int64) ([]clientv3.Cmp, []clientv3.Op, error) {
	b := cand.Block
	ck, hk, ips := ClaimKey(pool, b), HomeKey(pool, b), BlockIPsPrefix(pool, b)
	puts := []clientv3.Op{clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(lease))), clientv3.OpPut(hk, home)}
	if w := cand.First; w != nil {
		if w.Block != b || w.Pool != pool || !b.Contains(w.Addr) || w.Reserve || w.Borrowed || w.PrevRev != 0 {
			return nil, nil, fmt.Errorf("%w: claim block %s of pool %s: the first allocation %s of pool %s block %s must be a new one of the block", records.ErrBadRequest, b, pool, w.Addr, w.Pool, w.Block)
		}
		rec, err := kvstore.EncodeJSON(w.Record)
		if err != nil {
			return nil, nil, err
		}
		// The block is empty (PrefixEmpty below): the address is free.
		puts = append(puts, clientv3.OpPut(IPKey(pool, b, w.Addr), rec))
	}
	cmps := []clientv3.Cmp{kvstore.Absent(ck), kvstore.PrefixEmpty(ips)}
	if poolRev != 0 {
		// The spec the claimant read is still the pool's: no cidr of
		// it was removed, the pool was not deleted.
		cmps = append(cmps, kvstore.Unchanged(PoolKey(pool), poolRev))
	}
	return cmps, puts, nil
}

// claimReadKinds counts claimReads.
const claimReadKinds = 4

// claimReads are a claim transaction's Else reads, which claimError
// explains: the claim, the block's allocation count, the home, the pool.
func claimReads(pool string, b netip.Prefix) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(ClaimKey(pool, b)),
		clientv3.OpGet(BlockIPsPrefix(pool, b), clientv3.WithPrefix(), clientv3.WithCountOnly()),
		clientv3.OpGet(HomeKey(pool, b)),
		clientv3.OpGet(PoolKey(pool), clientv3.WithKeysOnly()),
	}
}

// claimError explains a failed claim from claimReads' responses.
func claimError(b netip.Prefix, rs []*etcdserverpb.ResponseOp, poolRev int64) *records.ClaimError {
	ce := &records.ClaimError{Block: b}
	if kvs := rs[0].GetResponseRange().Kvs; len(kvs) > 0 {
		ce = claimFound(b, kvs[0])
	}
	if poolRev != 0 {
		kvs := rs[3].GetResponseRange().Kvs
		ce.PoolChanged = len(kvs) == 0 || kvs[0].ModRevision != poolRev
	}
	ce.NonEmpty = rs[1].GetResponseRange().Count > 0
	if kvs := rs[2].GetResponseRange().Kvs; len(kvs) > 0 {
		if v, err := kvstore.Decode[records.Home](kvs[0]); err == nil {
			ce.HomeNode = v.Value.Node
		}
	}
	return ce
}

// claimFound explains a claim found on block b.
func claimFound(b netip.Prefix, kv *mvccpb.KeyValue) *records.ClaimError {
	ce := &records.ClaimError{Block: b, ClaimRev: kv.ModRevision, ClaimLease: kv.Lease, ClaimedBy: UnknownNode}
	if v, err := kvstore.Decode[records.Claim](kv); err == nil {
		ce.ClaimedBy = v.Value.Node
	}
	return ce
}

// Reclaim implements allocator.Store. The home must still be c.Node's at
// prev.HomeRev; the claim must be absent (orphaned block) or unchanged since
// prev (this node's claim on an older lease).
func (s *Store) Reclaim(ctx context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	b := prev.Block
	if prev.Home == nil || prev.Home.Node != c.Node {
		return 0, fmt.Errorf("reclaim block %s: home is not node %s: %w", b, c.Node, records.ErrNotOwned)
	}
	ck, hk := ClaimKey(pool, b), HomeKey(pool, b)
	claim, err := kvstore.EncodeJSON(c)
	if err != nil {
		return 0, err
	}
	claimCmp := kvstore.Absent(ck)
	if prev.Claim != nil {
		claimCmp = kvstore.Unchanged(ck, prev.ClaimRev)
	}
	resp, err := s.claims.Txn(ctx).
		If(claimCmp, kvstore.Unchanged(hk, prev.HomeRev)).
		Then(clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(lease)))).
		Else(claimReads(pool, b)...).
		Commit()
	if err != nil {
		return 0, fmt.Errorf("reclaim block %s of pool %s: %w", b, pool, leaseErr(kvstore.Unavailable(err)))
	}
	if resp.Succeeded {
		return resp.Header.Revision, nil
	}
	return 0, claimError(b, resp.Responses, 0)
}

// leaseErr marks a write refused for a lease etcd no longer has: the node
// lease expired before the node noticed.
func leaseErr(err error) error {
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return errors.Join(records.ErrLeaseLost, err)
	}
	return err
}

// Unclaim implements allocator.Store.
func (s *Store) Unclaim(ctx context.Context, pool string, b netip.Prefix, claimRev int64) error {
	ck, hk := ClaimKey(pool, b), HomeKey(pool, b)
	resp, err := s.kv.Txn(ctx).
		If(kvstore.Unchanged(ck, claimRev), kvstore.PrefixEmpty(BlockIPsPrefix(pool, b))).
		Then(clientv3.OpDelete(ck), clientv3.OpDelete(hk)).
		Commit()
	if err != nil {
		return fmt.Errorf("release block %s of pool %s: %w", b, pool, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("release block %s of pool %s: claim changed or block not empty: %w", b, pool, records.ErrConflict)
	}
	return nil
}
