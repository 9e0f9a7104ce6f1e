package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/stretchr/testify/require"
)

// The model test's operator commands and pool changes (model_test.go).

// extraCIDR is a cidr the pool operation adds to the pool and removes
// again (kvipamctl pool add-cidr / remove-cidr).
var extraCIDR = netip.MustParsePrefix("10.90.1.0/29")

// faultKV makes an operator's transactions meet the model's faults: an
// unknown outcome, a failure before sending, IP history's lease lost, and,
// where race is set, a lost race (another operator's write lands between
// the command's read and its compare).
type faultKV struct {
	clientv3.KV
	r    *modelRun
	kind string // the write kind: kindOperator, or a pool command's
	race func()
}

func (f faultKV) Txn(ctx context.Context) clientv3.Txn {
	return &faultTxn{Txn: f.KV.Txn(ctx), f: f}
}

// TimeToLive completes inspect.Client.
func (f faultKV) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	return f.r.b.(*etcdBackend).check.TimeToLive(ctx, id, opts...)
}

type faultTxn struct {
	clientv3.Txn
	f faultKV
	// writes: the transaction puts or deletes; one that only reads (a
	// snapshot at one revision) meets a read's faults, not a write's.
	writes bool
}

func (t *faultTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }
func (t *faultTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.Txn, t.writes = t.Txn.Then(ops...), t.writes || writesAny(ops)
	return t
}
func (t *faultTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn, t.writes = t.Txn.Else(ops...), t.writes || writesAny(ops)
	return t
}
func (t *faultTxn) Commit() (*clientv3.TxnResponse, error) {
	if !t.writes {
		return t.f.commitRead(t.Txn)
	}
	return t.f.commit(t.Txn)
}

// writesAny reports whether ops put or delete (a nested transaction is
// taken to).
func writesAny(ops []clientv3.Op) bool {
	return slices.ContainsFunc(ops, func(op clientv3.Op) bool { return op.IsPut() || op.IsDelete() || op.IsTxn() })
}

// The operators' write kinds.
const (
	kindOperator   = "operator delete" // kvipamctl release, node remove
	kindPoolChange = "pool change"     // pool disable, reserve, select, set-cooldown, set-masquerade, add-cidr, remove-cidr, drain-cidr, undrain-cidr
	kindPoolCreate = "pool create"
	kindPoolDelete = "pool delete"  // with the deleted-pool mark
	kindSchema     = "schema level" // the agents' raise, kvipamctl downgrade enable and cancel
)

// commitRead commits a transaction that only reads, failing it as the
// model fails a node's reads (readFailRate): past the call timeout, or
// before it was sent.
func (f faultKV) commitRead(txn clientv3.Txn) (*clientv3.TxnResponse, error) {
	if err := f.r.operatorRead(f.kind); err != nil {
		return nil, err
	}
	return txn.Commit()
}

func (f faultKV) commit(txn clientv3.Txn) (*clientv3.TxnResponse, error) {
	var resp *clientv3.TxnResponse
	err := f.r.operatorWrite(f.kind, f.race, rpctypes.ErrTooManyRequests, func() (err error) {
		resp, err = txn.Commit()
		return err
	})
	return resp, err
}

// operatorWrite sends an operator's write of kind (commit) through the
// model's faults, on either backend: IP history's lease revoked, a
// failure before it is sent, a lost race (race, if not nil, lands
// another write first), etcd refusing it for load (busy, as the store's
// client reports it), an unknown outcome, an answer past the call
// timeout.
func (r *modelRun) operatorWrite(kind string, race func(), busy error, commit func() error) error {
	r.call = "Txn"
	r.writes[kind]++
	if r.quiet {
		return commit()
	}
	if r.inject(kind, fHistory) && r.b.revokeHistoryLease() {
		r.count(kind, fHistory)
	}
	if r.inject(kind, fBefore) {
		r.count(kind, fBefore)
		return fmt.Errorf("%s: %w", kind, errInjected)
	}
	if race != nil && r.inject(kind, fRace) {
		r.count(kind, fRace)
		race()
	}
	if r.inject(kind, fBusy) {
		r.count(kind, fBusy)
		return busy
	}
	err := commit()
	if err == nil && r.inject(kind, fUnknown) {
		r.count(kind, fUnknown)
		return fmt.Errorf("%s: %w", kind, errUnknown)
	}
	if err == nil && r.inject(kind, fTimedOut) {
		r.count(kind, fTimedOut)
		return context.DeadlineExceeded
	}
	return err
}

