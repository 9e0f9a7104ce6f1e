package agent

import (
	"context"
	"sync"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// nsBindings mirrors the namespace bindings in etcd (a namespace's default
// pool, kvipamctl pool bind-namespace) for the allocate handler. It is
// safe for concurrent use.
type nsBindings struct {
	mu   sync.RWMutex
	pool map[string]string // namespace -> pool
}

// bindingSource is where the bindings come from (etcdstore.Store).
type bindingSource interface {
	WatchBindings(ctx context.Context, h etcdstore.BindingsHandler) error
}

func newNSBindings() *nsBindings { return &nsBindings{pool: map[string]string{}} }

// run follows the bindings until ctx ends.
func (b *nsBindings) run(ctx context.Context, src bindingSource) { _ = src.WatchBindings(ctx, b) }

// poolFor is namespace ns's bound pool, or "".
func (b *nsBindings) poolFor(ns string) string {
	if ns == "" {
		return ""
	}
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.pool[ns]
}

func (b *nsBindings) ResetBindings(bs []etcdstore.NamespaceBinding) {
	b.mu.Lock()
	defer b.mu.Unlock()
	clear(b.pool)
	for _, x := range bs {
		b.pool[x.Namespace] = x.Pool
	}
}

func (b *nsBindings) PutBinding(x etcdstore.NamespaceBinding) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pool[x.Namespace] = x.Pool
}

func (b *nsBindings) DeleteBinding(ns string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.pool, ns)
}
