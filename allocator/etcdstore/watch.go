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
	"github.com/kvipam/kvipam/allocator/schema"
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
	// Rev is the revision the home was written at (0 for a deleted one).
	Rev int64
}

// Handler follows a watched prefix of records of type T (homes, node
// records, namespace bindings, pool specs). Reset replaces everything
// known with all: at start, and whenever the watch had to list again (a
// compaction, a restore); a record that went while the watch could not see
// it gets no Delete, it is simply not in all. Put is a record written or
// changed; Delete one that went, with only the fields its key names set.
// Calls come from one goroutine.
type Handler[T any] interface {
	Reset(all []T)
	Put(v T)
	Delete(v T)
}

// NodeInfo is a node record as other nodes use it.
type NodeInfo struct {
	Name      string
	Addresses []netip.Addr
	// Level is the schema level of the features it names (NodeLevel).
	Level schema.Level
}

// WatchHomes lists every block home, then follows the changes until ctx
// ends, listing again whenever the watch cannot resume. It returns ctx's
// error. Homes whose key or value cannot be read are skipped.
// A deleted home names its pool, block (or lent address) and Lent, not
// its node.
func (s *Store) WatchHomes(ctx context.Context, h Handler[BlockHome]) error {
	return s.follow(ctx, AllHomesPrefix(), decoded[BlockHome]{h: h, decode: decodeHome, fromKey: func(key string) (BlockHome, bool) {
		pool, b, lent, ok := parseHomeKey(key)
		return BlockHome{Pool: pool, Block: b, Lent: lent}, ok
	}})
}

// WatchNodes lists the node records, then follows the changes until ctx
// ends, as WatchHomes does. A record goes when its node's lease ends; the
// deleted one names only the node.
func (s *Store) WatchNodes(ctx context.Context, h Handler[NodeInfo]) error {
	return s.follow(ctx, nodesPrefix(), decoded[NodeInfo]{h: h, decode: decodeNodeInfo, fromKey: func(key string) (NodeInfo, bool) {
		return NodeInfo{Name: strings.TrimPrefix(key, nodesPrefix())}, true
	}})
}

// WatchNode follows one node's record as WatchNodes follows them all,
// each record as etcd holds it (its Lease the lease its key is on). An
// unreadable record is skipped; a deleted one names only the node.
func (s *Store) WatchNode(ctx context.Context, node string, h Handler[NodeRecord]) error {
	key := NodeKey(node)
	// The watch is of key as a prefix (the one kind follow has): the
	// records of nodes whose names key prefixes are dropped.
	return s.follow(ctx, key, decoded[NodeRecord]{h: h,
		decode: func(kv *mvccpb.KeyValue) (NodeRecord, bool) {
			r, err := heldNode(kv)
			return r, err == nil && string(kv.Key) == key
		},
		fromKey: func(k string) (NodeRecord, bool) { return NodeRecord{Name: node}, k == key },
	})
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

// decoded follows a prefix of decoded records for a Handler: decode turns
// a key and value into a record, fromKey a deleted key into the record's
// key fields (false: unreadable, skipped).
type decoded[T any] struct {
	h       Handler[T]
	decode  func(*mvccpb.KeyValue) (T, bool)
	fromKey func(key string) (T, bool)
}

func (w decoded[T]) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	var out []T
	for _, kv := range kvs {
		if v, ok := w.decode(kv); ok {
			out = append(out, v)
		}
	}
	w.h.Reset(out)
}

func (w decoded[T]) Apply(ev *clientv3.Event) {
	if ev.Type == clientv3.EventTypeDelete {
		if v, ok := w.fromKey(string(ev.Kv.Key)); ok {
			w.h.Delete(v)
		}
		return
	}
	if v, ok := w.decode(ev.Kv); ok {
		w.h.Put(v)
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
	return BlockHome{Pool: pool, Block: b, Node: h.Node, Lent: lent, Rev: kv.ModRevision}, true
}

func decodeNodeInfo(kv *mvccpb.KeyValue) (NodeInfo, bool) {
	var r NodeRecord
	if json.Unmarshal(kv.Value, &r) != nil {
		return NodeInfo{}, false
	}
	n := NodeInfo{Name: strings.TrimPrefix(string(kv.Key), nodesPrefix()), Level: NodeLevel(r)}
	for _, s := range r.Addresses {
		if a, err := netip.ParseAddr(s); err == nil {
			n.Addresses = append(n.Addresses, a)
		}
	}
	return n, true
}

// WatchPools lists the pools, then follows the changes until ctx ends,
// as WatchHomes does. Each pool carries the revision it was written at.
// A deleted pool names only its Name. A pool is handed on as decoded,
// valid or not, as ListPools reads it: the node allocator refuses an
// invalid spec and says why, where skipping it here would read as a
// deleted pool.
func (s *Store) WatchPools(ctx context.Context, h Handler[allocator.Pool]) error {
	return s.follow(ctx, PoolsPrefix(), decoded[allocator.Pool]{h: h, decode: decodePool, fromKey: func(key string) (allocator.Pool, bool) {
		return allocator.Pool{Name: strings.TrimPrefix(key, PoolsPrefix())}, true
	}})
}

func decodePool(kv *mvccpb.KeyValue) (allocator.Pool, bool) {
	v, err := kvstore.Decode[allocator.Pool](kv)
	if err != nil {
		return allocator.Pool{}, false
	}
	v.Value.Rev = kv.ModRevision
	return v.Value, true
}