// operatorRead is an operator's read (a snapshot), failed as the model
// fails a node's reads (readFailRate): past the call timeout, or before
// it was sent.
func (r *modelRun) operatorRead(kind string) error {
	if !r.quiet && r.roll(readFailRate**modelFault) {
		r.reads++
		if r.roll(0.5) {
			return context.DeadlineExceeded
		}
		return fmt.Errorf("%s read: %w", kind, errInjected)
	}
	return nil
}

// operatorTries is how many times the model runs an operator's command
// with faults before etcd calms down: an operator runs a failed command
// again until it succeeds, and the model checks each try's outcome, but
// a run that injects many faults in a row must not read as a command
// that cannot succeed (with the faults tripled, nine tries in a row
// failed in 3 runs of 32). Without faults the command must succeed.
const operatorTries = 8

// opOperator stops node n (its agent gone: lease revoked, node record
// gone), then releases what its pods held as an operator does with the
// statement that the node is gone: kvipamctl release --owner for each of
// its owners (their addresses in other nodes' blocks too), then
// kvipamctl node remove for its blocks. Each command is planned from a
// fresh snapshot and run again until it succeeds. The node then starts
// again, with nothing. A live migration whose second owner (the
// alternate) ran on the node ends with node remove: its forwarding pod's
// DEL, refused while the alternate's node is away, goes through after.
func (r *modelRun) opOperator(n *mNode) {
	ending, ok := r.alternatesOn(n)
	if !ok {
		return // left out: a node stopped with a migration's forwarding pod, or an alternate the model is unsure of
	}
	r.op = kindOperator
	if n.sess != nil {
		r.b.revokeLease(n.sess.ID())
		n.sess.Close()
		n.sess = nil
	}
	lastSeen := r.b.now().UTC()
	var mine []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.node == n.i && (len(mo.told) > 0 || mo.unsure || mo.delFail) {
			mine = append(mine, mo)
		}
	}
	run := func(what string, command func() error) bool {
		defer func(q bool) { r.quiet = q }(r.quiet)
		for try := 0; ; try++ {
			r.quiet = r.quiet || try >= operatorTries // etcd calms down: then the command must succeed
			err := command()
			r.logf("operator %s: %v", what, err)
			r.tally("operator", err)
			if err == nil {
				return true
			}
			if try == operatorTries+3 {
				r.fail("operator %s: still failing without faults: %v", what, err)
				return false
			}
		}
	}
	ev := inspect.Evidence{ConfirmGone: n.name, LastSeen: lastSeen, StatedBy: "model", StatedAt: r.b.now().UTC()}
	for _, mo := range mine {
		if !run("release --owner "+mo.o.Key(), func() error { return r.b.releaseOwner(mo.o, ev) }) {
			return
		}
	}
	if !run("node remove "+n.name, func() error { return r.b.removeNode(n.name, ev) }) {
		return
	}
	for _, mg := range ending {
		r.alternateRemoved(mg, n)
	}
	for _, mo := range mine {
		for _, a := range mo.told {
			if r.holder[a] == mo.o.Key() {
				delete(r.holder, a)
			}
			r.noteRecent(a)
		}
		mo.told, mo.unsure, mo.delFail, mo.reserved, mo.operator = nil, false, false, false, true
	}
	// Kept records in the node's blocks are gone with them.
	for _, a := range slices.SortedFunc(maps.Keys(r.kept), netip.Addr.Compare) {
		if _, ok := r.readIP(a); !ok {
			delete(r.kept, a)
			r.noteRecent(a)
		}
	}
	r.op = "claim"
	r.startAlloc(n)
}

