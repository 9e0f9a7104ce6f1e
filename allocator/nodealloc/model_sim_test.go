package nodealloc_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/records/memstore"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

var (
	simSteps       = flag.Int("model.simsteps", 20000, "steps of TestModelSimulated when -model.steps is not given")
	simReplaySteps = flag.Int("model.replaysteps", 3000, "steps of each of TestModelSimulatedReplays' two runs")
)

// TestModelSimulated is TestModelNodeAllocator's model, operations and
// checks on the in-memory store (allocator/records/memstore) and its
// fake clock: waiting out a lease, a reservation or a sticky window is
// moving the clock on, a retry's pause too (retry.WithWait), so nothing
// sleeps, every interleaving is the seed's, and a seed replays bit for
// bit (TestModelSimulatedReplays). make test runs 20,000 steps;
// -model.steps=1000000 runs it long (make model-sim).
func TestModelSimulated(t *testing.T) {
	steps := *simSteps
	if flagSet("model.steps") {
		steps = *modelSteps
	}
	runModel(t, newSimBackend(t), modelSeedOrNow(), steps)
}

// TestModelSimulatedReplays runs one seed twice on the simulated store
// and requires the same trace: every step's operation, arguments,
// faults and answers, line for line.
func TestModelSimulatedReplays(t *testing.T) {
	seed := modelSeedOrNow()
	run := func(name string) *modelRun {
		var r *modelRun
		t.Run(name, func(t *testing.T) {
			b := newSimBackend(t)
			b.keepTrace = true
			r = runModel(t, b, seed, *simReplaySteps)
		})
		return r
	}
	a, b := run("first"), run("second")
	if a == nil || b == nil || t.Failed() {
		t.Fatalf("a run failed: seed %d", seed)
	}
	require.NotZero(t, a.trace.n, "the run traced nothing")
	if d := firstDiff(a.trace.lines, b.trace.lines); d != "" || a.trace.sum() != b.trace.sum() {
		t.Fatalf("seed %d replayed differently (hashes %016x, %016x): %s\nreplay: go test ./allocator/nodealloc -run 'TestModelSimulatedReplays$' -model.seed=%d -model.replaysteps=%d",
			seed, a.trace.sum(), b.trace.sum(), d, seed, *simReplaySteps)
	}
	t.Logf("seed %d: %d steps replayed, %d trace lines alike (hash %016x)", seed, a.step, a.trace.n, a.trace.sum())
}

// flagSet reports whether flag name was given on the command line.
func flagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// simBackend is the in-memory store on its fake clock. Every node
// allocator shares the one store, as they share etcd; the sessions'
// keep-alives run whenever the clock moves.
type simBackend struct {
	r         *modelRun
	st        *memstore.Store
	sessions  []*simSession
	keepTrace bool
}

func newSimBackend(t *testing.T) *simBackend {
	st := memstore.New(memstore.Options{ReservationTTL: reservationTTL})
	_, err := st.EnsurePool(context.Background(), modelPool())
	require.NoError(t, err)
	return &simBackend{st: st}
}

// simSession is a node's lease, kept alive by the backend until closed.
type simSession struct {
	b      *simBackend
	id     int64
	closed bool
}

func (s *simSession) ID() int64      { return s.id }
func (s *simSession) Lost() bool     { return s.closed || !s.b.st.LeaseAlive(s.id) }
func (s *simSession) Close()         { s.closed = true }
func (b *simBackend) now() time.Time { return b.st.Now() }

func (b *simBackend) nodeStore(*mNode) records.Store { return b.st }

func (b *simBackend) newSession(n *mNode) (modelSession, error) {
	s := &simSession{b: b, id: b.st.Grant(30 * time.Second)}
	b.st.NodeOnLease(n.name, s.id) // the node record, on the lease (an import compares it)
	live := b.sessions[:0]
	for _, o := range b.sessions {
		if !o.Lost() {
			live = append(live, o)
		}
	}
	b.sessions = append(live, s)
	return s, nil
}

