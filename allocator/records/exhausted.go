package records

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvipam/kvipam/allocator"
)

// ExhaustedError reports a pool family with no address left for this
// node: its own blocks are full, no block is left to claim and no other
// node's block has a free address to borrow. The counts come from one
// read of the whole pool, so the message says why, and whether waiting
// helps (Temporary) or the pool needs more addresses.
type ExhaustedError struct {
	Pool   string
	Family allocator.Family
	// Size is the number of addresses the pool can hand out, Reserved
	// those of them in reserved ranges (never handed out automatically).
	Size, Reserved uint64
	// Allocated counts every address held, Borrowed those held by a node
	// in another node's block, Pending the reservations of ADDs that have
	// not finished; the first of those lapses at LapseAt.
	Allocated, Borrowed, Pending int
	LapseAt                      time.Time
	// Blocks is the number of blocks, Claimed those with a claim.
	Blocks  uint64
	Claimed int
	// Orphaned are blocks whose node's lease ended while they still hold
	// allocations (OrphanedHeld of them, by OrphanNodes): they come free
	// only with kvipamctl node remove.
	Orphaned     int
	OrphanedHeld int
	OrphanNodes  []string
	// MaxBlocks, when set, is the pool's maxBlocksPerNode, which this
	// node holds: it may claim no block more, free or not.
	MaxBlocks int
}

// Temporary reports whether addresses will come free without adding any:
// reservations lapse, or orphaned blocks are freed by node remove.
func (e *ExhaustedError) Temporary() bool { return e.Pending > 0 || e.OrphanedHeld > 0 }

func (e *ExhaustedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pool %s exhausted (%s): %d addresses, %d allocated", e.Pool, e.Family, e.Size, e.Allocated)
	if e.Borrowed > 0 {
		fmt.Fprintf(&b, " (%d borrowed across blocks)", e.Borrowed)
	}
	fmt.Fprintf(&b, ", %d reserved; %d of %d blocks claimed", e.Reserved, e.Claimed, e.Blocks)
	if e.Orphaned > 0 {
		fmt.Fprintf(&b, ", %d more orphaned", e.Orphaned)
	}
	var why []string
	if e.Pending > 0 {
		s := fmt.Sprintf("%d reservations of unfinished ADDs", e.Pending)
		if !e.LapseAt.IsZero() {
			s += " lapse from " + e.LapseAt.UTC().Format(time.RFC3339)
		}
		why = append(why, s)
	}
	if e.OrphanedHeld > 0 {
		why = append(why, fmt.Sprintf("%d addresses in orphaned blocks of %s come free with kvipamctl node remove", e.OrphanedHeld, strings.Join(e.OrphanNodes, ", ")))
	}
	switch {
	case e.MaxBlocks > 0 && uint64(e.Claimed+e.Orphaned) < e.Blocks:
		fmt.Fprintf(&b, ". This node holds the pool's max blocks per node (%d) of %s, full, and no other node's block has a free address to borrow", e.MaxBlocks, e.Family)
		if e.Temporary() {
			fmt.Fprintf(&b, "; %s", strings.Join(why, "; "))
		}
		fmt.Fprintf(&b, "; raise it (kvipamctl pool set-max-blocks %s) or serve the pool from more nodes", e.Pool)
	case e.Temporary():
		fmt.Fprintf(&b, ". Temporary: %s", strings.Join(why, "; "))
	default:
		fmt.Fprintf(&b, ". Permanent: every address is in use; add a cidr (kvipamctl pool add-cidr %s) or free addresses", e.Pool)
	}
	return b.String()
}

// Unwrap makes an ExhaustedError match ErrExhausted.
func (e *ExhaustedError) Unwrap() error { return ErrExhausted }

// ExplainExhausted says why family f of pool p has no address to hand
// out, counted from snap: what an ADD is told, and kvipamctl pool show.
func ExplainExhausted(ctx context.Context, st LeaseReader, p allocator.Pool, f allocator.Family, snap PoolSnapshot) *ExhaustedError {
	e := &ExhaustedError{Pool: p.Name, Family: f, Size: p.Size(f), Reserved: p.ReservedCount(f), Blocks: p.BlockCount(f)}
	leases := map[int64]bool{}
	for _, bi := range snap.Blocks {
		if allocator.FamilyOf(bi.Block.Addr()) != f {
			continue
		}
		used := snap.Used[bi.Block]
		switch {
		case bi.Claim != nil:
			e.Claimed++
		case len(used) > 0:
			e.Orphaned++
			e.OrphanedHeld += len(used)
			if bi.Home != nil && !slices.Contains(e.OrphanNodes, bi.Home.Node) {
				e.OrphanNodes = append(e.OrphanNodes, bi.Home.Node)
			}
		}
	}
	for b, used := range snap.Used {
		if allocator.FamilyOf(b.Addr()) != f {
			continue
		}
		e.Allocated += len(used)
		for _, u := range used {
			if u.Lease != 0 {
				e.Pending++
				leases[u.Lease] = true
			}
		}
	}
	for addr := range snap.Lent {
		if allocator.FamilyOf(addr) == f {
			e.Borrowed++
		}
	}
	for l := range leases {
		if exp, err := st.LeaseExpiry(ctx, l); err == nil && (e.LapseAt.IsZero() || exp.Before(e.LapseAt)) {
			e.LapseAt = exp
		}
	}
	slices.Sort(e.OrphanNodes)
	return e
}
