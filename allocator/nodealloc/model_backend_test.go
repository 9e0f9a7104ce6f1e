package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// modelBackend is what the model test runs on: real etcd
// (TestModelNodeAllocator) or the in-memory store on a fake clock
// (TestModelSimulated). The model, its operations and its checks are
// one; a backend says how a node gets its store and its lease, how the
// checker reads the truth (without faults), how the world changes
// outside the allocators (leases revoked, records lost, operators'
// commands) and how time passes.
type modelBackend interface {
	// nodeStore is the store node n's allocator writes through (the
	// model's hookStore wraps it to inject faults).
	nodeStore(n *mNode) records.Store
	// newSession grants n a lease, as the agent's lease keeper does,
	// and writes its node record on it.
	newSession(n *mNode) (modelSession, error)
	// now is the time the allocators read (Config.Now).
	now() time.Time
	// sleep lets d pass: real time, or the fake clock moved on (the
	// sessions' keep-alives meanwhile).
	sleep(d time.Duration)
	// pollEvery is how often an await looks again.
	pollEvery() time.Duration
	// roundTrip is the time a store call takes, and betweenSteps the
	// time between two steps: on etcd they pass by themselves; on the
	// simulated store the clock moves by them, so that no two calls
	// see one instant (a lease whose TTL etcd answers as 0 has ended
	// by the next call, as on etcd).
	roundTrip()
	betweenSteps() time.Duration
	// request is one request's context, bounded by modelRequestTimeout
	// as the agent bounds one.
	request(ctx context.Context) (context.Context, context.CancelFunc)

	// The truth, read without faults.
	readIPs() []records.Allocation
	readIP(a netip.Addr) (records.Allocation, bool)
	bindings() []records.Binding
	binding(id string) (records.Binding, bool)
	lent() map[netip.Addr]nodealloc.Loan
	claimOf(b netip.Prefix) (records.Claim, bool)
	// homeOf is the node block b's home names ("" for none).
	homeOf(b netip.Prefix) string
	// nodeLive reports whether node has a live record (its agent's, on
	// its lease).
	nodeLive(node string) bool
	// leaseLeft is the time lease has left (0 or less: ended).
	leaseLeft(lease int64) time.Duration
	getPool(name string) (allocator.Pool, error)
	poolDeleted(name string) bool
	// history describes the IP history of addrs, for a report.
	history(addrs []netip.Addr) string
	// state is what the trace records of the store after each step
	// ("" for none): on the simulated store its revision and clock, so
	// that a replay that wrote differently differs there.
	state() string

	// Changes from outside the allocators.
	revokeLease(id int64)
	// revokeHistoryLease revokes the lease IP history is written on
	// now; false if the store has none (the in-memory store's history
	// has no lease).
	revokeHistoryLease() bool
	// lose deletes the allocation at a and its lent home, as a restore
	// of an older snapshot does.
	lose(a netip.Addr)

	// Operators' commands, each faulted as its kind (operatorTries).
	releaseOwner(o records.Owner, ev inspect.Evidence) error
	removeNode(node string, ev inspect.Evidence) error
	updatePool(change func(p *allocator.Pool) error) error
	removeCIDR(cidr netip.Prefix) error
	createPool(p allocator.Pool) error
	deletePool(name string) error
	// poolInUse reports whether err refuses a change of a pool that
	// still holds something.
	poolInUse(err error) bool
}

// modelSession is a node's lease as its agent holds it.
type modelSession interface {
	nodealloc.Lease
	Close()
}

// etcdBackend is a real, embedded etcd: faults at the clientv3 layer for
// the operators' commands (faultKV), real leases, real time.
type etcdBackend struct {
	r     *modelRun
	e     *kvstore.Embedded
	check *clientv3.Client // the test's own view of etcd, without faults
}

func newEtcdBackend(t *testing.T, pool allocator.Pool) *etcdBackend {
	e := etcdtest.Start(t)
	ensurePool(t, e, pool)
	return &etcdBackend{e: e, check: etcdtest.Client(t, e)}
}

