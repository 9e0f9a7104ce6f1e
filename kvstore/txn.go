package kvstore

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// ErrNotFound is returned by GetJSON for an absent key.
var ErrNotFound = errors.New("kvstore: key not found")

// Versioned is a decoded value with the revisions that fence later writes.
type Versioned[T any] struct {
	Key         string
	Value       T
	ModRevision int64
	CreateRev   int64
	Lease       clientv3.LeaseID
}

// Decode turns one etcd key-value into a Versioned value. A record that
// embeds jsonkeep.Unknown keeps the members it does not know (a newer
// version's), and EncodeJSON writes them back: a record rewritten from
// the one read loses nothing.
func Decode[T any](kv *mvccpb.KeyValue) (Versioned[T], error) {
	v := Versioned[T]{Key: string(kv.Key), ModRevision: kv.ModRevision, CreateRev: kv.CreateRevision, Lease: clientv3.LeaseID(kv.Lease)}
	if err := jsonkeep.Unmarshal(kv.Value, &v.Value); err != nil {
		return v, fmt.Errorf("decode %s: %w", kv.Key, err)
	}
	return v, nil
}

// EncodeJSON encodes v, with the members its jsonkeep.Unknowns hold
// (Decode); kvipam's records are plain structs, so a failure is a
// programming error reported as an error rather than a panic.
func EncodeJSON(v any) (string, error) {
	b, err := jsonkeep.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("encode %T: %w", v, err)
	}
	return string(b), nil
}

// GetJSON reads one key and decodes it.
func GetJSON[T any](ctx context.Context, kv clientv3.KV, key string) (Versioned[T], error) {
	resp, err := kv.Get(ctx, key)
	if err != nil {
		return Versioned[T]{}, fmt.Errorf("get %s: %w", key, Unavailable(err))
	}
	if len(resp.Kvs) == 0 {
		return Versioned[T]{Key: key}, fmt.Errorf("%s: %w", key, ErrNotFound)
	}
	return Decode[T](resp.Kvs[0])
}

// ListJSON reads every key under prefix and decodes it, in key order. It
// returns the store revision the read was served at, so a watch can resume
// from exactly there.
func ListJSON[T any](ctx context.Context, kv clientv3.KV, prefix string) ([]Versioned[T], int64, error) {
	resp, err := kv.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, 0, fmt.Errorf("list %s: %w", prefix, Unavailable(err))
	}
	out := make([]Versioned[T], 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		v, err := Decode[T](kv)
		if err != nil {
			return nil, 0, err
		}
		out = append(out, v)
	}
	return out, resp.Header.Revision, nil
}

// Absent is the compare "key does not exist".
func Absent(key string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
}

// Exists is the compare "key exists".
func Exists(key string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(key), ">", 0)
}

// Unchanged is the compare "key exists and was last written at rev".
func Unchanged(key string, rev int64) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(key), "=", rev)
}

// PrefixEmpty is the compare "no key exists under prefix". etcd evaluates a
// range compare against every key in the range and compares a missing key
// as zero, so an empty range passes and any present key fails it.
func PrefixEmpty(prefix string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(prefix), "=", 0).WithPrefix()
}

// DeleteAt deletes key only if it still has revision rev. A key already gone
// is success: deletes are idempotent. A key rewritten since rev wraps
// retry.ErrConflict, so a stale caller cannot delete someone else's write.
func DeleteAt(ctx context.Context, kv clientv3.KV, key string, rev int64) error {
	resp, err := kv.Txn(ctx).
		If(Unchanged(key, rev)).
		Then(clientv3.OpDelete(key)).
		Else(clientv3.OpGet(key, clientv3.WithCountOnly())).
		Commit()
	if err != nil {
		return fmt.Errorf("delete %s: %w", key, Unavailable(err))
	}
	if resp.Succeeded || resp.Responses[0].GetResponseRange().Count == 0 {
		return nil
	}
	return fmt.Errorf("delete %s at revision %d: changed: %w", key, rev, retry.ErrConflict)
}
