package agent

import (
	"maps"
	"net/netip"
	"sync"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// mirror is a map the agent keeps from a watch of etcd records (namespace
// bindings, block homes, node addresses): the one copy a part reads. A
// watch's handler fills it; listed says whether a full list has come in
// yet. It is safe for concurrent use.
type mirror[K comparable, V any] struct {
	mu     sync.RWMutex
	m      map[K]V
	listed bool
}

// byKey indexes a full list of records by their key, as a mirror holds
// them.
func byKey[T any, K comparable, V any](list []T, kv func(T) (K, V)) map[K]V {
	out := make(map[K]V, len(list))
	for _, x := range list {
		k, v := kv(x)
		out[k] = v
	}
	return out
}

// reset replaces the whole map with a full list's.
func (m *mirror[K, V]) reset(all map[K]V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.m, m.listed = all, true
}

// merge puts every entry of a full list, keeping entries the list lacks
// (node addresses outlive their record).
func (m *mirror[K, V]) merge(all map[K]V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.m == nil {
		m.m = map[K]V{}
	}
	maps.Copy(m.m, all)
	m.listed = true
}

func (m *mirror[K, V]) put(k K, v V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.m == nil {
		m.m = map[K]V{}
	}
	m.m[k] = v
}

func (m *mirror[K, V]) del(k K) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.m, k)
}

func (m *mirror[K, V]) get(k K) (V, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	v, ok := m.m[k]
	return v, ok
}

// snapshot is a copy of the map, and whether a full list is in.
func (m *mirror[K, V]) snapshot() (map[K]V, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return maps.Clone(m.m), m.listed
}

// homesMirror mirrors the block homes of every pool (a block, or a lent
// address as a host prefix, to its home node) from a watch of homes, and
// kicks its owner's loop on every change: the peer router and the BGP
// announcer follow homes through one.
type homesMirror struct {
	homes mirror[netip.Prefix, string]
	kick  chan<- struct{}
}

func (w *homesMirror) Reset(homes []etcdstore.BlockHome) {
	w.homes.reset(byKey(homes, func(h etcdstore.BlockHome) (netip.Prefix, string) { return h.Block, h.Node }))
	kick(w.kick)
}

func (w *homesMirror) Put(h etcdstore.BlockHome) {
	w.homes.put(h.Block, h.Node)
	kick(w.kick)
}

func (w *homesMirror) Delete(h etcdstore.BlockHome) {
	w.homes.del(h.Block)
	kick(w.kick)
}

// kick wakes a loop that waits on ch, unless it is already woken.
func kick(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
