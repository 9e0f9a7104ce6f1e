package allocator

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/internal/retry"
)

// Lease is the node's liveness lease: claims are written on it so they
// expire when the node is gone. kvstore.Session satisfies it.
type Lease interface {
	ID() int64
	Lost() bool
}

// NodeConfig configures a NodeAllocator.
type NodeConfig struct {
	Node   string
	BootID string
	Store  Store
	// Pools are the names of the pools this node allocates from; their
	// specs are read from the Store at Restore.
	Pools  []string
	Logger hclog.Logger
	// ClaimRetry bounds the claim loop; each lost race teaches the node
	// one more taken block, so the loop converges. Zero: 64 quick attempts.
	ClaimRetry retry.Policy
	// WriteRetry bounds allocation writes that lose a race. Zero: default.
	WriteRetry retry.Policy
	Now        func() time.Time
}

// NodeAllocator hands out IPs from the blocks one node owns, claiming
// blocks from the shared pool as needed. etcd (through Store) is the
// source of truth; the in-memory maps are a cache rebuilt by Restore and
// corrected whenever a write finds them wrong.
//
// NodeAllocator is safe for concurrent use. Calls are serialized: a batch
// (AllocateBatch) is the way to get throughput, one transaction for many
// requests.
type NodeAllocator struct {
	cfg NodeConfig
	log hclog.Logger

	mu       sync.Mutex
	lease    Lease
	restored bool
	pools    map[string]*poolState
}

// poolState is this node's view of one pool.
type poolState struct {
	pool Pool
	own  map[netip.Prefix]*ownBlock
	// others are blocks the node must not try to claim: claimed by another
	// node, or orphaned. It is refreshed from the store before each claim.
	others  map[netip.Prefix]otherBlock
	byOwner map[string]map[Family]*Allocation
	byAddr  map[netip.Addr]*Allocation
	expires map[netip.Addr]time.Time // reservations' expiry
}

type ownBlock struct {
	ba       *BlockAlloc
	claimRev int64
}

type otherBlock struct {
	node     string // claim holder, "" if unclaimed
	orphaned bool   // unclaimed but holding allocations
}

