package inspect_test

import (
	"context"
	"encoding/json"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// small has 16 blocks of 16 addresses: 254 usable (network, broadcast).
var small = allocator.Pool{Name: "small", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/24")}, BlockSizeV4: 28}

type agent = agenttest.Agent

func startAgent(t testing.TB, e *kvstore.Embedded, name string, resTTL time.Duration) *agent {
	t.Helper()
	return agenttest.Start(t, e, name, agenttest.Options{Pools: []string{small.Name}, ReservationTTL: resTTL})
}

func allocate(t testing.TB, a *agent, first, n int, reserve bool) []records.Allocation {
	t.Helper()
	return a.Allocate(t, small.Name, first, n, reserve)
}

var owner = agenttest.Owner

// env is an etcd with the small pool and a client for the operator.
type env struct {
	e   *kvstore.Embedded
	cli *clientv3.Client
	in  *inspect.Inspector
}

func newEnv(t testing.TB) *env {
	t.Helper()
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	agenttest.EnsurePool(t, e, small)
	return &env{e: e, cli: cli, in: inspect.New(cli, inspect.Options{})}
}

func (v *env) snapshot(t testing.TB) *inspect.Snapshot {
	t.Helper()
	s, err := v.in.Snapshot(context.Background())
	require.NoError(t, err)
	return s
}

// removeNode plans node remove of node, stated gone now, and runs it.
func (v *env) removeNode(t testing.TB, node string) {
	t.Helper()
	p, err := inspect.PlanNodeRemove(v.snapshot(t), node, gone(node), false)
	require.NoError(t, err)
	_, err = v.in.Execute(context.Background(), p, nil)
	require.NoError(t, err)
}

func (v *env) check(t testing.TB) inspect.Report {
	t.Helper()
	r, err := v.in.Check(context.Background(), v.snapshot(t))
	require.NoError(t, err)
	return r
}

// put writes a raw value as an operator with etcdctl would.
func (v *env) put(t testing.TB, key string, val any, opts ...clientv3.OpOption) {
	t.Helper()
	s, ok := val.(string)
	if !ok {
		b, err := json.Marshal(val)
		require.NoError(t, err)
		s = string(b)
	}
	_, err := v.cli.Put(context.Background(), key, s, opts...)
	require.NoError(t, err)
}

func (v *env) lease(t testing.TB) clientv3.LeaseID {
	t.Helper()
	resp, err := v.cli.Grant(context.Background(), 60)
	require.NoError(t, err)
	return resp.ID
}

func (v *env) exists(t testing.TB, key string) bool {
	t.Helper()
	resp, err := v.cli.Get(context.Background(), key, clientv3.WithCountOnly())
	require.NoError(t, err)
	return resp.Count > 0
}

// count is the number of keys under prefix.
func (v *env) count(t testing.TB, prefix string) int64 {
	t.Helper()
	resp, err := v.cli.Get(context.Background(), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	return resp.Count
}

// freeBlock returns a block of small with no claim, home or allocation.
func freeBlock(t testing.TB, s *inspect.Snapshot) netip.Prefix {
	t.Helper()
	used := map[netip.Prefix]bool{}
	for _, r := range inspect.Blocks(s, small.Name) {
		used[r.Block] = true
	}
	for i := range small.BlockCount(allocator.IPv4) {
		b, err := allocator.BlockAt(small.CIDRs[0], small.BlockSizeV4, i)
		require.NoError(t, err)
		if !used[b] {
			return b
		}
	}
	t.Fatal("no free block")
	return netip.Prefix{}
}

func addrAt(t testing.TB, b netip.Prefix, off int) netip.Addr {
	t.Helper()
	a, ok := allocator.AddrAt(b, off)
	require.True(t, ok)
	return a
}

func record(o records.Owner, node string, state records.State) records.Record {
	return records.Record{Owner: o, Node: node, State: state, Since: time.Now().UTC()}
}

// gone is an operator's statement that node is gone, last seen now: after
// every record the test wrote.
func gone(node string) inspect.Evidence {
	now := time.Now().UTC()
	return inspect.Evidence{ConfirmGone: node, LastSeen: now, StatedBy: "tester", StatedAt: now}
}

// kinds is the set of finding kinds in r.
func kinds(r inspect.Report) map[inspect.Kind]bool {
	out := map[inspect.Kind]bool{}
	for _, f := range r.Findings {
		out[f.Kind] = true
	}
	return out
}
