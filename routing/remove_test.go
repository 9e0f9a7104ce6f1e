package routing

import (
	"net"
	"net/netip"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestUninstallRemovesRouting: what routing vxlan and host-gw left in a
// node's namespace (the VXLAN device with its routes, the routes to other
// nodes' blocks) goes; a route of another owner on the same link stays;
// run again, it removes nothing.
func TestUninstallRemovesRouting(t *testing.T) {
	n := nstest.NewNS(t)
	h := nstest.Handle(t, n)
	ul := nstest.AddLink(t, h, "ul0")
	ad, err := netlink.ParseAddr("10.254.1.10/24")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(ul, ad))
	v := &VXLAN{node: "a", local: netip.MustParseAddr("10.254.1.10"), vni: 7, port: 4789, log: hclog.NewNullLogger()}
	require.NoError(t, v.program(h, map[netip.Prefix]peerHop{
		netip.MustParsePrefix("10.9.1.0/26"): {"b", netip.MustParseAddr("10.254.2.20"), []netip.Addr{netip.MustParseAddr("10.254.2.20")}},
	}))
	hostGW := &net.IPNet{IP: net.IPv4(10, 9, 2, 0), Mask: net.CIDRMask(26, 32)}
	require.NoError(t, h.RouteAdd(&netlink.Route{Dst: hostGW, Gw: net.IPv4(10, 254, 1, 20), Protocol: Protocol}))
	theirs := &net.IPNet{IP: net.IPv4(10, 9, 3, 0), Mask: net.CIDRMask(26, 32)}
	require.NoError(t, h.RouteAdd(&netlink.Route{Dst: theirs, Gw: net.IPv4(10, 254, 1, 30), Protocol: netlink.RouteProtocol(4)}))

	removed, err := Remove(n.Path())
	require.NoError(t, err)
	require.Contains(t, removed, "device "+vxlanDevice)
	require.Contains(t, removed, "route 10.9.2.0/26")
	_, err = h.LinkByName(vxlanDevice)
	require.ErrorAs(t, err, new(netlink.LinkNotFoundError))
	own, err := ownRoutes(h, netlink.FAMILY_ALL)
	require.NoError(t, err)
	require.Empty(t, own)
	rs, err := h.RouteGet(net.IPv4(10, 9, 3, 1))
	require.NoError(t, err)
	require.Equal(t, "10.254.1.30", rs[0].Gw.String(), "another owner's route stays")

	removed, err = Remove(n.Path())
	require.NoError(t, err)
	require.Empty(t, removed, "nothing left to remove")
}
