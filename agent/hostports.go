package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/hashicorp/go-hclog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/bpf"
	"github.com/kvipam/kvipam/internal/foundation/netlinkns"
	"github.com/kvipam/kvipam/routing"
)

// Host ports: the runtime's portMappings, which the plugin passes in the
// endpoint request, are served by the bpf datapath (bpf/hostport.h,
// docs/design.md "Host ports"): programmed with the endpoint, before the
// ADD answers, removed with it, pinned like it. The routes datapath has no
// program to serve them: there the conflist chains portmap, and a request
// that carries mappings is refused rather than silently not served.

// ErrPortInUse is a port mapping that overlaps another pod's on the node.
var ErrPortInUse = errors.New("agent: host port in use")

// PortInUseError names the pod whose mapping a request's overlaps.
type PortInUseError struct{ Msg string }

func (e *PortInUseError) Error() string { return e.Msg }
func (e *PortInUseError) Unwrap() error { return ErrPortInUse }

// checkPortMappings validates a request's mappings and returns them with
// the protocol spelled as stored (tcp or udp).
func checkPortMappings(pms []api.PortMapping, datapath string) ([]api.PortMapping, error) {
	if len(pms) == 0 {
		return nil, nil
	}
	if datapath != DatapathBPF {
		return nil, &FieldError{Field: "portMappings", Msg: fmt.Sprintf(
			"portMappings: the %s datapath does not serve host ports: chain the portmap plugin after kvipam (docs/cni.md)", datapath)}
	}
	out := make([]api.PortMapping, 0, len(pms))
	for i, pm := range pms {
		field := fmt.Sprintf("portMappings[%d]", i)
		bad := func(msg string, args ...any) error {
			return &FieldError{Field: field, Msg: field + ": " + fmt.Sprintf(msg, args...)}
		}
		pm.Protocol = strings.ToLower(pm.Protocol)
		if pm.Protocol == "" {
			pm.Protocol = "tcp"
		}
		switch {
		case pm.Protocol != "tcp" && pm.Protocol != "udp":
			return nil, bad("protocol %q is not tcp or udp", pm.Protocol)
		case pm.HostPort < 1 || pm.HostPort > 65535:
			return nil, bad("hostPort %d is not 1-65535", pm.HostPort)
		case pm.ContainerPort < 1 || pm.ContainerPort > 65535:
			return nil, bad("containerPort %d is not 1-65535", pm.ContainerPort)
		}
		if pm.HostIP != "" {
			a, err := netip.ParseAddr(pm.HostIP)
			if err != nil || a.Zone() != "" {
				return nil, bad("hostIP %q is not an IP address", pm.HostIP)
			}
			if a.Unmap().IsUnspecified() {
				pm.HostIP = "" // 0.0.0.0 and :: mean every address, as with portmap
			} else {
				pm.HostIP = a.Unmap().String()
			}
		}
		out = append(out, pm)
	}
	return out, nil
}

// bpfPorts resolves mappings to the endpoint's addresses: one per family
// the pod has, or the hostIP's family only.
func bpfPorts(pms []api.PortMapping, ips []netip.Addr) ([]bpf.PortMapping, error) {
	var out []bpf.PortMapping
	for i, pm := range pms {
		proto := uint8(unix.IPPROTO_TCP)
		if pm.Protocol == "udp" {
			proto = unix.IPPROTO_UDP
		}
		var host netip.Addr
		if pm.HostIP != "" {
			var err error
			if host, err = netip.ParseAddr(pm.HostIP); err != nil {
				return nil, fmt.Errorf("portMappings[%d]: hostIP %q: %w", i, pm.HostIP, err)
			}
		}
		found := false
		for _, fam4 := range []bool{true, false} {
			j := -1
			for k, a := range ips {
				if a.Unmap().Is4() == fam4 {
					j = k
					break
				}
			}
			if j < 0 || (host.IsValid() && host.Unmap().Is4() != fam4) {
				continue
			}
			found = true
			out = append(out, bpf.PortMapping{Protocol: proto, HostAddr: host, HostPort: uint16(pm.HostPort), PodAddr: ips[j], PodPort: uint16(pm.ContainerPort)})
		}
		if !found {
			return nil, &FieldError{Field: fmt.Sprintf("portMappings[%d]", i),
				Msg: fmt.Sprintf("portMappings[%d]: the pod has no address of hostIP %s's family", i, pm.HostIP)}
		}
	}
	return out, nil
}

// portInUse turns the datapath's conflict into one that names the pod
// holding the port, from the endpoint records.
func portInUse(err error, eps []api.Endpoint) error {
	var pc *bpf.PortConflictError
	if !errors.As(err, &pc) {
		return err
	}
	holder := fmt.Sprintf("endpoint %d", pc.EndpointID)
	for _, ep := range eps {
		if ep.ID == pc.EndpointID {
			holder = fmt.Sprintf("pod %s/%s (container %s, interface %s)", ep.Owner.Namespace, ep.Owner.Pod, ep.Owner.ContainerID, ep.Owner.IfName)
		}
	}
	return &PortInUseError{Msg: fmt.Sprintf("host port %s is already mapped by %s (%s)", pc.Mapping, holder, pc.Other)}
}

// hostPortUplinks are the interfaces other hosts' host port traffic
// arrives on: the configured ones, else those of the default routes and
// of the node's addresses.
func hostPortUplinks(configured, nodeAddrs []string, netnsPath string, log hclog.Logger) ([]int, error) {
	h, err := netlinkns.Open(netnsPath)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	var out []int
	add := func(l netlink.Link) {
		i, name := l.Attrs().Index, l.Attrs().Name
		if name != "lo" && !strings.HasPrefix(name, api.HostVethPrefix) && !slices.Contains(out, i) {
			out = append(out, i)
		}
	}
	if len(configured) > 0 {
		for _, name := range configured {
			l, err := h.LinkByName(name)
			if err != nil {
				return nil, fmt.Errorf("host port device %q: %w", name, err)
			}
			add(l)
		}
		return out, nil
	}
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		for _, l := range netlinkns.DefaultRouteLinks(h, fam) {
			add(l)
		}
	}
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list addresses: %w", err)
	}
	for _, s := range routing.NodeAddresses(nodeAddrs, netnsPath) {
		for _, a := range addrs {
			if a.IP.String() == s {
				if l, err := h.LinkByIndex(a.LinkIndex); err == nil {
					add(l)
				}
			}
		}
	}
	if len(out) == 0 {
		log.Warn("no uplink found for host ports (no default route, no node address on an interface): other hosts do not reach them; set hostPortDevices")
	}
	return out, nil
}
