package agent

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestVXLANRefusesLargeMTU: in vxlan mode a pod MTU given by hand that
// the overlay cannot carry (more than the underlay's less 50) stops the
// agent at start, naming the limit; with the MTU detected, pods get the
// overlay's.
func TestVXLANRefusesLargeMTU(t *testing.T) {
	e := etcdtest.Start(t)
	host := nstest.NewNS(t)
	h := nstest.Handle(t, host)
	ul := nstest.AddLink(t, h, "ul0")
	ad, err := netlink.ParseAddr("10.254.1.10/24")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(ul, ad))
	require.NoError(t, h.RouteAdd(&netlink.Route{Gw: net.ParseIP("10.254.1.1"), LinkIndex: ul.Attrs().Index}))

	cfg := testConfig(t, e)
	cfg.NetNS, cfg.NodeAddresses = host.Path(), []string{"10.254.1.10"}
	cfg.Routing, cfg.MTU = RoutingVXLAN, 1500
	a, err := New(cfg, Options{})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = a.Run(ctx, make(chan struct{}))
	require.ErrorIs(t, err, ErrBadConfig)
	require.Contains(t, err.Error(), "1450")

	cfg.MTU = 0
	ta := startAgent(t, cfg, Options{})
	got, err := ta.c.Config(ctx)
	require.NoError(t, err)
	require.Equal(t, 1450, got.MTU, "pods get the overlay's MTU")
}
