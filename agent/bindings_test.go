package agent

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestPoolChoice: the pool of an allocation is, in this order, the pod's
// annotation (PodPool), its namespace's binding in etcd (followed by a
// watch), the configuration's pool, the agent's default. A pool the node
// does not serve, from any of them, fails with the pod, the pool and where
// the choice came from, and allocates nothing.
func TestPoolChoice(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	pool := func(name, cidr string) allocator.Pool {
		return allocator.Pool{Name: name, BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix(cidr)}}
	}
	cfg.Pools = []allocator.Pool{pool("default", "10.61.0.0/24"), pool("blue", "10.62.0.0/24"), pool("green", "10.63.0.0/24")}
	ta := startAgent(t, cfg, Options{})
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	purple := pool("purple", "10.64.0.0/24")
	purple.NodeSelector = "rack=r9" // in etcd, not for this node
	_, err := st.EnsurePool(ctx, purple)
	require.NoError(t, err)
	require.ErrorIs(t, st.BindNamespace(ctx, "team", "nope"), records.ErrPoolNotFound, "no binding to a pool etcd does not have")
	require.NoError(t, st.BindNamespace(ctx, "team", "green"))
	require.NoError(t, st.BindNamespace(ctx, "odd", "purple"))

	n := 0
	alloc := func(ns, podPool, confPool string) (*api.AllocateResponse, error) {
		n++
		o := owner(n)
		o.Namespace = ns
		return ta.c.Allocate(ctx, api.AllocateRequest{Owner: o, PodPool: podPool, Pool: confPool, Permanent: true})
	}
	poolOf := func(ns, podPool, confPool string) string {
		t.Helper()
		r, err := alloc(ns, podPool, confPool)
		require.NoError(t, err)
		return r.Pool
	}
	require.Eventually(t, func() bool { return poolOf("team", "", "blue") == "green" }, 10*time.Second, 20*time.Millisecond,
		"the namespace binding, once the watch has it, comes before the configuration's pool")
	require.Equal(t, "blue", poolOf("team", "blue", "default"), "the pod's annotation comes first")
	require.Equal(t, "blue", poolOf("other", "", "blue"), "then the configuration's pool")
	require.Equal(t, "default", poolOf("other", "", ""), "then the agent's default")

	cli := etcdtest.Client(t, e)
	count := func() int64 {
		resp, err := cli.Get(ctx, etcdstore.AllIPsPrefix(), clientv3.WithPrefix(), clientv3.WithCountOnly())
		require.NoError(t, err)
		return resp.Count
	}
	// The pool and binding watches are apart: the binding may be seen
	// before the pool it names, and until the pool is seen the agent says
	// etcd has no such pool. Await the pool.
	require.Eventually(t, func() bool {
		_, err := alloc("odd", "", "")
		return err != nil && strings.Contains(err.Error(), `node selector "rack=r9"`)
	}, 10*time.Second, 20*time.Millisecond, "the agent sees pool purple and its selector")
	before := count()
	for _, tc := range []struct{ ns, podPool, field, want string }{
		{"other", "nope", "podPool", `pool "nope" (from the pod's annotation kvipam.io/pool)`},
		{"odd", "", "owner.namespace", `pool "purple" (from namespace odd's binding (kvipamctl pool bind-namespace)) is not served by node node-1: its node selector "rack=r9" does not choose the node's labels (none)`},
	} {
		_, err := alloc(tc.ns, tc.podPool, "")
		ae := apiErr(t, err)
		require.Equal(t, 400, ae.Status)
		require.Equal(t, tc.field, ae.Field)
		require.Contains(t, ae.Message, tc.want)
		require.Contains(t, ae.Message, "pod "+tc.ns+"/pod-")
	}
	require.Equal(t, before, count(), "a refused request allocates nothing")

	require.NoError(t, st.UnbindNamespace(ctx, "team"))
	require.Eventually(t, func() bool { return poolOf("team", "", "blue") == "blue" }, 10*time.Second, 20*time.Millisecond, "unbound")
}

// ownerIPs reads from etcd every address the owner holds in the pools.
func ownerIPs(t testing.TB, cli *clientv3.Client, o api.Owner, pools ...string) []records.Allocation {
	t.Helper()
	var out []records.Allocation
	for _, p := range pools {
		resp, err := cli.Get(context.Background(), etcdstore.IPsPrefix(p), clientv3.WithPrefix())
		require.NoError(t, err)
		als, err := agenttest.DecodeAllocations(p, resp.Kvs)
		require.NoError(t, err)
		for _, al := range als {
			if al.ContainerID == o.ContainerID && al.IfName == o.IfName {
				out = append(out, al)
			}
		}
	}
	return out
}

// TestRetriedAddAfterNamespaceRebind: an ADD lands in the pool its
// namespace is bound to; an operator rebinds the namespace (kvipamctl
// pool bind-namespace) and the runtime retries the same ADD (the answer
// was lost). The retry gets the addresses that landed, in the pool they
// are in, and etcd holds one address per family for the owner, not a
// second pair in the new pool.
func TestRetriedAddAfterNamespaceRebind(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	pool := func(name string, i int) allocator.Pool {
		return allocator.Pool{Name: name, BlockSizeV4: 28, BlockSizeV6: 124, CIDRs: []netip.Prefix{
			netip.MustParsePrefix(fmt.Sprintf("10.%d.0.0/24", i)), netip.MustParsePrefix(fmt.Sprintf("fd00:%d::/64", i))}}
	}
	cfg.Pools = []allocator.Pool{pool("default", 61), pool("green", 63), pool("blue", 62)}
	ta := startAgent(t, cfg, Options{})
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	cli := etcdtest.Client(t, e)
	bindTo := func(p string) {
		t.Helper()
		require.NoError(t, st.BindNamespace(ctx, "team", p))
		require.Eventually(t, func() bool { return ta.a.bindings.poolFor("team") == p }, 10*time.Second, 10*time.Millisecond,
			"the agent's watch has the binding")
	}

	o := owner(1)
	o.Namespace = "team"
	bindTo("green")
	first, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	require.Equal(t, "green", first.Pool)
	require.Len(t, first.IPs, 2)

	bindTo("blue")
	retried, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: o})
	require.NoError(t, err)
	require.Equal(t, "green", retried.Pool, "a retried ADD stays in the pool its addresses are in")
	require.Equal(t, first.IPs, retried.IPs, "and gets the addresses that landed")

	held := ownerIPs(t, cli, o, "default", "green", "blue")
	require.Len(t, held, 2, "etcd holds one address per family for the owner: %v", held)
	require.NotEqual(t, allocator.FamilyOf(held[0].Addr), allocator.FamilyOf(held[1].Addr))

	other := owner(2)
	other.Namespace = "team"
	r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: other, Permanent: true})
	require.NoError(t, err)
	require.Equal(t, "blue", r.Pool, "a new pod of the namespace gets the new binding")
}
