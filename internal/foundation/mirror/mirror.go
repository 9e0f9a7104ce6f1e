// Package mirror is a map kept from a watch of records (namespace
// bindings, block homes, node addresses): the one copy a part reads.
package mirror

import (
	"maps"
	"sync"
)

// Map is a map kept from a watch: a watch's handler fills it; whether a
// full list has come in yet is part of its Snapshot. It is safe for
// concurrent use; the zero Map is empty and not listed.
type Map[K comparable, V any] struct {
	mu     sync.RWMutex
	m      map[K]V
	listed bool
}

// ByKey indexes a full list of records by their key, as a Map holds
// them.
func ByKey[T any, K comparable, V any](list []T, kv func(T) (K, V)) map[K]V {
	out := make(map[K]V, len(list))
	for _, x := range list {
		k, v := kv(x)
		out[k] = v
	}
	return out
}

// Reset replaces the whole map with a full list's.
func (m *Map[K, V]) Reset(all map[K]V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.m, m.listed = all, true
}

// Merge puts every entry of a full list, keeping entries the list lacks
// (node addresses outlive their record).
func (m *Map[K, V]) Merge(all map[K]V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.m == nil {
		m.m = map[K]V{}
	}
	maps.Copy(m.m, all)
	m.listed = true
}

// Put sets one entry.
func (m *Map[K, V]) Put(k K, v V) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.m == nil {
		m.m = map[K]V{}
	}
	m.m[k] = v
}

// Del removes one entry.
func (m *Map[K, V]) Del(k K) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.m, k)
}

// Get is one entry.
func (m *Map[K, V]) Get(k K) (V, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	v, ok := m.m[k]
	return v, ok
}

// Snapshot is a copy of the map, and whether a full list is in.
func (m *Map[K, V]) Snapshot() (map[K]V, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return maps.Clone(m.m), m.listed
}
