//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// PortMapping is one host port an endpoint serves (a CNI portMappings
// entry, resolved to one of the endpoint's addresses): frames to HostAddr
// (or, when it is not valid, to any address of the node of PodAddr's
// family) and HostPort go to PodAddr and PodPort.
type PortMapping struct {
	// Protocol is unix.IPPROTO_TCP or unix.IPPROTO_UDP.
	Protocol uint8
	HostAddr netip.Addr
	HostPort uint16
	PodAddr  netip.Addr
	PodPort  uint16
}

func (m PortMapping) String() string {
	proto := "tcp"
	if m.Protocol == unix.IPPROTO_UDP {
		proto = "udp"
	}
	host := "*"
	if m.HostAddr.IsValid() {
		host = m.HostAddr.String()
	}
	fam := "ipv4"
	if m.PodAddr.Is6() {
		fam = "ipv6"
	}
	return fmt.Sprintf("%s %s %s:%d -> %s", fam, proto, host, m.HostPort, netip.AddrPortFrom(m.PodAddr, m.PodPort))
}

// ErrPortInUse is returned (in a *PortConflictError) by Attach when a
// mapping overlaps another endpoint's.
var ErrPortInUse = errors.New("bpf: host port in use by another endpoint")

// PortConflictError says which endpoint holds the host port a mapping
// wants: same family and protocol, same port, and the same host address or
// either of them all of the node's.
type PortConflictError struct {
	Mapping    PortMapping
	Other      PortMapping
	EndpointID uint32
	IfIndex    uint32
}

func (e *PortConflictError) Error() string {
	return fmt.Sprintf("host port %s overlaps %s of endpoint %d (ifindex %d)", e.Mapping, e.Other, e.EndpointID, e.IfIndex)
}

func (e *PortConflictError) Unwrap() error { return ErrPortInUse }

// checkPorts validates an endpoint's mappings: every pod address is one of
// ips, no two mappings overlap.
func checkPorts(ports []PortMapping, ips []netip.Addr) ([]PortMapping, error) {
	var out []PortMapping
	for _, m := range ports {
		m.PodAddr = m.PodAddr.Unmap().WithZone("")
		m.HostAddr = m.HostAddr.Unmap().WithZone("")
		switch {
		case m.Protocol != unix.IPPROTO_TCP && m.Protocol != unix.IPPROTO_UDP:
			return nil, fmt.Errorf("%w: port mapping protocol %d is not tcp or udp", ErrInvalidEndpoint, m.Protocol)
		case m.HostPort == 0 || m.PodPort == 0:
			return nil, fmt.Errorf("%w: port mapping %s has port 0", ErrInvalidEndpoint, m)
		case !containsAddr(ips, m.PodAddr):
			return nil, fmt.Errorf("%w: port mapping %s: %s is not an address of the endpoint", ErrInvalidEndpoint, m, m.PodAddr)
		case m.HostAddr.IsValid() && (m.HostAddr.Is4() != m.PodAddr.Is4() || m.HostAddr.IsUnspecified()):
			return nil, fmt.Errorf("%w: port mapping %s: host address of another family, or unspecified", ErrInvalidEndpoint, m)
		}
		for _, o := range out {
			if overlaps(o, m) {
				return nil, fmt.Errorf("%w: port mappings %s and %s overlap", ErrInvalidEndpoint, o, m)
			}
		}
		out = append(out, m)
	}
	return out, nil
}

func overlaps(a, b PortMapping) bool {
	return a.Protocol == b.Protocol && a.HostPort == b.HostPort && a.PodAddr.Is4() == b.PodAddr.Is4() &&
		(!a.HostAddr.IsValid() || !b.HostAddr.IsValid() || a.HostAddr == b.HostAddr)
}

func (m PortMapping) key() kvipamHostportKey {
	k := kvipamHostportKey{Proto: m.Protocol, Port: htons(m.HostPort), Family: familyIPv4}
	if m.PodAddr.Is6() {
		k.Family = familyIPv6
	}
	if m.HostAddr.IsValid() {
		k.Addr = addrKeyOf(m.HostAddr).Addr
	}
	return k
}

func (ep Endpoint) hostportInfo(m PortMapping) kvipamHostportInfo {
	return kvipamHostportInfo{
		Addr: addrKeyOf(m.PodAddr).Addr, Port: htons(m.PodPort),
		PodMac: macOf(ep.MAC), HostMac: macOf(ep.HostMAC),
		Ifindex: uint32(ep.HostIfIndex), EndpointId: ep.ID,
	}
}

func mappingOf(k kvipamHostportKey, v kvipamHostportInfo) PortMapping {
	m := PortMapping{Protocol: k.Proto, HostPort: ntohs(k.Port), PodPort: ntohs(v.Port)}
	pod, _ := kvipamAddrKey{Family: k.Family, Addr: v.Addr}.addr()
	m.PodAddr = pod
	if k.Addr != ([16]uint8{}) {
		m.HostAddr, _ = kvipamAddrKey{Family: k.Family, Addr: k.Addr}.addr()
	}
	return m
}

type hostportEntry struct {
	key  kvipamHostportKey
	info kvipamHostportInfo
}

func (d *Datapath) hostportEntries() ([]hostportEntry, error) {
	var (
		out  []hostportEntry
		e    hostportEntry
		iter = d.objs.KvipamHostports.Iterate()
	)
	for iter.Next(&e.key, &e.info) {
		out = append(out, e)
	}
	if err := iter.Err(); err != nil {
		return nil, fmt.Errorf("iterate host ports: %w", err)
	}
	return out, nil
}