// NewNodeAllocator checks cfg. Call Restore before anything else.
func NewNodeAllocator(cfg NodeConfig) (*NodeAllocator, error) {
	if cfg.Node == "" {
		return nil, fmt.Errorf("%w: node name is empty", ErrBadRequest)
	}
	if cfg.Store == nil {
		return nil, fmt.Errorf("%w: no store", ErrBadRequest)
	}
	if len(cfg.Pools) == 0 {
		return nil, fmt.Errorf("%w: no pools for node %s", ErrBadRequest, cfg.Node)
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.ClaimRetry.Attempts == 0 {
		cfg.ClaimRetry = retry.Policy{Attempts: 64, Initial: time.Millisecond, Max: 50 * time.Millisecond, Multiplier: 1.5, Jitter: 0.5}
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &NodeAllocator{cfg: cfg, log: cfg.Logger.Named("allocator"), pools: map[string]*poolState{}}, nil
}

// Node is the node this allocator serves.
func (a *NodeAllocator) Node() string { return a.cfg.Node }

// Restore rebuilds the node's state from the store on lease: it re-claims
// every block whose home is this node (orphaned blocks, and claims left on
// an earlier lease of this node), and reads their allocations, one range
// read per block. No allocation is changed. Call it at start and after
// the lease was lost and a new one granted.
func (a *NodeAllocator) Restore(ctx context.Context, lease Lease) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.restored = false
	a.lease = lease
	pools := map[string]*poolState{}
	for _, name := range a.cfg.Pools {
		p, err := a.cfg.Store.GetPool(ctx, name)
		if err != nil {
			return fmt.Errorf("restore pool %s: %w", name, err)
		}
		ps := newPoolState(p)
		if err := a.restorePool(ctx, ps); err != nil {
			return fmt.Errorf("restore pool %s: %w", name, err)
		}
		pools[name] = ps
	}
	a.pools = pools
	a.restored = true
	return nil
}

func newPoolState(p Pool) *poolState {
	return &poolState{
		pool:    p,
		own:     map[netip.Prefix]*ownBlock{},
		others:  map[netip.Prefix]otherBlock{},
		byOwner: map[string]map[Family]*Allocation{},
		byAddr:  map[netip.Addr]*Allocation{},
		expires: map[netip.Addr]time.Time{},
	}
}

func (a *NodeAllocator) restorePool(ctx context.Context, ps *poolState) error {
	infos, err := a.cfg.Store.ListBlocks(ctx, ps.pool.Name)
	if err != nil {
		return err
	}
	me := a.cfg.Node
	for _, info := range infos {
		home := info.Home != nil && info.Home.Node == me
		switch {
		case info.Owned(me) && info.ClaimLease == a.lease.ID():
			// Already ours on the current lease.
		case home && (info.Claim == nil || info.Claim.Node == me):
			rev, err := a.cfg.Store.Reclaim(ctx, ps.pool.Name, info, a.claimRecord(), a.lease.ID())
			var ce *ClaimError
			if errors.As(err, &ce) {
				a.log.Warn("could not re-claim own block", "pool", ps.pool.Name, "block", info.Block, "reason", ce.Error())
				ps.noteOther(info.Block, ce.ClaimedBy, ce.NonEmpty)
				continue
			}
			if err != nil {
				return err
			}
			a.log.Info("re-claimed block", "pool", ps.pool.Name, "block", info.Block, "orphaned", info.Claim == nil)
			info.ClaimRev = rev
		default:
			// Another node's claim. A home without a claim may be an
			// orphaned block or a free one; the claim loop finds out.
			if info.Claim != nil {
				ps.others[info.Block] = otherBlock{node: info.Claim.Node}
			}
			continue
		}
		if err := a.adoptBlock(ctx, ps, info.Block, info.ClaimRev); err != nil {
			return err
		}
	}
	return nil
}

// adoptBlock makes block one of ours at claimRev and loads its allocations.
func (a *NodeAllocator) adoptBlock(ctx context.Context, ps *poolState, block netip.Prefix, claimRev int64) error {
	ba, err := NewBlockAlloc(ps.pool, block)
	if err != nil {
		return err
	}
	ps.own[block] = &ownBlock{ba: ba, claimRev: claimRev}
	delete(ps.others, block)
	return a.reloadBlock(ctx, ps, block)
}

// reloadBlock replaces the cached allocations of an own block with the
// store's. It is the repair path whenever a write finds the cache wrong.
func (a *NodeAllocator) reloadBlock(ctx context.Context, ps *poolState, block netip.Prefix) error {
	ob := ps.own[block]
	allocs, err := a.cfg.Store.ListIPs(ctx, ps.pool.Name, block)
	if err != nil {
		return err
	}
	for addr, al := range ps.byAddr {
		if block.Contains(addr) {
			ps.forget(al)
		}
	}
	ob.ba.Reset()
	// Reservations read back from the store expire with their lease; ask
	// etcd once per lease how long it has, so a retried ADD after a
	// restart does not get a reservation that has already lapsed.
	expiry := map[int64]time.Time{}
	for _, al := range allocs {
		if _, done := expiry[al.Lease]; al.Lease != 0 && !done {
			exp, err := a.cfg.Store.LeaseExpiry(ctx, al.Lease)
			if err != nil {
				return err
			}
			expiry[al.Lease] = exp
		}
	}
	var newest *Allocation
	for i := range allocs {
		al := allocs[i]
		ob.ba.Mark(al.Addr)
		if al.ContainerID == "" {
			a.log.Warn("unreadable allocation key in own block; its address stays taken", "pool", ps.pool.Name, "ip", al.Addr)
			continue
		}
		if newest == nil || al.Since.After(newest.Since) {
			newest = &allocs[i]
		}
		if al.Node != a.cfg.Node {
			a.log.Warn("allocation of another node in own block", "pool", ps.pool.Name, "ip", al.Addr, "node", al.Node)
		}
		ps.remember(&al, expiry[al.Lease])
	}
	if newest != nil {
		ob.ba.ResumeAfter(newest.Addr)
	}
	return nil
}

func (a *NodeAllocator) claimRecord() Claim {
	return Claim{Node: a.cfg.Node, BootID: a.cfg.BootID, ClaimedAt: a.cfg.Now().UTC()}
}

// remember indexes al; expires is the reservation expiry if known.
func (ps *poolState) remember(al *Allocation, expires time.Time) {
	f := FamilyOf(al.Addr)
	m := ps.byOwner[al.Owner.Key()]
	if m == nil {
		m = map[Family]*Allocation{}
		ps.byOwner[al.Owner.Key()] = m
	}
	m[f] = al
	ps.byAddr[al.Addr] = al
	if al.State == StateReserved && !expires.IsZero() {
		ps.expires[al.Addr] = expires
	}
}

// forget drops al from the indexes (not from the block bitmap).
func (ps *poolState) forget(al *Allocation) {
	k := al.Owner.Key()
	if m := ps.byOwner[k]; m != nil && m[FamilyOf(al.Addr)] == al {
		delete(m, FamilyOf(al.Addr))
		if len(m) == 0 {
			delete(ps.byOwner, k)
		}
	}
	if ps.byAddr[al.Addr] == al {
		delete(ps.byAddr, al.Addr)
	}
	delete(ps.expires, al.Addr)
}

func (ps *poolState) noteOther(b netip.Prefix, node string, nonEmpty bool) {
	ps.others[b] = otherBlock{node: node, orphaned: node == "" && nonEmpty}
}

// ownBlockOf returns the own block holding addr.
func (ps *poolState) ownBlockOf(addr netip.Addr) (netip.Prefix, *ownBlock) {
	b, ok := ps.pool.BlockFor(addr)
	if !ok {
		return netip.Prefix{}, nil
	}
	return b, ps.own[b]
}

// sortedOwn lists own blocks of family f in address order, so allocation
// fills blocks in a stable order.
func (ps *poolState) sortedOwn(f Family) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(ps.own))
	for b := range ps.own {
		if FamilyOf(b.Addr()) == f {
			out = append(out, b)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr().Less(out[j].Addr()) })
	return out
}

// ready checks that the allocator may write now.
func (a *NodeAllocator) ready() error {
	if !a.restored {
		return fmt.Errorf("node %s not restored: %w", a.cfg.Node, ErrLeaseLost)
	}
	if a.lease == nil || a.lease.Lost() {
		return fmt.Errorf("node %s: %w", a.cfg.Node, ErrLeaseLost)
	}
	return nil
}

func (a *NodeAllocator) poolState(name string) (*poolState, error) {
	ps, ok := a.pools[name]
	if !ok {
		return nil, fmt.Errorf("pool %q is not served on node %s: %w", name, a.cfg.Node, ErrPoolNotFound)
	}
	return ps, nil
}
