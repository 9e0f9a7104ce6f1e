package planner

import (
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
)

// Request asks for one address per family for an owner.
type Request struct {
	Pool  string
	Owner records.Owner
	// Families defaults to the families of IPs, or else every family of
	// the pool.
	Families []allocator.Family
	// IPs are requested static addresses, at most one per family.
	IPs []netip.Addr
	// Reserve writes a reservation (on a short lease) instead of a
	// permanent allocation; Confirm makes it permanent.
	Reserve bool
	// Sticky, if set, makes the addresses follow an identity (sticky.go).
	Sticky *records.Sticky
	// Migration, with Sticky, marks the target pod of a live migration
	// of the identity (KubeVirt's kubevirt.io/migrationJobName): it is
	// admitted as the identity's alternate while another pod holds it
	// (nodealloc.Allocator.Admit).
	Migration string
}

// Result is what an owner holds in a pool after a request.
type Result struct {
	Pool        string
	Allocations []records.Allocation
	// Expires is when the reservation lapses unless confirmed; zero for
	// permanent allocations.
	Expires time.Time
	// Alternate says the owner was admitted as a live migration's
	// second, non-forwarding owner of Allocations, which are still
	// another pod's until the cut-over.
	Alternate bool
}
