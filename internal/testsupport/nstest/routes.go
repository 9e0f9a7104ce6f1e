package nstest

import (
	"net"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// RouteVia returns the gateway of the IPv4 route of protocol proto to
// dst in h's namespace, or "" if there is none.
func RouteVia(t testing.TB, h *netlink.Handle, proto netlink.RouteProtocol, dst netip.Prefix) string {
	t.Helper()
	routes, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: proto}, netlink.RT_FILTER_PROTOCOL)
	require.NoError(t, err)
	want := (&net.IPNet{IP: net.IP(dst.Addr().AsSlice()), Mask: net.CIDRMask(dst.Bits(), 32)}).String()
	for _, r := range routes {
		if r.Dst != nil && r.Dst.String() == want {
			return r.Gw.String()
		}
	}
	return ""
}

// RequireNoRouteDelete reads route updates up to a marker route it adds,
// so that every earlier update has arrived, and fails on a delete of dst.
// It waits for the marker's own update however long it takes (the test's
// timeout bounds it).
func RequireNoRouteDelete(t *testing.T, h *netlink.Handle, updates <-chan netlink.RouteUpdate, dst netip.Prefix) {
	t.Helper()
	const markerDst = "192.0.2.77/32"
	_, ipn, _ := net.ParseCIDR(markerDst)
	marker := &netlink.Route{Dst: ipn, Type: unix.RTN_BLACKHOLE}
	require.NoError(t, h.RouteAdd(marker))
	defer h.RouteDel(marker)
	for u := range updates {
		if u.Dst == nil {
			continue
		}
		if u.Dst.String() == dst.String() {
			require.NotEqual(t, uint16(unix.RTM_DELROUTE), u.Type, "the route to %s was removed", dst)
		}
		if u.Dst.String() == markerDst {
			return
		}
	}
	t.Fatal("the route updates ended before the marker route's")
}
