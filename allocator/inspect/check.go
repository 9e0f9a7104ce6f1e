package inspect

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/kvipam/kvipam/allocator/records"
)

// Kind names what a finding is about. The values are stable: scripts may
// match on them.
type Kind string

// Kinds of findings, with the invariant (docs/design.md) each one breaks.
const (
	// KindDuplicateIP: one address under two allocation keys of a pool
	// (two block keys, or two spellings of an IPv6 address). Invariant 1.
	KindDuplicateIP Kind = "duplicate-ip"
	// KindDuplicateOwner: one (containerID, ifName) holding two addresses
	// of one family in one pool. Invariant 1 seen from the owner's side.
	KindDuplicateOwner Kind = "duplicate-owner"
	// KindWrongNode: an allocation whose block's claim (or home, when
	// unclaimed) names another node, or no node; or a claim whose home
	// names another node. Invariant 2.
	KindWrongNode Kind = "wrong-node"
	// KindMisplaced: a key whose block is not a block of its pool, or an
	// allocation whose address is outside its key's block, not canonical,
	// or one the pool never hands out.
	KindMisplaced Kind = "misplaced"
	// KindOrphanedBlock: a block holding allocations without a claim.
	// Expected after a node died (invariant 3); it stays until the node
	// returns or an operator runs kvipamctl node remove.
	KindOrphanedBlock Kind = "orphaned-block"
	// KindDeadNodeClaim: a claim whose node has no node record.
	KindDeadNodeClaim Kind = "dead-node-claim"
	// KindClaimWithoutLease: a claim on no lease never expires.
	KindClaimWithoutLease Kind = "claim-without-lease"
	// KindExpiredReservation: a reservation with no lease or an expired
	// one, which will never go away by itself. Invariant 5.
	KindExpiredReservation Kind = "expired-reservation"
	// KindLeasedAllocation: a confirmed allocation on a lease, which will
	// vanish with it while the pod still uses the address.
	KindLeasedAllocation Kind = "leased-allocation"
	// KindUnknownPool: a claim, home or allocation of a pool that does not
	// exist.
	KindUnknownPool Kind = "unknown-pool"
	// KindUndecodable: a key or value that cannot be read.
	KindUndecodable Kind = "undecodable"
	// KindLostEndpoint: a pod endpoint a node found, on coming back, whose
	// addresses its owner no longer holds: the node's blocks were freed
	// while it was away (kvipamctl node remove) and another pod may use
	// the address now. The pod may still exist without working
	// networking. Invariant 1 is at risk until that pod is deleted. Listed
	// in the node record, so it is reported while the agent runs.
	KindLostEndpoint Kind = "lost-endpoint"
	// KindStickyConflict: a sticky identity's binding names an address
	// that another owner holds, or that nothing holds.
	KindStickyConflict Kind = "sticky-conflict"
	// KindBelowSchema: a live node that does not understand the cluster's
	// schema level (an older release started without kvipamctl
	// downgrade), or a pool that uses a feature above the level: records
	// a node may misread or drop.
	KindBelowSchema Kind = "below-schema"
)

// Finding is one breach found by Check.
type Finding struct {
	Kind    Kind     `json:"kind"`
	Keys    []string `json:"keys"`
	Message string   `json:"message"`
}

// Report is the result of Check.
type Report struct {
	Revision int64     `json:"revision"`
	Scanned  int       `json:"scanned"`
	Findings []Finding `json:"findings"`
}

// Clean reports whether the check found nothing.
func (r Report) Clean() bool { return len(r.Findings) == 0 }

// Check runs CheckSnapshot on s after asking etcd, once per distinct lease,
// how long each reservation lease has left.
func (in *Inspector) Check(ctx context.Context, s *Snapshot) (Report, error) {
	ttls := map[int64]int64{}
	for _, ip := range s.IPs {
		if ip.State != records.StateReserved || ip.Lease == 0 {
			continue
		}
		if _, done := ttls[ip.Lease]; done {
			continue
		}
		ttl, err := in.st.LeaseTTL(ctx, ip.Lease)
		if err != nil {
			return Report{}, fmt.Errorf("look up lease %x of %s: %w", ip.Lease, ip.Key, err)
		}
		ttls[ip.Lease] = ttl
	}
	return CheckSnapshot(s, ttls), nil
}

// CheckSnapshot finds the invariant breaches in s. ttls maps a reservation
// lease to its remaining TTL in seconds as etcd reports it (-1 for a lease
// etcd no longer has); a lease missing from ttls is not judged. A store
// written only by kvipam agents gives an empty report.
func CheckSnapshot(s *Snapshot, ttls map[int64]int64) Report {
	c := &checker{s: s, ttls: ttls}
	c.badKeys()
	c.claimsAndHomes()
	c.blocks()
	c.ips()
	c.duplicates()
	c.lostEndpoints()
	c.schemaLevel()
	c.bindings()
	slices.SortFunc(c.out, func(a, b Finding) int {
		return cmp.Or(cmp.Compare(a.Kind, b.Kind), slices.Compare(a.Keys, b.Keys), cmp.Compare(a.Message, b.Message))
	})
	if c.out == nil {
		c.out = []Finding{}
	}
	return Report{Revision: s.Revision, Scanned: s.Scanned, Findings: c.out}
}

type checker struct {
	s    *Snapshot
	ttls map[int64]int64
	out  []Finding
}

func (c *checker) add(k Kind, keys []string, format string, args ...any) {
	c.out = append(c.out, Finding{Kind: k, Keys: keys, Message: fmt.Sprintf(format, args...)})
}
