package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// TestReleaseFollowsAgentsHistoryRetention: release records IP history
// for the retention the agents stored in etcd, without a flag: the
// default when none has, the stored one (a lease of at most it plus an
// hour's bucket), none when it is 0. --history-retention overrides it.
func TestReleaseFollowsAgentsHistoryRetention(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t)
	h.withSmallPool()
	n1 := h.agent("n1")
	held := n1.Allocate(t, "small", 0, 4, false)
	n1.Kill(t)
	st := etcdstore.New(h.cli, etcdstore.Options{})
	release := func(i int, flags ...string) {
		t.Helper()
		h.ok(append([]string{"release", "--ip", held[i].Addr.String(), "--confirm-gone", "n1", "--last-seen", "0s"}, flags...)...)
	}
	// ttls maps each history record to its lease's remaining TTL.
	ttls := func() map[string]int64 {
		t.Helper()
		resp, err := h.cli.Get(ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix())
		require.NoError(t, err)
		out := map[string]int64{}
		for _, kv := range resp.Kvs {
			l, err := h.cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease))
			require.NoError(t, err)
			out[string(kv.Key)] = l.TTL
		}
		return out
	}
	newTTL := func(before map[string]int64) int64 {
		t.Helper()
		after := ttls()
		require.Len(t, after, len(before)+1, "one record more")
		for k, ttl := range after {
			if _, ok := before[k]; !ok {
				return ttl
			}
		}
		panic("unreachable")
	}

	before := ttls()
	release(0)
	require.Greater(t, newTTL(before), int64((etcdstore.DefaultHistoryRetention - time.Minute).Seconds()), "no agent stored one: the default")

	_, err := st.PublishHistoryRetention(ctx, 2*time.Hour, "n1")
	require.NoError(t, err)
	before = ttls()
	release(1)
	ttl := newTTL(before)
	require.Greater(t, ttl, int64((2*time.Hour - time.Minute).Seconds()))
	require.LessOrEqual(t, ttl, int64((3 * time.Hour).Seconds()), "the agents' retention, not the default")

	before = ttls()
	release(2, "--history-retention", "0")
	require.Len(t, ttls(), len(before), "the flag overrides the agents' retention: no record")

	_, err = st.PublishHistoryRetention(ctx, 0, "n1")
	require.NoError(t, err)
	before = ttls()
	release(3)
	require.Len(t, ttls(), len(before), "the agents' history is off: so is kvipamctl's")

	code, _, errs := h.run("release", "--ip", held[3].Addr.String(), "--history-retention", "-1s")
	require.Equal(t, exitError, code)
	require.Contains(t, errs, "must not be negative")
}
