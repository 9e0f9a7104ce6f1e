package routing

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"

	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
)

// Remove removes, for an uninstall, what routing left in the network
// namespace at netnsPath (empty: the caller's): the routes to other
// nodes' blocks it made (Protocol, IPv4 and IPv6) and the VXLAN device
// with what it carried. Routes of other owners stay. Run it after the
// agent is gone: a running agent puts them back. It returns what it
// removed, for people.
func Remove(netnsPath string) ([]string, error) {
	h, err := netlinkns.Open(netnsPath)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	var removed []string
	if l, err := h.LinkByName(vxlanDevice); err == nil {
		if err := h.LinkDel(l); err != nil {
			return removed, fmt.Errorf("remove device %s: %w", vxlanDevice, err)
		}
		removed = append(removed, "device "+vxlanDevice)
	} else if !errors.As(err, new(netlink.LinkNotFoundError)) {
		return removed, fmt.Errorf("find device %s: %w", vxlanDevice, err)
	}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := ownRoutes(h, family)
		if err != nil {
			return removed, fmt.Errorf("list routes: %w", err)
		}
		for _, r := range rs {
			if err := h.RouteDel(&r); err != nil {
				return removed, fmt.Errorf("remove route %s: %w", r.Dst, err)
			}
			removed = append(removed, "route "+r.Dst.String())
		}
	}
	return removed, nil
}