// checkPortConflicts refuses ep's mappings that overlap another
// interface's.
func (d *Datapath) checkPortConflicts(ep Endpoint) error {
	if len(ep.Ports) == 0 {
		return nil
	}
	all, err := d.hostportEntries()
	if err != nil {
		return err
	}
	for _, m := range ep.Ports {
		for _, e := range all {
			if e.info.Ifindex == uint32(ep.HostIfIndex) {
				continue
			}
			if other := mappingOf(e.key, e.info); overlaps(m, other) {
				return &PortConflictError{Mapping: m, Other: other, EndpointID: e.info.EndpointId, IfIndex: e.info.Ifindex}
			}
		}
	}
	return nil
}

// writePorts writes ep's mappings, returning how to undo the writes.
func (d *Datapath) writePorts(ep Endpoint, undo undoList) (undoList, error) {
	for _, m := range ep.Ports {
		restore, err := putRestorable(d.objs.KvipamHostports, m.key(), ep.hostportInfo(m), nil)
		if err != nil {
			return undo, fmt.Errorf("write host port %s: %w", m, err)
		}
		undo = append(undo, restore)
	}
	return undo, nil
}

// removePorts deletes the mappings of ifindex not in keep, then the
// translated flows no remaining mapping of ifindex serves. A flow is of
// use only while its mapping stands (the frames to the pod are translated
// by the mapping), and it is keyed by the pod's address, which may be
// handed out again once the endpoint goes. So an interface that had no
// mapping removed has no flow to drop, and its removal does not walk the
// flows map: a walk of that map, sized for every node-wide flow, was most
// of an endpoint's removal.
func (d *Datapath) removePorts(ifindex uint32, keep []PortMapping) error {
	all, err := d.hostportEntries()
	if err != nil {
		return err
	}
	var (
		errs    []error
		removed bool
	)
	for _, e := range all {
		if e.info.Ifindex != ifindex {
			continue
		}
		// Attach has written keep's entries already: only the key
		// tells one of them.
		if slices.ContainsFunc(keep, func(m PortMapping) bool { return m.key() == e.key }) {
			continue
		}
		removed = true
		if err := deleteIfPresent(d.objs.KvipamHostports, e.key); err != nil {
			errs = append(errs, fmt.Errorf("delete host port %s: %w", mappingOf(e.key, e.info), err))
		}
	}
	if removed {
		errs = append(errs, d.removeFlows(func(k kvipamNatKey, v kvipamNatInfo) bool {
			return v.Ifindex == ifindex && !slices.ContainsFunc(keep, func(m PortMapping) bool { return m.serves(k, v) })
		}))
	}
	return errors.Join(errs...)
}

// serves reports whether the flow k, v was translated by m.
func (m PortMapping) serves(k kvipamNatKey, v kvipamNatInfo) bool {
	pod := addrKeyOf(m.PodAddr)
	return k.Proto == m.Protocol && k.Family == pod.Family && k.PodAddr == pod.Addr && ntohs(k.PodPort) == m.PodPort &&
		ntohs(v.HostPort) == m.HostPort && (!m.HostAddr.IsValid() || v.HostAddr == addrKeyOf(m.HostAddr).Addr)
}

// removeFlows deletes the translated flows drop selects.
func (d *Datapath) removeFlows(drop func(kvipamNatKey, kvipamNatInfo) bool) error {
	var (
		k    kvipamNatKey
		v    kvipamNatInfo
		keys []kvipamNatKey
	)
	it := d.objs.KvipamNat.Iterate()
	for it.Next(&k, &v) {
		if drop(k, v) {
			keys = append(keys, k)
		}
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrIterationAborted) {
		return fmt.Errorf("iterate translated flows: %w", err)
	}
	var errs []error
	for _, k := range keys {
		if err := deleteIfPresent(d.objs.KvipamNat, k); err != nil {
			errs = append(errs, fmt.Errorf("delete translated flow: %w", err))
		}
	}
	return errors.Join(errs...)
}

// dropStalePorts deletes the mappings of interfaces with no endpoint, and
// the flows no remaining mapping serves (an agent up to v0.1.0 kept the
// flows of a mapping a re-attach dropped).
func (d *Datapath) dropStalePorts(kept []Endpoint) error {
	live := make(map[uint32]bool, len(kept))
	for _, ep := range kept {
		live[uint32(ep.HostIfIndex)] = true
	}
	all, err := d.hostportEntries()
	if err != nil {
		return err
	}
	var errs []error
	serving := map[uint32][]PortMapping{}
	for _, e := range all {
		if !live[e.info.Ifindex] {
			d.log.Info("removing a host port without an endpoint", "mapping", mappingOf(e.key, e.info).String(), "ifindex", e.info.Ifindex)
			errs = append(errs, deleteIfPresent(d.objs.KvipamHostports, e.key))
			continue
		}
		serving[e.info.Ifindex] = append(serving[e.info.Ifindex], mappingOf(e.key, e.info))
	}
	errs = append(errs, d.removeFlows(func(k kvipamNatKey, v kvipamNatInfo) bool {
		return !slices.ContainsFunc(serving[v.Ifindex], func(m PortMapping) bool { return m.serves(k, v) })
	}))
	return errors.Join(errs...)
}

// HostPorts lists the mappings in force, by host ifindex.
func (d *Datapath) HostPorts() (map[int][]PortMapping, error) {
	if err := d.rlock(); err != nil {
		return nil, err
	}
	defer d.mu.RUnlock()
	var all []hostportEntry
	if err := d.withMaps(func() (err error) { all, err = d.hostportEntries(); return err }); err != nil {
		return nil, err
	}
	out := map[int][]PortMapping{}
	for _, e := range all {
		out[int(e.info.Ifindex)] = append(out[int(e.info.Ifindex)], mappingOf(e.key, e.info))
	}
	return out, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
func ntohs(v uint16) uint16 { return htons(v) }
