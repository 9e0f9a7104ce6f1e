package routing

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/internal/testsupport/nstest"
)

// TestVXLANOverlay programs the overlay in a scratch namespace: the
// device on the node address's link with the MTU less the overhead, an
// on-link route per peer block, a permanent neighbour and FDB entry per
// peer. Programming the same state again changes nothing in the kernel
// (an agent restart adopts it); a node whose blocks went loses its
// route and entries; host-gw removes the device.
func TestVXLANOverlay(t *testing.T) {
	n := nstest.NewNS(t)
	h := nstest.Handle(t, n)
	ul := nstest.AddLink(t, h, "ul0")
	require.NoError(t, h.LinkSetMTU(ul, 1400))
	ad, err := netlink.ParseAddr("10.254.1.10/24")
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(ul, ad))

	v := &VXLAN{node: "a", local: netip.MustParseAddr("10.254.1.10"), vni: 7, port: 4789, log: hclog.NewNullLogger()}
	bB, bC := netip.MustParsePrefix("10.9.1.0/26"), netip.MustParsePrefix("10.9.2.0/26")
	vB, vC := netip.MustParseAddr("10.254.2.20"), netip.MustParseAddr("10.254.3.30")
	lent := netip.MustParsePrefix("10.9.1.7/32") // borrowed by c from b's block
	b6 := netip.MustParsePrefix("fd00:9::/120")
	v6B := netip.MustParseAddr("fd00::2")
	addrsB := []netip.Addr{vB, v6B}
	want := func() map[netip.Prefix]peerHop {
		return map[netip.Prefix]peerHop{bB: {"b", vB, addrsB}, bC: {"c", vC, []netip.Addr{vC}}, lent: {"c", vC, []netip.Addr{vC}},
			b6: {"b", v6B, addrsB}} // IPv6 over the IPv4 underlay: via b's link-local address
	}
	require.NoError(t, v.program(h, want()))

	l, err := h.LinkByName(vxlanDevice)
	require.NoError(t, err)
	vx := l.(*netlink.Vxlan)
	require.Equal(t, 7, vx.VxlanId)
	require.Equal(t, 1350, vx.MTU, "the underlay's MTU less 50")
	require.Equal(t, ul.Attrs().Index, vx.VtepDevIndex)
	require.Equal(t, vtepMAC("a"), vx.HardwareAddr)
	require.False(t, vx.Learning)
	routes, err := ownRoutes(h, netlink.FAMILY_ALL)
	require.NoError(t, err)
	require.Len(t, routes, 4)
	for _, r := range routes {
		require.Equal(t, l.Attrs().Index, r.LinkIndex)
		if r.Dst.String() == b6.String() {
			require.Equal(t, vtepLinkLocal("b").String(), r.Gw.String(), "an IPv6 block goes via its node's link-local address")
			continue
		}
		require.NotZero(t, r.Flags&int(netlink.FLAG_ONLINK))
		if r.Dst.String() == lent.String() {
			require.Equal(t, vC.String(), r.Gw.String(), "a borrowed address goes to its holder, beside its block's route to the lender")
		}
	}
	require.Equal(t, map[string]string{vB.String(): vtepMAC("b").String(), vC.String(): vtepMAC("c").String()}, neighbours(t, h, l, netlink.FAMILY_V4))
	require.Equal(t, map[string]string{vB.String(): vtepMAC("b").String(), vC.String(): vtepMAC("c").String()}, neighbours(t, h, l, unix.AF_BRIDGE))
	require.Equal(t, map[string]string{vtepLinkLocal("b").String(): vtepMAC("b").String()}, neighbours(t, h, l, netlink.FAMILY_V6))

	// Again, as a restarted agent does: no netlink change at all.
	changes := watchChanges(t, n, h)
	require.NoError(t, v.program(h, want()))
	require.Empty(t, changes(), "programming the same state again changes nothing")
	l2, err := h.LinkByName(vxlanDevice)
	require.NoError(t, err)
	require.Equal(t, l.Attrs().Index, l2.Attrs().Index, "the same device")

	// c's blocks go: so do its route, neighbour and FDB entry.
	w := want()
	delete(w, bC)
	delete(w, lent)
	require.NoError(t, v.program(h, w))
	routes, err = ownRoutes(h, netlink.FAMILY_ALL)
	require.NoError(t, err)
	require.Len(t, routes, 2)
	require.Equal(t, map[string]string{vB.String(): vtepMAC("b").String()}, neighbours(t, h, l, netlink.FAMILY_V4))
	require.Equal(t, map[string]string{vB.String(): vtepMAC("b").String()}, neighbours(t, h, l, unix.AF_BRIDGE))

	// host-gw takes over: the device goes, with its routes.
	require.Error(t, NewHostGW(hclog.NewNullLogger()).program(h, w), "b is not on our segment: no host-gw route")
	_, err = h.LinkByName(vxlanDevice)
	require.Error(t, err, "the vxlan device is gone")
}

