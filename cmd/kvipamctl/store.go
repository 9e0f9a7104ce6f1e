package main

import (
	"context"
	"net/netip"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// What kvipamctl's commands ask of the etcd store, one small interface per
// group of commands; each command and helper takes the one it uses.
// *etcdstore.Store implements all of them.

// poolWriter creates, changes and deletes pools (pool create, pool
// reserve/disable/add-cidr/... and pool delete).
type poolWriter interface {
	EnsurePool(ctx context.Context, p allocator.Pool) (allocator.Pool, error)
	UpdatePool(ctx context.Context, name string, change func(p *allocator.Pool) error) (allocator.Pool, error)
	RemoveCIDR(ctx context.Context, name string, cidr netip.Prefix, dropReserved bool) (allocator.Pool, error)
	CIDRUse(ctx context.Context, pool string, cidr netip.Prefix) (etcdstore.CIDRUse, error)
	DeletePool(ctx context.Context, name string) error
}

// nodeLister reads the live nodes' records (pool show and select, pool
// bind-namespace: which nodes serve a pool now).
type nodeLister interface {
	ListNodes(ctx context.Context) ([]etcdstore.NodeRecord, error)
	GetPool(ctx context.Context, name string) (allocator.Pool, error)
}

// exhaustionReader reads what pool show needs to say why a family has no
// address left.
type exhaustionReader interface {
	PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error)
	records.LeaseReader
}

// namespaceBinder keeps the namespaces' default pools (pool
// bind-namespace, unbind-namespace, bindings).
type namespaceBinder interface {
	BindNamespace(ctx context.Context, ns, pool string) error
	UnbindNamespace(ctx context.Context, ns string) error
	NamespaceBindings(ctx context.Context) ([]etcdstore.NamespaceBinding, error)
}

// stickyStore reads and releases sticky identities' bindings (claim list,
// show, release).
type stickyStore interface {
	ListBindings(ctx context.Context, pool string) ([]records.Binding, error)
	GetBinding(ctx context.Context, pool, identity string) (records.Binding, bool, error)
	ReleaseBinding(ctx context.Context, pool, identity string) ([]netip.Addr, error)
	// CutOverIdentity is kvipamctl ip migrate --cut-over.
	CutOverIdentity(ctx context.Context, pool, identity string) (records.Binding, error)
	records.LeaseReader
}

// historyReader reads IP history (history).
type historyReader interface {
	History(ctx context.Context, f etcdstore.HistoryFilter) ([]etcdstore.HistoryRecord, error)
}

// operatorStore is every method above: what withStore hands a command,
// which passes on only the interface its helpers take.
type operatorStore interface {
	poolWriter
	nodeLister
	exhaustionReader
	namespaceBinder
	stickyStore
	historyReader
	schemaReader
	downgrader
}

var _ operatorStore = (*etcdstore.Store)(nil)
