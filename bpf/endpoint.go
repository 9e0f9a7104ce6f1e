//go:build linux

package bpf

import (
	"bytes"
	"fmt"
	"math"
	"net"
	"net/netip"
	"slices"
)

// Endpoint is one pod interface as the datapath sees it: the host side of its
// veth and the addresses the pod may send from.
type Endpoint struct {
	// ID identifies the endpoint in the counters. 0 is reserved for frames
	// seen on an interface the datapath does not know.
	ID uint32
	// HostIfIndex is the index of the host-side veth in the agent's network
	// namespace. It names the endpoint in the maps and the link pins.
	HostIfIndex int
	// HostIfName is the host-side veth's name; kept for Adopt, optional.
	HostIfName string
	// MAC is the pod-side interface's address; stored, not enforced.
	MAC net.HardwareAddr
	// IPs are the addresses the pod may use as a source.
	IPs []netip.Addr
	// HostMAC is the host-side veth's address: the source of the frames
	// the node's own connections to a host port send to the pod.
	HostMAC net.HardwareAddr
	// Ports are the host ports the endpoint serves (hostport.go).
	Ports []PortMapping
	// Attach is how Attach attaches the program (AttachTCX or AttachTC);
	// empty: the datapath's mode (SetAttachMode).
	Attach string
}

// Address families as stored in addr_key.family.
const (
	familyIPv4 = 4
	familyIPv6 = 6
)

// ifNameMax is IFNAMSIZ without the terminating NUL.
const ifNameMax = 15

// normalize checks ep and returns a copy with its addresses unmapped,
// unzoned, sorted and without duplicates.
func (ep Endpoint) normalize() (Endpoint, error) {
	switch {
	case ep.ID == 0:
		return ep, fmt.Errorf("%w: ID 0 is reserved", ErrInvalidEndpoint)
	case ep.HostIfIndex <= 0 || ep.HostIfIndex > math.MaxInt32:
		return ep, fmt.Errorf("%w: host ifindex %d", ErrInvalidEndpoint, ep.HostIfIndex)
	case len(ep.HostIfName) > ifNameMax:
		return ep, fmt.Errorf("%w: host ifname %q longer than %d bytes", ErrInvalidEndpoint, ep.HostIfName, ifNameMax)
	case len(ep.MAC) != 0 && len(ep.MAC) != 6:
		return ep, fmt.Errorf("%w: MAC %s is not 6 bytes", ErrInvalidEndpoint, ep.MAC)
	case len(ep.HostMAC) != 0 && len(ep.HostMAC) != 6:
		return ep, fmt.Errorf("%w: host MAC %s is not 6 bytes", ErrInvalidEndpoint, ep.HostMAC)
	case len(ep.IPs) == 0:
		return ep, fmt.Errorf("%w: no addresses", ErrInvalidEndpoint)
	}
	if ep.Attach != "" {
		if err := checkMode(ep.Attach); err != nil {
			return ep, fmt.Errorf("%w: %w", ErrInvalidEndpoint, err)
		}
	}
	ips := make([]netip.Addr, 0, len(ep.IPs))
	for _, a := range ep.IPs {
		a = a.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() || a.IsMulticast() || a.IsLoopback() {
			return ep, fmt.Errorf("%w: address %s cannot be a pod's", ErrInvalidEndpoint, a)
		}
		ips = append(ips, a)
	}
	slices.SortFunc(ips, netip.Addr.Compare)
	ep.IPs = slices.Compact(ips)
	ep.MAC = slices.Clone(ep.MAC)
	ep.HostMAC = slices.Clone(ep.HostMAC)
	ports, err := checkPorts(ep.Ports, ep.IPs)
	if err != nil {
		return ep, err
	}
	ep.Ports = ports
	return ep, nil
}

func addrKeyOf(a netip.Addr) kvipamAddrKey {
	var k kvipamAddrKey
	if a.Is4() {
		k.Family = familyIPv4
		b := a.As4()
		copy(k.Addr[:], b[:])
	} else {
		k.Family = familyIPv6
		k.Addr = a.As16()
	}
	return k
}

func (k kvipamAddrKey) addr() (netip.Addr, bool) {
	switch k.Family {
	case familyIPv4:
		return netip.AddrFrom4([4]byte(k.Addr[:4])), true
	case familyIPv6:
		return netip.AddrFrom16(k.Addr), true
	}
	return netip.Addr{}, false
}

func macOf(hw net.HardwareAddr) [6]uint8 {
	var m [6]uint8
	copy(m[:], hw)
	return m
}

func (ep Endpoint) addrInfo() kvipamAddrInfo {
	return kvipamAddrInfo{Ifindex: uint32(ep.HostIfIndex), EndpointId: ep.ID, Mac: macOf(ep.MAC)}
}

func (ep Endpoint) ifaceInfo() kvipamIfaceInfo {
	info := kvipamIfaceInfo{EndpointId: ep.ID, Mac: macOf(ep.MAC)}
	for i := range min(len(ep.HostIfName), ifNameMax) {
		info.Name[i] = int8(ep.HostIfName[i])
	}
	return info
}

// endpointOf rebuilds an Endpoint, without addresses, from its ifaces entry.
func endpointOf(ifindex uint32, info kvipamIfaceInfo) Endpoint {
	name := make([]byte, 0, len(info.Name))
	for _, c := range info.Name {
		if c == 0 {
			break
		}
		name = append(name, byte(c))
	}
	ep := Endpoint{ID: info.EndpointId, HostIfIndex: int(ifindex), HostIfName: string(name)}
	if !bytes.Equal(info.Mac[:], make([]byte, 6)) {
		ep.MAC = net.HardwareAddr(slices.Clone(info.Mac[:]))
	}
	return ep
}
