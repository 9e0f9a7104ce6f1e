package nodealloc

import (
	"fmt"
	"net/netip"
	"slices"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// A pool's draining cidrs (allocator/drain.go), as the node serves them:
// its block walks leave them out (no claim), its own blocks there hand
// out nothing new (servingOwn), it borrows nothing there, and their
// empty blocks go back by the path a disabled pool's do (maybeUnclaim,
// giveBackEmpty), at the pool change, at a restore and as each address
// is released. What pods hold there stays theirs: a retried ADD gets its
// address, and a sticky identity's next pod takes its kept address back
// (it is the identity's, not a new one).

// servingOwn lists the own blocks of family f outside the pool's
// draining cidrs, in address order: those hand out new addresses.
func (ps *poolState) servingOwn(f allocator.Family) []netip.Prefix {
	return slices.DeleteFunc(ps.sortedOwn(f), func(b netip.Prefix) bool { return ps.pool.InDraining(b.Addr()) })
}

// givesBack reports whether own block b of ps goes back to the pool once
// empty, even if it is the node's last: the pool is disabled or does not
// choose the node (draining), or b is in a draining cidr.
func (a *Allocator) givesBack(ps *poolState, b netip.Prefix) bool {
	return a.draining(ps) || ps.pool.InDraining(b.Addr())
}

// staticDrained refuses a static request for an address of a draining
// cidr: the cidr is being retired, and a new address there would hold
// its removal up.
func staticDrained(p allocator.Pool, addr netip.Addr) error {
	c, ok := p.DrainingCIDR(addr)
	if !ok {
		return nil
	}
	return fmt.Errorf("%w: requested ip %s is in cidr %s of pool %s, which is draining and hands out no new address (kvipamctl pool undrain-cidr %s %s)",
		records.ErrBadRequest, addr, c, p.Name, p.Name, c)
}
