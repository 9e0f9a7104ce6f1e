package cluster_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestClusterHarness drives a 3-member cluster through what the chaos
// tests will do to it: SIGKILL the leader (the others elect a new one, and
// writes go on), restart it (it catches up from its data dir), and freeze
// a follower (writes go on without it).
func TestClusterHarness(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	cli := c.Client(t, "tester")

	_, err := cli.Put(ctx, "/harness/a", "1")
	require.NoError(t, err)
	got, err := cli.Get(ctx, "/harness/a")
	require.NoError(t, err)
	require.Len(t, got.Kvs, 1)
	require.Equal(t, "1", string(got.Kvs[0].Value))

	old, err := c.Leader(ctx)
	require.NoError(t, err)
	killed := time.Now()
	require.NoError(t, c.Kill(old))
	require.False(t, c.Running(old))
	leader, err := c.WaitLeader(ctx)
	require.NoError(t, err)
	t.Logf("SIGKILL of leader m%d: m%d leads %v later", old, leader, time.Since(killed).Round(time.Millisecond))
	require.NotEqual(t, old, leader)

	put, err := cli.Put(ctx, "/harness/b", "2")
	require.NoError(t, err, "write with the old leader dead")

	restarted := time.Now()
	require.NoError(t, c.Restart(old))
	require.NoError(t, c.WaitRevision(ctx, old, put.Header.Revision))
	t.Logf("restarted m%d caught up with revision %d in %v", old, put.Header.Revision, time.Since(restarted).Round(time.Millisecond))
	require.NoError(t, c.WaitHealthy(ctx))

	// The leader may have changed when the old one came back: ask again.
	leader, err = c.WaitLeader(ctx)
	require.NoError(t, err)
	follower := (leader + 1) % c.Len()
	require.NoError(t, c.Stop(follower))
	// A client of every member could send the write to the frozen one and
	// wait; this test is about the cluster, so it talks to the leader.
	toLeader := c.Client(t, "tester", leader)
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	put, err = toLeader.Put(wctx, "/harness/c", "3")
	wcancel()
	require.NoError(t, err, "write with follower m%d stopped", follower)
	require.NoError(t, c.Cont(follower))
	require.NoError(t, c.WaitRevision(ctx, follower, put.Header.Revision))
	require.NoError(t, c.WaitHealthy(ctx))

	got, err = cli.Get(ctx, "/harness/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, got.Kvs, 3)
}
