package nodealloc_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

var (
	modelSteps    = flag.Int("model.steps", 400, "steps of TestModelNodeAllocator (make test runs it briefly; raise it for a long run)")
	modelSeed     = flag.Uint64("model.seed", 0, "seed of TestModelNodeAllocator's choices and faults; 0 picks one and logs it")
	modelLogLines = flag.Int("model.log", 40, "operations TestModelNodeAllocator shows before a violation")
	modelSkip     = flag.String("model.skip", "", "comma-separated operations TestModelNodeAllocator leaves out, to look for one bug while another is known: "+
		"sticky (every sticky operation), storeloss (and reassert), pool (pool changes), operator (node remove, release), stickyreserve (sticky reservations), livetakeover (a sticky pod re-created before its DEL), stickyretry (a sticky ADD retried), restart (a restart on a loaded etcd)")
	modelSpare = flag.String("model.spare", "", "comma-separated write kind=fault cells TestModelNodeAllocator does not inject, "+
		"e.g. bind/takeover=unknown (faults: unknown, before, race, revoke, history, busy, timedout)")
	modelDump    = flag.Bool("model.dump", false, "TestModelNodeAllocator logs its last operations even when it passes")
	modelFault   = flag.Float64("model.faults", 1, "scale of TestModelNodeAllocator's fault rates (0: no faults)")
	modelNodeLog = flag.Int("model.nodelog", 0, "lines of each node allocator's own log TestModelNodeAllocator shows after a violation")
)

// The kinds of write the allocator sends, and the faults the model test
// injects into each (the rows and columns of its fault table).
var (
	writeKinds = []string{"create", "batch", "confirm", "release", "borrow", "keep", "bind/takeover", "reassert",
		"lapse-record", "claim", "unclaim", "unbind", "seed", "admit", "cut over", "drop alternate", kindOperator, kindPoolChange, kindPoolCreate, kindPoolDelete, kindSchema,
		kindImport, kindFinalize}
	faultKinds = []string{"unknown outcome", "fail before send", "lost race", "lease revoked", "history lease lost", "too many requests", "timed out, landed", "reservation lease lost"}
)

const (
	fUnknown = iota
	fBefore
	fRace
	fRevoke
	fHistory
	// fBusy is etcd's back-pressure ("too many requests"): refused before
	// it was proposed, an ErrUnavailable that a request with a deadline
	// retries inside it.
	fBusy
	// fTimedOut is a write that landed while its answer came past the
	// call timeout: an unknown outcome that is an ErrUnavailable, which a
	// request with a deadline settles and retries inside it.
	fTimedOut
	// fResLease revokes the node's newest reservation lease before a
	// write that may reserve: the write's own (a claim or a create then
	// meets "lease not found" and must tell it from its node's lease), or
	// one whose reservations lapse early.
	fResLease
	nFaults
)

// faultRates are the chances, per write, of each fault kind (faultKinds'
// order), and of a failed read.
var faultRates = [...]float64{fUnknown: 0.07, fBefore: 0.03, fRace: 0.02, fRevoke: 0.006, fHistory: 0.01, fBusy: 0.03, fTimedOut: 0.04, fResLease: 0.03}

// modelRequestTimeout bounds each of the model's requests, as the agent
// bounds an API request: an etcd that did not answer in time is retried
// inside it (retry.Policy.Unavailable).
const modelRequestTimeout = 30 * time.Second

const readFailRate = 0.01

// reservationTTL is short, so that reservations lapse during a run.
const reservationTTL = 4 * time.Second

// mOwner is what the model knows of one attachment: what it was told it
// holds, and whether it can know (unsure: its last operation failed with
// an outcome the model cannot tell, so etcd may hold more or less).
type mOwner struct {
	o        records.Owner
	node     int
	identity string // sticky identity, "" for an ordinary owner
	gen      int    // the container's generation in its identity
	born     int    // the step its container was made (a sticky identity's)
	told     []netip.Addr
	reserved bool
	expires  time.Time
	unsure   bool
	delFail  bool // its DEL failed: the runtime retries it
	// stalled: its ADD stalled before its confirm, so the agent made no
	// endpoint for it, until an answer tells it something again.
	stalled  bool
	operator bool // an operator released what it held (its node was removed)
	// lost: etcd lost its records and they could not be written back (a
	// reassert conflict: the pod should be deleted). Its binding may name
	// it until the identity's next pod replaces it.
	lost bool
	// retired: an earlier container of a sticky identity that holds
	// nothing, left out of the run's choices (retire).
	retired bool
	// alt: the addresses it was told it holds as a live migration's
	// alternate (second, non-forwarding owner); altUnsure: it may be
	// the alternate or not (a write of unknown outcome).
	alt       []netip.Addr
	altUnsure bool
	// gone: its DEL succeeded. migrant: a pod of a live migration the
	// model ran (its source or target), which etcd may name as an
	// alternate (model_migrate_test.go).
	gone, migrant bool
	// revoked: its reservation's lease was revoked before its time
	// (fResLease), which the store's contract does not foresee: the
	// allocator trusts the expiry it was given and may tell the same
	// reservation again from its cache. Its confirm, fenced by the
	// reservation's revision, then fails, so no pod runs with it; until
	// the owner is told something else, what it is told is doubted.
	revoked bool
	// imported: an attachment of another IPAM that an import made this
	// node's (model_import_test.go): no kvipam ADD made it, so the agent
	// has no endpoint of it, and the runtime sends it only its DEL.
	imported bool
}

// hasEndpoint reports whether the agent would have mo's endpoint record:
// not after a DEL that failed (the agent removed the record before the
// release), nor for an ADD that stalled before its confirm, nor for an
// imported attachment.
func (mo *mOwner) hasEndpoint() bool { return !mo.delFail && !mo.stalled && !mo.imported }

// keptFor is an address kept for a sticky identity after its pod's DEL,
// from a time before the Keep was sent: its window runs at least until
// from+window.
type keptFor struct {
	identity string
	from     time.Time
	window   time.Duration
}

// mNode is one node's allocator on a fault-injecting store, and what its
// agent does: renew a lost lease and Restore.
type mNode struct {
	i     int
	name  string
	cli   *clientv3.Client // etcd's client of the node (etcdBackend)
	hook  *hookStore
	alloc *nodealloc.Allocator
	sess  modelSession
	logs  *logRing // the allocator's log, for a report
}

// modelRun is one run of TestModelNodeAllocator: its nodes, its model and
// its faults. It is driven by one goroutine, so a seed replays the same
// choices and faults (lease and window timing still vary).
type modelRun struct {
	t      *testing.T
	ctx    context.Context
	b      modelBackend
	name   string // the test's name, for the replay command
	seed   uint64
	rng    *rand.Rand
	pool   allocator.Pool
	nodes  []*mNode
	owners map[string]*mOwner
	order  []string // owner keys in creation order, for seeded choices
	holder map[netip.Addr]string
	kept   map[netip.Addr]keptFor
	// resRevoked says a reservation lease was revoked in this step
	// (fResLease): a reservation told in it may have been on that lease,
	// written before the revocation in the same request.
	resRevoked bool
	// selChangedAt is the step the pool's node selector last changed.
	selChangedAt int
	// resRevokedAt is when a reservation lease was last revoked.
	resRevokedAt time.Time
	// maybeKept are addresses of sticky owners released while unsure:
	// etcd may keep them for a while; the window op waits for them too.
	maybeKept  map[netip.Addr]bool
	recent     []netip.Addr // addresses released or lapsed lately: static requests aim at them
	gens       map[string]int
	step       int
	op         string // the operation of this step, for the fault table's write kinds
	call       string // the store call in flight
	quiet      bool   // no faults (a probe, a recovery)
	faults     map[string]*[nFaults]int
	writes     map[string]int // calls of each write kind, faulted or not
	reads      int
	log        []string
	failed     bool
	lent       map[netip.Addr]nodealloc.Loan // lent addresses as the agents' watch last delivered them
	spec       allocator.Pool                // the pool's spec as stored now
	static     bool                          // the answer being applied is to a request for a static address
	confirming bool                          // the answer being applied is a Confirm's
	idAddrs    map[string]map[netip.Addr]bool
	ops        map[string]*[3]int
	// loaded: etcd refuses writes for load far more often than
	// faultRates says (opRestart), at loadedBusyRate.
	loaded bool
	// loadedWrites and loadedBusy count, by write kind, the writes sent
	// while etcd was loaded (restarts) and those it refused.
	loadedWrites, loadedBusy map[string]int
	trace                    modelTrace
	// migs are the live migrations in progress, by identity, and migN
	// numbers their pods (model_migrate_test.go).
	migs map[string]*mMigration
	migN int
}

