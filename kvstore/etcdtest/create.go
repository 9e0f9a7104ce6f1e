package etcdtest

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// CreateJSON puts key only if it is absent, in one create-if-absent
// transaction: the floor that benchmarks measure kvipam's writes against.
// It returns the revision of the write, or an error wrapping
// retry.ErrConflict if the key exists.
func CreateJSON(ctx context.Context, kv clientv3.KV, key string, v any) (int64, error) {
	val, err := kvstore.EncodeJSON(v)
	if err != nil {
		return 0, err
	}
	resp, err := kv.Txn(ctx).If(kvstore.Absent(key)).Then(clientv3.OpPut(key, val)).Commit()
	if err != nil {
		return 0, fmt.Errorf("create %s: %w", key, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("create %s: exists: %w", key, retry.ErrConflict)
	}
	return resp.Header.Revision, nil
}
