package etcdstore_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// BenchmarkHistorySpace releases b.N allocations, each leaving one history
// record, and reports what the records cost etcd: their key and value
// bytes, and the growth of the database in use, per release.
//
//	go test -run '^$' -bench HistorySpace -benchtime 1000x ./allocator/etcdstore/
func BenchmarkHistorySpace(b *testing.B) {
	ctx := context.Background()
	e := etcdtest.Start(b)
	cli := etcdtest.Client(b, e)
	s := etcdstore.New(cli, etcdstore.Options{})
	pool := allocator.Pool{Name: "default", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, BlockSizeV4: 26}
	_, err := s.EnsurePool(ctx, pool)
	require.NoError(b, err)
	block := netip.MustParsePrefix("10.0.0.0/26")
	sizeInUse := func() int64 {
		st, err := cli.Status(ctx, e.Endpoints()[0])
		require.NoError(b, err)
		return st.DbSizeInUse
	}
	before := sizeInUse()
	b.ResetTimer()
	require.ErrorIs(b, s.DeleteIP(ctx, records.Allocation{Pool: pool.Name, Block: block, Addr: block.Addr()}), records.ErrBadRequest, "a delete needs a revision")
	for i := range b.N {
		addr := netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", i/250%250, i%250+1))
		al := records.Allocation{Pool: pool.Name, Block: block, Addr: addr, Rev: 0,
			Record: records.Record{Owner: records.Owner{ContainerID: fmt.Sprintf("%064x", i), IfName: "eth0", Namespace: "default", Pod: fmt.Sprintf("web-%d-abcde", i), Network: "k8s-pod-network"},
				Node: "node-0001.example.internal", State: records.StateAllocated, Since: time.Now().UTC()}}
		b.StopTimer()
		key := etcdstore.IPKey(pool.Name, block, addr)
		_, err := cli.Put(ctx, key, `{}`)
		require.NoError(b, err)
		resp, err := cli.Get(ctx, key)
		require.NoError(b, err)
		al.Rev = resp.Kvs[0].ModRevision
		b.StartTimer()
		require.NoError(b, s.DeleteIP(ctx, al))
	}
	b.StopTimer()
	resp, err := cli.Get(ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix())
	require.NoError(b, err)
	require.EqualValues(b, b.N, resp.Count)
	var kv int
	for _, r := range resp.Kvs {
		kv += len(r.Key) + len(r.Value)
	}
	b.ReportMetric(float64(kv)/float64(b.N), "kv-bytes/release")
	b.ReportMetric(float64(sizeInUse()-before)/float64(b.N), "db-bytes/release")
}

// TestHistoryLeaseRevokedByHand: an operator revokes the retention lease
// of the current hour; the next release still succeeds and records its
// interval, on a newly granted lease.
func TestHistoryLeaseRevokedByHand(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	s := etcdstore.New(cli, etcdstore.Options{})
	block := netip.MustParsePrefix("10.0.0.0/26")
	release := func(i int) {
		t.Helper()
		addr := netip.MustParseAddr(fmt.Sprintf("10.0.0.%d", i))
		key := etcdstore.IPKey("default", block, addr)
		put, err := cli.Put(ctx, key, `{}`)
		require.NoError(t, err)
		al := records.Allocation{Pool: "default", Block: block, Addr: addr, Rev: put.Header.Revision,
			Record: records.Record{Owner: records.Owner{ContainerID: fmt.Sprintf("c%d", i), IfName: "eth0"}, Node: "n1"}}
		require.NoError(t, s.DeleteIP(ctx, al))
	}
	release(1)
	resp, err := cli.Get(ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	_, err = cli.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	require.NoError(t, err)

	release(2)
	resp, err = cli.Get(ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the first record went with its lease; the second is recorded")
	require.Contains(t, string(resp.Kvs[0].Value), `"containerID":"c2"`)
	require.NotZero(t, resp.Kvs[0].Lease)
}
