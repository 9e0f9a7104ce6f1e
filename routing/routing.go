// Package routing routes the pods of every other node's blocks to that
// node: host-gw (a route via the node's address, nodes on one L2
// segment), a VXLAN overlay (nodes on different subnets), or BGP (the
// node announces its own blocks to its routers; the speaker is
// routing/bgp). It follows the block homes and node records in etcd and
// programs the kernel or the speaker from them; it removes what it made
// for an uninstall. The agent composes it: routing never imports the
// agent, and names what it needs of the agent's parts (the store's
// watches, the node's lease, what the node holds) in small interfaces of
// its own.
package routing

import (
	"errors"
	"maps"
	"net"
	"net/netip"
	"syscall"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"
)

// Programmer makes the kernel's routes to other nodes' blocks equal
// want (block -> the node and its address), changing only what differs,
// so that a restarted agent adopts what is there without a flap. HostGW
// and VXLAN are the two.
type Programmer interface {
	program(h *netlink.Handle, want map[netip.Prefix]peerHop) error
}

// HostGW routes each block via its node's address, on whatever link
// reaches that address (flannel's host-gw).
type HostGW struct{ log hclog.Logger }

// NewHostGW is the host-gw programmer.
func NewHostGW(log hclog.Logger) HostGW { return HostGW{log: log} }

func (g HostGW) program(h *netlink.Handle, want map[netip.Prefix]peerHop) error {
	// A vxlan device left from an earlier mode goes, and its routes with it.
	if err := removeVXLANDevice(h); err != nil {
		return err
	}
	have, err := ownRoutes(h, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	var errs []error
	todo := maps.Clone(want)
	for _, r := range have {
		dst, _ := netip.ParsePrefix(r.Dst.String())
		gw, _ := netip.AddrFromSlice(r.Gw)
		if hop, ok := todo[dst]; ok && hop.addr.IsValid() && hop.addr == gw.Unmap() && r.Flags&int(netlink.FLAG_ONLINK) == 0 {
			delete(todo, dst)
			continue
		}
		if err := h.RouteDel(&r); err != nil && !errors.Is(err, syscall.ESRCH) {
			errs = append(errs, err)
		}
	}
	for b, hop := range todo {
		if !hop.addr.IsValid() {
			continue // the node has no address of the block's family
		}
		r := &netlink.Route{Dst: prefixNet(b), Gw: net.IP(hop.addr.AsSlice()), Protocol: Protocol}
		if err := h.RouteReplace(r); err != nil {
			errs = append(errs, err) // a peer not on our segment: no host-gw route to it
			continue
		}
		g.log.Debug("route to peer block", "block", b, "via", hop.addr)
	}
	return errors.Join(errs...)
}

// ownRoutes are the routes routing made (Protocol).
func ownRoutes(h *netlink.Handle, family int) ([]netlink.Route, error) {
	return netlinksafe.Handle{Handle: h}.RouteListFiltered(family, &netlink.Route{Protocol: Protocol}, netlink.RT_FILTER_PROTOCOL)
}
