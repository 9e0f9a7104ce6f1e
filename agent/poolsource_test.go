package agent

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestPoolsLiveInEtcd: pools live in etcd alone (invariant 8). An
// operator adds a cidr to a configured pool, removes another, and
// deletes a second configured pool, as kvipamctl pool add-cidr,
// remove-cidr and delete do (the same etcdstore calls). The agent,
// restarted with its old configuration, starts, keeps etcd's spec (the
// removed cidr stays out, the added one in, the deleted pool stays
// deleted) and its pod's address. An agent with no pool in its
// configuration serves etcd's pools, and a pool created while it runs.
func TestPoolsLiveInEtcd(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	inUse, spare, added := netip.MustParsePrefix("10.93.0.0/24"), netip.MustParsePrefix("10.93.1.0/24"), netip.MustParsePrefix("10.93.2.0/24")
	blue := allocator.Pool{Name: "blue", BlockSizeV4: 28, CIDRs: []netip.Prefix{inUse, spare}}
	old := allocator.Pool{Name: "old", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.94.0.0/24")}}
	cfg := testConfig(t, e)
	cfg.Pools, cfg.DefaultPool = []allocator.Pool{blue, old}, "blue"
	ta := startAgent(t, cfg, Options{})
	first, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true, IPs: api.Addrs{netip.MustParseAddr("10.93.0.5")}})
	require.NoError(t, err)
	ta.shutdown()

	// The operator's changes, as kvipamctl makes them.
	_, err = st.UpdatePool(ctx, "blue", func(p *allocator.Pool) error { p.CIDRs = append(p.CIDRs, added); return nil })
	require.NoError(t, err, "pool add-cidr")
	_, err = st.RemoveCIDR(ctx, "blue", spare, false)
	require.NoError(t, err, "pool remove-cidr")
	require.NoError(t, st.DeletePool(ctx, "old"), "pool delete")
	want, err := st.GetPool(ctx, "blue")
	require.NoError(t, err)

	// Restarted with the configuration it had: it starts, and etcd's
	// spec stands.
	ta = startAgent(t, cfg, Options{})
	got, err := st.GetPool(ctx, "blue")
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{inUse, added}, got.CIDRs, "the removed cidr stays out, the added one in")
	require.Equal(t, want.Rev, got.Rev, "the agent wrote nothing to the pool")
	_, err = st.GetPool(ctx, "old")
	require.ErrorIs(t, err, records.ErrPoolNotFound, "the deleted pool stays deleted")
	again, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	require.Equal(t, first.IPs[0].Address, again.IPs[0].Address, "the pod keeps its address")
	res, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(2), Permanent: true, IPs: api.Addrs{netip.MustParseAddr("10.93.2.7")}})
	require.NoError(t, err, "the added cidr is served")
	require.Equal(t, "10.93.2.7/32", res.IPs[0].Address.String())
	_, err = ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(3), Permanent: true, IPs: api.Addrs{netip.MustParseAddr("10.93.1.7")}})
	require.Error(t, err, "the removed cidr is not served")

	// An agent with no pool configured serves etcd's, and follows etcd.
	cfg2 := testConfig(t, e)
	cfg2.Node, cfg2.Pools = "node-2", nil
	tb := startAgent(t, cfg2, Options{})
	res, err = tb.c.Allocate(ctx, api.AllocateRequest{Owner: owner(4), Permanent: true})
	require.NoError(t, err, "the one pool in etcd is the default")
	require.Equal(t, "blue", res.Pool)
	_, err = st.EnsurePool(ctx, allocator.Pool{Name: "green", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.95.0.0/24")}})
	require.NoError(t, err, "pool create")
	require.Eventually(t, func() bool {
		res, err = tb.c.Allocate(ctx, api.AllocateRequest{Owner: owner(5), Permanent: true, Pool: "green"})
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "a pool created later is served without a restart")
	require.True(t, netip.MustParsePrefix("10.95.0.0/24").Contains(res.IPs[0].Address.Addr()))
	cfgPools, err := tb.c.Config(ctx)
	require.NoError(t, err)
	require.True(t, slices.Contains(cfgPools.Pools, "green"))
}
