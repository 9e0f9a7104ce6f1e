package agent

import (
	"context"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/foundation/mirror"
)

// nsBindings mirrors the namespace bindings in etcd (a namespace's default
// pool, kvipamctl pool bind-namespace) for the allocate handler. It is
// safe for concurrent use.
type nsBindings struct {
	pool mirror.Map[string, string] // namespace -> pool
}

// bindingSource is where the bindings come from (etcdstore.Store).
type bindingSource interface {
	WatchBindings(ctx context.Context, h etcdstore.Handler[etcdstore.NamespaceBinding]) error
}

func newNSBindings() *nsBindings { return &nsBindings{} }

// run follows the bindings until ctx ends.
func (b *nsBindings) run(ctx context.Context, src bindingSource) { _ = src.WatchBindings(ctx, b) }

// poolFor is namespace ns's bound pool, or "".
func (b *nsBindings) poolFor(ns string) string {
	if ns == "" {
		return ""
	}
	p, _ := b.pool.Get(ns)
	return p
}

func (b *nsBindings) Reset(bs []etcdstore.NamespaceBinding) {
	b.pool.Reset(mirror.ByKey(bs, func(x etcdstore.NamespaceBinding) (string, string) { return x.Namespace, x.Pool }))
}

func (b *nsBindings) Put(x etcdstore.NamespaceBinding) { b.pool.Put(x.Namespace, x.Pool) }

func (b *nsBindings) Delete(x etcdstore.NamespaceBinding) { b.pool.Del(x.Namespace) }
