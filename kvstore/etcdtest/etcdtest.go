// Package etcdtest starts a real, in-process etcd for tests: a fresh data
// directory and kernel-chosen loopback ports per call, stopped by t.Cleanup.
package etcdtest

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/kvstore"
)

// Start runs an embedded etcd for the test and returns it. Fsync is off and
// raft timers are short: fine for tests, never for production.
func Start(tb testing.TB) *kvstore.Embedded {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{Dir: tb.TempDir(), Fast: true})
	if err != nil {
		tb.Fatalf("start embedded etcd: %v", err)
	}
	tb.Cleanup(e.Close)
	return e
}

// Client connects a new client to e, closed by t.Cleanup. Each simulated
// node in a test gets its own client, as separate agents would.
func Client(tb testing.TB, e *kvstore.Embedded) *clientv3.Client {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cli, err := e.Client(ctx)
	if err != nil {
		tb.Fatalf("connect to embedded etcd: %v", err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}
