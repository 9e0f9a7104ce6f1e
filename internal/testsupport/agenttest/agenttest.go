// Package agenttest starts simulated kvipam agents against an embedded etcd
// for tests: each has its own etcd client, a lease kept alive, a node record
// on that lease and a restored allocator, as a real agent at start-up. It
// lets tests build etcd state with the real allocator rather than by hand.
package agenttest

import (
	"context"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// Agent is one simulated agent. Its lease is kept alive until the test
// ends or Kill.
type Agent struct {
	Name    string
	Client  *clientv3.Client
	Store   *etcdstore.Store
	Session *kvstore.Session
	Alloc   *nodealloc.Allocator
}

// Options tune Start.
type Options struct {
	// Pools the agent is to find in etcd at start (it serves every pool
	// etcd holds): a check of the test's set-up.
	Pools []string
	// Labels are the node's labels, which pools' node selectors choose by.
	Labels map[string]string
	// LeaseTTL of the node lease in seconds. Default 30.
	LeaseTTL int64
	// ReservationTTL for reservations. Default: the store's.
	ReservationTTL time.Duration
	// HistoryRetention of IP history records. Default: the store's.
	HistoryRetention time.Duration
	// Older makes the agent stand for kvipam v0.1.0: its node record
	// names no schema features (allocator/schema), so it is at level 1.
	// Otherwise it names this build's.
	Older bool
}

// Start starts an agent named name on e.
func Start(tb testing.TB, e *kvstore.Embedded, name string, o Options) *Agent {
	tb.Helper()
	ctx := context.Background()
	if o.LeaseTTL == 0 {
		o.LeaseTTL = 30
	}
	cli := etcdtest.Client(tb, e)
	st := etcdstore.New(cli, etcdstore.Options{ReservationTTL: o.ReservationTTL, HistoryRetention: o.HistoryRetention})
	sess, err := kvstore.NewSession(ctx, cli, o.LeaseTTL)
	if err != nil {
		tb.Fatalf("agent %s: %v", name, err)
	}
	tb.Cleanup(sess.Close)
	rec := etcdstore.NodeRecord{Name: name, StartedAt: time.Now().UTC(), Lease: sess.ID(), Labels: o.Labels, Features: schema.Names()}
	if o.Older {
		rec.Version, rec.Features = "v0.1.0", nil
	}
	if err := st.WriteNode(ctx, rec, sess.ID()); err != nil {
		tb.Fatalf("agent %s: %v", name, err)
	}
	al, err := nodealloc.New(nodealloc.Config{Node: name, Store: st, Labels: o.Labels})
	if err != nil {
		tb.Fatalf("agent %s: %v", name, err)
	}
	if err := al.Restore(ctx, sess); err != nil {
		tb.Fatalf("agent %s: restore: %v", name, err)
	}
	for _, p := range o.Pools {
		if _, ok := al.Pool(p); !ok {
			tb.Fatalf("agent %s: pool %s is not in etcd", name, p)
		}
	}
	return &Agent{Name: name, Client: cli, Store: st, Session: sess, Alloc: al}
}

// Kill ends the agent's lease as if it crashed and stayed away longer than
// the TTL: its node record and claims go, its homes and allocations stay.
func (a *Agent) Kill(tb testing.TB) {
	tb.Helper()
	if err := a.Session.Revoke(context.Background()); err != nil {
		tb.Fatalf("kill agent %s: %v", a.Name, err)
	}
}

// Allocate gives n owners, numbered from first (see Owner), one address
// per family of pool each, and returns the allocations in order.
func (a *Agent) Allocate(tb testing.TB, pool string, first, n int, reserve bool) []records.Allocation {
	tb.Helper()
	var out []records.Allocation
	for i := first; i < first+n; i++ {
		r, err := a.Alloc.Allocate(context.Background(), nodealloc.Request{Pool: pool, Owner: Owner(i), Reserve: reserve})
		if err != nil {
			tb.Fatalf("agent %s: %v", a.Name, err)
		}
		out = append(out, r.Allocations...)
	}
	return out
}

// Owner is the i-th test owner: container ctr-<i>, interface eth0.
func Owner(i int) records.Owner {
	return records.Owner{ContainerID: fmt.Sprintf("ctr-%04d", i), IfName: "eth0", Namespace: "default", Pod: fmt.Sprintf("pod-%d", i)}
}

// EnsurePool creates p on e.
func EnsurePool(tb testing.TB, e *kvstore.Embedded, p allocator.Pool) {
	tb.Helper()
	if _, err := etcdstore.New(etcdtest.Client(tb, e), etcdstore.Options{}).EnsurePool(context.Background(), p); err != nil {
		tb.Fatalf("ensure pool %s: %v", p.Name, err)
	}
}
