package etcdstore

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// BlockHome is one block's home: the node the block belongs to. A lent
// address (borrowed into another node's block) has a home of its own,
// whose Block is the address as a host prefix (/32, /128): routing the
// longest prefix sends it to its holder.
type BlockHome struct {
	Pool  string
	Block netip.Prefix
	Node  string
	// Lent marks a lent address's home; Block is then a host prefix.
	Lent bool
}

// HomesHandler follows the block homes of every pool. Calls come from one
// goroutine.
type HomesHandler interface {
	// ResetHomes replaces everything known with homes: at start, and
	// whenever the watch had to list again (a compaction, a restore).
	ResetHomes(homes []BlockHome)
	// PutHome records a home written or changed.
	PutHome(h BlockHome)
	// DeleteHome forgets the home of a block or lent address (Node is
	// not known).
	DeleteHome(h BlockHome)
}

// NodeInfo is a node record as other nodes use it.
type NodeInfo struct {
	Name      string
	Addresses []netip.Addr
}

// NodesHandler follows the node records. Calls come from one goroutine.
type NodesHandler interface {
	// ResetNodes gives every live node record: at start, and whenever the
	// watch had to list again. A record that went while the watch could
	// not see it gets no DeleteNode; it is simply not in nodes.
	ResetNodes(nodes []NodeInfo)
	// PutNode records a node record written or changed.
	PutNode(n NodeInfo)
	// DeleteNode is called when a record goes (its lease ended).
	DeleteNode(name string)
}

// WatchHomes lists every block home, then follows the changes until ctx
// ends, listing again whenever the watch cannot resume. It returns ctx's
// error. Homes whose key or value cannot be read are skipped.
func (s *Store) WatchHomes(ctx context.Context, h HomesHandler) error {
	return s.follow(ctx, AllHomesPrefix(), decoded[BlockHome]{decode: decodeHome, reset: h.ResetHomes, put: h.PutHome,
		del: func(key string) {
			if pool, b, lent, ok := parseHomeKey(key); ok {
				h.DeleteHome(BlockHome{Pool: pool, Block: b, Lent: lent})
			}
		}})
}

// WatchNodes lists the node records, then follows the changes until ctx
// ends, as WatchHomes does.
func (s *Store) WatchNodes(ctx context.Context, h NodesHandler) error {
	return s.follow(ctx, NodesPrefix(), decoded[NodeInfo]{decode: decodeNodeInfo, reset: h.ResetNodes, put: h.PutNode,
		del: func(key string) { h.DeleteNode(strings.TrimPrefix(key, NodesPrefix())) }})
}

// follow lists prefix and watches it from the list's revision, again and
// again until ctx ends; a failed list is retried after a second.
func (s *Store) follow(ctx context.Context, prefix string, h kvstore.WatchHandler) error {
	for ctx.Err() == nil {
		resp, err := s.cli.Get(ctx, prefix, clientv3.WithPrefix())
		if err == nil {
			h.Reset(resp.Kvs, resp.Header.Revision)
			_ = kvstore.Watch(ctx, s.cli, prefix, resp.Header.Revision+1, h)
			continue
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return ctx.Err()
}

// decoded follows a prefix of decoded records for a handler: decode
// turns a key into a record (false: unreadable, skipped), and a deleted
// key goes to del.
type decoded[T any] struct {
	decode func(*mvccpb.KeyValue) (T, bool)
	reset  func([]T)
	put    func(T)
	del    func(key string)
}

func (w decoded[T]) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	var out []T
	for _, kv := range kvs {
		if v, ok := w.decode(kv); ok {
			out = append(out, v)
		}
	}
	w.reset(out)
}

func (w decoded[T]) Apply(ev *clientv3.Event) {
	if ev.Type == clientv3.EventTypeDelete {
		w.del(string(ev.Kv.Key))
		return
	}
	if v, ok := w.decode(ev.Kv); ok {
		w.put(v)
	}
}

// parseHomeKey reads a block's home key, or a lent address's (lent), whose
// address it gives as a host route.
func parseHomeKey(key string) (pool string, b netip.Prefix, lent, ok bool) {
	k, err := ParseKey(key)
	switch {
	case err != nil:
		return "", netip.Prefix{}, false, false
	case k.Kind == KeyLent:
		return k.Pool, netip.PrefixFrom(k.Addr, k.Addr.BitLen()), true, true
	case k.Kind == KeyHome:
		return k.Pool, k.Block, false, true
	}
	return "", netip.Prefix{}, false, false
}

func decodeHome(kv *mvccpb.KeyValue) (BlockHome, bool) {
	pool, b, lent, ok := parseHomeKey(string(kv.Key))
	if !ok {
		return BlockHome{}, false
	}
	var h records.Home
	if json.Unmarshal(kv.Value, &h) != nil {
		return BlockHome{}, false
	}
	return BlockHome{Pool: pool, Block: b, Node: h.Node, Lent: lent}, true
}

func decodeNodeInfo(kv *mvccpb.KeyValue) (NodeInfo, bool) {
	var r NodeRecord
	if json.Unmarshal(kv.Value, &r) != nil {
		return NodeInfo{}, false
	}
	n := NodeInfo{Name: strings.TrimPrefix(string(kv.Key), NodesPrefix())}
	for _, s := range r.Addresses {
		if a, err := netip.ParseAddr(s); err == nil {
			n.Addresses = append(n.Addresses, a)
		}
	}
	return n, true
}

// PoolsHandler follows the pool specs. Calls come from one goroutine.
type PoolsHandler interface {
	// ResetPools gives every pool: at start, and whenever the watch had
	// to list again.
	ResetPools(pools []allocator.Pool)
	// PutPool records a pool created or changed.
	PutPool(p allocator.Pool)
	// DeletePool is called when a pool is deleted.
	DeletePool(name string)
}

// WatchPools lists the pools, then follows the changes until ctx ends,
// as WatchHomes does. Each pool carries the revision it was written at.
func (s *Store) WatchPools(ctx context.Context, h PoolsHandler) error {
	return s.follow(ctx, PoolsPrefix(), decoded[allocator.Pool]{decode: decodePool, reset: h.ResetPools, put: h.PutPool,
		del: func(key string) { h.DeletePool(strings.TrimPrefix(key, PoolsPrefix())) }})
}

func decodePool(kv *mvccpb.KeyValue) (allocator.Pool, bool) {
	v, err := kvstore.Decode[allocator.Pool](kv)
	if err != nil || v.Value.Validate() != nil {
		return allocator.Pool{}, false
	}
	v.Value.Rev = kv.ModRevision
	return v.Value, true
}