func (b *etcdBackend) nodeStore(n *mNode) records.Store {
	return etcdstore.New(etcdtest.Client(b.r.t, b.e), etcdstore.Options{ReservationTTL: reservationTTL})
}

func (b *etcdBackend) newSession(n *mNode) (modelSession, error) {
	if n.cli == nil {
		n.cli = etcdtest.Client(b.r.t, b.e)
	}
	sess, err := kvstore.NewSession(b.r.ctx, n.cli, 30)
	if err != nil {
		return nil, err
	}
	// The agent's node record, on its lease: an operator's commands
	// refuse a node that has one.
	rec := etcdstore.NodeRecord{Name: n.name, StartedAt: time.Now().UTC(), Lease: int64(sess.ID()), Features: schema.Names()}
	st := etcdstore.New(b.check, etcdstore.Options{})
	if err := st.WriteNode(b.r.ctx, rec, int64(sess.ID())); err != nil {
		sess.Close()
		return nil, fmt.Errorf("node record of %s: %w", n.name, err)
	}
	// The agents raise the cluster's schema level once every live node
	// understands it (agent.schemaRaiser): pool-max-blocks is usable.
	// A node stopped by the model (its blocks held, its record gone) is
	// away: the level waits for it (ErrNodesAway).
	if _, _, err := st.RaiseSchema(b.r.ctx, schema.Highest(), n.name, "model"); err != nil && !errors.Is(err, etcdstore.ErrNodesAway) {
		sess.Close()
		return nil, fmt.Errorf("raise the schema level: %w", err)
	}
	return sess, nil
}

func (b *etcdBackend) now() time.Time              { return time.Now() }
func (b *etcdBackend) sleep(d time.Duration)       { time.Sleep(d) }
func (b *etcdBackend) pollEvery() time.Duration    { return 50 * time.Millisecond }
func (b *etcdBackend) roundTrip()                  {}
func (b *etcdBackend) betweenSteps() time.Duration { return 0 }

func (b *etcdBackend) request(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, modelRequestTimeout)
}

func (b *etcdBackend) readIPs() []records.Allocation {
	r := b.r
	resp, err := b.check.Get(r.ctx, etcdstore.IPsPrefix(r.pool.Name), clientv3.WithPrefix())
	require.NoError(r.t, err)
	als, err := agenttest.DecodeAllocations(r.pool.Name, resp.Kvs)
	require.NoError(r.t, err)
	return als
}

func (b *etcdBackend) readIP(a netip.Addr) (records.Allocation, bool) {
	r := b.r
	blk, _ := r.pool.BlockFor(a)
	resp, err := b.check.Get(r.ctx, etcdstore.IPKey(r.pool.Name, blk, a))
	require.NoError(r.t, err)
	if len(resp.Kvs) == 0 {
		return records.Allocation{}, false
	}
	al, err := etcdstore.DecodeAllocation(r.pool.Name, resp.Kvs[0])
	require.NoError(r.t, err)
	return al, true
}

func (b *etcdBackend) bindings() []records.Binding {
	r := b.r
	resp, err := b.check.Get(r.ctx, etcdstore.StickyPrefix(r.pool.Name), clientv3.WithPrefix())
	require.NoError(r.t, err)
	var out []records.Binding
	for _, kv := range resp.Kvs {
		v, err := kvstore.Decode[records.Binding](kv)
		require.NoError(r.t, err)
		v.Value.Pool, v.Value.Rev, v.Value.Lease = r.pool.Name, kv.ModRevision, kv.Lease
		out = append(out, v.Value)
	}
	return out
}

func (b *etcdBackend) binding(id string) (records.Binding, bool) {
	r := b.r
	resp, err := b.check.Get(r.ctx, etcdstore.BindingKey(r.pool.Name, id))
	require.NoError(r.t, err)
	if len(resp.Kvs) == 0 {
		return records.Binding{}, false
	}
	v, err := kvstore.Decode[records.Binding](resp.Kvs[0])
	require.NoError(r.t, err)
	v.Value.Pool, v.Value.Rev, v.Value.Lease = r.pool.Name, resp.Kvs[0].ModRevision, resp.Kvs[0].Lease
	return v.Value, true
}

