package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// ListBlocks implements records.Store. Claims and homes are read in one
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

// GetBlocks implements records.Store: the claims and homes of blocks,
// read as GetIPs reads allocations (one transaction for up to maxTxnOps
// keys). It is how a claim whose outcome is unknown is settled.
func (s *Store) GetBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	return s.getBlocks(ctx, pool, blocks)
}

// PeekBlocks implements records.Store: GetBlocks's read, serializable.
// The member asked answers from what it has applied, without the
// consensus round (a read index) a linearizable read waits for, which
// behind an apply backlog is the backlog's length.
func (s *Store) PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	return s.getBlocks(ctx, pool, blocks, clientv3.WithSerializable())
}

func (s *Store) getBlocks(ctx context.Context, pool string, blocks []netip.Prefix, opts ...clientv3.OpOption) (map[netip.Prefix]records.BlockInfo, error) {
	keys := make([]string, 0, 2*len(blocks))
	for _, b := range blocks {
		keys = append(keys, ClaimKey(pool, b), HomeKey(pool, b))
	}
	got, _, err := s.getKeys(ctx, keys, opts...)
	if err != nil {
		return nil, fmt.Errorf("read %d blocks of pool %s: %w", len(blocks), pool, err)
	}
	var claims, homes []*mvccpb.KeyValue
	for i := range blocks {
		if kv := got[keys[2*i]]; kv != nil {
			claims = append(claims, kv)
		}
		if kv := got[keys[2*i+1]]; kv != nil {
			homes = append(homes, kv)
		}
	}
	out := map[netip.Prefix]records.BlockInfo{}
	for _, bi := range blockInfos(pool, claims, homes) {
		out[bi.Block] = bi
	}
	return out, nil
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
			c = records.Claim{Node: unknownNode}
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
			h = records.Home{Node: unknownNode}
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

// unknownNode stands for the owner of a claim or home whose value cannot
// be decoded.
const unknownNode = "?"

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

// Claim implements records.Store: one transaction, "claim absent and
// block empty", that writes the claim on the node's lease and the home,
// and the block's first allocation if c has one (records.Claim.First), a
// reservation on the shared reservation lease.
func (s *Store) Claim(ctx context.Context, pool string, b netip.Prefix, c records.Claim, lease int64) (records.WriteResult, error) {
	var res records.WriteResult
	ck, hk, ips := ClaimKey(pool, b), HomeKey(pool, b), BlockIPsPrefix(pool, b)
	claim, err := kvstore.EncodeJSON(c)
	if err != nil {
		return res, err
	}
	home, err := kvstore.EncodeJSON(records.Home{Node: c.Node, Since: c.ClaimedAt})
	if err != nil {
		return res, err
	}
	puts := []clientv3.Op{clientv3.OpPut(ck, claim, clientv3.WithLease(clientv3.LeaseID(lease))), clientv3.OpPut(hk, home)}
	var resLease clientv3.LeaseID
	if w := c.First; w != nil {
		s.hist.Ahead() // its release's history lease, ahead (HistoryRecorder.Ahead)
		if w.Block != b || w.Pool != pool || !b.Contains(w.Addr) || w.Borrowed || w.PrevRev != 0 {
			return res, fmt.Errorf("%w: claim block %s of pool %s: the first allocation %s of pool %s block %s must be a new one of the block", records.ErrBadRequest, b, pool, w.Addr, w.Pool, w.Block)
		}
		rec, err := kvstore.EncodeJSON(w.Record)
		if err != nil {
			return res, err
		}
		var opts []clientv3.OpOption
		if w.Reserve {
			if resLease, res.Expires, err = s.res.get(ctx); err != nil {
				return res, err
			}
			opts = append(opts, clientv3.WithLease(resLease))
		}
		// The block is empty (PrefixEmpty below): the address is free.
		puts = append(puts, clientv3.OpPut(IPKey(pool, b, w.Addr), rec, opts...))
	}
	cmps := []clientv3.Cmp{kvstore.Absent(ck), kvstore.PrefixEmpty(ips)}
	if c.PoolRev != 0 {
		// The spec the claimant read is still the pool's: no cidr of
		// it was removed, the pool was not deleted.
		cmps = append(cmps, kvstore.Unchanged(PoolKey(pool), c.PoolRev))
	}
	resp, err := s.claims.Txn(ctx).
		If(cmps...).
		Then(puts...).
		Else(claimReads(pool, b)...).
		Commit()
	if s.reservationLeaseGone(ctx, err, resLease, false) {
		return records.WriteResult{}, fmt.Errorf("claim block %s of pool %s: reservation lease gone: %w", b, pool, retry.ErrConflict)
	}
	if err != nil {
		return records.WriteResult{}, fmt.Errorf("claim block %s of pool %s: %w", b, pool, leaseErr(kvstore.Unavailable(err)))
	}
	if resp.Succeeded {
		res.Rev = resp.Header.Revision
		return res, nil
	}
	return records.WriteResult{}, claimError(b, resp, c.PoolRev)
}

// claimReads are a claim transaction's Else reads, which claimError
// explains: the claim, the block's allocation count, the home.
func claimReads(pool string, b netip.Prefix) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(ClaimKey(pool, b)),
		clientv3.OpGet(BlockIPsPrefix(pool, b), clientv3.WithPrefix(), clientv3.WithCountOnly()),
		clientv3.OpGet(HomeKey(pool, b)),
		clientv3.OpGet(PoolKey(pool), clientv3.WithKeysOnly()),
	}
}

// claimError explains a failed claim from claimReads.
func claimError(b netip.Prefix, resp *clientv3.TxnResponse, poolRev int64) error {
	ce := &records.ClaimError{Block: b}
	if poolRev != 0 {
		kvs := resp.Responses[3].GetResponseRange().Kvs
		ce.PoolChanged = len(kvs) == 0 || kvs[0].ModRevision != poolRev
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if v, err := kvstore.Decode[records.Claim](kvs[0]); err == nil {
			ce.ClaimedBy = v.Value.Node
		} else {
			ce.ClaimedBy = unknownNode
		}
		ce.ClaimRev, ce.ClaimLease = kvs[0].ModRevision, kvs[0].Lease
	}
	ce.NonEmpty = resp.Responses[1].GetResponseRange().Count > 0
	if kvs := resp.Responses[2].GetResponseRange().Kvs; len(kvs) > 0 {
		if v, err := kvstore.Decode[records.Home](kvs[0]); err == nil {
			ce.HomeNode = v.Value.Node
		}
	}
	return ce
}

// Reclaim implements records.Store. The home must still be c.Node's at
// prev.HomeRev; the claim must be absent (orphaned block) or unchanged since
// prev (this node's claim on an older lease).
func (s *Store) Reclaim(ctx context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	b := prev.Block
	if prev.Home == nil || prev.Home.Node != c.Node {
		return 0, fmt.Errorf("reclaim block %s: home is not node %s: %w", b, c.Node, records.ErrNotOwned)
	}
	ck, hk := ClaimKey(pool, b), HomeKey(pool, b)
	if prev.Claim != nil {
		// The claim is rewritten: what a newer version wrote in it stays.
		c.Unknown = prev.Claim.Unknown
	}
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
	return 0, claimError(b, resp, 0)
}

// leaseErr marks a write refused for a lease etcd no longer has: the node
// lease expired before the node noticed.
func leaseErr(err error) error {
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return errors.Join(records.ErrLeaseLost, err)
	}
	return err
}

// Unclaim implements records.Store.
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
		return fmt.Errorf("release block %s of pool %s: claim changed or block not empty: %w", b, pool, retry.ErrConflict)
	}
	return nil
}
