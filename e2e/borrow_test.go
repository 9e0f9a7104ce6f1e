package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/e2e/cluster"
)

// TestBorrowWhenNoBlockFree: a pool of two blocks (10.9.0.0/25 in /26s),
// both claimed by node 1 and each about half full. Nodes 2 and 3 can
// claim no block, yet their pods get addresses: single addresses borrowed
// from node 1's blocks. Every node routes a borrowed address to the node
// that holds it (a /32 beside node 1's /26), so pods on all three nodes
// reach each other. When node 2's pods are gone their addresses are node
// 1's again, and the /32 routes go.
func TestBorrowWhenNoBlockFree(t *testing.T) {
	c := cluster.Start(t, cluster.Options{})
	r := newRouter(t)
	type member = routedNode
	join := func(name string, host int) *member { return joinRouted(t, c, r, name, host, "tight=10.9.0.0/25", "") }
	addPod := func(m *member, name string) netip.Addr {
		p := newPod(t, name)
		v4, _ := podAddrs(t, m.n.mustAdd(m.l, p))
		m.pods, m.ips = append(m.pods, p), append(m.ips, v4)
		return v4
	}
	ctx := context.Background()
	m1 := join("bw1", 11)

	// Node 1 fills its first block, claims the second, and gives back
	// every other address of the first: both blocks about half full.
	c1 := m1.n.client()
	var fill []api.Owner
	for i := 0; len(m1.n.poolStatus("tight", "ipv4").Blocks) < 2 || i < 95; i++ {
		o := api.Owner{ContainerID: fmt.Sprintf("fill-%03d", i), IfName: "eth0"}
		_, err := c1.Allocate(ctx, api.AllocateRequest{Owner: o, Pool: "tight", Permanent: true})
		require.NoError(t, err)
		fill = append(fill, o)
	}
	blocks := m1.n.poolStatus("tight", "ipv4").Blocks
	require.Len(t, blocks, 2, "node 1 holds both blocks of the pool")
	for i, o := range fill {
		als, err := c1.Allocations(ctx, o)
		require.NoError(t, err)
		if i%2 == 0 && blocks[0].Contains(als[0].Address.Addr()) {
			_, err := c1.Release(ctx, o)
			require.NoError(t, err)
		}
	}
	st := m1.n.poolStatus("tight", "ipv4")
	t.Logf("node 1: blocks %v, %d addresses used, %d free", st.Blocks, st.Used, st.Free)
	require.Greater(t, st.Free, 20)
	addPod(m1, "bw1-p0")

	m2, m3 := join("bw2", 12), join("bw3", 13)
	b0 := addPod(m2, "bw2-p0")
	b1 := addPod(m2, "bw2-p1")
	c0 := addPod(m3, "bw3-p0")
	for _, ip := range []netip.Addr{b0, b1, c0} {
		require.True(t, blocks[0].Contains(ip) || blocks[1].Contains(ip), "%s is borrowed from node 1's blocks", ip)
	}
	require.Empty(t, m2.n.poolStatus("tight", "ipv4").Blocks, "node 2 claimed no block")
	require.Equal(t, 2, m2.n.poolStatus("tight", "ipv4").Borrowed)
	require.Equal(t, 3, m1.n.poolStatus("tight", "ipv4").Lent)

	members := []*member{m1, m2, m3}
	host := func(ip netip.Addr) netip.Prefix { return netip.PrefixFrom(ip, 32) }
	for _, m := range members {
		h := nlHandle(t, m.n.host)
		waitFor(t, 15*time.Second, m.n.name+" to route the borrowed addresses to their holders", func() bool {
			ok := true
			for _, holder := range []*member{m2, m3} {
				for _, ip := range holder.ips {
					if holder != m {
						ok = ok && hasRoute(h, host(ip), holder.addr.String())
					}
				}
			}
			for _, b := range blocks {
				if m != m1 {
					ok = ok && hasRoute(h, b, m1.addr.String())
				}
			}
			return ok
		})
	}
	for _, from := range members {
		for _, p := range from.pods {
			for _, to := range members {
				for _, ip := range to.ips {
					require.NoError(t, ping(p.ns, ip), "%s -> %s on %s", p.name, ip, to.n.name)
				}
			}
		}
	}

	// Node 2's pods go: node 1 gets their addresses back, and nobody
	// routes them to node 2 any more.
	for _, p := range m2.pods {
		require.NoError(t, m2.n.del(m2.l, p))
	}
	for _, m := range []*member{m1, m3} {
		h := nlHandle(t, m.n.host)
		waitFor(t, 15*time.Second, m.n.name+" to drop the /32 routes to node 2", func() bool {
			return !hasRoute(h, host(b0), m2.addr.String()) && !hasRoute(h, host(b1), m2.addr.String())
		})
	}
	got := map[netip.Addr]bool{}
	for i := 0; ; i++ {
		res, err := c1.Allocate(ctx, api.AllocateRequest{Owner: api.Owner{ContainerID: fmt.Sprintf("refill-%03d", i), IfName: "eth0"}, Pool: "tight", Permanent: true})
		if err != nil {
			var ae *api.Error
			require.ErrorAs(t, err, &ae)
			require.Equal(t, api.CodeExhausted, ae.Code, "node 1 fills the pool: %v", err)
			break
		}
		got[res.IPs[0].Address.Addr()] = true
	}
	require.True(t, got[b0] && got[b1], "node 2's former addresses %s and %s are node 1's again", b0, b1)
	require.False(t, got[c0], "node 3's borrowed address stays node 3's")
	require.Equal(t, 1, m1.n.poolStatus("tight", "ipv4").Lent)
	require.NoError(t, ping(m1.pods[0].ns, c0), "node 3's pod is still reached")
	_ = netlink.FAMILY_V4
}

// routedNode is a node on the router's subnet A whose agent runs on the
// etcd cluster, with its conflist and the pods a test added.
type routedNode struct {
	n    *node
	addr netip.Addr
	l    *libcni.NetworkConfigList
	pods []*pod
	ips  []netip.Addr
}

// joinRouted starts node name at .host of subnet A serving pool (NAME=CIDR);
// kvipamExtra is added to the kvipam plugin's configuration.
func joinRouted(t *testing.T, c *cluster.Cluster, r *router, name string, host int, pool, kvipamExtra string) *routedNode {
	n := newNode(t, name)
	addr := r.attach(t, n, "A", host)
	n.startAgent(agentOpts{pools: []string{pool}, etcd: c, extra: []string{"--node-address", addr.String()}})
	return &routedNode{n: n, addr: addr, l: n.kvipamList("kv", "1.0.0", kvipamExtra)}
}