// loadedBusyRate is the chance that etcd refuses a write for load ("too
// many requests") while it is loaded (modelRun.loaded).
const loadedBusyRate = 0.4

// TestModelNodeAllocator drives three node allocators through every kind
// of write the allocator has: ordinary allocations (reservations and
// permanent), batches, static addresses, borrowing across blocks,
// confirms, releases, sticky identities (bind, keep at DEL, takeover from
// a live pod and from a kept record, an earlier container's late DEL,
// window expiry), re-asserting allocations etcd lost (an etcd restore,
// in the running allocator or after a restart; an owner's DEL may come
// before the reassert), recording lapsed
// reservations, dropping a stale sticky binding at a restore, an
// operator's release --owner and node remove of a stopped node
// (model_ops_test.go), and pool changes (disable, reserve, drain
// and undrain a cidr, add and remove a cidr); while every write meets
// each fault: an unknown outcome (the write lands, the caller is told it failed), a failure
// before sending, a lost race (refused as a conflict without reaching
// etcd), a revocation of the node's lease, and of the lease IP history
// is written on. After every step it checks etcd, read without faults,
// against a model of what every owner was told: no address told to two
// live owners, and no kept address told to an owner of another identity
// inside its window; no owner with two addresses of a family; every sure
// owner's addresses in etcd exactly as told (after a release: nothing);
// no sticky binding naming a container that holds nothing; no address
// refused as in use on its node while etcd holds nothing for it; nothing
// new handed out of a disabled pool, a draining cidr or a reservation,
// nothing outside the pool's cidrs.
//
// Not here: a namespace rebound to another pool between two tries of an
// ADD. The allocator serves the pool a request names, and an owner may
// hold addresses in several pools; which pool a retry asks is the
// agent's choice (TestRetriedAddAfterNamespaceRebind).
//
// It is driven by one goroutine, so a seed replays the same choices and
// faults; lease and window timing still vary between runs (on the
// simulated store they do not: TestModelSimulated replays a seed bit for
// bit).
//
// Run longer with: go test ./allocator/nodealloc -run TestModelNodeAllocator -model.steps=100000
// (or on the simulated store, far faster: make model-sim).
func TestModelNodeAllocator(t *testing.T) {
	pool := modelPool()
	b := newEtcdBackend(t, pool)
	runModel(t, b, modelSeedOrNow(), *modelSteps)
}

