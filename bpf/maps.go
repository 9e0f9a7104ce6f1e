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
	if prevID, ok := d.owners.ids[ifindex]; ok && prevID != ep.ID {
		// Run last: the restored ifaces entry needs its counters, which
		// another interface's removal may have dropped since.
		undo = append(undo, func() error { _, err := d.ensureCounters(prevID); return err })
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

	restore, err := putRestorable(d.objs.KvipamIfaces, ifindex, ep.ifaceInfo(), d.noteIface)
	if err != nil {
		return undo, fmt.Errorf("write iface %d: %w", ifindex, err)
	}
	undo = append(undo, restore)

	for _, a := range ep.IPs {
		restore, err := putRestorable(d.objs.KvipamAddrs, addrKeyOf(a), ep.addrInfo(), d.noteAddr)
		if err != nil {
			return undo, fmt.Errorf("write address %s: %w", a, err)
		}
		undo = append(undo, restore)
	}
	return d.writePorts(ep, undo)
}

// putRestorable writes key=value and returns a function that puts back what
// was there before. note, unless nil, hears of each write that succeeded:
// the entry's value after it, nil when deleted.
func putRestorable[K comparable, V any](m *ebpf.Map, key K, value V, note func(K, *V)) (func() error, error) {
	if note == nil {
		note = func(K, *V) {}
	}
	var prev V
	err := m.Lookup(key, &prev)
	existed := err == nil
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil, err
	}
	if err := m.Put(key, value); err != nil {
		return nil, err
	}
	note(key, &value)
	return func() error {
		if existed {
			if err := m.Put(key, prev); err != nil {
				return err
			}
			note(key, &prev)
			return nil
		}
		if err := deleteIfPresent(m, key); err != nil {
			return err
		}
		note(key, nil)
		return nil
	}, nil
}

func deleteIfPresent(m *ebpf.Map, key any) error {
	if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	return nil
}

// removeAddrs deletes the addresses of ifindex that are not in keep.
func (d *Datapath) removeAddrs(ifindex uint32, keep []netip.Addr) error {
	var errs []error
	for _, a := range d.addrsOf(ifindex) {
		if containsAddr(keep, a) {
			continue
		}
		key := addrKeyOf(a)
		if err := deleteIfPresent(d.objs.KvipamAddrs, key); err != nil {
			errs = append(errs, fmt.Errorf("delete address %s: %w", a, err))
			continue
		}
		d.noteAddr(key, nil)
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
	if err := d.removePorts(ifindex, nil); err != nil {
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
		} else {
			d.noteIface(ifindex, nil)
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
	var errs []error
	for _, id := range ids {
		if id == 0 || d.idInUse(id) {
			continue
		}
		if err := deleteIfPresent(d.objs.KvipamCounters, id); err != nil {
			errs = append(errs, fmt.Errorf("delete counters %d: %w", id, err))
		}
	}
	return errors.Join(errs...)
}
