package routing

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// scriptedPeers delivers block homes at once and node records only when
// the test says, as a real etcd may when one list answers before the other.
type scriptedPeers struct {
	homes []etcdstore.BlockHome
	nodes []etcdstore.NodeInfo
	go_   chan struct{}
}

func (s *scriptedPeers) WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error {
	h.Reset(s.homes)
	<-ctx.Done()
	return ctx.Err()
}

func (s *scriptedPeers) WatchNodes(ctx context.Context, h etcdstore.Handler[etcdstore.NodeInfo]) error {
	select {
	case <-s.go_:
		h.Reset(s.nodes)
	case <-ctx.Done():
	}
	<-ctx.Done()
	return ctx.Err()
}

// TestPeerRouterWaitsForBothLists starts a peer router over a namespace
// that already has its route to a peer's block (as after an agent
// restart), with the homes listed but the node records not yet: it must
// not touch the route until it knows the peers' addresses.
func TestPeerRouterWaitsForBothLists(t *testing.T) {
	ns := nstest.NewNS(t)
	h := nstest.Handle(t, ns)
	nstest.AddLink(t, h, "ul0")
	l, err := h.LinkByName("ul0")
	require.NoError(t, err)
	ad, err := netlink.ParseAddr("10.254.0.1/24")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(l, ad))
	require.NoError(t, h.LinkSetUp(l))
	block := netip.MustParsePrefix("10.80.0.16/28")
	require.NoError(t, h.RouteAdd(&netlink.Route{Dst: prefixNet(block), Gw: net.ParseIP("10.254.0.2"), Protocol: Protocol}))

	updates := make(chan netlink.RouteUpdate, 64)
	done := make(chan struct{})
	defer close(done)
	nsh, err := netns.GetFromPath(ns.Path())
	require.NoError(t, err)
	defer nsh.Close()
	require.NoError(t, netlink.RouteSubscribeAt(nsh, updates, done))

	src := &scriptedPeers{
		homes: []etcdstore.BlockHome{{Pool: "default", Block: block, Node: "node-b"}},
		nodes: []etcdstore.NodeInfo{{Name: "node-b", Addresses: []netip.Addr{netip.MustParseAddr("10.254.0.2")}}},
		go_:   make(chan struct{}),
	}
	p := NewPeers("node-a", ns.Path(), src, NewHostGW(hclog.NewNullLogger()), hclog.NewNullLogger())
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); p.Run(ctx) }()
	defer func() { cancel(); <-stopped }()

	require.Eventually(t, func() bool { return p.Passes() >= 1 }, 10*time.Second, 5*time.Millisecond, "the router woke for the homes")
	close(src.go_)
	require.Eventually(t, func() bool { return p.Passes() >= 2 }, 10*time.Second, 5*time.Millisecond, "and for the node records")
	require.Equal(t, "10.254.0.2", nstest.RouteVia(t, h, Protocol, block))
	nstest.RequireNoRouteDelete(t, h, updates, block)
}