// modelPool is the pool the model runs on.
func modelPool() allocator.Pool {
	return allocator.Pool{Name: "model", BlockSizeV4: 29, BlockSizeV6: 125,
		// 30 and 31 usable addresses: the pool fills, and nodes borrow
		// across blocks.
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.90.0.0/27"), netip.MustParsePrefix("fd00:90::/123")}}
}

func modelSeedOrNow() uint64 {
	if *modelSeed != 0 {
		return *modelSeed
	}
	return uint64(time.Now().UnixNano())
}

// runModel runs the model on backend b, whose store holds pool
// modelPool(), for steps steps of seed.
func runModel(t *testing.T, b modelBackend, seed uint64, steps int) *modelRun {
	r := newModelRun(t, b, seed)
	t.Logf("seed %d (replay with -model.seed=%d -model.steps=%d)", seed, seed, steps)
	defer func() {
		if t.Failed() && !r.failed { // a failure outside the model's checks
			t.Logf("seed %d, step %d; replay: %s", seed, r.step, r.replayCommand())
		}
	}()
	start := time.Now()
	for r.step = 0; r.step < steps && !r.failed; r.step++ {
		r.b.sleep(r.b.betweenSteps())
		r.resRevoked = false
		r.expireReservations()
		r.randomStep()
		r.syncLent()
		r.expireReservations() // a step may have waited long
		if !r.failed {
			r.verify()
		}
		if st := r.b.state(); st != "" {
			r.trace.add(fmt.Sprintf("%d: %s", r.step, st))
		}
	}
	r.close()
	t.Logf("seed %d: %d steps in %s (trace hash %016x)", seed, r.step, time.Since(start).Round(time.Millisecond), r.trace.sum())
	t.Log("faults injected, by write kind:\n" + r.table())
	t.Log("operations (ok / refused / failed):\n" + r.opTable())
	t.Log("writes while etcd was loaded, restarts (sent / refused, \"too many requests\"): " + r.loadedTable())
	if *modelDump {
		t.Log("last operations:\n  " + strings.Join(r.log[max(0, len(r.log)-*modelLogLines):], "\n  "))
	}
	if r.failed {
		t.FailNow()
	}
	total := 0
	for _, row := range r.faults {
		total += row[fUnknown]
	}
	if *modelFault > 0 && steps >= 200 {
		require.NotZero(t, total, "the run must meet writes of unknown outcome")
	}
	if *modelFault > 0 {
		// A restart meets refused writes of every kind it sends.
		for k, n := range r.loadedWrites {
			if n >= 20 && !spared(k, fBusy) {
				require.NotZero(t, r.loadedBusy[k], "%d %s writes while etcd was loaded, none refused", n, k)
			}
		}
	}
	return r
}

// newModelRun sets the run up on b: its nodes, restored, and its owners.
func newModelRun(t *testing.T, b modelBackend, seed uint64) *modelRun {
	pool := modelPool()
	spec := pool
	// Keys of the extra cidr the pool operation adds and removes.
	pool.CIDRs = append(slices.Clone(pool.CIDRs), extraCIDR)
	r := &modelRun{spec: spec, ops: map[string]*[3]int{}, idAddrs: map[string]map[netip.Addr]bool{}, t: t, ctx: context.Background(), b: b, name: t.Name(), seed: seed, rng: rand.New(rand.NewPCG(seed, 1)),
		pool: pool, owners: map[string]*mOwner{}, holder: map[netip.Addr]string{},
		kept: map[netip.Addr]keptFor{}, maybeKept: map[netip.Addr]bool{}, gens: map[string]int{}, faults: map[string]*[nFaults]int{}, writes: map[string]int{},
		loadedWrites: map[string]int{}, loadedBusy: map[string]int{}, migs: map[string]*mMigration{}}
	r.bindBackend()
	for _, k := range writeKinds {
		r.faults[k] = &[nFaults]int{}
	}
	const nodes, ordinaryPerNode, identities = 3, 4, 3
	for i := range nodes {
		n := &mNode{i: i, name: fmt.Sprintf("node-%d", i)}
		n.hook = newHookStore(b.nodeStore(n))
		r.hookUp(n)
		r.nodes = append(r.nodes, n)
		r.startAlloc(n)
		for j := range ordinaryPerNode {
			r.addOwner(records.Owner{ContainerID: fmt.Sprintf("n%d-o%d", i, j), IfName: "eth0", Namespace: "default", Pod: fmt.Sprintf("pod-%d-%d", i, j)}, i, "")
		}
	}
	t.Cleanup(r.close)
	for i := range identities {
		r.gens[fmt.Sprintf("ns/web-%d", i)] = 0
	}
	r.gens[lapseIdentity] = 0
	return r
}

// close ends the nodes' sessions.
func (r *modelRun) close() {
	for _, n := range r.nodes {
		if n.sess != nil {
			n.sess.Close()
			n.sess = nil
		}
	}
}

// syncLent delivers to every node what changed in the pool's lent
// addresses, as each agent's watch of the homes does (NoteLent).
func (r *modelRun) syncLent() {
	now := r.b.lent()
	for _, addr := range slices.SortedFunc(maps.Keys(now), netip.Addr.Compare) {
		if loan := now[addr]; r.lent[addr] != loan {
			for _, n := range r.nodes {
				n.alloc.NoteLent(r.pool.Name, addr, loan.Node, loan.Rev, true)
			}
		}
	}
	for _, addr := range slices.SortedFunc(maps.Keys(r.lent), netip.Addr.Compare) {
		if _, ok := now[addr]; !ok {
			loan := r.lent[addr]
			for _, n := range r.nodes {
				n.alloc.NoteLent(r.pool.Name, addr, loan.Node, 0, false)
			}
		}
	}
	r.lent = now
}

// fail reports the first violation with the seed, the step and the
// operations before it.
func (r *modelRun) fail(format string, args ...any) {
	if r.failed {
		return
	}
	r.failed = true
	from := max(0, len(r.log)-*modelLogLines)
	r.t.Errorf("seed %d, step %d: %s\nlast operations:\n  %s\nreplay: %s", r.seed, r.step, fmt.Sprintf(format, args...), strings.Join(r.log[from:], "\n  "), r.replayCommand())
	if *modelNodeLog > 0 {
		for _, n := range r.nodes {
			lines := strings.Split(n.logs.String(), "\n")
			r.t.Logf("%s's allocator log, last %d lines:\n  %s", n.name, *modelNodeLog, strings.Join(lines[max(0, len(lines)-*modelNodeLog):], "\n  "))
		}
	}
}

func (r *modelRun) logf(format string, args ...any) {
	line := fmt.Sprintf("%d: ", r.step) + fmt.Sprintf(format, args...)
	r.trace.add(line)
	r.log = append(r.log, line)
	if len(r.log) > 400 {
		r.log = slices.Clone(r.log[200:])
	}
}

func (r *modelRun) addOwner(o records.Owner, node int, identity string) *mOwner {
	mo := &mOwner{o: o, node: node, identity: identity}
	r.owners[o.Key()] = mo
	r.order = append(r.order, o.Key())
	return mo
}

// hookUp makes n's store inject the faults.
func (r *modelRun) hookUp(n *mNode) {
	var kind string // the kind of the write in flight (one goroutine)
	n.hook.Observe(func(op string, arg any) { kind, r.call = r.kindOf(op, arg), op })
	reads := []string{"ListBlocks", "GetBlocks", "ListIPs", "GetIPs", "LeaseExpiry", "PoolSnapshot", "GetBinding", "ListBindings", "ListLent"}
	for _, op := range append(slices.Clone(reads), "Claim", "Reclaim", "Unclaim", "WriteIPs", "DeleteIP", "FenceBorrower", "WriteBound", "Keep", "RecordLapsed", "SeedPool", "DropStaleBinding",
		"Admit", "CutOver", "DropAlternate") {
		write := !slices.Contains(reads, op)
		n.hook.Before(op, func(ctx context.Context) error {
			r.b.roundTrip()
			if write && kind != "" {
				r.writes[kind]++
				if r.loaded {
					r.loadedWrites[kind]++
				}
			}
			if r.quiet {
				return nil
			}
			if !write || kind == "" {
				if r.roll(readFailRate * *modelFault) {
					r.reads++
					if r.roll(0.5) { // a read past the call timeout on a loaded etcd
						return errTimedOut(op)
					}
					return fmt.Errorf("%s: %w", op, errInjected)
				}
				return nil
			}
			if r.inject(kind, fRevoke) {
				r.count(kind, fRevoke)
				if n.sess != nil {
					r.b.revokeLease(n.sess.ID())
				}
			}
			if r.inject(kind, fHistory) && r.b.revokeHistoryLease() {
				r.count(kind, fHistory)
			}
			if reserves(kind) && r.inject(kind, fResLease) && r.revokeReservationLease(n) {
				r.count(kind, fResLease)
			}
			if r.inject(kind, fBefore) {
				r.count(kind, fBefore)
				return fmt.Errorf("%s: %w", op, errInjected)
			}
			if r.inject(kind, fRace) {
				r.count(kind, fRace)
				return fmt.Errorf("injected lost race in %s: %w", op, retry.ErrConflict)
			}
			if r.inject(kind, fBusy) || (r.loaded && !spared(kind, fBusy) && r.roll(loadedBusyRate)) {
				r.count(kind, fBusy)
				if r.loaded {
					r.loadedBusy[kind]++
				}
				return errTooMany(op)
			}
			return nil
		})
		if write {
			n.hook.After(op, func(_ context.Context, err error) error {
				if err == nil && !r.quiet && kind != "" && r.inject(kind, fUnknown) {
					r.count(kind, fUnknown)
					return fmt.Errorf("%s: %w", op, errUnknown)
				}
				if err == nil && !r.quiet && kind != "" && r.inject(kind, fTimedOut) {
					r.count(kind, fTimedOut)
					return errTimedOut(op)
				}
				return err
			})
		}
	}
}

// reqCtx is one request's context: bounded as the agent bounds one.
func (r *modelRun) reqCtx() (context.Context, context.CancelFunc) {
	return r.b.request(r.ctx)
}

// kindOf names the write kind of a store call.
func (r *modelRun) kindOf(op string, arg any) string {
	switch op {
	case "Claim", "Reclaim":
		return "claim"
	case "Unclaim":
		return "unclaim"
	case "DeleteIP":
		return "release"
	case "FenceBorrower":
		return "borrow"
	case "WriteBound":
		return "bind/takeover"
	case "Keep":
		return "keep"
	case "DropStaleBinding":
		return "unbind"
	case "RecordLapsed":
		return "lapse-record"
	case "SeedPool":
		return "seed"
	case "Admit":
		return "admit"
	case "CutOver":
		return "cut over"
	case "DropAlternate":
		return "drop alternate"
	case "WriteIPs":
		if r.op == "reassert" {
			return "reassert"
		}
		ws, _ := arg.([]records.IPWrite)
		if len(ws) == 0 {
			return "" // an empty transaction: nothing to fault
		}
		owners := map[string]bool{}
		for _, w := range ws {
			owners[w.Record.Owner.Key()] = true
			switch {
			case w.Borrowed:
				return "borrow"
			case w.PrevRev != 0:
				return "confirm"
			}
		}
		if len(owners) > 1 {
			return "batch"
		}
		return "create"
	}
	return op
}

func skip(op string) bool { return slices.Contains(strings.Split(*modelSkip, ","), op) }

func (r *modelRun) roll(p float64) bool { return r.rng.Float64() < p }

// spared reports whether -model.spare leaves fault f out of write kind.
func spared(kind string, f int) bool {
	short := [...]string{fUnknown: "unknown", fBefore: "before", fRace: "race", fRevoke: "revoke", fHistory: "history", fBusy: "busy", fTimedOut: "timedout", fResLease: "reslease"}
	return slices.Contains(strings.Split(*modelSpare, ","), kind+"="+short[f])
}

// inject rolls fault f for a write of kind.
func (r *modelRun) inject(kind string, f int) bool {
	hit := r.roll(faultRates[f] * *modelFault)
	return hit && !spared(kind, f)
}

func (r *modelRun) count(kind string, f int) {
	if row := r.faults[kind]; row != nil {
		row[f]++
	}
	r.logf("  fault: %s (%s): %s", kind, r.call, faultKinds[f])
}

// tally counts an operation's outcome: ok, refused or failed.
func (r *modelRun) tally(op string, err error) {
	row := r.ops[op]
	if row == nil {
		row = &[3]int{}
		r.ops[op] = row
	}
	switch {
	case err == nil:
		row[0]++
	case refusal(err):
		row[1]++
	default:
		row[2]++
	}
}

// loadedTable lists the writes sent while etcd was loaded, by kind.
func (r *modelRun) loadedTable() string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(r.loadedWrites)) {
		out = append(out, fmt.Sprintf("%s %d/%d", k, r.loadedWrites[k], r.loadedBusy[k]))
	}
	return strings.Join(out, ", ")
}

