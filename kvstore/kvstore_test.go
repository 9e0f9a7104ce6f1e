package kvstore_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

type rec struct {
	Node string `json:"node"`
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  kvstore.Config
		want string
	}{
		{"no endpoints", kvstore.Config{}, "no etcd endpoints"},
		{"cert without key", kvstore.Config{Endpoints: []string{"x"}, CertFile: "c"}, "both certFile and keyFile"},
		{"password without user", kvstore.Config{Endpoints: []string{"x"}, Password: "p"}, "without username"},
		{"ok", kvstore.Config{Endpoints: []string{"http://127.0.0.1:1"}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestConnectUnreachable(t *testing.T) {
	ctx := context.Background()
	_, err := kvstore.Connect(ctx, kvstore.Config{Endpoints: []string{"http://127.0.0.1:1"}, DialTimeout: 300 * time.Millisecond}, "/health")
	require.ErrorContains(t, err, "reach etcd")
}

// swapJSON replaces key only if it still has revision rev. It returns the
// new revision, or an error wrapping retry.ErrConflict if the key
// changed.
func swapJSON(ctx context.Context, kv clientv3.KV, key string, rev int64, v any) (int64, error) {
	val, err := kvstore.EncodeJSON(v)
	if err != nil {
		return 0, err
	}
	resp, err := kv.Txn(ctx).If(kvstore.Unchanged(key, rev)).Then(clientv3.OpPut(key, val)).Commit()
	if err != nil {
		return 0, fmt.Errorf("swap %s: %w", key, kvstore.Unavailable(err))
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("swap %s at revision %d: changed: %w", key, rev, retry.ErrConflict)
	}
	return resp.Header.Revision, nil
}

func TestCreateSwapDelete(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))

	rev, err := etcdtest.CreateJSON(ctx, cli, "/t/a", rec{"n1"})
	require.NoError(t, err)
	_, err = etcdtest.CreateJSON(ctx, cli, "/t/a", rec{"n2"})
	require.ErrorIs(t, err, retry.ErrConflict)

	got, err := kvstore.GetJSON[rec](ctx, cli, "/t/a")
	require.NoError(t, err)
	require.Equal(t, "n1", got.Value.Node)
	require.Equal(t, rev, got.ModRevision)

	rev2, err := swapJSON(ctx, cli, "/t/a", rev, rec{"n3"})
	require.NoError(t, err)
	_, err = swapJSON(ctx, cli, "/t/a", rev, rec{"stale"})
	require.ErrorIs(t, err, retry.ErrConflict, "a stale revision must not overwrite")

	require.ErrorIs(t, kvstore.DeleteAt(ctx, cli, "/t/a", rev), retry.ErrConflict, "a stale delete must not remove a newer write")
	require.NoError(t, kvstore.DeleteAt(ctx, cli, "/t/a", rev2))
	require.NoError(t, kvstore.DeleteAt(ctx, cli, "/t/a", rev2), "deleting twice is fine")
	_, err = kvstore.GetJSON[rec](ctx, cli, "/t/a")
	require.ErrorIs(t, err, kvstore.ErrNotFound)
}

func TestPrefixEmpty(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	empty := func() bool {
		resp, err := cli.Txn(ctx).If(kvstore.PrefixEmpty("/blk/1/")).Commit()
		require.NoError(t, err)
		return resp.Succeeded
	}
	require.True(t, empty())
	_, err := cli.Put(ctx, "/blk/10/x", "{}") // a sibling prefix must not count
	require.NoError(t, err)
	require.True(t, empty())
	_, err = cli.Put(ctx, "/blk/1/a", "{}")
	require.NoError(t, err)
	require.False(t, empty())
}

func TestSessionLostOnRevoke(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	s, err := kvstore.NewSession(ctx, cli, 5)
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/lease/k", "v", clientv3.WithLease(s.Lease()))
	require.NoError(t, err)
	require.False(t, s.Lost())
	_, err = cli.Revoke(ctx, s.Lease()) // as if etcd expired it
	require.NoError(t, err)
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("session did not report its lost lease")
	}
	resp, err := cli.Get(ctx, "/lease/k")
	require.NoError(t, err)
	require.Zero(t, resp.Count)
	s.Close()
}

