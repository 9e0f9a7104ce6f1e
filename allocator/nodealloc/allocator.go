package nodealloc

import (
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
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
	records.Migrations
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

// Request asks for one address per family for an owner.
type Request = planner.Request

// Result is what an owner holds in a pool after a request.
type Result = planner.Result

// Loan is another node's hold on an address of this node's block: the
// node, and the revision its home was written at.
type Loan = planner.Loan

// Allocator hands out IPs from the blocks one node owns, claiming
// blocks from the shared pool as needed. etcd (through Store) is the
// source of truth; the planner (package planner) holds the node's cache
// of it, rebuilt by Restore and corrected whenever a write finds it
// wrong, and makes every decision on it. The Allocator is the driver:
// it holds the locks (inflight.go says the rule), makes the store calls
// the planner asks for, retries, and parks and settles calls of unknown
// outcome.
//
// The store calls are in four files, one per stage of an address's
// life: allocate.go (the ADD: plan, claim, borrow, write, confirm),
// release.go (the DEL: release, keep, drop a binding, give a block back,
// record a lapse), settle.go (reads that fold into the cache: read-backs,
// block loads) and restore.go (restore, sweep, reassert).
//
// Allocator is safe for concurrent use. Allocations are serialized: a
// batch (AllocateBatch) is the way to get throughput, one transaction for
// many requests. Releases, confirms and views wait for an allocation's
// writes, not for its claims (inflight.go).
type Allocator struct {
	cfg    Config
	log    hclog.Logger
	events hclog.Logger // one line per allocation and release

	// allocMu serializes allocations, Restore, Reassert, UpdatePool and
	// GiveBackEmpty; it is taken before mu (inflight.go).
	allocMu sync.Mutex
	mu      sync.Mutex
	flight  inflight
	n       *planner.Node // guarded by mu
	reads   cacheReader
	claims  claimer
	voice   voice
	lease   Lease
	// restored: Restore read the pools on the current lease.
	restored bool
	fence    fence
	// lapsed are reservations seen to lapse whose end is not yet in IP
	// history (lapses.go); they have their own lock, so recording never
	// waits behind allocation.
	lapsed lapses
	// alts are the migration targets this node admitted (migrate.go).
	alts admitted
	// held tells the BGP announcer of addresses learned (heldchanged.go).
	held heldChanges
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
	a := &Allocator{cfg: cfg, log: log, events: log.Named("ip")}
	a.n = planner.NewNode(cfg.Node, cfg.Labels, cfg.Now, cfg.Held)
	a.flight.mu = &a.mu
	a.reads = cacheReader{st: cfg.Store, n: a.n}
	a.voice = voice{n: a.n, log: log, events: a.events, lapsed: &a.lapsed}
	a.fence = fence{st: cfg.Store, claim: func() records.Claim { return a.n.ClaimRecord(cfg.BootID) }, lease: func() int64 { return a.lease.ID() }}
	a.claims = claimer{n: a.n, st: cfg.Store, reads: a.reads, flight: &a.flight, log: log, node: cfg.Node, bootID: cfg.BootID,
		retry: cfg.ClaimRetry, lease: func() int64 { return a.lease.ID() }, ready: a.ready}
	return a, nil
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

// voice says what the planner's decisions did (planner.Event): a line
// per allocation and release on the allocator.ip logger, notes on the
// allocator's; a lapse waits to be recorded in IP history (lapses.go).
// The driver calls say, with mu held, at the end of every call that can
// decide.
type voice struct {
	n           *planner.Node
	log, events hclog.Logger
	lapsed      *lapses
}

func (v voice) say() {
	for _, e := range v.n.Events() {
		al := &e.Al
		switch e.Kind {
		case planner.Allocated:
			v.events.Info("ip allocated", ipFields(al)...)
		case planner.Ended:
			v.events.Info("ip "+e.How, append(ipFields(al), "end", e.End.UTC().Format(time.RFC3339Nano))...)
		case planner.Reasserted:
			v.events.Warn("ip re-asserted", ipFields(al)...)
		case planner.Lapsed:
			v.lapsed.add(e.Al, e.End)
		case planner.Note:
			v.log.Log(hclog.Level(int(e.Level)+int(hclog.Debug)), e.Msg, e.Args...)
		}
	}
}

// ipFields are the fields of an IP history record, so that a site with a
// log pipeline can keep history for as long as it likes.
func ipFields(al *records.Allocation) []any {
	return []any{"pool", al.Pool, "ip", al.Addr, "state", al.State,
		"container", al.ContainerID, "ifname", al.IfName, "namespace", al.Namespace, "pod", al.Pod, "pod_uid", al.PodUID,
		"network", al.Network, "node", al.Node, "start", al.Since}
}