func (r *modelRun) opTable() string {
	names := make([]string, 0, len(r.ops))
	for k := range r.ops {
		names = append(names, k)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, k := range names {
		fmt.Fprintf(&b, "%-16s %7d %7d %7d\n", k, r.ops[k][0], r.ops[k][1], r.ops[k][2])
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// table formats the fault counts by write kind and fault kind.
func (r *modelRun) table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-16s %7s", "write \\ fault", "calls")
	for _, f := range faultKinds {
		fmt.Fprintf(&b, " %18s", f)
	}
	b.WriteString("\n")
	for _, k := range writeKinds {
		fmt.Fprintf(&b, "%-16s %7d", k, r.writes[k])
		for _, c := range r.faults[k] {
			fmt.Fprintf(&b, " %18d", c)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(&b, "failed reads: %d", r.reads)
	return b.String()
}

// reserves reports whether a write of kind may put a reservation.
func reserves(kind string) bool {
	return slices.Contains([]string{"create", "batch", "claim", "borrow", "bind/takeover"}, kind)
}

// revokeReservationLease revokes the lease of n's newest reservation in
// etcd, the shared reservation lease its store hands out now or did
// last, and doubts the owners told a reservation on it: it lapses now,
// before its time. It reports whether there was one.
func (r *modelRun) revokeReservationLease(n *mNode) bool {
	als := r.b.readIPs()
	var newest *records.Allocation
	for i, al := range als {
		if al.Lease != 0 && al.Node == n.name && al.State == records.StateReserved && (newest == nil || al.Rev > newest.Rev) {
			newest = &als[i]
		}
	}
	if newest == nil {
		return false
	}
	lease := newest.Lease
	r.b.revokeLease(lease)
	// The owners of the records on it, told or not (an answer lost, then
	// settled into the allocator's cache, is told later from there).
	owners := map[string]bool{}
	for _, al := range als {
		if al.Lease == lease {
			owners[al.Owner.Key()] = true
		}
	}
	r.resRevoked, r.resRevokedAt = true, r.b.now()
	r.logf("%s's reservation lease %x revoked (%d reservations on it)", n.name, lease, len(owners))
	for _, k := range r.order {
		if mo := r.owners[k]; owners[k] {
			mo.unsure, mo.reserved, mo.revoked = true, false, true
			for _, a := range mo.told {
				r.noteRecent(a)
			}
		}
	}
	return true
}

// startAlloc makes n a new allocator, as an agent (re)start does, and
// restores it.
func (r *modelRun) startAlloc(n *mNode) {
	if n.logs == nil {
		n.logs = newLogRing(nodeLogKeep)
	}
	logger := hclog.New(&hclog.LoggerOptions{Output: n.logs, Level: hclog.Debug, DisableTime: true})
	al, err := nodealloc.New(nodealloc.Config{Node: n.name, Store: n.hook, Logger: logger, Labels: map[string]string{"node": n.name},
		Held: func() []netip.Addr { return r.heldOn(n.i) }, Now: r.b.now})
	require.NoError(r.t, err)
	n.alloc = al
	r.recover(n, true)
}

// heldOn lists the addresses the endpoints of node i use (NodeConfig.Held).
func (r *modelRun) heldOn(i int) []netip.Addr {
	var out []netip.Addr
	for _, k := range r.order {
		if mo := r.owners[k]; mo.node == i && mo.hasEndpoint() {
			out = append(out, mo.told...)
			out = append(out, mo.alt...) // a migration target's endpoint
		}
	}
	return out
}

// recover renews a lost lease and restores, as the agent's lease keeper
// does. Faults may fail it; after a few tries it goes on without them.
func (r *modelRun) recover(n *mNode, force bool) {
	if !force && n.sess != nil && !n.sess.Lost() {
		return
	}
	defer func(q bool) { r.quiet = q }(r.quiet)
	for try := 0; ; try++ {
		if try >= 4 {
			r.quiet = true
		}
		if n.sess == nil || n.sess.Lost() {
			if n.sess != nil {
				n.sess.Close()
			}
			sess, err := r.b.newSession(n)
			if err != nil {
				if try > 20 {
					r.fail("new session for %s: %v", n.name, err)
					return
				}
				continue
			}
			n.sess = sess
		}
		err := n.alloc.Restore(r.ctx, n.sess)
		if err == nil {
			return
		}
		if errors.Is(err, records.ErrLeaseLost) {
			// Revoked, and the keepalive has not noticed yet.
			n.sess.Close()
			n.sess = nil
		}
		if try > 20 {
			r.fail("restore %s: %v", n.name, err)
			return
		}
	}
}

// after handles an operation's error on node n: a lost lease is renewed
// and the node restored, as the agent's lease keeper does (not on any
// other error: the agent restores only when its lease is lost).
func (r *modelRun) after(n *mNode, err error) {
	if err != nil && errors.Is(err, records.ErrLeaseLost) {
		r.recover(n, true)
		return
	}
	r.recover(n, false)
}

// refusal reports whether err is a definite refusal, after which the store
// holds for the owner exactly what it held before.
func refusal(err error) bool {
	for _, e := range []error{records.ErrBadRequest, records.ErrIPInUse, records.ErrNotOwned, records.ErrExhausted,
		records.ErrNotFound, records.ErrIdentityInUse, records.ErrPoolDisabled, records.ErrNodeNotSelected} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// randomStep runs one operation chosen by the seed.
func (r *modelRun) randomStep() {
	n := r.nodes[r.rng.IntN(len(r.nodes))]
	r.recover(n, false)
	defer r.endMigrations()
	switch p := r.rng.IntN(100); {
	case p < 12:
		r.opAllocate(n)
	case p < 16:
		r.opMigrate()
	case p < 18:
		if !skip("restart") {
			r.opRestart(n)
		}
	case p < 24:
		r.opBatch(n)
	case p < 30:
		r.opStatic(n)
	case p < 40:
		r.opConfirm()
	case p < 58:
		r.opRelease()
	case p < 72:
		if !skip("sticky") {
			r.opStickyAdd(n)
		}
	case p < 80:
		if !skip("stickyretry") {
			r.opStickyRetry()
		}
	case p < 85:
		if !skip("storeloss") {
			r.opStoreLoss(n)
		}
	case p < 89:
		r.opAwaitWindows()
	case p < 90:
		r.opLapse(n)
	case p < 92:
		r.recordLapses(n)
	case p < 94:
		if !skip("pool") {
			r.opPool()
		}
	case p < 95:
		if !skip("seed") {
			r.opSeed(n)
		}
	case p < 97:
		if !skip("operator") {
			r.opOperator(n)
		}
	case p < 98:
		if !skip("pooldelete") {
			r.opPoolDelete(n)
		}
		if !skip("import") {
			r.opImport(n)
		}
	default:
		r.opMigrate()
	}
}

// opRestart restarts a node's agent while etcd is loaded, as when many
// agents restart at once: its restore, the sweep of stale sticky
// bindings in it, and the reassert of its endpoints after it, meet "too
// many requests" on two writes in five. It
// restarts, when there is one, the node of an owner whose DEL failed
// (the runtime retries that DEL later): the combination that found a
// retried DEL answering success and leaving a binding that named a
// container holding nothing (seed 1795803060803679554, -model.faults 3).
func (r *modelRun) opRestart(n *mNode) {
	var failed []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.delFail {
			failed = append(failed, mo)
		}
	}
	if len(failed) > 0 {
		n = r.nodes[failed[r.rng.IntN(len(failed))].node]
	}
	r.logf("%s restarts on a loaded etcd", n.name)
	r.op = "claim"
	r.loaded = true
	r.startAlloc(n)
	// The agent compares its endpoints with etcd after a restore of its
	// lease: the reassert's reads and writes meet the load too.
	r.reassertEndpoints(n, nil)
	r.loaded = false
	r.tally("restart", nil)
}

// ordinary picks an ordinary owner of node n.
func (r *modelRun) ordinary(n *mNode) *mOwner {
	var cands []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.identity == "" && mo.node == n.i && !mo.imported {
			cands = append(cands, mo)
		}
	}
	return cands[r.rng.IntN(len(cands))]
}

func (r *modelRun) opAllocate(n *mNode) {
	r.allocate(n, r.ordinary(n), r.rng.IntN(2) == 0)
}

// allocate ADDs ordinary owner mo on node n.
func (r *modelRun) allocate(n *mNode, mo *mOwner, reserve bool) {
	r.op = "create"
	req := nodealloc.Request{Pool: r.pool.Name, Owner: mo.o, Reserve: reserve}
	ctx, cancel := r.reqCtx()
	defer cancel()
	res, err := n.alloc.Allocate(ctx, req)
	r.logf("%s Allocate %s reserve=%v: %v %v", n.name, mo.o.Key(), req.Reserve, addrsOf(res.Allocations), err)
	r.tally("allocate", err)
	r.answer(mo, res, err)
	r.after(n, err)
}

func (r *modelRun) opBatch(n *mNode) {
	r.op = "batch"
	var reqs []nodealloc.Request
	var mos []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.identity == "" && mo.node == n.i && !mo.imported && r.rng.IntN(3) > 0 {
			reqs = append(reqs, nodealloc.Request{Pool: r.pool.Name, Owner: mo.o, Reserve: true})
			mos = append(mos, mo)
		}
	}
	ctx, cancel := r.reqCtx()
	defer cancel()
	outs := n.alloc.AllocateBatch(ctx, reqs)
	var lastErr error
	for i, oc := range outs {
		r.logf("%s AllocateBatch %s: %v %v", n.name, mos[i].o.Key(), addrsOf(oc.Result.Allocations), oc.Err)
		r.tally("batch request", oc.Err)
		r.answer(mos[i], oc.Result, oc.Err)
		if oc.Err != nil {
			lastErr = oc.Err
		}
	}
	r.after(n, lastErr)
}

// opStatic asks for a static address: one released or lapsed lately, or
// any of the pool. Taken ones must be refused; one etcd holds nothing for
// must not be refused as in use by the node whose block it is.
func (r *modelRun) opStatic(n *mNode) {
	r.op = "create"
	mo := r.ordinary(n)
	if len(mo.told) > 0 || mo.unsure {
		return
	}
	var addr netip.Addr
	if len(r.recent) > 0 && r.rng.IntN(2) == 0 {
		addr = r.recent[r.rng.IntN(len(r.recent))]
		if claimer := r.claimer(addr); claimer >= 0 {
			n = r.nodes[claimer]
			r.recover(n, false)
			// An owner of that node asks.
			if mo = r.ordinary(n); len(mo.told) > 0 || mo.unsure {
				return
			}
		}
	} else {
		cidr := r.pool.CIDRs[r.rng.IntN(len(r.pool.CIDRs))]
		addr = cidr.Addr()
		for range 1 + r.rng.IntN(30) {
			addr = addr.Next()
		}
	}
	freeBefore := r.freeInEtcd(addr)
	req := nodealloc.Request{Pool: r.pool.Name, Owner: mo.o, IPs: []netip.Addr{addr}}
	ctx, cancel := r.reqCtx()
	defer cancel()
	res, err := n.alloc.Allocate(ctx, req)
	r.logf("%s Allocate %s static %s (free in etcd before: %v): %v %v", n.name, mo.o.Key(), addr, freeBefore, addrsOf(res.Allocations), err)
	r.tally("static", err)
	r.static = true
	defer func() { r.static = false }()
	if errors.Is(err, records.ErrIPInUse) && freeBefore && r.holder[addr] == "" && !r.maybeKept[addr] && r.claimer(addr) == n.i {
		r.probeWedged(n, mo, addr, err)
		return
	}
	r.answer(mo, res, err)
	r.after(n, err)
}

// logOf is what n's allocator logged about addr.
func (n *mNode) logOf(addr netip.Addr) string {
	var out []string
	for _, l := range strings.Split(n.logs.String(), "\n") {
		if strings.Contains(l, "="+addr.String()+" ") || strings.HasSuffix(l, "="+addr.String()) || strings.Contains(l, addr.String()+"]") || strings.Contains(l, addr.String()+",") {
			out = append(out, "    "+l)
		}
	}
	return strings.Join(out, "\n")
}

// probeWedged asks again, with no faults and once every window the model
// knows of has ended (and every reservation revoked early would have
// lapsed), for an address etcd holds nothing for and that the
// node refused as in use. A second refusal is a wedged address.
func (r *modelRun) probeWedged(n *mNode, mo *mOwner, addr netip.Addr, first error) {
	r.quiet = true
	defer func() { r.quiet = false }()
	var until time.Time
	for _, k := range r.kept {
		until = maxTime(until, k.from.Add(k.window+time.Second))
	}
	// A reservation whose lease was revoked before its time (fResLease)
	// stays in its node's cache until the expiry it was given, which
	// the allocator trusts: its address is not free there until then,
	// whether or not its owner was told it (an answer lost).
	until = maxTime(until, r.resRevokedAt.Add(reservationTTL+reservationTTL/4+time.Second))
	r.b.sleep(until.Sub(r.b.now()))
	if !r.freeInEtcd(addr) {
		return
	}
	res, err := n.alloc.Allocate(r.ctx, nodealloc.Request{Pool: r.pool.Name, Owner: mo.o, IPs: []netip.Addr{addr}})
	r.logf("%s probe: Allocate %s static %s without faults: %v %v", n.name, mo.o.Key(), addr, addrsOf(res.Allocations), err)
	r.static = true
	if errors.Is(err, records.ErrIPInUse) && r.freeInEtcd(addr) {
		r.fail("%s is wedged on %s: etcd holds nothing for it, nobody was told it, and a static request is refused (%v; first: %v)\n%s's log of %s:\n%s",
			addr, n.name, err, first, n.name, addr, n.logOf(addr))
		return
	}
	r.answer(mo, res, err)
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// freeInEtcd reports whether etcd holds no allocation at addr.
func (r *modelRun) freeInEtcd(addr netip.Addr) bool {
	if _, ok := r.pool.BlockFor(addr); !ok {
		return false
	}
	_, held := r.b.readIP(addr)
	return !held
}

// claimer is the index of the node claiming addr's block, or -1.
func (r *modelRun) claimer(addr netip.Addr) int {
	b, ok := r.pool.BlockFor(addr)
	if !ok {
		return -1
	}
	c, ok := r.b.claimOf(b)
	if !ok {
		return -1
	}
	for _, n := range r.nodes {
		if n.name == c.Node {
			return n.i
		}
	}
	return -1
}

func (r *modelRun) opConfirm() {
	r.op = "confirm"
	// Mostly an owner told a reservation (the confirm of its ADD), else
	// any (a confirm of nothing, or of what lapsed).
	var reserved []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.reserved || (mo.unsure && len(mo.told) > 0) {
			reserved = append(reserved, mo)
		}
	}
	mo := r.owners[r.order[r.rng.IntN(len(r.order))]]
	if len(reserved) > 0 && r.rng.IntN(4) > 0 {
		mo = reserved[r.rng.IntN(len(reserved))]
	}
	if mo.delFail || (mo.migrant && !mo.reserved) {
		// A migration's pod got its addresses by a cut-over, not by
		// an ADD of its own to confirm.
		return
	}
	r.confirm(mo)
}

// confirm confirms mo's ADD on its node.
func (r *modelRun) confirm(mo *mOwner) {
	n := r.nodes[mo.node]
	r.recover(n, false)
	done, err := n.alloc.Confirm(r.ctx, mo.o)
	r.logf("%s Confirm %s: %v %v", n.name, mo.o.Key(), addrsOf(done), err)
	r.tally("confirm", err)
	switch {
	case errors.Is(err, records.ErrNotFound):
		if len(mo.told) > 0 && !mo.unsure {
			r.fail("confirm of %s found nothing, but it was told %v", mo.o.Key(), mo.told)
		}
	case err == nil:
		r.confirming = true
		r.tell(mo, done, time.Time{})
		r.confirming = false
	case !refusal(err):
		mo.unsure = true
	}
	r.after(n, err)
}

// opRelease DELs an owner: one whose DEL failed (the runtime retries it),
// or any, an earlier container of a sticky identity included (a late DEL).
func (r *modelRun) opRelease() {
	r.op = "release"
	var mo *mOwner
	var retry []*mOwner
	for _, k := range r.order {
		if r.owners[k].delFail {
			retry = append(retry, r.owners[k])
		}
	}
	var holding []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; len(mo.told) > 0 || mo.unsure {
			holding = append(holding, mo)
		}
	}
	switch {
	case len(retry) > 0 && r.rng.IntN(2) == 0:
		mo = retry[r.rng.IntN(len(retry))]
	case len(holding) > 0 && r.rng.IntN(4) > 0:
		// Mostly a pod's DEL; else any container's, an earlier one of
		// a sticky identity included (a late DEL).
		mo = holding[r.rng.IntN(len(holding))]
	default:
		mo = r.owners[r.order[r.rng.IntN(len(r.order))]]
	}
	r.release(mo)
}

// release DELs mo on its node.
func (r *modelRun) release(mo *mOwner) {
	r.op = "release"
	n := r.nodes[mo.node]
	r.recover(n, false)
	from := r.b.now()
	// The agent names the identity its endpoint's record has, or the
	// DEL's request (both plugins send the pod's annotations); a failed
	// DEL's is noted on the node's disk until its release lands, so the
	// runtime's retry names it too, after a restart as well. The agent
	// removes the endpoint's record before the release: its addresses
	// are no longer held (NodeConfig.Held) while the release runs.
	mo.delFail = true
	otherLive := r.otherLive(mo)
	out, err := n.alloc.ReleaseAs(r.ctx, mo.o, mo.identity)
	r.logf("%s Release %s as %q (told %v, unsure %v): %v %v", n.name, mo.o.Key(), mo.identity, mo.told, mo.unsure, addrsOf(out), err)
	r.tally("release", err)
	if err != nil {
		mo.unsure, mo.delFail = true, true
		r.migDelFailed(mo)
		r.after(n, err)
		return
	}
	r.migLeft(mo, otherLive)
	r.released(mo, from, out)
	r.after(n, nil)
}

// stickyWindow is a window short enough for the run to see windows end.
func (r *modelRun) stickyWindow() time.Duration { return time.Duration(1+r.rng.IntN(2)) * time.Second }

// opStickyAdd ADDs a new container of a sticky identity (its pod
// re-created), on its last container's node or another: a takeover from
// a live pod when the last container was not DELeted, else of the kept
// addresses, or a new binding.
func (r *modelRun) opStickyAdd(n *mNode) {
	r.op = "bind/takeover"
	if mo, n := r.newContainer(n, ""); mo != nil {
		r.stickyAdd(n, mo, r.rng.IntN(3) == 0 && !skip("stickyreserve"))
	}
}

// newContainer makes a new container of sticky identity id (any but
// lapseIdentity if ""), on its last container's node or on n; nil if the
// run leaves that out.
func (r *modelRun) newContainer(n *mNode, id string) (*mOwner, *mNode) {
	if id == "" {
		ids := make([]string, 0, len(r.gens))
		for id := range r.gens {
			if id != lapseIdentity {
				ids = append(ids, id)
			}
		}
		sort.Strings(ids)
		id = ids[r.rng.IntN(len(ids))]
	}
	last := r.latest(id)
	if last != nil && (len(last.told) > 0 || last.unsure || last.delFail) && skip("livetakeover") {
		return nil, nil
	}
	if r.migs[id] != nil {
		// A VM's pods are not re-created during its live migration
		// (left out: a takeover in the middle of one).
		return nil, nil
	}
	if last != nil && r.rng.IntN(2) == 0 {
		n = r.nodes[last.node] // re-created on the same node
		r.recover(n, false)
	}
	r.gens[id]++
	_, name, _ := strings.Cut(id, "/")
	o := records.Owner{ContainerID: fmt.Sprintf("%s-c%d", name, r.gens[id]), IfName: "eth0", Namespace: "ns", Pod: name,
		PodUID: fmt.Sprintf("uid-%s-%d", name, r.gens[id])}
	mo := r.addOwner(o, n.i, id)
	mo.gen, mo.born = r.gens[id], r.step
	r.retire(id)
	return mo, n
}

// keptGenerations is how many of a sticky identity's latest containers
// the run keeps choosing from (a late DEL of an earlier container);
// older ones that hold nothing retire, so that a long run's steps cost
// what its first ones do.
const keptGenerations = 4

// retire drops from the run's choices the containers of identity id
// older than keptGenerations that hold nothing, surely: no operation
// picks them again, and verify requires that etcd holds nothing for
// them.
func (r *modelRun) retire(id string) {
	r.order = slices.DeleteFunc(r.order, func(k string) bool {
		mo := r.owners[k]
		if mo.identity != id || mo.gen > r.gens[id]-keptGenerations || len(mo.told) > 0 || mo.unsure || mo.delFail || mo.reserved ||
			len(mo.alt) > 0 || mo.altUnsure || r.inMigration(mo) {
			return false
		}
		mo.retired = true
		return true
	})
}

// opStickyRetry retries the ADD of a sticky identity's latest container,
// as the runtime does after a failed ADD (or a second ADD of a live one).
func (r *modelRun) opStickyRetry() {
	r.op = "bind/takeover"
	var cands []*mOwner
	for _, id := range slices.Sorted(maps.Keys(r.gens)) { // the seed's choices in one order
		if last := r.latest(id); last != nil && !last.delFail && (last.unsure || r.rng.IntN(4) == 0) {
			cands = append(cands, last)
		}
	}
	if len(cands) == 0 {
		return
	}
	slices.SortFunc(cands, func(a, b *mOwner) int { return strings.Compare(a.o.Key(), b.o.Key()) })
	mo := cands[r.rng.IntN(len(cands))]
	n := r.nodes[mo.node]
	r.recover(n, false)
	r.stickyAdd(n, mo, mo.reserved)
}

// latest is the identity's latest container, nil if none.
func (r *modelRun) latest(id string) *mOwner {
	_, name, _ := strings.Cut(id, "/")
	return r.owners[fmt.Sprintf("%s-c%d/eth0", name, r.gens[id])]
}

func (r *modelRun) stickyAdd(n *mNode, mo *mOwner, reserve bool) {
	req := nodealloc.Request{Pool: r.pool.Name, Owner: mo.o, Reserve: reserve, Sticky: &records.Sticky{Identity: mo.identity, Window: r.stickyWindow()}}
	ctx, cancel := r.reqCtx()
	defer cancel()
	res, err := n.alloc.Allocate(ctx, req)
	r.logf("%s sticky Allocate %s reserve=%v: %v %v", n.name, mo.o.Key(), reserve, addrsOf(res.Allocations), err)
	r.tally("sticky allocate", err)
	if errors.Is(err, records.ErrNodeNotSelected) && len(r.idAddrs[mo.identity]) > 0 {
		// Its row of its own: the run shows takeovers the selector
		// refused.
		r.tally("takeover refused", err)
	}
	if err != nil && !refusal(err) {
		// A takeover may have landed: the identity's other containers
		// may hold less than they were told. And a binding may have
		// landed with addresses nobody was told: they are the
		// identity's, for its next pods to take over (checkNew).
		for _, k := range r.order {
			if other := r.owners[k]; other.identity == mo.identity {
				other.unsure = true
			}
		}
		r.learnIdentity(mo.identity)
	}
	r.answer(mo, res, err)
	r.migTakenOver(mo, err)
	if err == nil {
		// The identity's kept addresses are all taken over: none stays
		// kept beside the new pod's.
		for _, al := range r.readIPs() {
			if al.State == records.StateKept && al.Identity == mo.identity {
				r.fail("sticky identity %s: its pod %s was given %v while etcd still keeps %s for it", mo.identity, mo.o.Key(), addrsOf(res.Allocations), al.Addr)
			}
		}
	}
	r.after(n, err)
}

// answer applies an allocation's answer to the model.
func (r *modelRun) answer(mo *mOwner, res nodealloc.Result, err error) {
	switch {
	case err == nil:
		r.tell(mo, res.Allocations, res.Expires)
	case !refusal(err):
		mo.unsure = true
	}
}

// opStoreLoss loses some of node n's allocations from etcd, as a restore
// of an older snapshot does, then re-asserts them as the agent does:
// after restarting (Restore, with the endpoints' addresses held) or in
// the running allocator; one of those owners' DEL may come before the
// reassert (delBeforeReassert).
func (r *modelRun) opStoreLoss(n *mNode) {
	var lost []*mOwner
	for _, k := range r.order {
		// An imported attachment has no endpoint to re-assert from.
		if mo := r.owners[k]; mo.node == n.i && !mo.unsure && !mo.imported && len(mo.told) > 0 && r.migs[mo.identity] == nil && r.rng.IntN(2) == 0 {
			lost = append(lost, mo)
		}
	}
	if len(lost) == 0 {
		return
	}
	for _, mo := range lost {
		for _, a := range mo.told {
			r.b.lose(a)
		}
	}
	restart := r.rng.IntN(2) == 0
	r.logf("%s store loss of %v; restart %v", n.name, func() (s []string) {
		for _, mo := range lost {
			s = append(s, mo.o.Key())
		}
		return
	}(), restart)
	// A restart, half the time on a loaded etcd (restore and reassert
	// meet "too many requests" on two writes in five), as when many
	// agents restart after a restore of etcd.
	loaded := restart && r.rng.IntN(2) == 0
	if restart {
		r.op = "claim"
		r.loaded = loaded
		r.startAlloc(n)
		r.loaded = false
	}
	if r.rng.IntN(2) == 0 {
		r.delBeforeReassert(lost)
	}
	r.loaded = loaded
	r.reassertEndpoints(n, lost)
	r.loaded = false
}

// reassertEndpoints re-asserts node n's endpoints, as the agent does
// after a restore of its lease and when it finds etcd lost records: tried
// again while it fails, then the owners whose records etcd lost (lost)
// are doubted.
func (r *modelRun) reassertEndpoints(n *mNode, lost []*mOwner) {
	var held []nodealloc.HeldAddr
	for _, k := range r.order {
		if mo := r.owners[k]; mo.node == n.i && mo.hasEndpoint() {
			for _, a := range mo.told {
				// The agent's endpoint record keeps the identity (and its
				// window; the model's are 1-2 s) for a restarted node.
				held = append(held, nodealloc.HeldAddr{Owner: mo.o, Addr: a, Identity: mo.identity, WindowSeconds: 1})
			}
		}
	}
	r.op = "reassert"
	for try := 0; ; try++ {
		restored, conflicts, err := n.alloc.Reassert(r.ctx, held)
		r.logf("%s Reassert: restored %v, conflicts %s, %v", n.name, addrsOf(restored), conflictText(conflicts), err)
		r.tally("reassert", err)
		for _, c := range conflicts {
			// Reported, as the agent does (the pod should be deleted):
			// an unsure owner's address may be another's by now.
			r.owners[c.Owner.Key()].unsure = true
			r.owners[c.Owner.Key()].lost = true
		}
		if err == nil {
			break
		}
		r.after(n, err)
		if try == 6 {
			for _, mo := range lost {
				if len(mo.told) > 0 { // not one whose DEL came first
					mo.unsure = true
				}
			}
			break
		}
	}
	r.after(n, nil)
}

// delBeforeReassert DELs one of the owners whose records etcd lost, a
// sticky one if there is one, before the agent re-asserts them: the pod
// was deleted meanwhile. Its keep finds the records gone (in a running
// allocator whose cache still holds them; after a restart the cache
// knows nothing of it), and the binding, which names a container that
// holds nothing, must go with the DEL (a DEL answering success and
// leaving it was found by review, as the model had no such step).
func (r *modelRun) delBeforeReassert(lost []*mOwner) {
	cands := slices.DeleteFunc(slices.Clone(lost), func(mo *mOwner) bool { return mo.identity == "" })
	if len(cands) == 0 {
		cands = lost
	}
	mo := cands[r.rng.IntN(len(cands))]
	mo.unsure = true // etcd holds less than it was told: nothing to keep
	r.release(mo)
}

// lapseIdentity is the sticky identity opLapse's new containers have: its
// binding is dropped with each, so its next container is told a
// reservation (the other identities' are mostly taken over, allocated).
const lapseIdentity = "ns/lapse"

// opLapse lets a reservation lapse: an ADD whose confirm comes too late
// (its runtime stalled). The reservation is one told already, or of a new
// ADD on n, two in three of them sticky (the DEL, or a restore, then
// drops the binding). It waits until etcd has let the reservation go,
// restarts the node on a loaded etcd or not (with a DEL before, which
// the load may refuse), confirms it (the confirm fails, and the node
// notices the lapse), DELs it or not (again, if the first failed), and
// records the lapses of its node.
func (r *modelRun) opLapse(n *mNode) {
	pending := func(mo *mOwner) bool { return mo.reserved && !mo.unsure && !mo.delFail && len(mo.told) > 0 }
	var reserved []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; pending(mo) {
			reserved = append(reserved, mo)
		}
	}
	var mo *mOwner
	switch {
	case len(reserved) > 0 && r.rng.IntN(2) == 0:
		mo = reserved[r.rng.IntN(len(reserved))]
	case r.rng.IntN(3) > 0 && !skip("sticky") && !skip("stickyreserve"):
		r.op = "bind/takeover"
		var on *mNode
		if mo, on = r.newContainer(n, lapseIdentity); mo != nil {
			r.stickyAdd(on, mo, true)
		}
	default:
		mo = r.ordinary(n)
		r.allocate(n, mo, true)
	}
	if mo == nil || !pending(mo) {
		return
	}
	r.op = "lapse"
	mo.stalled = true
	for _, a := range mo.told {
		var al records.Allocation
		if !r.await(60*time.Second, func() bool {
			var ok bool
			al, ok = r.readIP(a)
			return !ok || al.Owner.Key() != mo.o.Key() || al.State != records.StateReserved
		}) {
			r.fail("the reservation of %s for %s is still in etcd long after its TTL: %+v", a, mo.o.Key(), al)
			return
		}
	}
	r.logf("the reservation of %s (%v) lapsed", mo.o.Key(), mo.told)
	r.expireReservations()
	if r.rng.IntN(2) == 0 {
		// The agent restarted meanwhile, on a loaded etcd: no cache
		// knows the reservation (the restore's sweep drops a sticky
		// one's binding, and meets "too many requests"). Its DEL may
		// have come before, and met them too; the runtime retries it.
		if r.rng.IntN(2) == 0 {
			r.loaded = true
			r.release(mo)
			r.loaded = false
		}
		r.logf("%s restarts on a loaded etcd", r.nodes[mo.node].name)
		r.op = "claim"
		r.loaded = true
		r.startAlloc(r.nodes[mo.node])
		r.loaded = false
		r.op = "lapse"
	}
	r.confirm(mo)
	if r.rng.IntN(2) == 0 || mo.delFail {
		r.release(mo)
	}
	r.recordLapses(r.nodes[mo.node])
}

