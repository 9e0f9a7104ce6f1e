package cluster_test

import (
	"context"
	"path/filepath"
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

	cpu, err := c.CPUTime()
	require.NoError(t, err)
	require.Positive(t, cpu, "the members' CPU time: starting took some")
	_, err = cli.Put(ctx, "/harness/a", "1")
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

// TestClusterSnapshotRestore: a snapshot, more writes, a restore with a
// revision bump: the later writes are gone, the revision went up, and a
// watcher resuming from its last revision learns of a compaction instead
// of seeing revisions go backwards.
func TestClusterSnapshotRestore(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := cluster.Start(t, cluster.Options{})
	cli := c.Client(t, cluster.RootUser)
	_, err := cli.Put(ctx, "/k/before", "1")
	require.NoError(t, err)
	snap := filepath.Join(t.TempDir(), "snap.db")
	rev, err := c.Snapshot(ctx, 0, snap)
	require.NoError(t, err)
	put, err := cli.Put(ctx, "/k/after", "2")
	require.NoError(t, err)
	last := put.Header.Revision

	require.NoError(t, c.RestoreFrom(ctx, snap, 1000))
	cli = c.Client(t, cluster.RootUser)
	resp, err := cli.Get(ctx, "/k/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the write after the snapshot is gone")
	require.Equal(t, "/k/before", string(resp.Kvs[0].Key))
	require.Greater(t, resp.Header.Revision, last, "the revision went up, not back: %d after the snapshot's %d", resp.Header.Revision, rev)
	wresp := <-cli.Watch(ctx, "/k/", clientv3.WithPrefix(), clientv3.WithRev(last+1))
	require.NotZero(t, wresp.CompactRevision, "a watcher resuming from its last revision sees a compaction")
}