// opPool changes the pool as an operator does, its write faulted like
// any other, and gives every node the spec etcd then holds (the agents
// follow the pool key): disable or enable it, reserve an address or clear
// the reservations, select nodes, set the reuse cooldown or the egress
// masquerade, drain an IPv4 cidr or undrain it, add the extra cidr or
// remove it (refused while anything is in it). A change lands whole or
// not at all:
// etcd holds the old spec or the new one, the new one only if the change
// may have landed.
func (r *modelRun) opPool() {
	r.op = kindPoolChange
	var change func(p *allocator.Pool) error
	what := ""
	k := r.rng.IntN(8)
	if r.spec.Disabled {
		k = 0 // a drain lasts until the next pool change
	}
	drain, undrain := r.drainChoice()
	switch {
	case k == 6 && undrain.IsValid():
		// kvipamctl pool undrain-cidr: the cidr serves again.
		what = "undrain-cidr " + undrain.String()
		change = func(p *allocator.Pool) error { return p.Undrain(undrain) }
	case k == 6 && drain.IsValid():
		// kvipamctl pool drain-cidr: nothing new lands in the cidr from
		// the moment a node sees it (checkNew); its empty blocks go back.
		what = "drain-cidr " + drain.String()
		change = func(p *allocator.Pool) error { return p.Drain(drain) }
	case k == 7:
		// kvipamctl pool set-max-blocks: no limit, or one or two blocks
		// of each family per node, beyond which a node borrows (schema
		// feature pool-max-blocks; the nodes' records name it).
		n := r.rng.IntN(3)
		what = "set-max-blocks " + fmt.Sprint(n)
		change = func(p *allocator.Pool) error { p.MaxBlocksPerNode = n; return nil }
	case k == 5:
		// kvipamctl pool set-masquerade: on, off, or the routing mode's
		// default (unset). No node allocates by it; the change must land
		// whole, as every other.
		m := []string{"on", "off", "default"}[r.rng.IntN(3)]
		v, err := allocator.ParseMasquerade(m)
		require.NoError(r.t, err)
		what = "set-masquerade " + m
		change = func(p *allocator.Pool) error { p.Masquerade = v; return nil }
	case k == 4:
		// kvipamctl pool set-cooldown: the default, reuse at once, a
		// cooldown that ends within a run and one that does not.
		d := []*allocator.Duration{nil, allocator.DurationOf(0), allocator.DurationOf(200 * time.Millisecond), allocator.DurationOf(time.Hour)}[r.rng.IntN(4)]
		what = "set-cooldown " + fmt.Sprint(d)
		if d == nil {
			what = "set-cooldown default"
		}
		change = func(p *allocator.Pool) error { p.ReuseCooldown = d; return nil }
	case k == 3:
		// A node selector that leaves one node out (the node keeps what
		// it holds, takes nothing new), or every node again.
		sel := ""
		if r.spec.NodeSelector == "" {
			sel = "node!=" + r.nodes[r.rng.IntN(len(r.nodes))].name
		}
		what = "select " + sel
		change = func(p *allocator.Pool) error { p.NodeSelector = sel; return nil }
	case k == 0:
		what = "toggle disabled"
		change = func(p *allocator.Pool) error { p.Disabled = !p.Disabled; return nil }
	case k == 1:
		cidr := r.pool.CIDRs[r.rng.IntN(2)]
		a := cidr.Addr()
		for range 1 + r.rng.IntN(30) {
			a = a.Next()
		}
		clear := r.rng.IntN(2) == 0
		what = "reserve " + a.String()
		if clear {
			what = "clear reservations"
		}
		change = func(p *allocator.Pool) error {
			if clear {
				p.Reserved = nil
			} else if !slices.ContainsFunc(p.Reserved, func(x allocator.Reservation) bool { return x.Range.Contains(a) }) {
				p.Reserved = append(p.Reserved, allocator.Reservation{Range: allocator.AddrRange{First: a, Last: a}, Reason: "model"})
			}
			return nil
		}
	case slices.Contains(r.spec.CIDRs, extraCIDR):
		what = "remove-cidr " + extraCIDR.String()
		change = func(p *allocator.Pool) error {
			p.CIDRs = slices.DeleteFunc(p.CIDRs, func(c netip.Prefix) bool { return c == extraCIDR })
			p.Reserved = slices.DeleteFunc(p.Reserved, func(x allocator.Reservation) bool { return extraCIDR.Contains(x.Range.First) })
			p.Draining = slices.DeleteFunc(p.Draining, func(c netip.Prefix) bool { return c == extraCIDR })
			return nil
		}
	default:
		what = "add-cidr " + extraCIDR.String()
		change = func(p *allocator.Pool) error { p.CIDRs = append(p.CIDRs, extraCIDR); return nil }
	}
	old := r.spec
	want := old
	want.CIDRs, want.Reserved, want.Draining = slices.Clone(old.CIDRs), slices.Clone(old.Reserved), slices.Clone(old.Draining)
	require.NoError(r.t, change(&want))
	// Removing the extra cidr while the pool's other IPv4 cidr drains
	// would leave no IPv4 cidr to serve from: refused whole.
	invalid := strings.HasPrefix(what, "remove-cidr") && want.Validate() != nil
	var err error
	if strings.HasPrefix(what, "remove-cidr") {
		err = r.b.removeCIDR(extraCIDR)
	} else {
		err = r.b.updatePool(change)
	}
	r.logf("pool %s: %v", what, err)
	if strings.Contains(what, "drain-cidr") {
		r.tally("pool drain", err) // its own row: the run shows it drained
	} else {
		r.tally("pool change", err)
	}
	cur, gerr := r.b.getPool(r.pool.Name)
	require.NoError(r.t, gerr)
	landed := samePool(cur, want)
	// An answer lost, or past the call timeout: the change may have landed.
	unknown := errors.Is(err, errUnknown) || errors.Is(err, context.DeadlineExceeded)
	switch {
	case err == nil && !landed:
		r.fail("pool %s succeeded, and etcd holds %+v, not %+v", what, cur, want)
	case err != nil && !landed && !samePool(cur, old):
		r.fail("pool %s failed (%v), and etcd holds %+v, neither the old spec %+v nor the new %+v", what, err, cur, old, want)
	case err != nil && landed && !samePool(want, old) && !unknown:
		r.fail("pool %s failed (%v) before it could land, and etcd holds the new spec %+v", what, err, cur)
	case err != nil && !unknown && !r.b.poolInUse(err) && !errors.Is(err, errInjected) && !errors.Is(err, retry.ErrUnavailable) &&
		!(invalid && errors.Is(err, allocator.ErrInvalidPool)) && !errors.Is(err, etcdstore.ErrSchemaLevel):
		// A refusal by the schema level is checked where it can come
		// from (etcdBackend.updatePool).
		r.fail("pool %s: %v", what, err)
	case err == nil && invalid:
		r.fail("pool %s succeeded, leaving %+v, which is not a valid pool", what, cur)
	}
	if cur.NodeSelector != r.spec.NodeSelector {
		r.selChangedAt = r.step
	}
	r.spec = cur
	for _, n := range r.nodes {
		n.alloc.UpdatePool(cur)
	}
}