// recordLapses runs the reconciler's record of lapsed reservations.
func (r *modelRun) recordLapses(n *mNode) {
	r.op = "lapse-record"
	err := n.alloc.RecordLapses(r.ctx)
	r.logf("%s RecordLapses: %v", n.name, err)
	r.tally("record lapses", err)
}

// opAwaitWindows waits for the kept addresses' windows to end: their
// records leave etcd by themselves (or a later pod took them over).
func (r *modelRun) opAwaitWindows() {
	if len(r.kept) == 0 && len(r.maybeKept) == 0 {
		return
	}
	addrs := slices.SortedFunc(maps.Keys(r.kept), netip.Addr.Compare)
	for _, a := range slices.SortedFunc(maps.Keys(r.maybeKept), netip.Addr.Compare) {
		if _, ok := r.kept[a]; !ok {
			addrs = append(addrs, a)
		}
	}
	deadline := r.b.now().Add(30 * time.Second)
	for _, a := range addrs {
		var al records.Allocation
		if !r.await(deadline.Sub(r.b.now()), func() bool {
			var ok bool
			al, ok = r.readIP(a)
			return !ok || al.State != records.StateKept
		}) {
			r.fail("%s is still kept for %s long after its window: %+v", a, al.Identity, al)
			return
		}
		delete(r.kept, a)
		delete(r.maybeKept, a)
		r.noteRecent(a)
	}
	r.logf("windows ended for %v", addrs)
	r.tally("await windows", nil)
}

