package cni

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/kvipam/kvipam/agent/api"
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

// SetupPod creates the veth with its peer directly in the pod's netns,
// configures both ends through netlink handles, and routes the pod's
// addresses to the host veth. It runs in the host's network namespace
// (that of the calling thread). On error it removes the veth, so nothing
// is left behind; the caller still owns the allocation.
//
// Pod side: addresses with no DAD, the link-scope route to the IPv4
// gateway, default routes through the gateways, and permanent neighbour
// entries for them, so the first packet needs no ARP or NDP.
// Host side: the fixed MAC, proxy ARP (for pods whose neighbour entry was
// flushed), no DAD, and a /32 or /128 route per pod address.
func SetupPod(s PodSpec) (*PodLinks, error) {
	podNS, err := openNetns(s.Netns)
	if err != nil {
		return nil, err
	}
	defer podNS.Close()
	host, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("open netlink in the host netns: %w", err)
	}
	defer host.Close()
	pod, err := netlink.NewHandleAt(podNS, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("open netlink in netns %s: %w", s.Netns, err)
	}
	defer pod.Close()

	hasV6 := false
	for _, a := range s.Addrs {
		hasV6 = hasV6 || a.Addr().Is6()
	}
	if hasV6 && !ipv6Enabled() {
		return nil, fmt.Errorf("pod %s needs IPv6 but IPv6 is disabled in the host netns", s.IfName)
	}
	hv, err := createVeth(host, pod, podNS, s)
	if err != nil {
		return nil, err
	}
	links, err := configure(host, pod, podNS, hv, s, hasV6)
	if err != nil {
		if derr := host.LinkDel(hv); derr != nil && !isNotFound(derr) {
			err = errors.Join(err, fmt.Errorf("remove veth %s: %w", s.HostIfName, derr))
		}
		return nil, err
	}
	return links, nil
}

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

// createVeth adds the pair with the peer born in the pod netns: ~10x
// cheaper than creating it in the host and moving it. A host veth of the
// same name is a leftover of this same attachment (the name is a hash of
// it), such as one a DEL retired and the agent has not deleted yet (an ADD
// again in the same netns), so it is replaced; if it vanishes meanwhile
// (the agent deleted it), the pair is simply made again.
func createVeth(host, pod *netlink.Handle, podNS netns.NsHandle, s PodSpec) (*netlink.Veth, error) {
	la := netlink.NewLinkAttrs()
	la.Name = s.HostIfName
	la.MTU = s.MTU
	la.HardwareAddr = HostVethMAC
	v := &netlink.Veth{LinkAttrs: la, PeerName: s.IfName, PeerNamespace: netlink.NsFd(podNS), PeerTxQLen: -1}
	err := host.LinkAdd(v)
	for try := 0; errors.Is(err, unix.EEXIST) && try < 2; try++ {
		old, lerr := host.LinkByName(s.HostIfName)
		switch {
		case isNotFound(lerr) && try == 0:
			// The pod's interface name is taken: by the pod end of a
			// veth an earlier DEL retired (its pair has gone since, or
			// is deleted now), or by something else.
			if ok, err := removeRetiredPair(host, pod, s.IfName); err != nil || !ok {
				return nil, errors.Join(fmt.Errorf("create veth %s: interface %s already exists in netns %s", s.HostIfName, s.IfName, s.Netns), err)
			}
		case lerr != nil:
			return nil, fmt.Errorf("create veth %s: interface %s already exists in netns %s", s.HostIfName, s.IfName, s.Netns)
		default:
			if derr := host.LinkDel(old); derr != nil && !isNotFound(derr) {
				return nil, fmt.Errorf("remove leftover veth %s: %w", s.HostIfName, derr)
			}
		}
		err = host.LinkAdd(v)
	}
	if err != nil {
		return nil, fmt.Errorf("create veth %s with peer %s in %s: %w", s.HostIfName, s.IfName, s.Netns, err)
	}
	return v, nil
}

