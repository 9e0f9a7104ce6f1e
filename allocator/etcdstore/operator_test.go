package etcdstore_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestOperatorScanAll: every record kind is read, page by page, at the
// revision of the first read, and keys outside the records are not.
func TestOperatorScanAll(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	b := netip.MustParsePrefix("10.0.0.0/28")
	want := []string{etcdstore.PoolKey("p"), etcdstore.NodeKey("n"), etcdstore.ClaimKey("p", b), etcdstore.HomeKey("p", b)}
	for i := range 5 {
		want = append(want, etcdstore.IPKey("p", b, netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})))
	}
	want = append(want, etcdstore.BindingKey("p", "ns/name"))
	for _, k := range want {
		_, err := cli.Put(ctx, k, "{}")
		require.NoError(t, err)
	}
	_, err := cli.Put(ctx, etcdstore.Prefix+"health", "x")
	require.NoError(t, err)

	for _, page := range []int{0, 2} {
		var got []string
		rev, err := etcdstore.NewOperator(cli, page).ScanAll(ctx, func(kv *mvccpb.KeyValue) {
			got = append(got, string(kv.Key))
			if len(got) == 1 {
				// A write after the first read is not seen.
				_, err := cli.Put(ctx, etcdstore.IPKey("p", b, netip.MustParseAddr("10.0.0.9")), "{}")
				require.NoError(t, err)
			}
		})
		require.NoError(t, err)
		require.Equal(t, want, got, "page size %d", page)
		resp, err := cli.Get(ctx, "any")
		require.NoError(t, err)
		require.Less(t, rev, resp.Header.Revision)
		_, err = cli.Delete(ctx, etcdstore.IPKey("p", b, netip.MustParseAddr("10.0.0.9")))
		require.NoError(t, err)
	}
}

// TestOperatorLeaseTTL: a live lease's TTL, and -1 for one etcd no
// longer has.
func TestOperatorLeaseTTL(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	l, err := cli.Grant(ctx, 60)
	require.NoError(t, err)
	op := etcdstore.NewOperator(cli, 0)
	ttl, err := op.LeaseTTL(ctx, int64(l.ID))
	require.NoError(t, err)
	require.Greater(t, ttl, int64(50))
	_, err = cli.Revoke(ctx, l.ID)
	require.NoError(t, err)
	ttl, err = op.LeaseTTL(ctx, int64(l.ID))
	require.NoError(t, err)
	require.Equal(t, int64(-1), ttl)
}