func (r *modelRun) noteRecent(a netip.Addr) {
	if !slices.Contains(r.recent, a) {
		r.recent = append(r.recent, a)
	}
	if len(r.recent) > 12 {
		r.recent = r.recent[1:]
	}
}

// expireReservations doubts owners whose reservation is about to lapse:
// etcd may drop it any time from then on.
func (r *modelRun) expireReservations() {
	now := r.b.now()
	for _, k := range r.order {
		if mo := r.owners[k]; mo.reserved && !mo.expires.IsZero() && now.After(mo.expires.Add(-time.Second)) {
			mo.unsure, mo.reserved = true, false
			for _, a := range mo.told {
				r.noteRecent(a)
			}
		}
	}
}

// tell records that mo was told als (its whole holding, one address per
// family), checking it against everyone else's.
func (r *modelRun) tell(mo *mOwner, als []records.Allocation, expires time.Time) {
	k := mo.o.Key()
	fams := map[allocator.Family]netip.Addr{}
	var got []netip.Addr
	now := r.b.now()
	for _, al := range als {
		if al.Owner.Key() != k {
			r.fail("%s was answered %s with the record of %s", k, al.Addr, al.Owner.Key())
		}
		if h := r.holder[al.Addr]; r.confirming && h != "" && h != k && mo.identity != "" && r.owners[h].identity == mo.identity && r.owners[h].gen > mo.gen {
			// A Confirm of a container whose identity a later pod took
			// over on another node answers its node's cache, which has
			// not seen the takeover; its late DEL releases nothing.
			continue
		}
		f := allocator.FamilyOf(al.Addr)
		if prev, dup := fams[f]; dup {
			r.fail("%s was told two %s addresses at once: %s and %s", k, f, prev, al.Addr)
		}
		fams[f] = al.Addr
		got = append(got, al.Addr)
		switch {
		case !mo.unsure && !slices.Contains(mo.told, al.Addr):
			r.checkNew(mo, al.Addr, r.static, mo.identity != "" && r.idAddrs[mo.identity][al.Addr])
		case mo.identity != "" && !slices.Contains(mo.told, al.Addr) && mo.born > r.selChangedAt &&
			!r.spec.Selects(map[string]string{"node": r.nodes[mo.node].name}):
			// A retried sticky ADD, whose earlier try's write may have
			// landed: but the selector has left its node out since
			// before the container's first ADD, so nothing could land.
			r.fail("%s was handed %s on %s, which the pool's selector %q has left out since step %d, before its first ADD (step %d)",
				k, al.Addr, r.nodes[mo.node].name, r.spec.NodeSelector, r.selChangedAt, mo.born)
		}
		r.noteIdentity(mo.identity, al.Addr)
		if kf, ok := r.kept[al.Addr]; ok {
			if kf.identity != mo.identity && now.Before(kf.from.Add(kf.window)) {
				r.fail("%s, kept for sticky identity %s since %s for %s, was handed to %s", al.Addr, kf.identity, kf.from.Format(time.StampMilli), kf.window, k)
			}
			delete(r.kept, al.Addr)
		}
		delete(r.maybeKept, al.Addr)
		if h := r.holder[al.Addr]; h != "" && h != k {
			ho := r.owners[h]
			switch {
			case mo.identity != "" && ho.identity == mo.identity:
				// Taken over from another container of the identity: a
				// later pod, or an earlier one ADDed again.
				ho.told = slices.DeleteFunc(ho.told, func(a netip.Addr) bool { return a == al.Addr })
			case !ho.unsure:
				r.fail("%s handed to %s while %s holds it", al.Addr, k, h)
			default:
				ho.told = slices.DeleteFunc(ho.told, func(a netip.Addr) bool { return a == al.Addr })
			}
		}
	}
	if !mo.unsure {
		for _, prev := range mo.told {
			if a, ok := fams[allocator.FamilyOf(prev)]; ok && a != prev {
				r.fail("%s held %s and a retry gave it %s", k, prev, a)
			}
		}
	}
	for _, prev := range mo.told {
		if !slices.Contains(got, prev) {
			if _, same := fams[allocator.FamilyOf(prev)]; same || mo.unsure {
				if r.holder[prev] == k {
					delete(r.holder, prev)
				}
				continue
			}
			got = append(got, prev) // a family not in this answer is still held
		}
	}
	for _, a := range got {
		r.holder[a] = k
	}
	mo.told, mo.unsure, mo.delFail, mo.operator, mo.stalled, mo.gone = got, false, false, false, false, false
	// A reservation lapses no earlier than its record's time plus the
	// reservation TTL; an answer may not know its expiry (after a Restore).
	mo.reserved, mo.expires = false, expires
	for _, al := range als {
		if al.State != records.StateReserved {
			continue
		}
		mo.reserved = true
		if end := al.Since.Add(reservationTTL); mo.expires.IsZero() || end.Before(mo.expires) {
			mo.expires = end
		}
	}
	if mo.reserved && r.resRevoked {
		mo.revoked = true
	}
	switch {
	case mo.revoked && mo.reserved:
		mo.unsure = true
	case mo.revoked:
		mo.revoked = false
	}
	if mo.reserved {
		r.logf("  %s holds a reservation until %s at the earliest", k, mo.expires.Format(time.StampMilli))
	}
}