// removeRetiredPair deletes the veth whose pod end holds name in the pod
// netns when its host end is one a DEL retired (in api.ReapLinkGroup,
// waiting for the agent to delete it), and reports whether name is free
// now. Anything else holding the name is left alone.
func removeRetiredPair(host, pod *netlink.Handle, name string) (bool, error) {
	pl, err := pod.LinkByName(name)
	if isNotFound(err) {
		return true, nil // deleted meanwhile
	}
	if err != nil {
		return false, fmt.Errorf("find %s in the pod netns: %w", name, err)
	}
	if _, ok := pl.(*netlink.Veth); !ok || pl.Attrs().ParentIndex == 0 {
		return false, nil
	}
	peer, err := host.LinkByIndex(pl.Attrs().ParentIndex)
	if isNotFound(err) {
		return true, nil // the pair is being deleted: gone once LinkAdd runs
	}
	if err != nil {
		return false, fmt.Errorf("find the host end of %s: %w", name, err)
	}
	if peer.Attrs().Group != api.ReapLinkGroup || !strings.HasPrefix(peer.Attrs().Name, HostVethPrefix) {
		return false, nil
	}
	if err := host.LinkDel(peer); err != nil && !isNotFound(err) {
		return false, fmt.Errorf("delete retired veth %s: %w", peer.Attrs().Name, err)
	}
	return true, nil
}

func configure(host, pod *netlink.Handle, podNS netns.NsHandle, hv *netlink.Veth, s PodSpec, hasV6 bool) (*PodLinks, error) {
	// Before the link is up, so its link-local address is never tentative
	// and proxy ARP answers at once.
	sysctls := [][2]string{
		{"ipv4/conf/" + s.HostIfName + "/proxy_arp", "1"},
		{"ipv4/neigh/" + s.HostIfName + "/proxy_delay", "0"},
	}
	if hasV6 {
		sysctls = append(sysctls, [2]string{"ipv6/conf/" + s.HostIfName + "/accept_dad", "0"})
	}
	for _, kv := range sysctls {
		if err := setSysctl(kv[0], kv[1]); err != nil {
			return nil, fmt.Errorf("configure host veth: %w", err)
		}
	}
	if err := host.LinkSetUp(hv); err != nil {
		return nil, fmt.Errorf("set %s up: %w", s.HostIfName, err)
	}
	if hasV6 {
		// The EUI-64 link-local of HostVethMAC is the default gateway;
		// another gateway the agent names must be on the veth too.
		gw := &netlink.Addr{IPNet: hostPrefix(s.GatewayV6, 64), Flags: unix.IFA_F_NODAD}
		if err := host.AddrAdd(hv, gw); err != nil && !errors.Is(err, unix.EEXIST) {
			return nil, fmt.Errorf("add gateway %s to %s: %w", s.GatewayV6, s.HostIfName, err)
		}
	}

	pl, err := pod.LinkByName(s.IfName)
	if err != nil {
		return nil, fmt.Errorf("find %s in %s: %w", s.IfName, s.Netns, err)
	}
	if err := pod.LinkSetUp(pl); err != nil {
		return nil, fmt.Errorf("set %s up in %s: %w", s.IfName, s.Netns, err)
	}
	if err := configurePodAddrs(pod, pl, s); err != nil {
		return nil, err
	}
	if err := configurePodRoutes(pod, pl, s); err != nil {
		return nil, err
	}
	for _, a := range s.Addrs {
		r := &netlink.Route{LinkIndex: hv.Attrs().Index, Dst: hostPrefix(a.Addr(), a.Addr().BitLen())}
		if a.Addr().Is4() {
			r.Scope = netlink.SCOPE_LINK
		}
		// Replace: a route left by an old veth of a reused address must
		// not block this pod.
		if err := host.RouteReplace(r); err != nil {
			return nil, fmt.Errorf("route %s to %s: %w", a, s.HostIfName, err)
		}
	}
	if err := waitOperUp(host, netns.None(), s.HostIfName); err != nil {
		return nil, err
	}
	if err := waitOperUp(pod, podNS, s.IfName); err != nil {
		return nil, fmt.Errorf("in %s: %w", s.Netns, err)
	}
	return &PodLinks{
		HostIfName: s.HostIfName, HostMAC: hv.Attrs().HardwareAddr, HostIfIndex: hv.Attrs().Index,
		PodIfName: s.IfName, PodMAC: pl.Attrs().HardwareAddr,
	}, nil
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

// podRoutes are the routes SetupPod puts in the pod, in the order it adds
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
