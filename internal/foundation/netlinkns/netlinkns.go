// Package netlinkns opens netlink handles bound to a network namespace.
package netlinkns

import (
	"fmt"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// Open returns a netlink handle for the network namespace at path, or
// for the caller's own namespace when path is empty. A handle bound to a
// namespace works from any goroutine, unlike the package-level functions,
// which act in whatever namespace the calling thread is in.
func Open(path string) (*netlink.Handle, error) {
	if path == "" {
		h, err := netlink.NewHandle()
		if err != nil {
			return nil, fmt.Errorf("open netlink: %w", err)
		}
		return h, nil
	}
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("open netlink in %s: %w", path, err)
	}
	return h, nil
}

// DefaultRouteLinks are the links that carry a default route of family
// fam (netlink.FAMILY_V4 or FAMILY_V6) on h, in the kernel's route order;
// none if the routes cannot be listed.
func DefaultRouteLinks(h *netlink.Handle, fam int) []netlink.Link {
	routes, err := h.RouteList(nil, fam)
	if err != nil {
		return nil
	}
	var out []netlink.Link
	for _, r := range routes {
		if r.Dst != nil && !r.Dst.IP.IsUnspecified() {
			continue
		}
		if l, err := h.LinkByIndex(r.LinkIndex); err == nil {
			out = append(out, l)
		}
	}
	return out
}
