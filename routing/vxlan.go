package routing

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The VXLAN overlay (routing vxlan), for nodes that are not on one L2
// segment. Each node has one VXLAN device whose local endpoint (VTEP) is
// its node address; another node's block is routed onto the device via
// that node's address as an on-link gateway; a permanent neighbour entry
// gives the gateway the peer device's MAC, and a permanent FDB entry sends
// frames for that MAC to the peer's address in UDP. Everything is computed
// from the block homes and node records in etcd; nothing is learned from
// traffic. A device's MAC is derived from its node's name, so every node
// knows every other node's MAC without storing it, and a restarted agent
// finds its device unchanged.
//
// The overlay carries IPv4 and IPv6 pods over an IPv4 or an IPv6
// underlay (VXLANConfig.IPv6Underlay): the VTEPs are the nodes' addresses
// of the underlay's family. An IPv4 block over an IPv4 underlay is routed via
// the peer's VTEP address, as before; every other route (IPv6 blocks, and
// IPv4 blocks over an IPv6 underlay, as IPv4 routes with an IPv6 next hop,
// RFC 5549 style) goes via the peer's link-local address on the overlay,
// fe80:: and the EUI-64 of its device's MAC, whose permanent neighbour
// entry is that MAC. So no node needs an address of a family it does not
// carry, and nothing is learned from traffic.

const (
	vxlanDevice = "kvipam.vxlan"
	// vxlanOverhead is what encapsulation adds to a packet over an IPv4
	// underlay: outer IPv4 (20), UDP (8), VXLAN (8) and inner Ethernet (14).
	vxlanOverhead = 50
	// vxlanOverhead6 is the same over an IPv6 underlay (outer IPv6: 40).
	vxlanOverhead6 = 70
)

// VXLANOverhead is what the overlay adds to a packet over an IPv4
// underlay, or over an IPv6 one: pods' MTU is the underlay's less this.
func VXLANOverhead(ipv6Underlay bool) int {
	if ipv6Underlay {
		return vxlanOverhead6
	}
	return vxlanOverhead
}

// vtepLinkLocal is the link-local address of node's overlay device, the
// gateway of the routes to its blocks that do not go via its VTEP.
func vtepLinkLocal(node string) netip.Addr {
	mac := vtepMAC(node)
	var b [16]byte
	b[0], b[1] = 0xfe, 0x80
	b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15] = mac[0]^0x02, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]
	return netip.AddrFrom16(b)
}

// vtepMAC is node's VXLAN device MAC: locally administered, unicast.
func vtepMAC(node string) net.HardwareAddr {
	h := sha256.Sum256([]byte("kvipam-vtep/" + node))
	mac := net.HardwareAddr(h[:6])
	mac[0] = mac[0]&^0x01 | 0x02
	return mac
}

// VXLAN is the overlay's programmer: this node's device, and the
// routes, neighbour and FDB entries to every other node's blocks on it.
type VXLAN struct {
	node  string
	local netip.Addr // this node's VTEP, its node address of the underlay's family
	six   bool       // an IPv6 underlay
	vni   int
	port  int
	log   hclog.Logger
}

// VXLANConfig is the overlay of one node.
type VXLANConfig struct {
	Node         string
	VNI, Port    int
	IPv6Underlay bool // the tunnel endpoints are IPv6 (else IPv4)
	// Addresses are the node's addresses (NodeAddresses); the first of
	// the underlay's family is its VTEP.
	Addresses []string
}

// NewVXLAN is the overlay's programmer for cfg.
func NewVXLAN(cfg VXLANConfig, log hclog.Logger) *VXLAN {
	v := &VXLAN{node: cfg.Node, vni: cfg.VNI, port: cfg.Port, six: cfg.IPv6Underlay, log: log}
	for _, s := range cfg.Addresses {
		if a, err := netip.ParseAddr(s); err == nil && a.Is6() == v.six {
			v.local = a
			break
		}
	}
	return v
}

func (v *VXLAN) family() (int, string) {
	if v.six {
		return netlink.FAMILY_V6, "IPv6"
	}
	return netlink.FAMILY_V4, "IPv4"
}

