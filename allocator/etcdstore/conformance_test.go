package etcdstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records/storetest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestConformance holds etcdstore to the store contract, the suite the
// in-memory store (allocator/records/memstore) passes too. One etcd
// serves every test; each starts from an empty keyspace, with no lease.
func TestConformance(t *testing.T) {
	cli := etcdtest.Client(t, etcdtest.Start(t))
	ctx := context.Background()
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		_, err := cli.Delete(ctx, "\x00", clientv3.WithFromKey())
		require.NoError(t, err)
		leases, err := cli.Leases(ctx)
		require.NoError(t, err)
		for _, l := range leases.Leases {
			_, err := cli.Revoke(ctx, l.ID)
			require.NoError(t, err)
		}
		return storetest.Harness{
			Store: etcdstore.New(cli, etcdstore.Options{}),
			Grant: func(ttl time.Duration) int64 {
				resp, err := cli.Grant(ctx, int64((ttl+time.Second-1)/time.Second))
				require.NoError(t, err)
				return int64(resp.ID)
			},
			Revoke: func(id int64) {
				_, err := cli.Revoke(ctx, clientv3.LeaseID(id))
				require.NoError(t, err)
			},
			Now: time.Now,
		}
	})
}
