package agent

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

// routeProgrammer makes the kernel's routes to other nodes' blocks equal
// want (block -> the node and its address), changing only what differs,
// so that a restarted agent adopts what is there without a flap.
type routeProgrammer interface {
	program(h *netlink.Handle, want map[netip.Prefix]peerHop) error
}

// newRouteProgrammer is the programmer of a routing mode; nil for none.
func newRouteProgrammer(cfg *Config, log hclog.Logger) routeProgrammer {
	switch cfg.Routing {
	case RoutingHostGW:
		return hostGW{log: log}
	case RoutingVXLAN:
		return newVXLAN(cfg, log)
	}
	return nil
}

// hostGW routes each block via its node's address, on whatever link
// reaches that address (flannel's host-gw).
type hostGW struct{ log hclog.Logger }

func (g hostGW) program(h *netlink.Handle, want map[netip.Prefix]peerHop) error {
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
		r := &netlink.Route{Dst: prefixNet(b), Gw: net.IP(hop.addr.AsSlice()), Protocol: routeProtocol}
		if err := h.RouteReplace(r); err != nil {
			errs = append(errs, err) // a peer not on our segment: no host-gw route to it
			continue
		}
		g.log.Debug("route to peer block", "block", b, "via", hop.addr)
	}
	return errors.Join(errs...)
}

// ownRoutes are the routes the agent made (routeProtocol).
func ownRoutes(h *netlink.Handle, family int) ([]netlink.Route, error) {
	return netlinksafe.Handle{Handle: h}.RouteListFiltered(family, &netlink.Route{Protocol: routeProtocol}, netlink.RT_FILTER_PROTOCOL)
}