func (b *etcdBackend) lent() map[netip.Addr]nodealloc.Loan {
	r := b.r
	resp, err := b.check.Get(r.ctx, etcdstore.LentPrefix(r.pool.Name), clientv3.WithPrefix())
	require.NoError(r.t, err)
	now := map[netip.Addr]nodealloc.Loan{}
	for _, kv := range resp.Kvs {
		addr, err := netip.ParseAddr(strings.TrimPrefix(string(kv.Key), etcdstore.LentPrefix(r.pool.Name)))
		if err != nil {
			continue
		}
		if v, err := kvstore.Decode[records.Home](kv); err == nil {
			now[addr] = nodealloc.Loan{Node: v.Value.Node, Rev: kv.ModRevision}
		}
	}
	return now
}

func (b *etcdBackend) claimOf(blk netip.Prefix) (records.Claim, bool) {
	c, err := kvstore.GetJSON[records.Claim](b.r.ctx, b.check, etcdstore.ClaimKey(b.r.pool.Name, blk))
	if err != nil {
		return records.Claim{}, false
	}
	return c.Value, true
}

func (b *etcdBackend) homeOf(blk netip.Prefix) string {
	h, err := kvstore.GetJSON[records.Home](b.r.ctx, b.check, etcdstore.HomeKey(b.r.pool.Name, blk))
	if err != nil {
		return ""
	}
	return h.Value.Node
}

func (b *etcdBackend) nodeLive(node string) bool {
	resp, err := b.check.Get(b.r.ctx, etcdstore.NodeKey(node), clientv3.WithCountOnly())
	require.NoError(b.r.t, err)
	return resp.Count > 0
}

func (b *etcdBackend) leaseLeft(lease int64) time.Duration {
	resp, err := b.check.TimeToLive(b.r.ctx, clientv3.LeaseID(lease))
	if err != nil {
		return time.Hour // unknown: not taken for ended
	}
	return time.Duration(resp.TTL) * time.Second
}

func (b *etcdBackend) getPool(name string) (allocator.Pool, error) {
	return etcdstore.New(b.check, etcdstore.Options{}).GetPool(b.r.ctx, name)
}

func (b *etcdBackend) poolDeleted(name string) bool {
	resp, err := b.check.Get(b.r.ctx, etcdstore.DeletedPoolKey(name))
	require.NoError(b.r.t, err)
	return len(resp.Kvs) > 0
}

func (b *etcdBackend) history(addrs []netip.Addr) string {
	st := etcdstore.New(b.check, etcdstore.Options{})
	var out []string
	for _, a := range addrs {
		hs, err := st.History(b.r.ctx, etcdstore.HistoryFilter{Pool: b.r.pool.Name, IP: a})
		if err != nil {
			return err.Error()
		}
		for _, h := range hs {
			out = append(out, fmt.Sprintf("%s %s on %s %s at %s", h.IP, h.Owner.Key(), h.Node, h.Reason, h.End.Format(time.StampMilli)))
		}
	}
	return strings.Join(out, "; ")
}

func (b *etcdBackend) state() string { return "" }

func (b *etcdBackend) revokeLease(id int64) {
	_, _ = b.check.Revoke(b.r.ctx, clientv3.LeaseID(id))
}

func (b *etcdBackend) revokeHistoryLease() bool {
	resp, err := b.check.Get(b.r.ctx, etcdstore.HistoryPrefix(), clientv3.WithPrefix(), clientv3.WithLimit(1), clientv3.WithSort(clientv3.SortByModRevision, clientv3.SortDescend))
	if err != nil || len(resp.Kvs) == 0 || resp.Kvs[0].Lease == 0 {
		return true // etcd's history has a lease; none to revoke yet
	}
	_, _ = b.check.Revoke(b.r.ctx, clientv3.LeaseID(resp.Kvs[0].Lease))
	return true
}

