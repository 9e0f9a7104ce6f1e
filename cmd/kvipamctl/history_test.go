package main

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
)

// TestIPHistory hands one address to three pods in turn. kvipamctl ip
// history shows the three intervals in order (two ended, one current),
// also after etcd's history is compacted away; and the ended records
// disappear by themselves once their retention has passed.
func TestIPHistory(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.withSmallPool()
	const retention = 2 * time.Second
	a := agenttest.Start(t, h.e, "n1", agenttest.Options{Pools: []string{"small"}, HistoryRetention: retention})
	addr := netip.MustParseAddr("10.20.0.77")
	var owners []records.Owner
	for i := range 3 {
		o := agenttest.Owner(i)
		o.Namespace, o.Pod = "web", "web-0" // the same pod, re-created
		owners = append(owners, o)
		_, err := a.Alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o, IPs: []netip.Addr{addr}})
		require.NoError(t, err)
		if i < 2 {
			_, err = a.Alloc.Release(ctx, o)
			require.NoError(t, err)
		}
	}
	check := func(wantEnded int) []historyRow {
		t.Helper()
		var rows []historyRow
		require.Equal(t, exitOK, h.json(&rows, "ip", "history", addr.String()))
		require.Len(t, rows, wantEnded+1)
		for i, r := range rows {
			o := owners[len(owners)-len(rows)+i]
			require.Equal(t, o.ContainerID, r.ContainerID, "interval %d", i)
			require.Equal(t, "10.20.0.77", r.IP)
			require.Equal(t, "n1", r.Node)
			require.Equal(t, i == len(rows)-1, r.Current)
			if !r.Current {
				require.Equal(t, etcdstore.EndReleased, r.Reason)
				require.False(t, r.End.Before(r.Start), "ends after it starts")
				if i > 0 {
					require.False(t, r.Start.Before(rows[i-1].End), "one interval at a time")
				}
			}
		}
		return rows
	}
	before := check(2)

	// etcd's MVCC history is compacted to the latest revision: the
	// history records are ordinary keys and stay.
	resp, err := h.cli.Get(ctx, "x")
	require.NoError(t, err)
	_, err = h.cli.Compact(ctx, resp.Header.Revision, clientv3.WithCompactPhysical())
	require.NoError(t, err)
	require.Equal(t, before, check(2), "compaction changes nothing")

	var byPod []historyRow
	require.Equal(t, exitOK, h.json(&byPod, "ip", "history", "--pod", "web/web-0"))
	require.Equal(t, before, byPod, "the same intervals by pod")

	// The records sit on a retention lease: etcd deletes them by itself.
	waitGone(t, h.cli, etcdstore.HistoryPrefix())
	check(0)
}

// waitGone waits, by watching, until nothing is left under prefix.
func waitGone(t *testing.T, cli *clientv3.Client, prefix string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	left := resp.Count
	if left == 0 {
		return
	}
	for wr := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1)) {
		for _, ev := range wr.Events {
			if ev.Type == clientv3.EventTypeDelete {
				left--
			}
		}
		if left <= 0 {
			return
		}
	}
	t.Fatalf("%d records under %s outlived their retention: %v", left, prefix, ctx.Err())
}