// keepAliveEvery is how often a session renews its lease: a third of
// its TTL, as kvstore.Session does.
const keepAliveEvery = 10 * time.Second

// sleep moves the clock on by d, renewing the live sessions' leases on
// the way as their keep-alives would.
func (b *simBackend) sleep(d time.Duration) {
	for d > 0 {
		step := min(d, keepAliveEvery)
		for _, s := range b.sessions {
			if !s.closed {
				b.st.KeepAlive(s.id)
			}
		}
		b.st.Advance(step)
		d -= step
	}
}

func (b *simBackend) pollEvery() time.Duration { return 100 * time.Millisecond }

// simRoundTrip and simBetweenSteps are the time a store call takes and
// the time between two steps on the simulated store: about what they
// take on the embedded etcd.
const (
	simRoundTrip    = time.Millisecond
	simBetweenSteps = 5 * time.Millisecond
)

func (b *simBackend) roundTrip() {
	b.sleep(simRoundTrip)
	b.syncNodes()
}

// syncNodes gives the store each node's liveness, as etcd has it from
// the node records on the agents' leases: a node whose lease was
// revoked or lapsed has none (a migration's admit and cut-over to it
// are refused, memstore.NodeDown).
func (b *simBackend) syncNodes() {
	if b.r == nil {
		return
	}
	for _, n := range b.r.nodes {
		b.st.NodeDown(n.name, !b.nodeLive(n.name))
	}
}

func (b *simBackend) nodeLive(node string) bool {
	for _, n := range b.r.nodes {
		if n.name == node {
			return n.sess != nil && b.st.LeaseAlive(n.sess.ID())
		}
	}
	return false
}

func (b *simBackend) homeOf(blk netip.Prefix) string {
	got, err := b.st.GetBlocks(context.Background(), b.r.pool.Name, []netip.Prefix{blk})
	require.NoError(b.r.t, err)
	if bi, ok := got[blk.Masked()]; ok && bi.Home != nil {
		return bi.Home.Node
	}
	return ""
}
func (b *simBackend) betweenSteps() time.Duration { return simBetweenSteps }

type simDeadline struct{}

// request bounds a request by modelRequestTimeout on the fake clock:
// its retries' pauses move the clock (wait), and the one that would pass
// the deadline ends it. Its real deadline is far, and only there for
// retry.Do to retry an unavailable store at all.
func (b *simBackend) request(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx = context.WithValue(ctx, simDeadline{}, b.now().Add(modelRequestTimeout))
	return context.WithTimeout(ctx, time.Hour)
}

// wait is every retry's pause (retry.WithWait): the fake clock moves on.
func (b *simBackend) wait(ctx context.Context, d time.Duration) error {
	if dl, ok := ctx.Value(simDeadline{}).(time.Time); ok && b.now().Add(d).After(dl) {
		return context.DeadlineExceeded
	}
	b.sleep(d)
	return nil
}

func (b *simBackend) readIPs() []records.Allocation { return b.st.PoolIPs(b.r.pool.Name) }

func (b *simBackend) readIP(a netip.Addr) (records.Allocation, bool) {
	blk, ok := b.r.pool.BlockFor(a)
	if !ok {
		return records.Allocation{}, false
	}
	got, err := b.st.GetIPs(context.Background(), []records.IPRef{{Pool: b.r.pool.Name, Block: blk, Addr: a}})
	require.NoError(b.r.t, err)
	al, ok := got[a]
	return al, ok
}

func (b *simBackend) bindings() []records.Binding {
	out, err := b.st.ListBindings(context.Background(), b.r.pool.Name)
	require.NoError(b.r.t, err)
	return out
}

func (b *simBackend) binding(id string) (records.Binding, bool) {
	out, ok, err := b.st.GetBinding(context.Background(), b.r.pool.Name, id)
	require.NoError(b.r.t, err)
	return out, ok
}

