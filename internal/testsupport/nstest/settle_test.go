package nstest

import (
	"net"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestSettle: right after a veth pair comes up the kernel is still at
// work on it (its operational state pending, then its link-local
// addresses tentative while DAD runs, a second or so); after Settle both
// ends have their link-local address, none is tentative, and every
// address, an IFA_F_NODAD one too, has its local route.
func TestSettle(t *testing.T) {
	n := NewNS(t)
	h := Handle(t, n)
	l := AddLink(t, h, "s0")
	peer, err := h.LinkByName("s0p")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(peer); err != nil {
		t.Fatal(err)
	}
	if err := h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("fd00:5e::1"), Mask: net.CIDRMask(64, 128)}, Flags: unix.IFA_F_NODAD}); err != nil {
		t.Fatal(err)
	}
	if pending, err := unsettled(h); err != nil || pending == "" {
		t.Fatalf("a fresh link's addresses are still being worked on, yet unsettled says %q (%v)", pending, err)
	}
	Settle(t, h)
	addrs, err := h.AddrList(nil, netlink.FAMILY_V6)
	if err != nil {
		t.Fatal(err)
	}
	local, err := h.RouteListFiltered(netlink.FAMILY_V6, &netlink.Route{Table: unix.RT_TABLE_LOCAL}, netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	routed := map[string]bool{}
	for _, r := range local {
		routed[r.Dst.IP.String()] = true
	}
	var linkLocals int
	for _, a := range addrs {
		if a.Flags&unix.IFA_F_TENTATIVE != 0 {
			t.Errorf("%s is still tentative after Settle", a.IPNet)
		}
		if !routed[a.IP.String()] {
			t.Errorf("%s has no local route after Settle", a.IPNet)
		}
		if a.IP.IsLinkLocalUnicast() {
			linkLocals++
		}
	}
	if linkLocals != 2 {
		t.Errorf("want the link-local addresses of both ends, got %d in %v", linkLocals, addrs)
	}
}

// TestSettleAwaitsLinkLocal: the state a CI run under load met right after
// a veth came up: its operational state set (IFF_RUNNING), an IFA_F_NODAD
// address already routed, and addrconf not yet told, so no link-local
// address at all. It is not settled: the link-local comes, tentative.
func TestSettleAwaitsLinkLocal(t *testing.T) {
	up := uint32(unix.IFF_UP | unix.IFF_LOWER_UP | unix.IFF_RUNNING)
	lo := &netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: 1, Name: "lo", MTU: 65536, EncapType: "loopback", RawFlags: up | unix.IFF_LOOPBACK}}
	s0 := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Index: 2, Name: "s0", MTU: 1500, EncapType: "ether", RawFlags: up}}
	nodad := netlink.Addr{LinkIndex: 2, IPNet: &net.IPNet{IP: net.ParseIP("fd00:5e::1"), Mask: net.CIDRMask(64, 128)}, Flags: unix.IFA_F_NODAD}
	loop := netlink.Addr{LinkIndex: 1, IPNet: &net.IPNet{IP: net.IPv6loopback, Mask: net.CIDRMask(128, 128)}}
	routes := []netlink.Route{
		{Dst: &net.IPNet{IP: net.IPv6loopback, Mask: net.CIDRMask(128, 128)}},
		{Dst: &net.IPNet{IP: net.ParseIP("fd00:5e::1"), Mask: net.CIDRMask(128, 128)}},
	}
	links := []netlink.Link{lo, s0}
	if got := pending(links, []netlink.Addr{loop, nodad}, routes); got != "s0 (link-local address pending)" {
		t.Fatalf("no link-local yet on a running veth: pending says %q", got)
	}
	ll := netlink.Addr{LinkIndex: 2, IPNet: &net.IPNet{IP: net.ParseIP("fe80::1"), Mask: net.CIDRMask(64, 128)}}
	routes = append(routes, netlink.Route{Dst: &net.IPNet{IP: net.ParseIP("fe80::1"), Mask: net.CIDRMask(128, 128)}})
	if got := pending(links, []netlink.Addr{loop, nodad, ll}, routes); got != "" {
		t.Fatalf("every address routed, none tentative: pending says %q", got)
	}
	// A namespace without IPv6 (no ::1) expects no link-local address.
	v4 := netlink.Addr{LinkIndex: 2, IPNet: &net.IPNet{IP: net.ParseIP("10.9.0.1"), Mask: net.CIDRMask(24, 32)}}
	if got := pending(links, []netlink.Addr{v4}, []netlink.Route{{Dst: &net.IPNet{IP: net.ParseIP("10.9.0.1").To4(), Mask: net.CIDRMask(32, 32)}}}); got != "" {
		t.Fatalf("IPv4 only: pending says %q", got)
	}
}
