package cluster_test

import (
	"context"
	"crypto/tls"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestClusterTLSRefusals: the members refuse a client without a
// certificate, a client refuses members whose CA it does not trust, and
// with auth on, a user whose role covers only /kvipam/ can write there and
// nowhere else.
func TestClusterTLSRefusals(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := c.CAPool()
	require.NoError(t, err)
	tester, err := c.TLSConfig("tester")
	require.NoError(t, err)
	noCert := &tls.Config{RootCAs: pool}

	t.Run("a request hides the cause", func(t *testing.T) {
		// clientv3 waits for a ready connection and returns its context's
		// error: the caller learns nothing about TLS.
		cli := newClient(t, c.Endpoints()[0], noCert)
		rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer rcancel()
		_, err := cli.Put(rctx, "/kvipam/x", "refused")
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, "context deadline exceeded", err.Error())
	})

	for _, tc := range []struct {
		name string
		tls  *tls.Config
		// want matches the connection error a blocking dial returns.
		want string
	}{
		// TLS 1.3 finishes the client's side of the handshake before the
		// server checks the client: the refusal arrives as the server's
		// alert or, when the server has already closed the connection, as
		// the failed write of gRPC's preface (about half the time each).
		{"no client certificate", noCert, `tls: certificate required|write: broken pipe|connection reset by peer`},
		{"untrusted members", &tls.Config{Certificates: tester.Certificates}, `tls: failed to verify certificate: x509: certificate signed by unknown authority`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Only a blocking dial that returns the connection error tells
			// why (both options are deprecated in gRPC, still honoured).
			_, err := clientv3.New(clientv3.Config{
				Endpoints: c.Endpoints()[:1], TLS: tc.tls, DialTimeout: 500 * time.Millisecond, Logger: zap.NewNop(),
				DialOptions: []grpc.DialOption{grpc.WithBlock(), grpc.WithReturnConnectionError()},
			})
			require.Error(t, err)
			t.Logf("clientv3.New: %v", err)
			require.Regexp(t, tc.want, err.Error())
		})
	}
	// The member says why, whatever the client saw.
	log, err := os.ReadFile(c.LogPath(0))
	require.NoError(t, err)
	require.Contains(t, string(log), "tls: client didn't provide a certificate")

	require.NoError(t, c.EnableAuth(ctx))
	require.NoError(t, c.AddUser(ctx, "agent", "", cluster.Role{Name: "kvipam", Prefix: "/kvipam/"}))
	agent := c.Client(t, "agent")
	_, err = agent.Put(ctx, "/kvipam/x", "mine")
	require.NoError(t, err)
	_, err = agent.Put(ctx, "/other", "not mine")
	require.ErrorIs(t, err, rpctypes.ErrPermissionDenied)
	require.ErrorContains(t, err, "permission denied")
	_, err = agent.Get(ctx, "/other")
	require.ErrorIs(t, err, rpctypes.ErrPermissionDenied)
	// A certificate of the cluster's CA whose CN names no user gets in but
	// may touch nothing.
	_, err = c.Client(t, "stranger").Put(ctx, "/kvipam/y", "no")
	require.ErrorIs(t, err, rpctypes.ErrPermissionDenied)
	// root still may.
	_, err = c.Client(t, cluster.RootUser).Put(ctx, "/other", "root's")
	require.NoError(t, err)
}

// newClient is a client of endpoint with tc, closed when the test ends.
func newClient(tb testing.TB, endpoint string, tc *tls.Config) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, TLS: tc, Logger: zap.NewNop()})
	require.NoError(tb, err) // clientv3 connects on the first request
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}
