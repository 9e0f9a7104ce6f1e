package kvstore_test

import (
	"context"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/kvipam/kvipam/internal/testsupport/cutproxy"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestSessionHeldUntilMoves: a healthy session's HeldUntil moves on with
// every keepalive (a third of the TTL), and never comes within two thirds
// of the TTL of now while etcd answers.
func TestSessionHeldUntilMoves(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	start := time.Now()
	s, err := kvstore.NewSession(ctx, cli, 3)
	granted := time.Now()
	require.NoError(t, err)
	defer s.Close()
	until, moved := s.HeldUntil()
	require.False(t, until.Before(start.Add(3*time.Second)) || until.After(granted.Add(3*time.Second)), "the grant's send time plus the TTL")
	for range 3 {
		select {
		case <-moved:
		case <-s.Done():
			t.Fatal("session lost while etcd answers")
		case <-time.After(10 * time.Second):
			t.Fatal("HeldUntil did not move")
		}
		next, m := s.HeldUntil()
		require.True(t, next.After(until), "moved on: %s after %s", next, until)
		require.Greater(t, time.Until(next), time.Second, "renewed a third of the TTL in")
		until, moved = next, m
	}
}

// TestSessionKeepalivesOnOneStream: the sessions of a client send their
// keepalives on one long-lived LeaseKeepAlive stream, not a new gRPC
// stream each nor one a session (either cost the members their leader
// with 2,500 sessions in one process: docs/scale.md). The client counts
// the streams it opens.
func TestSessionKeepalivesOnOneStream(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	var streams atomic.Int64
	count := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == "/etcdserverpb.Lease/LeaseKeepAlive" {
			streams.Add(1)
		}
		return streamer(ctx, desc, cc, method, opts...)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainStreamInterceptor(count)}})
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })

	const sessions, keepalives = 3, 5
	for i := range sessions {
		s, err := kvstore.NewSession(ctx, cli, int64(1+i))
		require.NoError(t, err)
		defer s.Close()
		_, moved := s.HeldUntil()
		for range keepalives {
			select {
			case <-moved:
			case <-s.Done():
				t.Fatal("session lost while etcd answers")
			}
			_, moved = s.HeldUntil()
		}
	}
	require.EqualValues(t, 1, streams.Load(), "%d sessions' keepalives answered on one stream", sessions)
}

// TestSessionLostByHeldUntil cuts a session's client off etcd (packets
// dropped): Done closes at HeldUntil as it stood at the cut, which is no
// later than the cut plus the TTL (the last keepalive etcd answered was
// sent before it), and then HeldUntil is zero. etcd itself keeps the
// lease and its key until its own clock says so (logged: the key goes
// after the session said it lost the lease).
func TestSessionLostByHeldUntil(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	u, err := url.Parse(e.Endpoints()[0])
	require.NoError(t, err)
	p, err := cutproxy.New(u.Host)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	cli, err := kvstore.Connect(ctx, kvstore.Config{Endpoints: []string{"http://" + p.Addr()}, DialTimeout: time.Second}, "/probe")
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	direct := etcdtest.Client(t, e)

	const ttl = 2 * time.Second
	s, err := kvstore.NewSession(ctx, cli, int64(ttl/time.Second))
	require.NoError(t, err)
	defer s.Close()
	_, err = direct.Put(ctx, "/lease/k", "v", clientv3.WithLease(s.Lease()))
	require.NoError(t, err)
	// A watch of the key from the other client says when etcd deletes it.
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	deleted := make(chan time.Time, 1)
	wch := direct.Watch(wctx, "/lease/k")
	go func() {
		for resp := range wch {
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypeDelete {
					deleted <- time.Now()
					return
				}
			}
		}
	}()

	cut := time.Now()
	p.Stall()
	<-s.Done()
	lost := time.Now()
	until, _ := s.HeldUntil()
	require.True(t, until.IsZero(), "a lost session holds nothing")
	t.Logf("session lost %s after the cut (TTL %s)", lost.Sub(cut).Round(time.Millisecond), ttl)
	require.Less(t, lost.Sub(cut), ttl+500*time.Millisecond, "lost by the cut plus the TTL (plus a timer's lateness)")
	select {
	case at := <-deleted:
		// Seen by another goroutine, so the order is not proof either
		// way; the log shows the margin etcd's expiry leaves.
		t.Logf("etcd deleted the key %s after the session said it lost the lease", at.Sub(lost).Round(time.Millisecond))
	case <-time.After(10 * time.Second):
		t.Fatal("etcd never expired the lease")
	}
	p.Heal()
}
