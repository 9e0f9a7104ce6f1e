// Package etcdtest starts a real, in-process etcd for tests: a fresh data
// directory and kernel-chosen loopback ports per call, stopped by t.Cleanup.
package etcdtest

import (
	"context"
	"fmt"
	"net"
	"sync"
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

// Cluster is a multi-member etcd, every member in this process.
type Cluster struct {
	Members []*kvstore.Embedded
	clients []string
}

// Endpoints are every member's client URL.
func (c *Cluster) Endpoints() []string { return c.clients }

// Config is a client configuration naming every member.
func (c *Cluster) Config() kvstore.Config { return kvstore.Config{Endpoints: c.clients} }

// StartCluster runs an n-member etcd cluster for fault tests: members can
// be stopped (Close) to take them away mid-test.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	names := make([]string, n)
	peers := make([]string, n)
	clients := make([]string, n)
	initial := ""
	for i := range n {
		names[i] = fmt.Sprintf("m%d", i)
		peers[i] = "http://" + freeAddr(tb)
		clients[i] = "http://" + freeAddr(tb)
		if i > 0 {
			initial += ","
		}
		initial += names[i] + "=" + peers[i]
	}
	c := &Cluster{Members: make([]*kvstore.Embedded, n), clients: clients}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() { // members wait for each other, so start them together
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c.Members[i], errs[i] = kvstore.StartEmbedded(ctx, kvstore.EmbedConfig{
				Dir: tb.TempDir(), Name: names[i], ClientURL: clients[i], PeerURL: peers[i], InitialCluster: initial, Fast: true,
			})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("start member %d: %v", i, err)
		}
	}
	tb.Cleanup(func() {
		for _, m := range c.Members {
			m.Close()
		}
	})
	return c
}

// freeAddr is a loopback address with a port that was free a moment ago.
func freeAddr(tb testing.TB) string {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("find a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().String()
}
