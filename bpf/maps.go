//go:build linux

package bpf

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// The functions here read and write the maps; callers hold mapsMu, or mu
// exclusively (locks.go).

// undoList collects the inverse of each map write so a failed Attach leaves
// the maps as it found them. It runs holding mapsMu, like the writes.
type undoList []func() error

func (u undoList) run() error {
	var errs []error
	for i := len(u) - 1; i >= 0; i-- {
		errs = append(errs, u[i]())
	}
	return errors.Join(errs...)
}

// ensureCounters creates the zeroed per-CPU counters of an endpoint ID if
// absent and reports whether it did. The program never inserts counters.
func (d *Datapath) ensureCounters(id uint32) (bool, error) {
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return false, fmt.Errorf("count possible cpus: %w", err)
	}
	err = d.objs.KvipamCounters.Update(id, make([]kvipamCounters, cpus), ebpf.UpdateNoExist)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, ebpf.ErrKeyExist):
		return false, nil
	default:
		return false, fmt.Errorf("create counters %d: %w", id, err)
	}
}

// writeEndpoint writes the counters, ifaces and addrs entries of ep and
// returns how to undo the writes. It writes nothing if an address belongs to
// another interface.
func (d *Datapath) writeEndpoint(ep Endpoint) (undoList, error) {
	ifindex := uint32(ep.HostIfIndex)
	for _, a := range ep.IPs {
		var owner kvipamAddrInfo
		err := d.objs.KvipamAddrs.Lookup(addrKeyOf(a), &owner)
		switch {
		case errors.Is(err, ebpf.ErrKeyNotExist):
		case err != nil:
			return nil, fmt.Errorf("look up address %s: %w", a, err)
		case owner.Ifindex != ifindex:
			return nil, fmt.Errorf("%w: %s belongs to endpoint %d on ifindex %d",
				ErrAddressInUse, a, owner.EndpointId, owner.Ifindex)
		}
	}
	if err := d.checkPortConflicts(ep); err != nil {
		return nil, err
	}

	var undo undoList
	var prev kvipamIfaceInfo
	if d.objs.KvipamIfaces.Lookup(ifindex, &prev) == nil && prev.EndpointId != ep.ID {
		// Run last: the restored ifaces entry needs its counters, which
		// another interface's removal may have dropped since.
		undo = append(undo, func() error { _, err := d.ensureCounters(prev.EndpointId); return err })
	}
	created, err := d.ensureCounters(ep.ID)
	if err != nil {
		return undo, err
	}
	if created {
		// Not a plain delete: another interface with the same ID may
		// have been attached since, finding these counters.
		undo = append(undo, func() error { return d.dropUnusedCounters(ep.ID) })
	}

	restore, err := putRestorable(d.objs.KvipamIfaces, ifindex, ep.ifaceInfo())
	if err != nil {
		return undo, fmt.Errorf("write iface %d: %w", ifindex, err)
	}
	undo = append(undo, restore)

	for _, a := range ep.IPs {
		restore, err := putRestorable(d.objs.KvipamAddrs, addrKeyOf(a), ep.addrInfo())
		if err != nil {
			return undo, fmt.Errorf("write address %s: %w", a, err)
		}
		undo = append(undo, restore)
	}
	return d.writePorts(ep, undo)
}

// putRestorable writes key=value and returns a function that puts back what
// was there before.
func putRestorable[K comparable, V any](m *ebpf.Map, key K, value V) (func() error, error) {
	var prev V
	err := m.Lookup(key, &prev)
	existed := err == nil
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, err
	}
	if err := m.Put(key, value); err != nil {
		return nil, err
	}
	return func() error {
		if existed {
			return m.Put(key, prev)
		}
		return deleteIfPresent(m, key)
	}, nil
}

func deleteIfPresent(m *ebpf.Map, key any) error {
	if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	return nil
}

// addrsByIfindex lists the addrs map grouped by owning interface.
func (d *Datapath) addrsByIfindex() (map[uint32][]netip.Addr, error) {
	out := make(map[uint32][]netip.Addr)
	var (
		key  kvipamAddrKey
		info kvipamAddrInfo
	)
	it := d.objs.KvipamAddrs.Iterate()
	for it.Next(&key, &info) {
		if a, ok := key.addr(); ok {
			out[info.Ifindex] = append(out[info.Ifindex], a)
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("iterate addresses: %w", err)
	}
	return out, nil
}

// removeAddrs deletes the addresses of ifindex that are not in keep.
func (d *Datapath) removeAddrs(ifindex uint32, keep []netip.Addr) error {
	all, err := d.addrsByIfindex()
	if err != nil {
		return err
	}
	var errs []error
	for _, a := range all[ifindex] {
		if containsAddr(keep, a) {
			continue
		}
		if err := deleteIfPresent(d.objs.KvipamAddrs, addrKeyOf(a)); err != nil {
			errs = append(errs, fmt.Errorf("delete address %s: %w", a, err))
		}
	}
	return errors.Join(errs...)
}

func containsAddr(list []netip.Addr, a netip.Addr) bool {
	for _, b := range list {
		if a == b {
			return true
		}
	}
	return false
}

// removeEndpoint deletes every map entry of the endpoint on ifindex: its
// addresses, its ifaces entry, its announcement watch and the counters of
// its ID. callerID, the caller's idea of the ID, matters when the ifaces
// entry is already gone.
func (d *Datapath) removeEndpoint(ifindex uint32, callerID uint32) error {
	var errs []error
	if err := d.removeAddrs(ifindex, nil); err != nil {
		errs = append(errs, err)
	}
	if err := d.removePorts(ifindex, nil, true); err != nil {
		errs = append(errs, err)
	}
	// A later endpoint given the same ifindex is not a migration target
	// until the agent says so.
	if err := deleteIfPresent(d.objs.KvipamWatch, ifindex); err != nil {
		errs = append(errs, fmt.Errorf("delete announcement watch %d: %w", ifindex, err))
	}
	ids := []uint32{callerID}
	var info kvipamIfaceInfo
	switch err := d.objs.KvipamIfaces.Lookup(ifindex, &info); {
	case err == nil:
		ids = append(ids, info.EndpointId)
		if err := deleteIfPresent(d.objs.KvipamIfaces, ifindex); err != nil {
			errs = append(errs, fmt.Errorf("delete iface %d: %w", ifindex, err))
		}
	case !errors.Is(err, ebpf.ErrKeyNotExist):
		errs = append(errs, fmt.Errorf("look up iface %d: %w", ifindex, err))
	}
	if err := d.dropUnusedCounters(ids...); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// dropUnusedCounters deletes the counters of the given endpoint IDs that no
// ifaces entry refers to any more. ID 0 is kept.
func (d *Datapath) dropUnusedCounters(ids ...uint32) error {
	inUse := make(map[uint32]bool)
	var (
		ifindex uint32
		info    kvipamIfaceInfo
	)
	it := d.objs.KvipamIfaces.Iterate()
	for it.Next(&ifindex, &info) {
		inUse[info.EndpointId] = true
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate ifaces: %w", err)
	}
	var errs []error
	for _, id := range ids {
		if id == 0 || inUse[id] {
			continue
		}
		if err := deleteIfPresent(d.objs.KvipamCounters, id); err != nil {
			errs = append(errs, fmt.Errorf("delete counters %d: %w", id, err))
		}
	}
	return errors.Join(errs...)
}
