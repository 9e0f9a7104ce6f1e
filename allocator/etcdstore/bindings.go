package etcdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
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
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// BindNamespace makes pool the default pool of namespace ns, in one
// transaction that requires the pool to exist (else ErrPoolNotFound). A
// binding ns has is rewritten from the one read (what a newer version
// wrote in it stays), if unchanged since.
func (s *Store) BindNamespace(ctx context.Context, ns, pool string) error {
	if ns == "" || strings.ContainsAny(ns, "/ ") {
		return fmt.Errorf("%w: namespace %q", records.ErrBadRequest, ns)
	}
	key := namespaceBindingKey(ns)
	return retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
		var b NamespaceBinding
		same := kvstore.Absent(key)
		v, err := kvstore.GetJSON[NamespaceBinding](ctx, s.kv, key)
		switch {
		case errors.Is(err, kvstore.ErrNotFound):
		case errors.Is(err, retry.ErrUnavailable):
			return fmt.Errorf("bind namespace %s: %w", ns, err)
		case err != nil: // unreadable (written by hand): replaced
			same = kvstore.Unchanged(key, v.ModRevision)
		default:
			b, same = v.Value, kvstore.Unchanged(key, v.ModRevision)
		}
		b.Pool, b.Since = pool, s.now().UTC()
		val, err := kvstore.EncodeJSON(b)
		if err != nil {
			return err
		}
		pk := PoolKey(pool)
		resp, err := s.kv.Txn(ctx).If(kvstore.Exists(pk), same).
			Then(clientv3.OpPut(key, val)).Else(clientv3.OpGet(pk, clientv3.WithCountOnly())).Commit()
		switch {
		case err != nil:
			return fmt.Errorf("bind namespace %s: %w", ns, kvstore.Unavailable(err))
		case resp.Succeeded:
			return nil
		case resp.Responses[0].GetResponseRange().Count == 0:
			return fmt.Errorf("bind namespace %s to pool %s: %w", ns, pool, records.ErrPoolNotFound)
		}
		return fmt.Errorf("bind namespace %s: its binding changed meanwhile: %w", ns, retry.ErrConflict)
	})
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
