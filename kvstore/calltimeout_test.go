package kvstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// stuckKV answers nothing until the request's context ends, as a member
// does whose leader is gone.
type stuckKV struct{ clientv3.KV }

func (stuckKV) Get(ctx context.Context, _ string, _ ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (stuckKV) Txn(ctx context.Context) clientv3.Txn { return stuckTxn{ctx} }

type stuckTxn struct{ ctx context.Context }

func (t stuckTxn) If(...clientv3.Cmp) clientv3.Txn  { return t }
func (t stuckTxn) Then(...clientv3.Op) clientv3.Txn { return t }
func (t stuckTxn) Else(...clientv3.Op) clientv3.Txn { return t }
func (t stuckTxn) Commit() (*clientv3.TxnResponse, error) {
	<-t.ctx.Done()
	return nil, t.ctx.Err()
}

// TestCallTimeout: a request etcd does not answer is abandoned after the
// call timeout, not the caller's (longer) deadline, and the error is
// retry.ErrUnavailable once classified; requests etcd answers pass through.
func TestCallTimeout(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kv := kvstore.WithCallTimeout(stuckKV{}, 50*time.Millisecond)
	began := time.Now()
	_, err := kv.Get(ctx, "k")
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, kvstore.Unavailable(err), retry.ErrUnavailable)
	_, err = kv.Txn(ctx).If().Then().Commit()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, time.Since(began), 10*time.Second, "abandoned at the call timeout, not the caller's minute")
	require.NoError(t, ctx.Err())

	e := etcdtest.Start(t)
	real := kvstore.WithCallTimeout(etcdtest.Client(t, e), time.Second)
	_, err = real.Put(ctx, "k", "v")
	require.NoError(t, err)
	resp, err := real.Txn(ctx).If(clientv3.Compare(clientv3.Value("k"), "=", "v")).Then(clientv3.OpGet("k")).Commit()
	require.NoError(t, err)
	require.True(t, resp.Succeeded)
	require.Equal(t, clientv3.KV(stuckKV{}), kvstore.WithCallTimeout(stuckKV{}, 0), "zero: no call timeout")
}
