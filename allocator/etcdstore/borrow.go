package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// FenceBorrower implements records.Store. The fence is created on the
// node's lease; a fence of this node on an older lease (the agent
// restarted within the TTL) is moved to the new one.
func (s *Store) FenceBorrower(ctx context.Context, c records.Claim, lease int64) (int64, error) {
	key := borrowerKey(c.Node)
	val, err := kvstore.EncodeJSON(c)
	if err != nil {
		return 0, err
	}
	put := clientv3.OpPut(key, val, clientv3.WithLease(clientv3.LeaseID(lease)))
	for range 3 {
		resp, err := s.kv.Txn(ctx).If(kvstore.Absent(key)).Then(put).Else(clientv3.OpGet(key)).Commit()
		if err != nil {
			return 0, fmt.Errorf("borrow fence of node %s: %w", c.Node, leaseErr(kvstore.Unavailable(err)))
		}
		if resp.Succeeded {
			return resp.Header.Revision, nil
		}
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			continue // expired between the compare and the read
		}
		if kvs[0].Lease == lease {
			return kvs[0].ModRevision, nil // our own write, answer lost
		}
		moved, err := movedFence(c, kvs[0], lease)
		if err != nil {
			return 0, err
		}
		resp, err = s.kv.Txn(ctx).If(kvstore.Unchanged(key, kvs[0].ModRevision)).Then(moved).Commit()
		if err != nil {
			return 0, fmt.Errorf("borrow fence of node %s: %w", c.Node, leaseErr(kvstore.Unavailable(err)))
		}
		if resp.Succeeded {
			return resp.Header.Revision, nil
		}
	}
	return 0, fmt.Errorf("borrow fence of node %s: changed concurrently: %w", c.Node, retry.ErrConflict)
}

// movedFence is the put that moves the fence held, of an older lease of
// the node, to lease: c, with what a newer version wrote in the fence.
func movedFence(c records.Claim, held *mvccpb.KeyValue, lease int64) (clientv3.Op, error) {
	if v, err := kvstore.Decode[records.Claim](held); err == nil {
		c.Unknown = v.Value.Unknown
	}
	val, err := kvstore.EncodeJSON(c)
	if err != nil {
		return clientv3.Op{}, err
	}
	return clientv3.OpPut(string(held.Key), val, clientv3.WithLease(clientv3.LeaseID(lease))), nil
}

// lentHomes reads the homes at keys (LentKey), in one round trip, for
// writes that rewrite them: a home is rewritten from the one read, so
// what a newer version wrote in it stays. A home absent, or unreadable,
// is missing from the map. The home changes only with its allocation,
// whose revision those writes compare.
func (s *Store) lentHomes(ctx context.Context, keys []string) (map[string]records.Home, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	gets := make([]clientv3.Op, len(keys))
	for i, k := range keys {
		gets[i] = clientv3.OpGet(k)
	}
	resp, err := s.kv.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return nil, fmt.Errorf("read %d lent homes: %w", len(keys), kvstore.Unavailable(err))
	}
	out := map[string]records.Home{}
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			if v, err := kvstore.Decode[records.Home](kv); err == nil {
				out[string(kv.Key)] = v.Value
			}
		}
	}
	return out, nil
}

// ListLent implements records.Store.
func (s *Store) ListLent(ctx context.Context, pool string) (map[netip.Addr]string, error) {
	resp, err := s.kv.Get(ctx, LentPrefix(pool), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list lent addresses of pool %s: %w", pool, kvstore.Unavailable(err))
	}
	out := map[netip.Addr]string{}
	for _, kv := range resp.Kvs {
		if addr, node, ok := decodeLent(pool, string(kv.Key), kv.Value); ok {
			out[addr] = node
		}
	}
	return out, nil
}

func decodeLent(pool, key string, val []byte) (netip.Addr, string, bool) {
	rest, ok := strings.CutPrefix(key, LentPrefix(pool))
	if !ok {
		return netip.Addr{}, "", false
	}
	addr, err := netip.ParseAddr(rest)
	if err != nil {
		return netip.Addr{}, "", false
	}
	var h records.Home
	if json.Unmarshal(val, &h) != nil {
		h.Node = unknownNode
	}
	return addr, h.Node, true
}

// PoolSnapshot implements records.Store: claims, homes (block and lent)
// and the allocation keys, without their values, in one transaction.
func (s *Store) PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error) {
	resp, err := s.kv.Txn(ctx).Then(
		clientv3.OpGet(ClaimsPrefix(pool), clientv3.WithPrefix()),
		clientv3.OpGet(HomesPrefix(pool), clientv3.WithPrefix()),
		clientv3.OpGet(IPsPrefix(pool), clientv3.WithPrefix(), clientv3.WithKeysOnly()),
	).Commit()
	if err != nil {
		return records.PoolSnapshot{}, fmt.Errorf("read pool %s: %w", pool, kvstore.Unavailable(err))
	}
	snap := records.PoolSnapshot{Rev: resp.Header.Revision, Used: map[netip.Prefix][]records.UsedAddr{}, Lent: map[netip.Addr]string{}}
	snap.Blocks = blockInfos(pool, resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs)
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		if addr, node, ok := decodeLent(pool, string(kv.Key), kv.Value); ok {
			snap.Lent[addr] = node
		}
	}
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		b, addr, err := parseIPKey(pool, string(kv.Key))
		if err != nil {
			continue
		}
		snap.Used[b] = append(snap.Used[b], records.UsedAddr{Addr: addr, Lease: kv.Lease})
	}
	return snap, nil
}
