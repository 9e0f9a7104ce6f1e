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
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestStickyKeepAfterHistoryLeaseLost: the retention lease of the current
// hour's history records is gone (revoked by hand, or etcd restored from
// a snapshot older than it). A sticky pod's DEL (Keep) and a takeover
// from a live pod (WriteBound ending the earlier pod's interval) still
// land and record their intervals, on a newly granted lease.
func TestStickyKeepAfterHistoryLeaseLost(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "small", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/24")}, BlockSizeV4: 28}
	agenttest.EnsurePool(t, e, pool)
	a := agenttest.Start(t, e, "a", agenttest.Options{Pools: []string{pool.Name}})
	cli := etcdtest.Client(t, e)
	pod := func(gen int) nodealloc.Request {
		o := records.Owner{ContainerID: fmt.Sprintf("web-0-c%d", gen), IfName: "eth0", Namespace: "ns", Pod: "web-0"}
		return nodealloc.Request{Pool: pool.Name, Owner: o, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Hour}}
	}
	// history reads x's records and revokes the lease they are on, as an
	// operator would by hand.
	var x netip.Addr
	revokeHistory := func() {
		t.Helper()
		resp, err := cli.Get(ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix())
		require.NoError(t, err)
		require.NotEmpty(t, resp.Kvs)
		_, err = cli.Revoke(ctx, clientv3.LeaseID(resp.Kvs[len(resp.Kvs)-1].Lease))
		require.NoError(t, err)
	}
	history := func() []etcdstore.HistoryRecord {
		t.Helper()
		h, err := a.Store.History(ctx, etcdstore.HistoryFilter{Pool: pool.Name, IP: x})
		require.NoError(t, err)
		return h
	}

	// c1 comes and goes: its DEL records the first interval and grants
	// the hour's lease.
	res, err := a.Alloc.Allocate(ctx, pod(1))
	require.NoError(t, err)
	x = res.Allocations[0].Addr
	_, err = a.Alloc.Release(ctx, pod(1).Owner)
	require.NoError(t, err)
	require.Len(t, history(), 1)
	revokeHistory()

	// c2 takes x back; its DEL keeps x again, recording its interval.
	res, err = a.Alloc.Allocate(ctx, pod(2))
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr)
	_, err = a.Alloc.Release(ctx, pod(2).Owner)
	require.NoError(t, err, "a sticky DEL succeeds after the history lease is gone")
	h := history()
	require.Len(t, h, 1, "the first record went with its lease")
	require.Equal(t, etcdstore.EndKept, h[0].Reason)
	require.Equal(t, pod(2).Owner.ContainerID, h[0].ContainerID)

	// c3 takes x; c4 (the same pod, recreated before c3's DEL came) takes
	// it over from c3, ending c3's interval.
	_, err = a.Alloc.Allocate(ctx, pod(3))
	require.NoError(t, err)
	revokeHistory()
	res, err = a.Alloc.Allocate(ctx, pod(4))
	require.NoError(t, err, "a takeover from a live pod succeeds after the history lease is gone")
	require.Equal(t, x, res.Allocations[0].Addr)
	h = history()
	require.Len(t, h, 1)
	require.Equal(t, etcdstore.EndTakenOver, h[0].Reason)
	require.Equal(t, pod(3).Owner.ContainerID, h[0].ContainerID)

	// etcd refuses a history write for its lease even after a new one is
	// granted: nothing was written, so the error is a conflict (a
	// refusal), never an unknown outcome to settle.
	t.Run("refused twice is a conflict", func(t *testing.T) {
		rec := etcdstore.NewHistoryRecorder(revokingGranter{cli}, time.Hour)
		r := etcdstore.HistoryRecord{Pool: pool.Name, IP: x.String(), Owner: pod(9).Owner, End: time.Now()}
		tries := 0
		err := rec.Commit(ctx, []etcdstore.HistoryRecord{r}, func(puts []clientv3.Op) error {
			tries++
			_, err := cli.Txn(ctx).Then(puts...).Commit()
			return err
		})
		require.ErrorIs(t, err, retry.ErrConflict)
		require.Equal(t, 2, tries, "one retry on a newly granted lease")
	})
}

// revokingGranter grants leases that are gone before they are used, as
// when etcd loses the lease between the grant and the write.
type revokingGranter struct{ cli *clientv3.Client }

func (g revokingGranter) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	resp, err := g.cli.Grant(ctx, ttl)
	if err != nil {
		return nil, err
	}
	_, err = g.cli.Revoke(ctx, resp.ID)
	return resp, err
}
