package e2e

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// TestTwoNodes runs two nodes joined by an underlay link, one etcd (node
// a's embedded one, listening on the underlay), and one agent each: they
// claim different blocks, route each other's blocks (host-gw), and a pod
// on node a pings a pod on node b and back.
func TestTwoNodes(t *testing.T) {
	a, b := newNode(t, "na"), newNode(t, "nb")
	underlay(t, a, b)
	ha, hb := nlHandle(t, a.host), nlHandle(t, b.host)
	const pool = "default=10.1.0.0/16"
	const etcd = "http://10.254.0.1:2379" // node a's namespace is fresh: the port is free
	a.startAgent(agentOpts{pools: []string{pool}, extra: []string{"--embedded-etcd-listen", etcd, "--node-address", "10.254.0.1"}})
	b.startAgent(agentOpts{pools: []string{pool}, etcdURL: etcd, extra: []string{"--node-address", "10.254.0.2"}})

	la, lb := a.kvipamList("kv", "1.0.0", ""), b.kvipamList("kv", "1.0.0", "")
	pa, pb := newPod(t, "pa"), newPod(t, "pb")
	ra, rb := a.mustAdd(la, pa), b.mustAdd(lb, pb)
	ipa, _ := podAddrs(t, ra)
	ipb, _ := podAddrs(t, rb)
	blockA, blockB := a.poolStatus("default", "ipv4").Blocks[0], b.poolStatus("default", "ipv4").Blocks[0]
	require.NotEqual(t, blockA, blockB, "the nodes claimed different blocks")
	require.True(t, blockB.Contains(ipb))

	waitFor(t, 10*time.Second, "each node to route the other's block", func() bool {
		return hasRoute(ha, blockB, "10.254.0.2") && hasRoute(hb, blockA, "10.254.0.1")
	})
	require.NoError(t, ping(pa.ns, ipb), "pod on node a reaches pod on node b")
	require.NoError(t, ping(pb.ns, ipa), "and back")

	require.NoError(t, a.del(la, pa))
	require.NoError(t, b.del(lb, pb))
}

func hasRoute(h *netlink.Handle, dst netip.Prefix, via string) bool {
	routes, err := h.RouteList(nil, netlink.FAMILY_V4)
	if err != nil {
		return false
	}
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == dst.String() && r.Gw.String() == via {
			return true
		}
	}
	return false
}
