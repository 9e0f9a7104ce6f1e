package agent

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
// finds its device unchanged. IPv4 only: an IPv6 block is not routed.

const (
	vxlanDevice = "kvipam.vxlan"
	// vxlanOverhead is what encapsulation adds to a packet over an IPv4
	// underlay: outer IPv4 (20), UDP (8), VXLAN (8) and inner Ethernet (14).
	vxlanOverhead = 50
)

// vtepMAC is node's VXLAN device MAC: locally administered, unicast.
func vtepMAC(node string) net.HardwareAddr {
	h := sha256.Sum256([]byte("kvipam-vtep/" + node))
	mac := net.HardwareAddr(h[:6])
	mac[0] = mac[0]&^0x01 | 0x02
	return mac
}

type vxlanOverlay struct {
	node  string
	local netip.Addr // this node's VTEP, its IPv4 node address
	vni   int
	port  int
	log   hclog.Logger
}

func newVXLAN(cfg *Config, log hclog.Logger) *vxlanOverlay {
	v := &vxlanOverlay{node: cfg.Node, vni: cfg.VXLAN.VNI, port: cfg.VXLAN.Port, log: log}
	for _, s := range nodeAddresses(cfg.NodeAddresses, cfg.NetNS) {
		if a, err := netip.ParseAddr(s); err == nil && a.Is4() {
			v.local = a
			break
		}
	}
	return v
}

// underlay is the link that holds the local VTEP address.
func (v *vxlanOverlay) underlay(h *netlink.Handle) (netlink.Link, error) {
	if !v.local.IsValid() {
		return nil, errors.New("vxlan: this node has no IPv4 node address to be its VTEP (--node-address)")
	}
	addrs, err := h.AddrList(nil, netlink.FAMILY_V4)
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
func (v *vxlanOverlay) device(h *netlink.Handle) (netlink.Link, error) {
	under, err := v.underlay(h)
	if err != nil {
		return nil, err
	}
	mac, mtu := vtepMAC(v.node), under.Attrs().MTU-vxlanOverhead
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

func (v *vxlanOverlay) program(h *netlink.Handle, want map[netip.Prefix]peerHop) error {
	l, err := v.device(h)
	if err != nil {
		return err
	}
	idx := l.Attrs().Index
	peers := map[netip.Addr]net.HardwareAddr{} // VTEP -> MAC of the nodes with blocks
	routes := map[netip.Prefix]peerHop{}
	for b, hop := range want {
		if b.Addr().Is4() && hop.addr.Is4() {
			routes[b] = hop
			peers[hop.addr] = vtepMAC(hop.node)
		}
	}
	errs := []error{v.syncRoutes(h, idx, routes), v.syncEntries(h, idx, netlink.FAMILY_V4, peers), v.syncEntries(h, idx, unix.AF_BRIDGE, peers)}
	return errors.Join(errs...)
}

func (v *vxlanOverlay) syncRoutes(h *netlink.Handle, idx int, want map[netip.Prefix]peerHop) error {
	have, err := ownRoutes(h, netlink.FAMILY_V4)
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range have {
		dst, _ := netip.ParsePrefix(r.Dst.String())
		gw, _ := netip.AddrFromSlice(r.Gw)
		if hop, ok := want[dst]; ok && hop.addr == gw.Unmap() && r.LinkIndex == idx && r.Flags&int(netlink.FLAG_ONLINK) != 0 {
			delete(want, dst)
			continue
		}
		if err := h.RouteDel(&r); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	for b, hop := range want {
		r := &netlink.Route{Dst: prefixNet(b), Gw: net.IP(hop.addr.AsSlice()), LinkIndex: idx,
			Flags: int(netlink.FLAG_ONLINK), Protocol: routeProtocol}
		if err := h.RouteReplace(r); err != nil {
			errs = append(errs, fmt.Errorf("vxlan route %s via %s: %w", b, hop.addr, err))
			continue
		}
		v.log.Debug("route to peer block over vxlan", "block", b, "via", hop.addr, "node", hop.node)
	}
	return errors.Join(errs...)
}

// syncEntries keeps one permanent entry of family on the device per peer:
// a neighbour entry (AF_INET: the peer's VTEP address, the on-link gateway
// of its routes, resolves to its device's MAC) or a forwarding entry
// (AF_BRIDGE: frames for that MAC go to that address). Entries that
// match are kept, other permanent ones removed, missing ones added.
func (v *vxlanOverlay) syncEntries(h *netlink.Handle, idx, family int, want map[netip.Addr]net.HardwareAddr) error {
	what := map[int]string{netlink.FAMILY_V4: "neighbour", unix.AF_BRIDGE: "fdb"}[family]
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