// noteIdentity records that a has been sticky identity id's: its pods may
// take it over (checkNew).
func (r *modelRun) noteIdentity(id string, a netip.Addr) {
	if id == "" {
		return
	}
	if r.idAddrs[id] == nil {
		r.idAddrs[id] = map[netip.Addr]bool{}
	}
	r.idAddrs[id][a] = true
}

// learnIdentity notes the addresses etcd's binding of sticky identity id
// names as the identity's, after a write of unknown outcome: the binding
// may have landed with addresses no answer told.
func (r *modelRun) learnIdentity(id string) {
	b, ok := r.b.binding(id)
	if !ok {
		return
	}
	for _, a := range b.Addrs {
		r.noteIdentity(id, a)
	}
}

// released records that mo's DEL succeeded, sent at from, answered out: a
// sure sticky owner's permanent addresses are kept for its identity
// (but those the answer shows written back without it, after the
// identity moved on);
// everything else it held is free. An unsure sticky owner may have held
// addresses it was never told (an answer lost): those the DEL kept are
// the identity's too.
func (r *modelRun) released(mo *mOwner, from time.Time, out []records.Allocation) {
	k := mo.o.Key()
	for _, al := range out {
		if mo.identity != "" && al.Identity == mo.identity && !slices.Contains(mo.told, al.Addr) {
			r.noteIdentity(mo.identity, al.Addr)
			r.maybeKept[al.Addr] = true
		}
	}
	// A record written back without its identity (a reassert after the
	// identity moved on to a later pod) is freed by the DEL, not kept.
	freed := func(a netip.Addr) bool {
		return slices.ContainsFunc(out, func(al records.Allocation) bool { return al.Addr == a && al.Identity != mo.identity })
	}
	for _, a := range mo.told {
		if r.holder[a] == k {
			delete(r.holder, a)
		}
		switch {
		case mo.identity != "" && freed(a):
			r.noteRecent(a)
		case mo.identity != "" && !mo.unsure && !mo.reserved:
			r.kept[a] = keptFor{identity: mo.identity, from: from, window: time.Second}
		case mo.identity != "":
			r.maybeKept[a] = true
		default:
			r.noteRecent(a)
		}
	}
	mo.told, mo.unsure, mo.delFail, mo.reserved, mo.revoked = nil, false, false, false, false
}

