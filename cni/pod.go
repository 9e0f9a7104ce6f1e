package cni

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// HostVethMAC is the MAC of every host-side veth. The pod's gateways
// resolve to it, and its EUI-64 link-local address is the IPv6 gateway
// api.GatewayV6 (the Calico scheme).
var HostVethMAC = net.HardwareAddr{0xee, 0xee, 0xee, 0xee, 0xee, 0xee}

// PodSpec is one pod attachment to set up in routes mode.
type PodSpec struct {
	// Netns is the pod's network namespace path (CNI_NETNS).
	Netns string
	// IfName is the pod-side interface name (CNI_IFNAME).
	IfName string
	// HostIfName is the host-side veth name (HostVethName).
	HostIfName string
	MTU        int
	// Addrs are the pod's addresses, /32 and /128.
	Addrs []netip.Prefix
	// GatewayV4 and GatewayV6 are the pod's link-local next hops.
	GatewayV4, GatewayV6 netip.Addr
	// NoHostRoutes leaves out the host's route to each address through
	// the veth (a live migration's target: the agent adds them at the
	// cut-over).
	NoHostRoutes bool
	// AcceptLocal sets accept_local on the host veth: the pod has host
	// ports, whose replies the agent's bpf datapath translates back to a
	// source that is one of the node's addresses before the kernel routes
	// them (IPv4 drops such a frame as a martian otherwise).
	AcceptLocal bool
}

// PodLinks are the two ends of a set-up attachment.
type PodLinks struct {
	HostIfName  string
	HostMAC     net.HardwareAddr
	HostIfIndex int
	PodIfName   string
	PodMAC      net.HardwareAddr
}

// ErrNetnsMissing wraps a CNI_NETNS that is not (or no longer) a network
// namespace.
var ErrNetnsMissing = errors.New("network namespace not found")

// checkNetns says clearly when CNI_NETNS is not a network namespace.
func checkNetns(path string) error {
	if err := ns.IsNSorErr(path); err != nil {
		return withCode(types.ErrInvalidEnvironmentVariables, fmt.Errorf("CNI_NETNS %q: %w: %w", path, ErrNetnsMissing, err))
	}
	return nil
}

// openNetns opens a network namespace path, or says clearly that it is not one.
func openNetns(path string) (netns.NsHandle, error) {
	if err := checkNetns(path); err != nil {
		return netns.None(), err
	}
	h, err := netns.GetFromPath(path)
	if err != nil {
		return netns.None(), withCode(types.ErrInvalidEnvironmentVariables, fmt.Errorf("CNI_NETNS %q: %w: %w", path, ErrNetnsMissing, err))
	}
	return h, nil
}

func configurePodAddrs(pod *netlink.Handle, pl netlink.Link, s PodSpec) error {
	for _, a := range s.Addrs {
		addr := &netlink.Addr{IPNet: hostPrefix(a.Addr(), a.Bits())}
		if a.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		err := pod.AddrAdd(pl, addr)
		if a.Addr().Is6() && (errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM)) {
			// The runtime disabled IPv6 in the pod; this pod is given
			// an IPv6 address, so enable it for this interface.
			if err = enablePodIPv6(s.Netns, s.IfName); err == nil {
				err = pod.AddrAdd(pl, addr)
			}
		}
		if err != nil {
			return fmt.Errorf("add %s to %s in %s: %w", a, s.IfName, s.Netns, err)
		}
	}
	return nil
}

func configurePodRoutes(pod *netlink.Handle, pl netlink.Link, s PodSpec) error {
	idx := pl.Attrs().Index
	for _, gw := range podGateways(s) {
		n := &netlink.Neigh{LinkIndex: idx, State: netlink.NUD_PERMANENT, IP: gw.AsSlice(), HardwareAddr: HostVethMAC, Family: family(gw)}
		if err := pod.NeighSet(n); err != nil {
			return fmt.Errorf("neighbour %s in %s: %w", gw, s.Netns, err)
		}
	}
	for _, r := range podRoutes(s) {
		nr := &netlink.Route{LinkIndex: idx, Dst: ipNet(r.Dst), Gw: r.GW}
		if r.Scope != nil {
			nr.Scope = netlink.Scope(*r.Scope)
		}
		if r.GW != nil {
			nr.Flags = int(netlink.FLAG_ONLINK)
		}
		if err := pod.RouteAdd(nr); err != nil {
			return fmt.Errorf("route %s in %s: %w", routeString(r), s.Netns, err)
		}
	}
	return nil
}

// podGateways are the gateways of the families the pod has addresses of.
func podGateways(s PodSpec) []netip.Addr {
	var out []netip.Addr
	var v4, v6 bool
	for _, a := range s.Addrs {
		v4, v6 = v4 || a.Addr().Is4(), v6 || a.Addr().Is6()
	}
	if v4 {
		out = append(out, s.GatewayV4)
	}
	if v6 {
		out = append(out, s.GatewayV6)
	}
	return out
}

// podRoutes are the routes Configure puts in the pod, in the order it adds
// them; they are also the result's routes.
func podRoutes(s PodSpec) []*types.Route {
	return gatewayRoutes(podGateways(s))
}

// gatewayRoutes routes everything through each gateway: for IPv4 a link
// route to the gateway first, since the pod's /32 has no subnet; an IPv6
// link-local gateway is on-link by definition.
func gatewayRoutes(gws []netip.Addr) []*types.Route {
	var out []*types.Route
	for _, gw := range gws {
		if gw.Is4() {
			link := int(netlink.SCOPE_LINK)
			out = append(out, &types.Route{Dst: *hostPrefix(gw, 32), Scope: &link})
			out = append(out, &types.Route{Dst: net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}, GW: gw.AsSlice()})
		} else {
			out = append(out, &types.Route{Dst: net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}, GW: gw.AsSlice()})
		}
	}
	return out
}

func enablePodIPv6(path, ifName string) error {
	return ns.WithNetNSPath(path, func(ns.NetNS) error {
		return setSysctl("ipv6/conf/"+ifName+"/disable_ipv6", "0")
	})
}

// DeleteHostVeth removes a host-side veth, and with it the pod end and
// the host routes through it. It reports whether there was one to remove;
// none is not an error.
func DeleteHostVeth(name string) (bool, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("open netlink in the host netns: %w", err)
	}
	defer h.Close()
	l, err := h.LinkByName(name)
	if isNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("find host veth %s: %w", name, err)
	}
	if _, ok := l.(*netlink.Veth); !ok {
		return false, fmt.Errorf("host interface %s is a %s, not a veth; not deleting it", name, l.Type())
	}
	if err := h.LinkDel(l); err != nil && !isNotFound(err) {
		return false, fmt.Errorf("delete host veth %s: %w", name, err)
	}
	return true, nil
}

func isNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

func hostPrefix(a netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}
}

func ipNet(n net.IPNet) *net.IPNet { return &n }

func family(a netip.Addr) int {
	if a.Is4() {
		return netlink.FAMILY_V4
	}
	return netlink.FAMILY_V6
}
