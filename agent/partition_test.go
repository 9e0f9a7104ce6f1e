package agent

import (
	"context"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/agent/delqueue"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/cutproxy"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// cutProxy is a cutproxy.Proxy with the test's cleanup.
type cutProxy struct{ *cutproxy.Proxy }

func newCutProxy(t testing.TB, target string) *cutProxy {
	p, err := cutproxy.New(target)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return &cutProxy{p}
}

func (p *cutProxy) partition() { p.Stall() } // packets dropped, connections hang

func (p *cutProxy) heal() { p.Heal() }

func (p *cutProxy) endpoint() string { return "http://" + p.Addr() }

// behindCutProxy points cfg at e through a proxy the test can cut, with a
// lease of ttl and a request timeout of a second, so that a partition
// outlives the lease quickly; it returns the proxy.
func behindCutProxy(t testing.TB, e *kvstore.Embedded, cfg *Config, ttl time.Duration) *cutProxy {
	t.Helper()
	u, err := url.Parse(e.Endpoints()[0])
	require.NoError(t, err)
	proxy := newCutProxy(t, u.Host)
	cfg.Etcd = EtcdConfig{Endpoints: []string{proxy.endpoint()}, DialTimeout: Duration{time.Second}}
	cfg.LeaseTTL = Duration{ttl}
	cfg.RequestTimeout = Duration{time.Second}
	return proxy
}

// TestPartitionedAgent cuts one agent off etcd for longer than its lease
// while another keeps working (flannel's duplicate-subnet failure): the
// other agent cannot take the cut-off agent's blocks that hold pods, and
// when the partition heals the first agent re-claims them with every
// address unchanged.
func TestPartitionedAgent(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	small := allocator.Pool{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.79.0.0/26")}}
	cfgA := testConfig(t, e)
	cfgA.Node, cfgA.Pools = "node-a", []allocator.Pool{small}
	proxy := behindCutProxy(t, e, &cfgA, 2*time.Second)
	a := startAgent(t, cfgA, Options{})
	var held []api.IPConfig
	for i := range 20 { // two blocks of node-a hold pods
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		held = append(held, r.IPs...)
	}

	lease := a.a.lease.session()
	proxy.partition()
	<-lease.Done()
	cli := etcdtest.Client(t, e) // etcd itself is fine for everyone else
	// etcd expires node-a's lease on its own clock; wait for the claims to go.
	require.Eventually(t, func() bool {
		bs, err := etcdstore.New(cli, etcdstore.Options{}).ListBlocks(ctx, "default")
		require.NoError(t, err)
		for _, b := range bs {
			if b.Claim != nil {
				return false
			}
		}
		return true
	}, 10*time.Second, 50*time.Millisecond, "node-a's claims expire with its lease")

	cfgB := testConfig(t, e)
	cfgB.Node, cfgB.Pools = "node-b", []allocator.Pool{small}
	b := startAgent(t, cfgB, Options{})
	heldByA := map[netip.Prefix]bool{}
	for _, ip := range held {
		heldByA[ip.Block] = true
	}
	for i := 100; ; i++ {
		r, err := b.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		if err != nil {
			require.Equal(t, api.CodeExhausted, apiErr(t, err).Code, err.Error())
			require.Contains(t, err.Error(), "2 more orphaned")
			break
		}
		require.False(t, heldByA[r.IPs[0].Block], "node-b allocated %s inside cut-off node-a's block", r.IPs[0].Address)
	}
	_, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(50)})
	require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code, "the cut-off agent refuses to allocate")

	proxy.heal()
	require.NoError(t, waitReady(a.c, 30*time.Second))
	var after []api.IPConfig
	for i := range 20 {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		after = append(after, r.IPs...)
	}
	require.Equal(t, held, after, "node-a kept every address through the partition")
}

// TestQueuedDelAppliedWhenEtcdReturns: a DEL a plugin queued while its
// agent could not reach etcd is applied as soon as etcd answers again, not
// at the reconciler's next pass (an hour here): the address must not stay
// held by a pod that is gone.
func TestQueuedDelAppliedWhenEtcdReturns(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	proxy := behindCutProxy(t, e, &cfg, 2*time.Second)
	a := startAgent(t, cfg, Options{})
	for i := range 2 {
		_, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
	}

	lease := a.a.lease.session()
	proxy.partition()
	_, err := a.c.Release(ctx, owner(1))
	require.Equal(t, api.CodeTryAgain, apiErr(t, err).Code, "the cut-off agent cannot release")
	require.NoError(t, delqueue.Enqueue(cfg.delQueueDir(), owner(1))) // what the plugin does then
	<-lease.Done()                                                    // past the lease, as in the chaos run
	proxy.heal()

	cli := etcdtest.Client(t, e)
	// The drain releases first and removes the queued entry after: await both.
	require.Eventually(t, func() bool {
		for _, al := range storeIPs(t, cli) {
			if al.ContainerID == owner(1).ContainerID {
				return false
			}
		}
		queued, err := delqueue.List(cfg.delQueueDir())
		require.NoError(t, err)
		return len(queued) == 0
	}, 15*time.Second, 50*time.Millisecond, "the queued DEL is applied, and taken off the queue, once etcd answers again")
	held := storeIPs(t, cli)
	require.NotEmpty(t, held)
	for _, al := range held {
		require.Equal(t, owner(0).ContainerID, al.ContainerID, "owner 0 keeps its addresses")
	}
}

// TestQueuedDelAppliedWhileRunning: a DEL a plugin queued while its agent
// was restarting, after the agent drained the queue at start, is applied
// within seconds, not at the reconciler's next pass (an hour here).
func TestQueuedDelAppliedWhileRunning(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	a := startAgent(t, cfg, Options{})
	_, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	require.NoError(t, delqueue.Enqueue(cfg.delQueueDir(), owner(1)))
	cli := etcdtest.Client(t, e)
	require.Eventually(t, func() bool { return len(storeIPs(t, cli)) == 0 }, 10*time.Second, 50*time.Millisecond,
		"the queued DEL is applied while the agent runs")
}