// conflictText describes a Reassert's conflicts for the trace: what
// each is, not where it sits in memory.
func conflictText(cs []nodealloc.Conflict) string {
	var out []string
	for _, c := range cs {
		held := ""
		if c.HeldBy != nil {
			held = fmt.Sprintf(" (held by %s at rev %d)", c.HeldBy.Owner.Key(), c.HeldBy.Rev)
		}
		out = append(out, fmt.Sprintf("%s %s: %s%s", c.Owner.Key(), c.Addr, c.Reason, held))
	}
	return "[" + strings.Join(out, "; ") + "]"
}

func addrsOf(als []records.Allocation) []netip.Addr {
	out := make([]netip.Addr, len(als))
	for i, al := range als {
		out[i] = al.Addr
	}
	return out
}

func (r *modelRun) readIPs() []records.Allocation { return r.b.readIPs() }

// history describes the IP history of addrs, for a report.
func (r *modelRun) history(addrs []netip.Addr) string { return r.b.history(addrs) }

// lapsing reports whether a lease has ended or ends within a second.
func (r *modelRun) lapsing(lease int64) bool { return r.b.leaseLeft(lease) <= time.Second }

func (r *modelRun) readIP(a netip.Addr) (records.Allocation, bool) { return r.b.readIP(a) }

// verify checks etcd, read without faults, against the model.
func (r *modelRun) verify() {
	als := r.readIPs()
	held := map[string][]netip.Addr{}
	fams := map[string]netip.Addr{}
	for _, al := range als {
		if !slices.ContainsFunc(r.spec.CIDRs, func(c netip.Prefix) bool { return c.Contains(al.Addr) }) {
			r.fail("etcd holds %s for %s, outside the pool's cidrs %v", al.Addr, al.Owner.Key(), r.spec.CIDRs)
			return
		}
		if al.State == records.StateKept {
			continue
		}
		k := al.Owner.Key()
		if mo := r.owners[k]; al.Lease != 0 && (mo == nil || !slices.Contains(mo.told, al.Addr)) && r.lapsing(al.Lease) {
			// A reservation whose lease has ended, not yet deleted by
			// etcd: its owner's node dropped it at its end.
			continue
		}
		held[k] = append(held[k], al.Addr)
		fk := k + "/" + allocator.FamilyOf(al.Addr).String()
		if prev, dup := fams[fk]; dup {
			r.fail("etcd holds two %s addresses for %s: %s and %s", allocator.FamilyOf(al.Addr), k, prev, al.Addr)
			return
		}
		fams[fk] = al.Addr
	}
	for _, k := range r.order {
		mo := r.owners[k]
		if mo.unsure {
			continue
		}
		got, want := slices.Clone(held[k]), slices.Clone(mo.told)
		slices.SortFunc(got, netip.Addr.Compare)
		slices.SortFunc(want, netip.Addr.Compare)
		if !slices.Equal(got, want) {
			r.fail("%s was told %v (reserved %v, until %s; now %s) but etcd holds %v for it (IP history of %v: %s)", k, want, mo.reserved,
				mo.expires.Format(time.StampMilli), r.b.now().Format(time.StampMilli), got, want, r.history(want))
			return
		}
	}
	for _, k := range slices.Sorted(maps.Keys(held)) {
		switch mo := r.owners[k]; {
		case mo == nil:
			r.fail("etcd holds %v for %s, which the model never saw", held[k], k)
			return
		case mo.retired:
			r.fail("etcd holds %v for %s, an earlier container of %s which holds nothing", held[k], k, mo.identity)
			return
		}
	}
	r.verifyMigrations(als)
	if r.failed {
		return
	}
	// A binding names a container that holds its addresses.
	for _, b := range r.b.bindings() {
		if b.Kept() {
			continue
		}
		mo := r.owners[b.Owner.Key()]
		if mo == nil {
			r.fail("binding of %s names %s, which the model never saw", b.Identity, b.Owner.Key())
			return
		}
		if !mo.unsure && !mo.lost && len(mo.told) == 0 {
			how := "its release succeeded"
			if mo.operator {
				how = "an operator released it with its node"
			}
			r.fail("binding of %s names %s (addresses %v), which holds nothing (%s; etcd holds %v for it)", b.Identity, b.Owner.Key(), b.Addrs, how, held[b.Owner.Key()])
			return
		}
	}
}