func (b *etcdBackend) lose(a netip.Addr) {
	r := b.r
	blk, _ := r.pool.BlockFor(a)
	_, err := b.check.Delete(r.ctx, etcdstore.IPKey(r.pool.Name, blk, a))
	require.NoError(r.t, err)
	_, err = b.check.Delete(r.ctx, etcdstore.LentKey(r.pool.Name, a))
	require.NoError(r.t, err)
}

// inspector is kvipamctl's inspector, its transactions faulted as an
// operator's.
func (b *etcdBackend) inspector() *inspect.Inspector {
	return inspect.New(faultKV{KV: b.check, r: b.r, kind: kindOperator}, inspect.Options{History: etcdstore.NewHistoryRecorder(b.check, time.Hour)})
}

// plan runs one operator command as kvipamctl does: planned from a fresh
// snapshot, then executed.
func (b *etcdBackend) plan(plan func(s *inspect.Snapshot) (inspect.Plan, error)) error {
	in := b.inspector()
	s, err := in.Snapshot(b.r.ctx)
	if err == nil {
		var p inspect.Plan
		if p, err = plan(s); err == nil {
			_, err = in.Execute(b.r.ctx, p, nil)
		}
	}
	return err
}

func (b *etcdBackend) releaseOwner(o records.Owner, ev inspect.Evidence) error {
	return b.plan(func(s *inspect.Snapshot) (inspect.Plan, error) {
		return inspect.PlanReleaseOwner(s, o.ContainerID, o.IfName, ev, false)
	})
}

func (b *etcdBackend) removeNode(node string, ev inspect.Evidence) error {
	return b.plan(func(s *inspect.Snapshot) (inspect.Plan, error) { return inspect.PlanNodeRemove(s, node, ev, false) })
}

func (b *etcdBackend) updatePool(change func(p *allocator.Pool) error) error {
	b.schemaStep()
	truth := etcdstore.New(b.check, etcdstore.Options{})
	level, err := truth.ReadSchema(b.r.ctx)
	require.NoError(b.r.t, err)
	_, err = b.r.operatorStore(kindPoolChange, b.r.pool.Name).UpdatePool(b.r.ctx, b.r.pool.Name, change)
	if errors.Is(err, etcdstore.ErrSchemaLevel) {
		// Refused by the level: only a spec that needs more than the
		// level held (kvipamctl downgrade enable) may be.
		want, gerr := truth.GetPool(b.r.ctx, b.r.pool.Name)
		require.NoError(b.r.t, gerr)
		require.NoError(b.r.t, change(&want))
		if need := schema.PoolNeeds(want); need <= level.Level {
			b.r.fail("pool change refused by the schema level (%v), but it needs level %d and the level is %d", err, need, level.Level)
		}
	}
	return err
}

