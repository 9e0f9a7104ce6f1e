package nodealloc

import "net/netip"

// ResetLent replaces what the node knows of the addresses of its own
// blocks that other nodes hold, by pool, with a complete listing (the
// agent's home watch listed again after a gap): a pool missing from lent
// has none. A loan the node knew of and the listing lacks was given back
// while no one watched; it is dropped as NoteLent drops a returned one.
// ResetLent returns the pools that had a loan dropped, whose blocks may
// now be empty (see GiveBackEmpty). Like NoteLent it only keeps the books:
// etcd's create-if-absent stays the guard.
func (a *Allocator) ResetLent(lent map[string]map[netip.Addr]string) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var changed []string
	for name, ps := range a.pools {
		listed := lent[name]
		dropped := false
		for addr := range ps.lent {
			if _, ok := listed[addr]; !ok {
				ps.dropLent(addr)
				dropped = true
			}
		}
		for addr, node := range listed {
			if _, ob := ps.ownBlockOf(addr); ob != nil && node != a.cfg.Node {
				ps.lent[addr] = node
				ob.ba.Mark(addr)
			}
		}
		if dropped {
			changed = append(changed, name)
		}
	}
	return changed
}

// dropLent forgets a loan given back, and frees its address unless the
// node uses it (cached, planned, of unknown outcome or kept).
func (ps *poolState) dropLent(addr netip.Addr) {
	delete(ps.lent, addr)
	_, ob := ps.ownBlockOf(addr)
	if ob == nil {
		return
	}
	_, parked := ps.unknown[addr]
	_, kept := ps.kept[addr]
	if ps.byAddr[addr] == nil && !ps.planned[addr] && !parked && !kept {
		ob.ba.Unmark(addr)
	}
}
