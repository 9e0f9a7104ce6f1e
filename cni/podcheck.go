package cni

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// CheckPod verifies that an attachment ADD made is still in place:
// both veth ends up (the pod end with podMAC when it is not empty), every
// address of s on the pod end, every route in routes (those of the
// result that ADD made) in the pod, and the host routes to the pod.
// It reports every problem it finds at once.
func CheckPod(s PodSpec, podMAC string, routes []*types.Route) error {
	podNS, err := openNetns(s.Netns)
	if err != nil {
		return err
	}
	defer podNS.Close()
	host, err := netlinksafe.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("open netlink in the host netns: %w", err)
	}
	defer host.Close()
	pod, err := netlinksafe.NewHandleAt(podNS, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("open netlink in netns %s: %w", s.Netns, err)
	}
	defer pod.Close()

	var errs []error
	hl, err := host.LinkByName(s.HostIfName)
	if err != nil {
		return fmt.Errorf("check: host veth %s: %w", s.HostIfName, err)
	}
	if _, ok := hl.(*netlink.Veth); !ok {
		errs = append(errs, fmt.Errorf("check: host interface %s is a %s, not a veth", s.HostIfName, hl.Type()))
	}
	if hl.Attrs().Flags&net.FlagUp == 0 {
		errs = append(errs, fmt.Errorf("check: host veth %s is down", s.HostIfName))
	}
	pl, err := pod.LinkByName(s.IfName)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("check: %s in %s: %w", s.IfName, s.Netns, err))...)
	}
	if pl.Attrs().Flags&net.FlagUp == 0 {
		errs = append(errs, fmt.Errorf("check: %s in %s is down", s.IfName, s.Netns))
	}
	if podMAC != "" && pl.Attrs().HardwareAddr.String() != podMAC {
		errs = append(errs, fmt.Errorf("check: %s has MAC %s, the result says %s", s.IfName, pl.Attrs().HardwareAddr, podMAC))
	}

	addrs, err := addrList(pod, pl)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("check: list addresses of %s: %w", s.IfName, err))...)
	}
	for _, want := range s.Addrs {
		if !slices.ContainsFunc(addrs, func(a netlink.Addr) bool { return prefixOf(a.IPNet) == want }) {
			errs = append(errs, fmt.Errorf("check: %s has lost address %s", s.IfName, want))
		}
	}

	podRts, err := pod.RouteList(pl, netlink.FAMILY_ALL)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("check: list routes in %s: %w", s.Netns, err))...)
	}
	for _, want := range routes {
		if !slices.ContainsFunc(podRts, func(r netlink.Route) bool { return sameRoute(r, want) }) {
			errs = append(errs, fmt.Errorf("check: route %s is missing in %s", routeString(want), s.Netns))
		}
	}

	hostRts, err := host.RouteList(hl, netlink.FAMILY_ALL)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("check: list routes via %s: %w", s.HostIfName, err))...)
	}
	for _, a := range s.Addrs {
		want := netip.PrefixFrom(a.Addr(), a.Addr().BitLen())
		if !slices.ContainsFunc(hostRts, func(r netlink.Route) bool { return r.Dst != nil && prefixOf(r.Dst) == want }) {
			errs = append(errs, fmt.Errorf("check: host route %s via %s is missing", want, s.HostIfName))
		}
	}
	return errors.Join(errs...)
}

// sameRoute compares a kernel route with a result route by destination
// and gateway; a default route's Dst is nil in the kernel's answer.
func sameRoute(r netlink.Route, want *types.Route) bool {
	wantDst := prefixOf(&want.Dst)
	var dst netip.Prefix
	if r.Dst == nil {
		dst = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
		if r.Family == netlink.FAMILY_V6 {
			dst = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
		}
	} else {
		dst = prefixOf(r.Dst)
	}
	if dst != wantDst {
		return false
	}
	if want.GW == nil {
		return r.Gw == nil
	}
	return r.Gw != nil && r.Gw.Equal(want.GW)
}

// prefixOf converts a net.IPNet, unmapping IPv4 held in 16 bytes.
func prefixOf(n *net.IPNet) netip.Prefix {
	if n == nil {
		return netip.Prefix{}
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}
	}
	ones, bits := n.Mask.Size()
	if a.Is4In6() && bits == 32 {
		a = a.Unmap()
	}
	if bits == 0 {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(a, ones)
}

// addrList lists a link's addresses, retrying a dump the kernel
// interrupted (its result may be incomplete).
func addrList(h netlinksafe.Handle, l netlink.Link) ([]netlink.Addr, error) {
	for attempt := 0; ; attempt++ {
		addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
		if !errors.Is(err, netlink.ErrDumpInterrupted) || attempt == 4 {
			return addrs, err
		}
	}
}

// routeString is a result route as ip-route would show it.
func routeString(r *types.Route) string {
	s := prefixOf(&r.Dst).String()
	if r.GW != nil {
		s += " via " + r.GW.String()
	}
	if r.Scope != nil && *r.Scope == int(netlink.SCOPE_LINK) {
		s += " scope link"
	}
	return s
}
