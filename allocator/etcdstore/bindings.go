package etcdstore

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
)

// Namespace bindings: a Kubernetes namespace's default pool. The runtime
// passes no namespace annotations to CNI and kvipam reads no Kubernetes
// API, so the binding is kept in etcd (kvipamctl pool bind-namespace) and
// every agent follows it with a watch.

// NamespaceBinding is one namespace's default pool.
type NamespaceBinding struct {
	Namespace string    `json:"-"`
	Pool      string    `json:"pool"`
	Since     time.Time `json:"since"`
}

// BindNamespace makes pool the default pool of namespace ns, in one
// transaction that requires the pool to exist (else ErrPoolNotFound).
func (s *Store) BindNamespace(ctx context.Context, ns, pool string) error {
	if ns == "" || strings.ContainsAny(ns, "/ ") {
		return fmt.Errorf("%w: namespace %q", records.ErrBadRequest, ns)
	}
	val, err := kvstore.EncodeJSON(NamespaceBinding{Pool: pool, Since: s.now().UTC()})
	if err != nil {
		return err
	}
	resp, err := s.kv.Txn(ctx).If(clientv3.Compare(clientv3.Version(PoolKey(pool)), ">", 0)).
		Then(clientv3.OpPut(namespaceBindingKey(ns), val)).Commit()
	if err != nil {
		return fmt.Errorf("bind namespace %s: %w", ns, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return fmt.Errorf("bind namespace %s to pool %s: %w", ns, pool, records.ErrPoolNotFound)
	}
	return nil
}

// UnbindNamespace removes ns's binding; none is not an error.
func (s *Store) UnbindNamespace(ctx context.Context, ns string) error {
	if _, err := s.kv.Delete(ctx, namespaceBindingKey(ns)); err != nil {
		return fmt.Errorf("unbind namespace %s: %w", ns, kvstore.Unavailable(err))
	}
	return nil
}

// NamespaceBindings lists every binding, by namespace.
func (s *Store) NamespaceBindings(ctx context.Context) ([]NamespaceBinding, error) {
	resp, err := s.kv.Get(ctx, namespaceBindingsPrefix(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("list namespace bindings: %w", kvstore.Unavailable(err))
	}
	var out []NamespaceBinding
	for _, kv := range resp.Kvs {
		if b, ok := decodeBinding(kv); ok {
			out = append(out, b)
		}
	}
	return out, nil
}

// WatchBindings lists the namespace bindings, then follows the changes
// until ctx ends, as WatchHomes does. A deleted binding names only its
// Namespace.
func (s *Store) WatchBindings(ctx context.Context, h Handler[NamespaceBinding]) error {
	return s.follow(ctx, namespaceBindingsPrefix(), decoded[NamespaceBinding]{h: h, decode: decodeBinding, fromKey: func(key string) (NamespaceBinding, bool) {
		return NamespaceBinding{Namespace: strings.TrimPrefix(key, namespaceBindingsPrefix())}, true
	}})
}

func decodeBinding(kv *mvccpb.KeyValue) (NamespaceBinding, bool) {
	var b NamespaceBinding
	if json.Unmarshal(kv.Value, &b) != nil || b.Pool == "" {
		return NamespaceBinding{}, false
	}
	b.Namespace = strings.TrimPrefix(string(kv.Key), namespaceBindingsPrefix())
	return b, true
}