// neighbours are the permanent entries of family on l: IP -> MAC.
func neighbours(t *testing.T, h *netlink.Handle, l netlink.Link, family int) map[string]string {
	t.Helper()
	ns, err := h.NeighList(l.Attrs().Index, family)
	require.NoError(t, err)
	out := map[string]string{}
	for _, n := range ns {
		if n.State&netlink.NUD_PERMANENT != 0 {
			out[n.IP.String()] = n.HardwareAddr.String()
		}
	}
	return out
}

// watchChanges lets the kernel finish its own work in n (h's namespace),
// then subscribes to route, link and neighbour changes there; the
// function it returns makes a marker change, waits for its event, and
// returns what came before it.
func watchChanges(t *testing.T, n interface{ Fd() uintptr }, h *netlink.Handle) func() []string {
	t.Helper()
	nstest.Settle(t, h)
	nsh := netns.NsHandle(n.Fd())
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	routes := make(chan netlink.RouteUpdate, 64)
	links := make(chan netlink.LinkUpdate, 64)
	neighs := make(chan netlink.NeighUpdate, 64)
	require.NoError(t, netlink.RouteSubscribeWithOptions(routes, done, netlink.RouteSubscribeOptions{Namespace: &nsh}))
	require.NoError(t, netlink.LinkSubscribeWithOptions(links, done, netlink.LinkSubscribeOptions{Namespace: &nsh}))
	require.NoError(t, netlink.NeighSubscribeWithOptions(neighs, done, netlink.NeighSubscribeOptions{Namespace: &nsh}))
	return func() []string {
		marker := &netlink.Route{Dst: &net.IPNet{IP: net.IPv4(192, 0, 2, 99), Mask: net.CIDRMask(32, 32)}, Type: unix.RTN_BLACKHOLE}
		require.NoError(t, h.RouteAdd(marker))
		var seen []string
		timeout := time.After(10 * time.Second)
		for {
			select {
			case u := <-routes:
				if u.Dst != nil && u.Dst.String() == "192.0.2.99/32" {
					return seen
				}
				seen = append(seen, "route "+u.Dst.String())
			case u := <-links:
				seen = append(seen, "link "+u.Attrs().Name)
			case u := <-neighs:
				seen = append(seen, "neighbour "+u.IP.String()+" "+u.HardwareAddr.String())
			case <-timeout:
				t.Fatal("no event for the marker route")
			}
		}
	}
}

// TestVXLANOverlayIPv6Underlay: over an IPv6 underlay the device's VTEP is
// the node's IPv6 address and its MTU 70 below the link's; every block,
// IPv4 included (an IPv4 route with an IPv6 next hop), goes via the
// peer's link-local address, which a permanent IPv6 neighbour entry
// resolves to its MAC, and the FDB sends that MAC to the peer's IPv6
// VTEP. Programming the same state again changes nothing.
func TestVXLANOverlayIPv6Underlay(t *testing.T) {
	n := nstest.NewNS(t)
	h := nstest.Handle(t, n)
	ul := nstest.AddLink(t, h, "ul0")
	local := netip.MustParseAddr("fd00:254:1::10")
	require.NoError(t, h.AddrAdd(ul, &netlink.Addr{IPNet: prefixNet(netip.PrefixFrom(local, 64)), Flags: unix.IFA_F_NODAD}))

	v := &VXLAN{node: "a", local: local, six: true, vni: 7, port: 4789, log: hclog.NewNullLogger()}
	vB := netip.MustParseAddr("fd00:254:2::20")
	addrsB := []netip.Addr{netip.MustParseAddr("10.254.2.20"), vB}
	b4, b6 := netip.MustParsePrefix("10.9.1.0/26"), netip.MustParsePrefix("fd00:9::/120")
	want := func() map[netip.Prefix]peerHop {
		return map[netip.Prefix]peerHop{b4: {"b", addrsB[0], addrsB}, b6: {"b", vB, addrsB}}
	}
	require.NoError(t, v.program(h, want()))
	l, err := h.LinkByName(vxlanDevice)
	require.NoError(t, err)
	vx := l.(*netlink.Vxlan)
	require.Equal(t, local.String(), vx.SrcAddr.String())
	require.Equal(t, ul.Attrs().MTU-70, vx.MTU)
	routes, err := ownRoutes(h, netlink.FAMILY_ALL)
	require.NoError(t, err)
	require.Len(t, routes, 2)
	ll := vtepLinkLocal("b")
	for _, r := range routes {
		require.Equal(t, l.Attrs().Index, r.LinkIndex)
		if r.Dst.String() == b4.String() {
			via, ok := r.Via.(*netlink.Via)
			require.True(t, ok, "an IPv4 route with an IPv6 next hop: %+v", r)
			require.Equal(t, ll.String(), via.Addr.String())
		} else {
			require.Equal(t, ll.String(), r.Gw.String())
		}
	}
	require.Equal(t, map[string]string{ll.String(): vtepMAC("b").String()}, neighbours(t, h, l, netlink.FAMILY_V6))
	require.Empty(t, neighbours(t, h, l, netlink.FAMILY_V4))
	require.Equal(t, map[string]string{vB.String(): vtepMAC("b").String()}, neighbours(t, h, l, unix.AF_BRIDGE))

	changes := watchChanges(t, n, h)
	require.NoError(t, v.program(h, want()))
	require.Empty(t, changes(), "programming the same state again changes nothing")
}
