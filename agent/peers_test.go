package agent

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/internal/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestPeerRoutes runs two agents, each managing its own scratch "node"
// namespace, the two joined by an underlay veth: each node routes the
// other's blocks via the other's underlay address, and a block given back
// to the pool loses its route.
func TestPeerRoutes(t *testing.T) {
	nsA, nsB := nstest.NewNS(t), nstest.NewNS(t)
	hA, hB := nstest.Handle(t, nsA), nstest.Handle(t, nsB)
	underlay := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ul0"}, PeerName: "ul0", PeerNamespace: netlink.NsFd(int(nsB.Fd()))}
	require.NoError(t, hA.LinkAdd(underlay))
	for _, side := range []struct {
		h    *netlink.Handle
		addr string
	}{{hA, "10.254.0.1/24"}, {hB, "10.254.0.2/24"}} {
		l, err := side.h.LinkByName("ul0")
		require.NoError(t, err)
		ad, err := netlink.ParseAddr(side.addr)
		require.NoError(t, err)
		require.NoError(t, side.h.AddrAdd(l, ad))
		require.NoError(t, side.h.LinkSetUp(l))
	}
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "default", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.80.0.0/24")}}
	start := func(node, netns, addr string) *testAgent {
		cfg := testConfig(t, e)
		cfg.Node, cfg.NetNS, cfg.NodeAddresses, cfg.PeerRoutes = node, netns, []string{addr}, true
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

	require.Eventually(t, func() bool { return routeVia(t, hB, blockA) == "10.254.0.1" }, 10*time.Second, 20*time.Millisecond, "node-b routes node-a's block")
	require.Eventually(t, func() bool { return routeVia(t, hA, lastB) == "10.254.0.2" }, 10*time.Second, 20*time.Millisecond, "node-a routes node-b's block")
	require.Empty(t, routeVia(t, hA, blockA), "no route to a node's own block")

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
	require.Eventually(t, func() bool { return routeVia(t, hA, lastB) == "" }, 10*time.Second, 20*time.Millisecond, "a freed block loses its route")
}

// routeVia returns the gateway of the kvipam route to dst, or "".
func routeVia(t testing.TB, h *netlink.Handle, dst netip.Prefix) string {
	routes, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: routeProtocol}, netlink.RT_FILTER_PROTOCOL)
	require.NoError(t, err)
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == (&net.IPNet{IP: net.IP(dst.Addr().AsSlice()), Mask: net.CIDRMask(dst.Bits(), 32)}).String() {
			return r.Gw.String()
		}
	}
	return ""
}