// schemaStep writes the schema level as the agents and kvipamctl do,
// under the fault injector (answers lost, races lost, refusals), before
// a pool change: an agent's raise (the model's nodes all understand
// every feature), or now and then kvipamctl downgrade enable 1 or
// cancel. It checks each against the truth: a raise never lowers the
// level and never passes a hold; enable is refused, writing nothing,
// while the pool needs more than level 1, and held the level at 1 when
// it succeeded; cancel ended the hold when it succeeded.
func (b *etcdBackend) schemaStep() {
	r := b.r
	truth := etcdstore.New(b.check, etcdstore.Options{})
	before, err := truth.ReadSchema(r.ctx)
	require.NoError(r.t, err)
	pool, err := truth.GetPool(r.ctx, r.pool.Name)
	require.NoError(r.t, err)
	st := r.schemaStore()
	var what string
	switch k := r.rng.IntN(6); {
	case k == 0:
		what = "downgrade enable 1"
		_, err = st.EnableDowngrade(r.ctx, schema.Base, "model")
	case k == 1:
		what = "downgrade cancel"
		_, _, err = st.CancelDowngrade(r.ctx, "model")
	default:
		what = "raise"
		_, _, err = st.RaiseSchema(r.ctx, schema.Highest(), "model", "model")
	}
	r.tally(kindSchema+" "+what, err)
	after, aerr := truth.ReadSchema(r.ctx)
	require.NoError(r.t, aerr)
	unknown := errors.Is(err, errUnknown) || errors.Is(err, context.DeadlineExceeded)
	// A lost race rewrites the key as it is: compare what it says.
	same := func(a, b etcdstore.SchemaSetting) bool { return a.Level == b.Level && a.Downgrade == b.Downgrade }
	switch what {
	case "raise":
		if after.Level < before.Level || (before.Downgrade && !same(after, before)) {
			r.fail("raise (%v): the level went from %+v to %+v", err, before, after)
		}
	case "downgrade enable 1":
		switch {
		case schema.PoolNeeds(pool) > schema.Base && (err == nil || !errors.Is(err, etcdstore.ErrSchemaLevel) && !errors.Is(err, errInjected) && !unknown && !errors.Is(err, retry.ErrUnavailable)):
			r.fail("downgrade enable while pool %+v needs level %d: %v", pool, schema.PoolNeeds(pool), err)
		case schema.PoolNeeds(pool) > schema.Base && !same(after, before):
			r.fail("refused downgrade enable (%v) changed the level from %+v to %+v", err, before, after)
		case err == nil && (after.Level != schema.Base || !after.Downgrade):
			r.fail("downgrade enable succeeded, and the level is %+v", after)
		}
	case "downgrade cancel":
		if err == nil && after.Downgrade {
			r.fail("downgrade cancel succeeded, and the level is still held: %+v", after)
		}
	}
}

// schemaStore is the store of the agents' and kvipamctl's writes of the
// schema level, faulted as kindSchema: a lost race rewrites the schema
// key as it is, so that the writer's compare fails and it reads again.
func (r *modelRun) schemaStore() *etcdstore.Store {
	b := r.b.(*etcdBackend)
	cli := clientv3.NewCtxClient(r.ctx)
	cli.KV = faultKV{KV: b.check.KV, r: r, kind: kindSchema, race: func() {
		resp, err := b.check.Get(r.ctx, etcdstore.SchemaKey())
		require.NoError(r.t, err)
		if len(resp.Kvs) > 0 {
			_, err = b.check.Put(r.ctx, etcdstore.SchemaKey(), string(resp.Kvs[0].Value))
			require.NoError(r.t, err)
		}
	}}
	cli.Lease = b.check.Lease
	return etcdstore.New(cli, etcdstore.Options{})
}

func (b *etcdBackend) removeCIDR(cidr netip.Prefix) error {
	_, err := b.r.operatorStore(kindPoolChange, b.r.pool.Name).RemoveCIDR(b.r.ctx, b.r.pool.Name, cidr, true)
	return err
}

func (b *etcdBackend) createPool(p allocator.Pool) error {
	_, err := b.r.operatorStore(kindPoolCreate, p.Name).EnsurePool(b.r.ctx, p)
	return err
}

func (b *etcdBackend) deletePool(name string) error {
	return b.r.operatorStore(kindPoolDelete, name).DeletePool(b.r.ctx, name)
}

func (b *etcdBackend) poolInUse(err error) bool { return errors.Is(err, etcdstore.ErrPoolInUse) }

// operatorStore is kvipamctl's store, its transactions faulted as kind.
// A lost race rewrites pool's key as it is: its revision moves on, so the
// command's compare fails and it must read again.
func (r *modelRun) operatorStore(kind, pool string) *etcdstore.Store {
	b := r.b.(*etcdBackend)
	cli := clientv3.NewCtxClient(r.ctx)
	cli.KV = faultKV{KV: b.check.KV, r: r, kind: kind, race: func() {
		resp, err := b.check.Get(r.ctx, etcdstore.PoolKey(pool))
		require.NoError(r.t, err)
		if len(resp.Kvs) > 0 {
			_, err = b.check.Put(r.ctx, etcdstore.PoolKey(pool), string(resp.Kvs[0].Value))
			require.NoError(r.t, err)
		}
	}}
	cli.Lease = b.check.Lease
	return etcdstore.New(cli, etcdstore.Options{})
}
