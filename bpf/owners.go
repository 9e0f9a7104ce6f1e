//go:build linux

package bpf

import (
	"fmt"
	"net/netip"
)

// owners mirrors who owns what in the addrs and ifaces maps: the host
// ifindex of each address, and the endpoint ID of each ifindex. The
// program never writes those maps and this process writes them only under
// mapsMu or mu held exclusively (locks.go), through putOwned and
// deleteOwned, so the mirror, read from the maps at Open and changed with
// each write, is exact. With it an endpoint's attach and removal find the
// interface's addresses, and whether an ID's counters are still used,
// without walking the maps: a walk costs two system calls an entry, and
// the walks were half of the agent's work to remove a pod's endpoint.
type owners struct {
	addrs map[kvipamAddrKey]uint32 // address -> host ifindex
	ids   map[uint32]uint32        // host ifindex -> endpoint ID
}

// loadOwners reads the mirror from the maps; Open calls it before any
// other call can write them.
func (d *Datapath) loadOwners() error {
	d.owners = owners{addrs: map[kvipamAddrKey]uint32{}, ids: map[uint32]uint32{}}
	var (
		key   kvipamAddrKey
		owner kvipamAddrInfo
	)
	it := d.objs.KvipamAddrs.Iterate()
	for it.Next(&key, &owner) {
		d.owners.addrs[key] = owner.Ifindex
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("iterate addresses: %w", err)
	}
	var (
		ifindex uint32
		info    kvipamIfaceInfo
	)
	ifs := d.objs.KvipamIfaces.Iterate()
	for ifs.Next(&ifindex, &info) {
		d.owners.ids[ifindex] = info.EndpointId
	}
	if err := ifs.Err(); err != nil {
		return fmt.Errorf("iterate ifaces: %w", err)
	}
	return nil
}

// addrsByIfindex lists the addrs map grouped by owning interface.
func (d *Datapath) addrsByIfindex() map[uint32][]netip.Addr {
	out := make(map[uint32][]netip.Addr)
	for key, ifindex := range d.owners.addrs {
		if a, ok := key.addr(); ok {
			out[ifindex] = append(out[ifindex], a)
		}
	}
	return out
}

// addrsOf lists the addresses the addrs map gives to ifindex.
func (d *Datapath) addrsOf(ifindex uint32) []netip.Addr {
	var out []netip.Addr
	for key, owner := range d.owners.addrs {
		if a, ok := key.addr(); ok && owner == ifindex {
			out = append(out, a)
		}
	}
	return out
}

// idInUse reports whether an ifaces entry names endpoint ID id.
func (d *Datapath) idInUse(id uint32) bool {
	for _, used := range d.owners.ids {
		if used == id {
			return true
		}
	}
	return false
}

// noteAddr and noteIface record a write that succeeded: value is the
// entry's value now, or nil when there is none.
func (d *Datapath) noteAddr(key kvipamAddrKey, value *kvipamAddrInfo) {
	if value == nil {
		delete(d.owners.addrs, key)
		return
	}
	d.owners.addrs[key] = value.Ifindex
}

func (d *Datapath) noteIface(ifindex uint32, value *kvipamIfaceInfo) {
	if value == nil {
		delete(d.owners.ids, ifindex)
		return
	}
	d.owners.ids[ifindex] = value.EndpointId
}
