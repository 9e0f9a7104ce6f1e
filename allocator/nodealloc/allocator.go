package nodealloc

import (
	"fmt"
	"maps"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Lease is the node's liveness lease: claims are written on it so they
// expire when the node is gone. kvstore.Session satisfies it.
type Lease interface {
	ID() int64
	Lost() bool
}

// Store is what the node allocator needs of the store: every role of
// records.Store but writing pool specs (the node serves the pools the
// store holds; it never writes them).
type Store interface {
	records.PoolReader
	records.Claims
	records.IPs
	records.Loans
	records.Bindings
}

// Config configures an Allocator.
type Config struct {
	Node   string
	BootID string
	Store  Store
	// Labels are the node's labels. A pool whose node selector does not
	// choose them gives the node no new block or address (a node
	// relabelled restarts its agent). The node serves every pool the Store holds: Restore
	// reads them all, and UpdatePool follows them.
	Labels map[string]string
	Logger hclog.Logger
	// ClaimRetry paces the claim loop. Each lost race teaches the node one
	// more taken block, so the loop converges: by default it has no
	// attempt budget and ends only with a claimed block, a pool that is
	// truly exhausted, or the caller's context.
	ClaimRetry retry.Policy
	// RestoreRetry bounds Restore's re-listing when a re-claim of the
	// node's own block loses to a concurrent change. Zero: default.
	RestoreRetry retry.Policy
	// WriteRetry bounds allocation writes that lose a race. Zero: default.
	WriteRetry retry.Policy
	Now        func() time.Time
	// Held, if set, lists the addresses the node's endpoints use. They
	// are never handed out, even when the store has no allocation for
	// them (etcd restored from an older snapshot) until Reassert has
	// settled them.
	Held func() []netip.Addr
}

// Allocator hands out IPs from the blocks one node owns, claiming
// blocks from the shared pool as needed. etcd (through Store) is the
// source of truth; the in-memory maps are a cache rebuilt by Restore and
// corrected whenever a write finds them wrong.
//
// Allocator is safe for concurrent use. Allocations are serialized: a
// batch (AllocateBatch) is the way to get throughput, one transaction for
// many requests. Releases, confirms and views wait for an allocation's
// writes, not for its claims (inflight.go).
type Allocator struct {
	cfg    Config
	log    hclog.Logger
	events hclog.Logger // one line per allocation and release (events.go)

	// allocMu serializes allocations, Restore, Reassert, UpdatePool and
	// GiveBackEmpty; it is taken before mu (inflight.go).
	allocMu sync.Mutex
	mu      sync.Mutex
	// busy holds the owners of the allocation in flight, and busyDone is
	// closed when it ends; both nil between allocations (inflight.go).
	busy     map[string]bool
	busyDone chan struct{}
	lease    Lease
	restored bool
	pools    map[string]*poolState
	labels   map[string]string
	// fenceRev is the revision of the node's borrow fence on the current
	// lease; 0 until the first borrow (borrow.go).
	fenceRev int64
	// lapsed are reservations seen to lapse whose end is not yet in IP
	// history (lapses.go); they have their own lock, so recording never
	// waits behind allocation.
	lapsed lapses
}

// New checks cfg. Call Restore before anything else.
func New(cfg Config) (*Allocator, error) {
	if cfg.Node == "" {
		return nil, fmt.Errorf("%w: node name is empty", records.ErrBadRequest)
	}
	if cfg.Store == nil {
		return nil, fmt.Errorf("%w: no store", records.ErrBadRequest)
	}
	if err := allocator.CheckLabels(cfg.Labels); err != nil {
		return nil, fmt.Errorf("%w: node %s: %w", records.ErrBadRequest, cfg.Node, err)
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.NewNullLogger()
	}
	if cfg.ClaimRetry.Attempts == 0 {
		cfg.ClaimRetry = retry.Policy{Attempts: retry.Unlimited, Initial: time.Millisecond, Max: 20 * time.Millisecond, Multiplier: 1.5, Jitter: 0.5}
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger.Named("allocator")
	return &Allocator{cfg: cfg, log: log, events: log.Named("ip"), pools: map[string]*poolState{}, labels: maps.Clone(cfg.Labels)}, nil
}

// Node is the node this allocator serves.
func (a *Allocator) Node() string { return a.cfg.Node }

func (a *Allocator) claimRecord() records.Claim {
	return records.Claim{Node: a.cfg.Node, BootID: a.cfg.BootID, ClaimedAt: a.cfg.Now().UTC()}
}

// ready checks that the allocator may write now.
func (a *Allocator) ready() error {
	if !a.restored {
		return fmt.Errorf("node %s not restored: %w", a.cfg.Node, records.ErrLeaseLost)
	}
	if a.lease == nil || a.lease.Lost() {
		return fmt.Errorf("node %s: %w", a.cfg.Node, records.ErrLeaseLost)
	}
	return nil
}

func (a *Allocator) poolState(name string) (*poolState, error) {
	ps, ok := a.pools[name]
	if !ok {
		return nil, fmt.Errorf("pool %q is not served on node %s: no such pool in etcd (kvipamctl pool list): %w", name, a.cfg.Node, records.ErrPoolNotFound)
	}
	return ps, nil
}

// selected reports whether ps's node selector chooses this node: only
// then does the node take new blocks and addresses in it.
func (a *Allocator) selected(ps *poolState) bool { return ps.pool.Selects(a.labels) }

// draining reports whether the node gives every empty block of ps back:
// the pool is disabled or refused, or its selector no longer chooses the
// node.
func (a *Allocator) draining(ps *poolState) bool {
	return ps.pool.Disabled || ps.refused != nil || !a.selected(ps)
}

// refusedErr is the error of a request for a refused pool, naming why.
func refusedErr(ps *poolState) error {
	return fmt.Errorf("%w: pool %s is refused and hands out no addresses: %w (fix or delete it: kvipamctl pool remove-cidr, pool delete)",
		records.ErrPoolDisabled, ps.pool.Name, ps.refused)
}

// logRefused reports a refused pool spec at ERROR: an operator must fix
// or delete it.
func (a *Allocator) logRefused(ps *poolState) {
	if ps.refused != nil {
		a.log.Error("pool refused: its spec in etcd is invalid; it hands out nothing new, pods keep what they hold in it (kvipamctl pool show)",
			"pool", ps.pool.Name, "rev", ps.pool.Rev, "reason", ps.refused)
	}
}

// notSelected is the error of a request for a pool that does not choose
// this node, naming the pool, its selector and the node's labels.
func (a *Allocator) notSelected(ps *poolState) error {
	return fmt.Errorf("%w: pool %s serves only nodes matching %q; node %s (labels %s) takes no new address there (kvipamctl pool show %s lists the nodes it serves)",
		records.ErrNodeNotSelected, ps.pool.Name, ps.pool.NodeSelector, a.cfg.Node, a.labelText(), ps.pool.Name)
}

// takeoverNotSelected is the error of a sticky identity's pod on a node
// ps's selector leaves out: b's addresses stay where they are.
func (a *Allocator) takeoverNotSelected(ps *poolState, b records.Binding) error {
	where := fmt.Sprintf("held by its pod %s/%s on node %s", b.Owner.Namespace, b.Owner.Pod, b.Node)
	if b.Kept() {
		where = "kept for it until " + b.Since.Add(b.Window()).UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("%w: sticky identity %s has %v in pool %s (%s), which serves only nodes matching %q; node %s (labels %s) cannot take them over: run the identity's pods on nodes the selector chooses (kvipamctl pool show %s lists them)",
		records.ErrNodeNotSelected, b.Identity, b.Addrs, ps.pool.Name, where, ps.pool.NodeSelector, a.cfg.Node, a.labelText(), ps.pool.Name)
}

// labelText is the node's labels for an error message.
func (a *Allocator) labelText() string {
	if labels := allocator.FormatLabels(a.labels); labels != "" {
		return labels
	}
	return "none"
}