// samePool reports whether two specs are the same, whatever revision
// each was read at.
func samePool(a, b allocator.Pool) bool {
	norm := func(p allocator.Pool) allocator.Pool {
		p.Rev = 0
		if len(p.Reserved) == 0 {
			p.Reserved = nil
		}
		if len(p.Draining) == 0 {
			p.Draining = nil
		}
		return p
	}
	return reflect.DeepEqual(norm(a), norm(b))
}

// drainChoice is the cidr a drain-cidr of the pool may name now, and the
// draining cidr an undrain-cidr may name; each invalid (the zero prefix)
// when there is none. Only the extra cidr is drained: it holds one block,
// which a node claims and fills, so a drain meets a block with pods in
// it, and the IPv6 cidr is its family's only one. Draining the /27
// instead would leave the run six IPv4 addresses, so that nearly every
// request borrows: a different run, not a drain's.
func (r *modelRun) drainChoice() (drain, undrain netip.Prefix) {
	if len(r.spec.Draining) > 0 {
		undrain = r.spec.Draining[r.rng.IntN(len(r.spec.Draining))]
		if r.rng.IntN(2) == 0 {
			return drain, undrain
		}
	}
	p := r.spec
	p.Draining = slices.Clone(r.spec.Draining)
	if slices.Contains(p.CIDRs, extraCIDR) && !slices.Contains(p.Draining, extraCIDR) && p.Drain(extraCIDR) == nil {
		drain = extraCIDR
	}
	return drain, undrain
}

