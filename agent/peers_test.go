package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	"github.com/kvipam/kvipam/routing"
)

// TestPeerRoutes runs two agents, each managing its own scratch "node"
// namespace, the two joined by an underlay veth: each node routes the
// other's blocks via the other's underlay address, and a block given back
// to the pool loses its route.
func TestPeerRoutes(t *testing.T) {
	nsA, nsB, hA, hB := twoNodes(t)
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.80.0.0/24")}}
	start := func(node, netns, addr string) *testAgent {
		cfg := testConfig(t, e)
		cfg.Node, cfg.NetNS, cfg.NodeAddresses, cfg.Routing = node, netns, []string{addr}, RoutingHostGW
		cfg.Pools = []allocator.Pool{pool}
		return startAgent(t, cfg, Options{})
	}
	a := start("node-a", nsA.Path(), "10.254.0.1")
	b := start("node-b", nsB.Path(), "10.254.0.2")
	ctx := context.Background()
	ra, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	var rb *api.AllocateResponse
	for i := 2; i < 20; i++ { // two blocks on node-b
		rb, err = b.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
	}
	blockA := ra.IPs[0].Block
	lastB := rb.IPs[0].Block

	require.Eventually(t, func() bool { return nstest.RouteVia(t, hB, routing.Protocol, blockA) == "10.254.0.1" }, 10*time.Second, 20*time.Millisecond, "node-b routes node-a's block")
	require.Eventually(t, func() bool { return nstest.RouteVia(t, hA, routing.Protocol, lastB) == "10.254.0.2" }, 10*time.Second, 20*time.Millisecond, "node-a routes node-b's block")
	require.Empty(t, nstest.RouteVia(t, hA, routing.Protocol, blockA), "no route to a node's own block")

	// node-b releases the pods of its second block; the empty block goes
	// back to the pool and node-a drops the route.
	for i := 2; i < 20; i++ {
		r, err := b.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		if r.IPs[0].Block == lastB {
			_, err := b.c.Release(ctx, owner(i))
			require.NoError(t, err)
		}
	}
	require.Eventually(t, func() bool { return nstest.RouteVia(t, hA, routing.Protocol, lastB) == "" }, 10*time.Second, 20*time.Millisecond, "a freed block loses its route")
}

// TestPeerRoutesSurviveRestart restarts one agent while watching its node
// namespace's routes: the routes to the other node's blocks must stay as
// they are. A restarted agent used to sync before it had read the other
// nodes' addresses, delete those routes and add them back a moment later,
// dropping pod traffic across nodes.
func TestPeerRoutesSurviveRestart(t *testing.T) {
	nsA, nsB, hA, _ := twoNodes(t)
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.80.0.0/24")}}
	cfgA := testConfig(t, e)
	cfgA.Node, cfgA.NetNS, cfgA.NodeAddresses, cfgA.Routing, cfgA.Pools = "node-a", nsA.Path(), []string{"10.254.0.1"}, RoutingHostGW, []allocator.Pool{pool}
	cfgB := testConfig(t, e)
	cfgB.Node, cfgB.NetNS, cfgB.NodeAddresses, cfgB.Routing, cfgB.Pools = "node-b", nsB.Path(), []string{"10.254.0.2"}, RoutingHostGW, []allocator.Pool{pool}
	a := startAgent(t, cfgA, Options{})
	b := startAgent(t, cfgB, Options{})
	ctx := context.Background()
	rb, err := b.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	blockB := rb.IPs[0].Block
	require.Eventually(t, func() bool { return nstest.RouteVia(t, hA, routing.Protocol, blockB) == "10.254.0.2" }, 10*time.Second, 20*time.Millisecond, "node-a routes node-b's block")

	updates := make(chan netlink.RouteUpdate, 64)
	done := make(chan struct{})
	defer close(done)
	nsh, err := netns.GetFromPath(nsA.Path())
	require.NoError(t, err)
	defer nsh.Close()
	require.NoError(t, netlink.RouteSubscribeAt(nsh, updates, done))
	a.shutdown()
	a2 := startAgent(t, cfgA, Options{})
	require.Eventually(t, func() bool { return a2.a.peers.Passes() >= 1 }, 10*time.Second, 10*time.Millisecond, "the restarted agent syncs its routes")
	require.Equal(t, "10.254.0.2", nstest.RouteVia(t, hA, routing.Protocol, blockB))
	nstest.RequireNoRouteDelete(t, hA, updates, blockB)
}

// twoNodes makes two scratch node namespaces joined by an underlay veth,
// 10.254.0.1 in the first and 10.254.0.2 in the second.
func twoNodes(t *testing.T) (nsA, nsB ns.NetNS, hA, hB *netlink.Handle) {
	t.Helper()
	nsA, nsB = nstest.NewNS(t), nstest.NewNS(t)
	hA, hB = nstest.Handle(t, nsA), nstest.Handle(t, nsB)
	nstest.Underlay(t, nsA, nsB)
	return nsA, nsB, hA, hB
}
