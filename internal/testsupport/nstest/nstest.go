// Package nstest gives root-only tests scratch network namespaces, so no
// test touches the real host's links, routes or sysctls.
package nstest

import (
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// RequireRoot skips the test when it cannot create network namespaces.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() != 0 {
		tb.Skip("needs root to create network namespaces (CI runs as root)")
	}
}

// NewNS creates a network namespace with lo up, removed when the test
// ends, also when it fails.
func NewNS(tb testing.TB) ns.NetNS {
	tb.Helper()
	RequireRoot(tb)
	n, release, err := NewEphemeralNS()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(release)
	return n
}

// NewEphemeralNS creates a network namespace with lo up, for a caller
// that releases it itself (a long test making thousands of them must not
// keep each one's file descriptor to its end). release may be called more
// than once.
func NewEphemeralNS() (ns.NetNS, func(), error) {
	n, err := testutils.NewNS()
	if err != nil {
		return nil, nil, fmt.Errorf("create netns: %w", err)
	}
	var once sync.Once
	release := func() {
		once.Do(func() {
			_ = n.Close()
			// Detached, as ip netns delete and container runtimes do:
			// a plain unmount failed with EBUSY for about one in twenty
			// sandboxes of a concurrent benchmark (no process held the
			// file), leaving the netns mounted behind.
			if err := unix.Unmount(n.Path(), unix.MNT_DETACH); err == nil {
				_ = os.Remove(n.Path())
			}
		})
	}
	h, err := netlink.NewHandleAt(netns.NsHandle(n.Fd()))
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("netlink handle in %s: %w", n.Path(), err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err == nil {
		err = h.LinkSetUp(lo)
	}
	if err != nil {
		release()
		return nil, nil, fmt.Errorf("set lo up in %s: %w", n.Path(), err)
	}
	return n, release, nil
}

// Handle is a netlink handle bound to n, closed at cleanup. It works from
// any goroutine, whatever namespace that goroutine's thread is in.
func Handle(tb testing.TB, n ns.NetNS) *netlink.Handle {
	tb.Helper()
	h, err := netlink.NewHandleAt(netns.NsHandle(n.Fd()))
	if err != nil {
		tb.Fatalf("netlink handle in %s: %v", n.Path(), err)
	}
	tb.Cleanup(h.Close)
	return h
}

// AddLink creates an up interface in the handle's namespace: one end of a
// veth pair whose peer (name+"p") stays in the same namespace. (veth, not
// dummy: some kernels here build no dummy driver.) Deleting either end
// deletes both.
func AddLink(tb testing.TB, h *netlink.Handle, name string) netlink.Link {
	tb.Helper()
	l := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
	if err := h.LinkAdd(l); err != nil {
		tb.Fatalf("add dummy %s: %v", name, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		tb.Fatalf("set %s up: %v", name, err)
	}
	got, err := h.LinkByName(name)
	if err != nil {
		tb.Fatalf("find %s: %v", name, err)
	}
	return got
}

// Underlay joins two namespaces with a veth named ul0 at both ends, up,
// with 10.254.0.1/24 in a and 10.254.0.2/24 in b: two nodes on one L2
// segment.
func Underlay(tb testing.TB, a, b ns.NetNS) {
	tb.Helper()
	ha, hb := Handle(tb, a), Handle(tb, b)
	if err := ha.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ul0"}, PeerName: "ul0", PeerNamespace: netlink.NsFd(int(b.Fd()))}); err != nil {
		tb.Fatalf("add underlay veth: %v", err)
	}
	for _, side := range []struct {
		h    *netlink.Handle
		addr string
	}{{ha, "10.254.0.1/24"}, {hb, "10.254.0.2/24"}} {
		l, err := side.h.LinkByName("ul0")
		if err != nil {
			tb.Fatalf("underlay: %v", err)
		}
		ad, err := netlink.ParseAddr(side.addr)
		if err != nil {
			tb.Fatalf("underlay: %v", err)
		}
		if err := side.h.AddrAdd(l, ad); err != nil {
			tb.Fatalf("underlay address %s: %v", side.addr, err)
		}
		if err := side.h.LinkSetUp(l); err != nil {
			tb.Fatalf("underlay up: %v", err)
		}
	}
}

// Settle waits until the kernel has finished its own work on the links
// and addresses in h's namespace: every link with carrier has its
// operational state, no address on a running link is tentative, and
// each address that is not has its local route. The kernel does all
// three from work queues, after LinkSetUp or AddrAdd (IFA_F_NODAD too)
// has returned, so a test that watches netlink for changes it did not
// make settles first. (A tentative address on a link without carrier
// waits for the carrier, not for the kernel: it is left out.)
func Settle(tb testing.TB, h *netlink.Handle) {
	tb.Helper()
	for {
		pending, err := unsettled(h)
		if err != nil {
			tb.Fatalf("settle: %v", err)
		}
		if pending == "" {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// unsettled names a link or an address the kernel is still working on,
// or is "".
func unsettled(h *netlink.Handle) (string, error) {
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return "", fmt.Errorf("list addresses: %w", err)
	}
	local, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_LOCAL}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return "", fmt.Errorf("list local routes: %w", err)
	}
	links, err := h.LinkList()
	if err != nil {
		return "", fmt.Errorf("list links: %w", err)
	}
	return pending(links, addrs, local), nil
}

// pending names what of links, addrs and local (the local table's routes)
// the kernel is still working on, or is "".
func pending(links []netlink.Link, addrs []netlink.Addr, local []netlink.Route) string {
	have := map[string]bool{}
	for _, r := range local {
		if r.Dst != nil {
			have[r.Dst.IP.String()] = true
		}
	}
	// The namespace runs IPv6 when its loopback has ::1; then addrconf
	// gives every running Ethernet link a link-local address.
	v6, linkLocal := false, map[int]bool{}
	for _, a := range addrs {
		if a.IP.Equal(net.IPv6loopback) {
			v6 = true
		}
		if a.IP.To4() == nil && a.IP.IsLinkLocalUnicast() {
			linkLocal[a.LinkIndex] = true
		}
	}
	running := map[int]bool{}
	for _, l := range links {
		at := l.Attrs()
		flags := at.RawFlags
		if flags&unix.IFF_UP != 0 && flags&unix.IFF_LOWER_UP != 0 && flags&unix.IFF_RUNNING == 0 {
			// Carrier, but linkwatch has yet to set the operational
			// state; addrconf starts on the link only then.
			return at.Name + " (operational state pending)"
		}
		if flags&unix.IFF_RUNNING != 0 && flags&unix.IFF_LOOPBACK == 0 && at.EncapType == "ether" &&
			v6 && at.MTU >= 1280 && !linkLocal[at.Index] {
			// linkwatch sets the operational state first and tells
			// addrconf after: the link-local address comes a moment
			// later (seen under load, an address with IFA_F_NODAD
			// already routed in between).
			return at.Name + " (link-local address pending)"
		}
		running[at.Index] = flags&unix.IFF_RUNNING != 0
	}
	for _, a := range addrs {
		if a.Flags&unix.IFA_F_DADFAILED != 0 {
			continue // the kernel is done with it: it will never be used
		}
		if a.Flags&unix.IFA_F_TENTATIVE != 0 {
			if running[a.LinkIndex] {
				return a.IPNet.String() + " (tentative)"
			}
			continue
		}
		if !have[a.IP.String()] {
			return a.IPNet.String() + " (no local route)"
		}
	}
	return ""
}