// scratchPool is the pool opPoolDelete creates and deletes: no node
// serves it.
var scratchPool = allocator.Pool{Name: "scratch", BlockSizeV4: 29, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.91.0.0/29")}}

// opPoolDelete is an operator creating a pool and deleting it again
// (kvipamctl pool create, pool delete), each command run again until it
// is done, then node n's agent starting with the pool in its
// configuration; every write faulted. A delete lands whole or not at all
// (the pool gone and marked deleted, or there and unmarked), and no seed
// makes a deleted pool again.
func (r *modelRun) opPoolDelete(n *mNode) {
	name := scratchPool.Name
	state := func() (present, marked bool) {
		_, err := r.b.getPool(name)
		if err != nil && !errors.Is(err, records.ErrPoolNotFound) {
			require.NoError(r.t, err)
		}
		return err == nil, r.b.poolDeleted(name)
	}
	retried := func(what string, do func() error, done func() bool) bool {
		defer func(q bool) { r.quiet = q }(r.quiet)
		for try := 0; ; try++ {
			r.quiet = r.quiet || try >= operatorTries // etcd calms down: then the command must be done
			err := do()
			r.logf("operator pool %s %s: %v", what, name, err)
			r.tally("pool "+what, err)
			// Never both; and once a delete was tried, never neither (a
			// pool gone without its mark). Before any delete, neither is
			// the pool not created yet.
			if present, marked := state(); (present && marked) || (what == "delete" && !present && !marked) {
				r.fail("pool %s %s (%v): the pool is present=%v and marked deleted=%v", what, name, err, present, marked)
				return false
			}
			if done() {
				return true
			}
			if try == operatorTries+3 {
				r.fail("operator pool %s %s: still not done without faults: %v", what, name, err)
				return false
			}
		}
	}
	present := func() bool { p, _ := state(); return p }
	r.op = kindPoolCreate
	if !retried("create", func() error { return r.b.createPool(scratchPool) }, present) {
		return
	}
	r.op = kindPoolDelete
	if !retried("delete", func() error { return r.b.deletePool(name) }, func() bool { return !present() }) {
		return
	}
	r.op = "seed"
	for range 3 {
		_, created, err := n.hook.SeedPool(r.ctx, scratchPool)
		r.logf("%s seed pool %s (deleted by an operator): created %v, %v", n.name, name, created, err)
		r.tally("seed", err)
		if p, marked := state(); created || p || !marked {
			r.fail("seeding pool %s, which an operator deleted, made it again (created %v, present %v, marked %v)", name, created, p, marked)
			return
		}
	}
}

// checkNew checks an address the model is about to tell an owner that did
// not hold it: the pool must hand out none outside its cidrs, none on a
// node its selector leaves out (a sticky identity's own address taken
// over neither: the selector binds it too), and, unless it is such a
// takeover, none while disabled, none in a draining cidr (not even asked
// for by name), and none of a reservation unless asked for by name.
func (r *modelRun) checkNew(mo *mOwner, a netip.Addr, static, takeover bool) {
	switch {
	case !slices.ContainsFunc(r.spec.CIDRs, func(c netip.Prefix) bool { return c.Contains(a) }):
		r.fail("%s was handed %s, outside the pool's cidrs %v", mo.o.Key(), a, r.spec.CIDRs)
	case !r.spec.Selects(map[string]string{"node": r.nodes[mo.node].name}):
		r.fail("%s was handed %s on %s, which the pool's selector %q leaves out (a takeover of its identity's: %v)", mo.o.Key(), a, r.nodes[mo.node].name, r.spec.NodeSelector, takeover)
	case takeover:
		// The identity's own address: taken back in a disabled pool, or
		// in a range reserved since, it is not a new one.
	case r.spec.Disabled:
		r.fail("%s was handed %s while the pool is disabled", mo.o.Key(), a)
	case r.spec.InDraining(a):
		r.fail("%s was handed %s, in cidr %v, which every node has seen draining (static: %v)", mo.o.Key(), a, r.spec.Draining, static)
	case !static && slices.ContainsFunc(r.spec.Reserved, func(x allocator.Reservation) bool { return x.Range.Contains(a) }):
		r.fail("%s was handed %s, which is reserved, without asking for it", mo.o.Key(), a)
	}
}

// opSeed is an agent starting with a configured pool that differs from
// etcd's (an operator changed it since): the seed, faulted like any write,
// must never change the pool in etcd.
func (r *modelRun) opSeed(n *mNode) {
	seed := r.spec
	seed.Reserved, seed.Disabled, seed.NodeSelector, seed.Draining = nil, !r.spec.Disabled, "rack=nowhere", nil
	seed.ReuseCooldown = allocator.DurationOf((r.spec.Cooldown() + time.Second) % allocator.MaxReuseCooldown)
	notMasq := !r.spec.MasqueradeOr(true)
	seed.Masquerade = &notMasq
	r.op = "seed"
	got, created, err := n.hook.SeedPool(r.ctx, seed)
	r.logf("%s seed pool (differs from etcd's): created %v, %v", n.name, created, err)
	r.tally("seed", err)
	if created {
		r.fail("seeding pool %s over etcd's spec created it again", r.pool.Name)
	}
	cur, gerr := r.b.getPool(r.pool.Name)
	require.NoError(r.t, gerr)
	if cur.Disabled != r.spec.Disabled || cur.NodeSelector != r.spec.NodeSelector || len(cur.Reserved) != len(r.spec.Reserved) || !slices.Equal(cur.Draining, r.spec.Draining) ||
		!reflect.DeepEqual(cur.ReuseCooldown, r.spec.ReuseCooldown) || !reflect.DeepEqual(cur.Masquerade, r.spec.Masquerade) {
		r.fail("seeding pool %s changed etcd's spec: %+v, was %+v", r.pool.Name, cur, r.spec)
	}
	if err == nil && (got.Disabled != r.spec.Disabled || got.NodeSelector != r.spec.NodeSelector) {
		r.fail("seeding pool %s answered %+v, not etcd's spec %+v", r.pool.Name, got, r.spec)
	}
}