func (b *simBackend) lent() map[netip.Addr]nodealloc.Loan {
	out := map[netip.Addr]nodealloc.Loan{}
	for a, l := range b.st.LentAt(b.r.pool.Name) {
		out[a] = nodealloc.Loan{Node: l.Node, Rev: l.Rev}
	}
	return out
}

func (b *simBackend) claimOf(blk netip.Prefix) (records.Claim, bool) {
	got, err := b.st.GetBlocks(context.Background(), b.r.pool.Name, []netip.Prefix{blk})
	require.NoError(b.r.t, err)
	if bi, ok := got[blk.Masked()]; ok && bi.Claim != nil {
		return *bi.Claim, true
	}
	return records.Claim{}, false
}

func (b *simBackend) leaseLeft(lease int64) time.Duration {
	end, err := b.st.LeaseExpiry(context.Background(), lease)
	require.NoError(b.r.t, err)
	return end.Sub(b.now())
}

func (b *simBackend) getPool(name string) (allocator.Pool, error) {
	return b.st.GetPool(context.Background(), name)
}

func (b *simBackend) poolDeleted(name string) bool { return b.st.PoolDeleted(name) }

func (b *simBackend) history([]netip.Addr) string { return "(not read on the simulated store)" }

func (b *simBackend) state() string {
	return fmt.Sprintf("rev %d at %s", b.st.Rev(), b.now().Format(time.RFC3339Nano))
}

func (b *simBackend) revokeLease(id int64) {
	b.st.Revoke(id)
	b.syncNodes()
}

// revokeHistoryLease: the in-memory store's history has no lease.
func (b *simBackend) revokeHistoryLease() bool { return false }

func (b *simBackend) lose(a netip.Addr) { b.st.Lose(b.r.pool.Name, a) }

// The operators' commands, each one step of the store, faulted as an
// operator's transaction is on etcd (operatorWrite); a lost race of a
// pool command is one the command's own retry absorbs, as etcdstore's.

func (b *simBackend) releaseOwner(o records.Owner, ev inspect.Evidence) error {
	if err := b.r.operatorRead(kindOperator); err != nil {
		return err
	}
	return b.r.operatorWrite(kindOperator, nil, errTooMany(kindOperator), func() error { b.st.ReleaseOwner(o, ev.ConfirmGone); return nil })
}

func (b *simBackend) removeNode(node string, _ inspect.Evidence) error {
	if err := b.r.operatorRead(kindOperator); err != nil {
		return err
	}
	return b.r.operatorWrite(kindOperator, nil, errTooMany(kindOperator), func() error { b.st.RemoveNode(node); return nil })
}

func (b *simBackend) poolWrite(kind string, commit func() error) error {
	return b.r.operatorWrite(kind, func() {}, errTooMany(kind), commit)
}

func (b *simBackend) updatePool(change func(p *allocator.Pool) error) error {
	return b.poolWrite(kindPoolChange, func() error { _, err := b.st.UpdatePool(b.r.pool.Name, change); return err })
}

func (b *simBackend) removeCIDR(cidr netip.Prefix) error {
	if err := b.r.operatorRead(kindPoolChange); err != nil {
		return err
	}
	return b.poolWrite(kindPoolChange, func() error { _, err := b.st.RemoveCIDR(b.r.pool.Name, cidr); return err })
}

func (b *simBackend) createPool(p allocator.Pool) error {
	return b.poolWrite(kindPoolCreate, func() error { _, err := b.st.EnsurePool(context.Background(), p); return err })
}

func (b *simBackend) deletePool(name string) error {
	return b.poolWrite(kindPoolDelete, func() error { return b.st.DeletePool(name) })
}

func (b *simBackend) poolInUse(err error) bool { return errors.Is(err, memstore.ErrPoolInUse) }

// bindBackend gives the backend its run, and the run the context its
// requests start from.
func (r *modelRun) bindBackend() {
	switch b := r.b.(type) {
	case *etcdBackend:
		b.r = r
	case *simBackend:
		b.r = r
		r.trace.keep = b.keepTrace
		r.ctx = retry.WithWait(r.ctx, b.wait)
	}
}
