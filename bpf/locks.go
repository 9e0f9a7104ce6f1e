//go:build linux

package bpf

import "fmt"

// Locking. Calls on one endpoint (Attach, Detach, Disarm, Forget) take
// Datapath.mu shared and then the lock of their host ifindex, so that
// calls on different interfaces run at once (their kernel attaches and
// detaches, rtnl and RCU waits, are the slow part) and calls on the same
// interface run one after another. Whole-datapath calls (Close,
// SetAttachMode, Adopt) take mu exclusively: they wait for the calls in
// flight, and the calls that follow see closed and the new mode.
//
// What endpoints share, and why it is safe:
//   - The maps. Every write this process makes to them, and every walk of
//     them, happens under Datapath.mapsMu (or mu held exclusively), in
//     short sections with no netlink call inside. Each section leaves the
//     maps consistent: an address is checked free and claimed in one
//     section, so two interfaces cannot both take it during a replace; an
//     ifaces entry and the counters of its ID are created in one section,
//     and an ifaces entry is deleted and its counters dropped if unused in
//     another, so dropUnusedCounters never deletes the counters of an
//     endpoint that is being attached. Walks see no concurrent delete from
//     this process, and the program never inserts or deletes entries.
//     The mirror of the addrs and ifaces maps (owners.go) is read and
//     written under the same locks as the maps, by the same sections.
//   - Between sections, the entries that name an ifindex (its ifaces
//     entry, addresses whose entry has its ifindex, its link pin) are
//     changed only by the holder of that ifindex's lock, so an Attach's
//     cleanup and undo, run in later sections, find them as it left them.
//     An undo drops the counters it created only if no other interface
//     took up the same ID meanwhile, and recreates those of an entry it
//     restores.
//   - Go state: mode is written under mu held exclusively; noTCX is
//     atomic; objs, progID, progTag and mapIDs do not change after Open.

// lockEndpoint takes mu shared, unless the datapath is closed, and the lock
// of ifindex, and returns their unlock. An ifindex no interface can have
// is ErrInvalidEndpoint.
func (d *Datapath) lockEndpoint(ifindex int) (unlock func(), err error) {
	if ifindex <= 0 {
		return nil, fmt.Errorf("%w: host ifindex %d", ErrInvalidEndpoint, ifindex)
	}
	if err := d.rlock(); err != nil {
		return nil, err
	}
	unlockIf := d.ifLocks.Lock(ifindex)
	return func() {
		unlockIf()
		d.mu.RUnlock()
	}, nil
}

// rlock takes mu shared unless the datapath is closed.
func (d *Datapath) rlock() error { return d.lockOpen(d.mu.RLock, d.mu.RUnlock) }

// lock takes mu exclusively unless the datapath is closed.
func (d *Datapath) lock() error { return d.lockOpen(d.mu.Lock, d.mu.Unlock) }

// lockOpen takes mu with lock and keeps it if the datapath is open.
func (d *Datapath) lockOpen(lock, unlock func()) error {
	lock()
	if d.closed {
		unlock()
		return ErrClosed
	}
	return nil
}

// withMaps runs fn holding mapsMu, for a caller holding mu shared.
func (d *Datapath) withMaps(fn func() error) error {
	d.mapsMu.Lock()
	defer d.mapsMu.Unlock()
	return fn()
}
