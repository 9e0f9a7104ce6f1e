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