func TestSessionCloseKeepsLease(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	s, err := kvstore.NewSession(ctx, cli, 30)
	require.NoError(t, err)
	s.Close()
	ttl, err := cli.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.Greater(t, ttl.TTL, int64(0), "Close must leave the lease to expire on its own")
}

// TestSessionUnavailable stops etcd under a client: granting a session and
// revoking one fail with an error that matches retry.ErrUnavailable, as every
// other etcd call in kvstore does.
func TestSessionUnavailable(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	s, err := kvstore.NewSession(ctx, cli, 30)
	require.NoError(t, err)
	e.Close() // waits out etcd's graceful stop of the session's keepalive stream (~5 s)

	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = kvstore.NewSession(cctx, cli, 30)
	require.ErrorIs(t, err, retry.ErrUnavailable, "grant: %v", err)

	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	err = s.Revoke(rctx)
	require.ErrorIs(t, err, retry.ErrUnavailable, "revoke: %v", err)
}

// mirror keeps a map of a prefix from watch events, as the agent does.
type mirror struct {
	mu     sync.Mutex
	m      map[string]string
	resets atomic.Int32
	seen   chan struct{}
}

func (m *mirror) Reset(kvs []*mvccpb.KeyValue, _ int64) {
	m.mu.Lock()
	m.m = map[string]string{}
	for _, kv := range kvs {
		m.m[string(kv.Key)] = string(kv.Value)
	}
	m.mu.Unlock()
	m.resets.Add(1)
	m.seen <- struct{}{}
}

func (m *mirror) Apply(ev *clientv3.Event) {
	m.mu.Lock()
	if ev.Type == clientv3.EventTypeDelete {
		delete(m.m, string(ev.Kv.Key))
	} else {
		m.m[string(ev.Kv.Key)] = string(ev.Kv.Value)
	}
	m.mu.Unlock()
	m.seen <- struct{}{}
}

func (m *mirror) snapshot() map[string]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]string{}
	for k, v := range m.m {
		out[k] = v
	}
	return out
}

func TestWatchRelistsAfterCompaction(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cli := etcdtest.Client(t, etcdtest.Start(t))
	put := func(k, v string) int64 {
		r, err := cli.Put(ctx, k, v)
		require.NoError(t, err)
		return r.Header.Revision
	}
	put("/w/a", "1")
	start := put("/w/b", "1")
	// History from start on is gone before the watch begins.
	put("/w/a", "2")
	_, err := cli.Delete(ctx, "/w/b")
	require.NoError(t, err)
	last := put("/w/c", "1")
	_, err = cli.Compact(ctx, last)
	require.NoError(t, err)

	m := &mirror{m: map[string]string{"/w/a": "1", "/w/b": "1"}, seen: make(chan struct{}, 100)}
	done := make(chan error, 1)
	go func() { done <- kvstore.Watch(ctx, cli, "/w/", start+1, m) }()
	<-m.seen
	require.Equal(t, int32(1), m.resets.Load())
	require.Equal(t, map[string]string{"/w/a": "2", "/w/c": "1"}, m.snapshot())

	put("/w/d", "1") // and it keeps following after the relist
	<-m.seen
	require.Equal(t, "1", m.snapshot()["/w/d"])
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
}

func TestEmbeddedKeepsDataAcrossRestart(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: dir, Fast: true})
	require.NoError(t, err)
	cli, err := e.Client(ctx)
	require.NoError(t, err)
	_, err = cli.Put(ctx, "/persist", "yes")
	require.NoError(t, err)
	cli.Close()
	e.Close()

	e, err = kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: dir, Fast: true})
	require.NoError(t, err)
	defer e.Close()
	cli, err = e.Client(ctx)
	require.NoError(t, err)
	defer cli.Close()
	got, err := cli.Get(ctx, "/persist")
	require.NoError(t, err)
	require.Equal(t, "yes", string(got.Kvs[0].Value))
}