// underlay is the link that holds the local VTEP address.
func (v *VXLAN) underlay(h *netlink.Handle) (netlink.Link, error) {
	fam, name := v.family()
	if !v.local.IsValid() {
		return nil, fmt.Errorf("vxlan: this node has no %s node address to be its VTEP (--node-address; vxlan-underlay)", name)
	}
	addrs, err := h.AddrList(nil, fam)
	if err != nil {
		return nil, fmt.Errorf("vxlan: list addresses: %w", err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == v.local {
			return h.LinkByIndex(a.LinkIndex)
		}
	}
	return nil, fmt.Errorf("vxlan: node address %s is on no link", v.local)
}

// device returns the VXLAN device, created if missing and re-created if
// its parameters differ; one that matches is kept as it is.
func (v *VXLAN) device(h *netlink.Handle) (netlink.Link, error) {
	under, err := v.underlay(h)
	if err != nil {
		return nil, err
	}
	mac, mtu := vtepMAC(v.node), under.Attrs().MTU-VXLANOverhead(v.six)
	if l, err := h.LinkByName(vxlanDevice); err == nil {
		vx, ok := l.(*netlink.Vxlan)
		if ok && vx.VxlanId == v.vni && vx.Port == v.port && vx.SrcAddr.Equal(v.local.AsSlice()) &&
			vx.VtepDevIndex == under.Attrs().Index && !vx.Learning && bytes.Equal(vx.HardwareAddr, mac) {
			if vx.MTU != mtu {
				if err := h.LinkSetMTU(l, mtu); err != nil {
					return nil, fmt.Errorf("vxlan: set mtu: %w", err)
				}
			}
			if vx.Flags&net.FlagUp == 0 {
				if err := h.LinkSetUp(l); err != nil {
					return nil, fmt.Errorf("vxlan: set up: %w", err)
				}
			}
			return l, nil
		}
		v.log.Info("re-creating the vxlan device: its parameters changed", "device", vxlanDevice)
		if err := h.LinkDel(l); err != nil {
			return nil, fmt.Errorf("vxlan: delete old device: %w", err)
		}
	}
	la := netlink.NewLinkAttrs()
	la.Name, la.MTU, la.HardwareAddr = vxlanDevice, mtu, mac
	vx := &netlink.Vxlan{LinkAttrs: la, VxlanId: v.vni, VtepDevIndex: under.Attrs().Index,
		SrcAddr: v.local.AsSlice(), Port: v.port, Learning: false}
	if err := h.LinkAdd(vx); err != nil {
		return nil, fmt.Errorf("vxlan: create %s: %w", vxlanDevice, err)
	}
	l, err := h.LinkByName(vxlanDevice)
	if err != nil {
		return nil, fmt.Errorf("vxlan: %w", err)
	}
	if err := h.LinkSetUp(l); err != nil {
		return nil, fmt.Errorf("vxlan: set up: %w", err)
	}
	v.log.Info("created the vxlan device", "device", vxlanDevice, "vni", v.vni, "port", v.port, "local", v.local, "mtu", mtu)
	return l, nil
}

func (v *VXLAN) program(h *netlink.Handle, want map[netip.Prefix]peerHop) error {
	l, err := v.device(h)
	if err != nil {
		return err
	}
	idx := l.Attrs().Index
	fdb := map[netip.Addr]net.HardwareAddr{}    // VTEP -> MAC of the nodes with blocks
	neigh4 := map[netip.Addr]net.HardwareAddr{} // IPv4 gateways (VTEPs of an IPv4 underlay)
	neigh6 := map[netip.Addr]net.HardwareAddr{} // link-local gateways
	routes := map[netip.Prefix]overlayHop{}
	for b, hop := range want {
		vtep := v.vtepOf(hop)
		if !vtep.IsValid() {
			continue // the node has no address of the underlay's family
		}
		mac := vtepMAC(hop.node)
		fdb[vtep] = mac
		gw := vtepLinkLocal(hop.node)
		if b.Addr().Is4() && vtep.Is4() {
			gw = vtep
			neigh4[gw] = mac
		} else {
			neigh6[gw] = mac
		}
		routes[b] = overlayHop{node: hop.node, gw: gw}
	}
	errs := []error{v.syncRoutes(h, idx, routes), v.syncEntries(h, idx, netlink.FAMILY_V4, neigh4),
		v.syncEntries(h, idx, netlink.FAMILY_V6, neigh6), v.syncEntries(h, idx, unix.AF_BRIDGE, fdb)}
	return errors.Join(errs...)
}

// vtepOf is the peer's address of the underlay's family.
func (v *VXLAN) vtepOf(hop peerHop) netip.Addr {
	if hop.addr.IsValid() && hop.addr.Is6() == v.six {
		return hop.addr
	}
	for _, a := range hop.addrs {
		if a.Is6() == v.six {
			return a
		}
	}
	return netip.Addr{}
}

// overlayHop is a route's gateway on the overlay device: the peer's IPv4
// VTEP (on-link) or its link-local address.
type overlayHop struct {
	node string
	gw   netip.Addr
}

// overlayRoute is the kernel route of block via hop on the device.
func overlayRoute(b netip.Prefix, hop overlayHop, idx int) *netlink.Route {
	r := &netlink.Route{Dst: prefixNet(b), LinkIndex: idx, Protocol: Protocol}
	switch {
	case b.Addr().Is4() && hop.gw.Is6():
		r.Via = &netlink.Via{AddrFamily: netlink.FAMILY_V6, Addr: net.IP(hop.gw.AsSlice())}
	case hop.gw.Is4():
		r.Gw, r.Flags = net.IP(hop.gw.AsSlice()), int(netlink.FLAG_ONLINK)
	default:
		r.Gw = net.IP(hop.gw.AsSlice())
	}
	return r
}

// sameOverlayRoute reports whether the kernel's route r is block's route via hop.
func sameOverlayRoute(r netlink.Route, hop overlayHop, idx int) bool {
	if r.LinkIndex != idx {
		return false
	}
	if via, ok := r.Via.(*netlink.Via); ok && via != nil {
		a, _ := netip.AddrFromSlice(via.Addr)
		return a == hop.gw
	}
	gw, _ := netip.AddrFromSlice(r.Gw)
	if gw.Unmap() != hop.gw {
		return false
	}
	return !hop.gw.Is4() || r.Flags&int(netlink.FLAG_ONLINK) != 0
}

func (v *VXLAN) syncRoutes(h *netlink.Handle, idx int, want map[netip.Prefix]overlayHop) error {
	have, err := ownRoutes(h, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range have {
		dst, _ := netip.ParsePrefix(r.Dst.String())
		if hop, ok := want[dst]; ok && sameOverlayRoute(r, hop, idx) {
			delete(want, dst)
			continue
		}
		if err := h.RouteDel(&r); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	for b, hop := range want {
		if err := h.RouteReplace(overlayRoute(b, hop, idx)); err != nil {
			errs = append(errs, fmt.Errorf("vxlan route %s via %s: %w", b, hop.gw, err))
			continue
		}
		v.log.Debug("route to peer block over vxlan", "block", b, "via", hop.gw, "node", hop.node)
	}
	return errors.Join(errs...)
}

// syncEntries keeps one permanent entry of family on the device per peer:
// a neighbour entry (AF_INET: the peer's VTEP address, the on-link gateway
// of its routes, resolves to its device's MAC) or a forwarding entry
// (AF_BRIDGE: frames for that MAC go to that address). Entries that
// match are kept, other permanent ones removed, missing ones added.
func (v *VXLAN) syncEntries(h *netlink.Handle, idx, family int, want map[netip.Addr]net.HardwareAddr) error {
	what := map[int]string{netlink.FAMILY_V4: "neighbour", netlink.FAMILY_V6: "IPv6 neighbour", unix.AF_BRIDGE: "fdb"}[family]
	have, err := h.NeighList(idx, family)
	if err != nil {
		return fmt.Errorf("vxlan %s entries: %w", what, err)
	}
	var errs []error
	done := map[netip.Addr]bool{}
	for _, n := range have {
		if n.State&netlink.NUD_PERMANENT == 0 {
			continue
		}
		ip, _ := netip.AddrFromSlice(n.IP)
		if mac, ok := want[ip.Unmap()]; ok && bytes.Equal(n.HardwareAddr, mac) {
			done[ip.Unmap()] = true
			continue
		}
		if err := h.NeighDel(&n); err != nil && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, err)
		}
	}
	for ip, mac := range want {
		if done[ip] {
			continue
		}
		n := &netlink.Neigh{LinkIndex: idx, Family: family, State: netlink.NUD_PERMANENT, IP: net.IP(ip.AsSlice()), HardwareAddr: mac}
		if family == unix.AF_BRIDGE {
			n.Flags = netlink.NTF_SELF
		}
		if err := h.NeighSet(n); err != nil {
			errs = append(errs, fmt.Errorf("vxlan %s %s %s: %w", what, ip, mac, err))
		}
	}
	return errors.Join(errs...)
}

// removeVXLANDevice deletes the overlay's device if there is one (a node
// moved off routing vxlan); its routes and entries go with it.
func removeVXLANDevice(h *netlink.Handle) error {
	l, err := h.LinkByName(vxlanDevice)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("look up %s: %w", vxlanDevice, err)
	}
	if err := h.LinkDel(l); err != nil {
		return fmt.Errorf("delete %s: %w", vxlanDevice, err)
	}
	return nil
}
