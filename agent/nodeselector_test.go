package agent

import (
	"context"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/cni"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestPoolNodeSelector: nodes in two racks (rack=r1, rack=r2), a pool
// per rack chosen by a node selector and a shared pool for every node.
// A pod that names no pool gets its rack's pool; a pod that names the
// other rack's pool is refused with the pool and its selector named. A
// node relabelled (its agent restarted with rack=r2) keeps its pod's
// address in its old rack's pool, claims no new block there, and gives
// the block back once it is empty; its new pods get the new rack's pool.
// An operator's change of a selector reaches running agents.
func TestPoolNodeSelector(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	for _, p := range []allocator.Pool{
		{Name: "rack-r1", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/24")}, NodeSelector: "rack=r1"},
		{Name: "rack-r2", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.97.0.0/24")}, NodeSelector: "rack=r2"},
		{Name: "shared", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.98.0.0/24")}},
	} {
		_, err := st.EnsurePool(ctx, p)
		require.NoError(t, err, "pool create %s", p.Name)
	}
	nodeCfg := func(name, rack string) Config {
		c := testConfig(t, e)
		c.Node, c.Pools, c.NodeLabels = name, nil, map[string]string{"rack": rack}
		return c
	}
	cfg1 := nodeCfg("node-1", "r1")
	n1 := startAgent(t, cfg1, Options{})
	n2 := startAgent(t, nodeCfg("node-2", "r2"), Options{})
	claims := func(pool, node string) int {
		t.Helper()
		infos, err := st.ListBlocks(ctx, pool)
		require.NoError(t, err)
		n := 0
		for _, bi := range infos {
			if bi.Owned(node) {
				n++
			}
		}
		return n
	}

	// Each rack's pods get the rack's pool; the shared pool serves both.
	pod1, err := n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	require.Equal(t, "rack-r1", pod1.Pool, "a pool for some nodes comes before the pool for all")
	pod2, err := n2.c.Allocate(ctx, api.AllocateRequest{Owner: owner(2), Permanent: true})
	require.NoError(t, err)
	require.Equal(t, "rack-r2", pod2.Pool)
	for i, n := range []*testAgent{n1, n2} {
		r, err := n.c.Allocate(ctx, api.AllocateRequest{Owner: owner(10 + i), Permanent: true, Pool: "shared"})
		require.NoError(t, err)
		require.Equal(t, "shared", r.Pool)
	}
	_, err = n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(3), Permanent: true, PodPool: "rack-r2"})
	ae := apiErr(t, err)
	require.Equal(t, http.StatusBadRequest, ae.Status)
	require.Contains(t, ae.Message, `pool "rack-r2" (from the pod's annotation kvipam.io/pool) is not served by node node-1: its node selector "rack=r2" does not choose the node's labels (rack=r1)`)
	require.Equal(t, uint(7), cni.Code(ae), "CNI error 7, as for a pool the node does not serve")
	require.Zero(t, claims("rack-r2", "node-1"), "nothing claimed in the other rack's pool")

	// node-1 moves to rack r2: its agent restarts with the new label.
	n1.shutdown()
	cfg1.NodeLabels = map[string]string{"rack": "r2"}
	n1 = startAgent(t, cfg1, Options{})
	again, err := n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err, "a retried ADD of a running pod")
	require.Equal(t, "rack-r1", again.Pool)
	require.Equal(t, pod1.IPs[0].Address, again.IPs[0].Address, "the running pod keeps its address")
	require.Equal(t, 1, claims("rack-r1", "node-1"), "the block that holds the pod stays claimed")
	_, err = n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(4), Permanent: true, PodPool: "rack-r1"})
	ae = apiErr(t, err)
	require.Contains(t, ae.Message, `its node selector "rack=r1" does not choose the node's labels (rack=r2)`)
	_, err = n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(5), Permanent: true, PodPool: "rack-r1", IPs: api.Addrs{netip.MustParseAddr("10.96.0.200")}})
	require.Error(t, err, "not even a static address in another block")
	require.Equal(t, 1, claims("rack-r1", "node-1"), "no new block in the old rack's pool")
	pod4, err := n1.c.Allocate(ctx, api.AllocateRequest{Owner: owner(4), Permanent: true})
	require.NoError(t, err)
	require.Equal(t, "rack-r2", pod4.Pool, "new pods get the new rack's pool")
	_, err = n1.c.Release(ctx, owner(1))
	require.NoError(t, err, "the running pod's DEL")
	require.Zero(t, claims("rack-r1", "node-1"), "the emptied block goes back to the old rack's pool")

	// An operator narrows the shared pool (kvipamctl pool select): the
	// agents follow it from their watch.
	_, err = st.UpdatePool(ctx, "shared", func(p *allocator.Pool) error { p.NodeSelector = "rack=r9"; return nil })
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := n2.c.Allocate(ctx, api.AllocateRequest{Owner: owner(20), Permanent: true, Pool: "shared"})
		if err == nil {
			_, _ = n2.c.Release(ctx, owner(20))
		}
		return err != nil
	}, 10*time.Second, 20*time.Millisecond, "a node the selector no longer chooses takes nothing new")
	_, err = n2.c.Release(ctx, owner(11))
	require.NoError(t, err)
	require.Zero(t, claims("shared", "node-2"), "and gives its emptied block back")
}

// TestStickyNextPodOnAnotherRack: a StatefulSet pod's next pod, scheduled
// on a node of another rack, does not take its kept address over (CNI
// error 7, as for any pool the node does not serve), and the error names
// the identity, its address, the pool, its selector and the node; the
// next pod on the identity's rack gets the address.
func TestStickyNextPodOnAnotherRack(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	st := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	_, err := st.EnsurePool(ctx, allocator.Pool{Name: "rack-r1", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/24")}, NodeSelector: "rack=r1"})
	require.NoError(t, err)
	nodeCfg := func(name, rack string) Config {
		c := testConfig(t, e)
		c.Node, c.Pools, c.NodeLabels = name, nil, map[string]string{"rack": rack}
		return c
	}
	n1 := startAgent(t, nodeCfg("node-1", "r1"), Options{})
	n2 := startAgent(t, nodeCfg("node-2", "r2"), Options{})
	n3 := startAgent(t, nodeCfg("node-3", "r1"), Options{})

	web := owner(30)
	kept, err := n1.c.Allocate(ctx, api.AllocateRequest{Owner: web, Permanent: true, Sticky: "10m", PodPool: "rack-r1"})
	require.NoError(t, err)
	x := kept.IPs[0].Address.Addr()
	_, err = n1.c.Release(ctx, web)
	require.NoError(t, err)
	next := web
	next.ContainerID = "ctr-web-next"
	_, err = n2.c.Allocate(ctx, api.AllocateRequest{Owner: next, Permanent: true, Sticky: "10m", PodPool: "rack-r1"})
	ae := apiErr(t, err)
	require.Equal(t, http.StatusBadRequest, ae.Status)
	require.Equal(t, uint(7), cni.Code(ae))
	require.Contains(t, ae.Message, "sticky identity ns/pod-30 has ["+x.String()+"] in pool rack-r1 (kept for it until")
	require.Contains(t, ae.Message, `which serves only nodes matching "rack=r1"; node node-2 (labels rack=r2) cannot take them over`)

	got, err := n3.c.Allocate(ctx, api.AllocateRequest{Owner: next, Permanent: true, Sticky: "10m", PodPool: "rack-r1"})
	require.NoError(t, err, "the same pod on the identity's rack")
	require.Equal(t, x, got.IPs[0].Address.Addr())
}
