package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/inspect"
	"github.com/stretchr/testify/require"
)

// The model test's operator commands and pool changes (model_test.go).

// extraCIDR is a cidr the pool operation adds to the pool and removes
// again (kvipamctl pool add-cidr / remove-cidr).
var extraCIDR = netip.MustParsePrefix("10.90.1.0/29")

// faultKV makes an operator's transactions meet the model's faults: an
// unknown outcome, a failure before sending, IP history's lease lost.
type faultKV struct {
	clientv3.KV
	r *modelRun
}

func (f faultKV) Txn(ctx context.Context) clientv3.Txn {
	return &faultTxn{Txn: f.KV.Txn(ctx), r: f.r}
}

// TimeToLive completes inspect.Client.
func (f faultKV) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	return f.r.check.TimeToLive(ctx, id, opts...)
}

type faultTxn struct {
	clientv3.Txn
	r *modelRun
}

func (t *faultTxn) If(cs ...clientv3.Cmp) clientv3.Txn     { t.Txn = t.Txn.If(cs...); return t }
func (t *faultTxn) Then(ops ...clientv3.Op) clientv3.Txn   { t.Txn = t.Txn.Then(ops...); return t }
func (t *faultTxn) Else(ops ...clientv3.Op) clientv3.Txn   { t.Txn = t.Txn.Else(ops...); return t }
func (t *faultTxn) Commit() (*clientv3.TxnResponse, error) { return t.r.operatorCommit(t.Txn) }

const kindOperator = "operator delete"

func (r *modelRun) operatorCommit(txn clientv3.Txn) (*clientv3.TxnResponse, error) {
	r.call = "Txn"
	if r.inject(kindOperator, fHistory) {
		r.count(kindOperator, fHistory)
		r.revokeHistoryLease()
	}
	if r.inject(kindOperator, fBefore) {
		r.count(kindOperator, fBefore)
		return nil, fmt.Errorf("operator delete: %w", errInjected)
	}
	resp, err := txn.Commit()
	if err == nil && r.inject(kindOperator, fUnknown) {
		r.count(kindOperator, fUnknown)
		return nil, fmt.Errorf("operator delete: %w", errUnknown)
	}
	return resp, err
}

// opOperator stops node n (its agent gone: lease revoked, node record
// gone), then releases what its pods held as an operator does with the
// statement that the node is gone: kvipamctl release --owner for each of
// its owners (their addresses in other nodes' blocks too), then
// kvipamctl node remove for its blocks. Each command is planned from a
// fresh snapshot and run again until it succeeds. The node then starts
// again, with nothing.
func (r *modelRun) opOperator(n *mNode) {
	r.op = kindOperator
	if n.sess != nil {
		_ = n.sess.Revoke(r.ctx)
		n.sess = nil
	}
	lastSeen := time.Now().UTC()
	in := inspect.New(faultKV{KV: r.check, r: r}, inspect.Options{History: etcdstore.NewHistoryRecorder(r.check, time.Hour)})
	var mine []*mOwner
	for _, k := range r.order {
		if mo := r.owners[k]; mo.node == n.i && (len(mo.told) > 0 || mo.unsure || mo.delFail) {
			mine = append(mine, mo)
		}
	}
	run := func(what string, plan func(s *inspect.Snapshot) (inspect.Plan, error)) bool {
		for try := 0; ; try++ {
			s, err := in.Snapshot(r.ctx)
			if err == nil {
				var p inspect.Plan
				if p, err = plan(s); err == nil {
					_, err = in.Execute(r.ctx, p, nil)
				}
			}
			r.logf("operator %s: %v", what, err)
			r.tally("operator", err)
			if err == nil {
				return true
			}
			if try == 8 {
				r.fail("operator %s: still failing: %v", what, err)
				return false
			}
		}
	}
	ev := inspect.Evidence{ConfirmGone: n.name, LastSeen: lastSeen, StatedBy: "model", StatedAt: time.Now().UTC()}
	for _, mo := range mine {
		if !run("release --owner "+mo.o.Key(), func(s *inspect.Snapshot) (inspect.Plan, error) {
			return inspect.PlanReleaseOwner(s, mo.o.ContainerID, mo.o.IfName, ev, false)
		}) {
			return
		}
	}
	if !run("node remove "+n.name, func(s *inspect.Snapshot) (inspect.Plan, error) {
		return inspect.PlanNodeRemove(s, n.name, ev, false)
	}) {
		return
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
	for a := range r.kept {
		if _, ok := r.readIP(a); !ok {
			delete(r.kept, a)
			r.noteRecent(a)
		}
	}
	r.op = "claim"
	r.startAlloc(n)
}

// opPool changes the pool as an operator does, and gives every node the
// new spec (the agents follow the pool key): disable or enable it,
// reserve an address or clear the reservations, add the extra cidr or
// remove it (refused while anything is in it).
func (r *modelRun) opPool() {
	st := etcdstore.New(r.check, etcdstore.Options{})
	var p allocator.Pool
	var err error
	what := ""
	k := r.rng.IntN(4)
	if r.spec.Disabled {
		k = 0 // a drain lasts until the next pool change
	}
	switch {
	case k == 3:
		// A node selector that leaves one node out (the node keeps what
		// it holds, takes nothing new), or every node again.
		sel := ""
		if r.spec.NodeSelector == "" {
			sel = "node!=" + r.nodes[r.rng.IntN(len(r.nodes))].name
		}
		what = "select " + sel
		p, err = st.UpdatePool(r.ctx, r.pool.Name, func(p *allocator.Pool) error { p.NodeSelector = sel; return nil })
	case k == 0:
		what = "toggle disabled"
		p, err = st.UpdatePool(r.ctx, r.pool.Name, func(p *allocator.Pool) error { p.Disabled = !p.Disabled; return nil })
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
		p, err = st.UpdatePool(r.ctx, r.pool.Name, func(p *allocator.Pool) error {
			if clear {
				p.Reserved = nil
			} else if !slices.ContainsFunc(p.Reserved, func(x allocator.Reservation) bool { return x.Range.Contains(a) }) {
				p.Reserved = append(p.Reserved, allocator.Reservation{Range: allocator.AddrRange{First: a, Last: a}, Reason: "model"})
			}
			return nil
		})
	default:
		cur, gerr := st.GetPool(r.ctx, r.pool.Name)
		if gerr != nil {
			err = gerr
			break
		}
		if slices.Contains(cur.CIDRs, extraCIDR) {
			what = "remove-cidr " + extraCIDR.String()
			p, err = st.RemoveCIDR(r.ctx, r.pool.Name, extraCIDR)
		} else {
			what = "add-cidr " + extraCIDR.String()
			p, err = st.UpdatePool(r.ctx, r.pool.Name, func(p *allocator.Pool) error { p.CIDRs = append(p.CIDRs, extraCIDR); return nil })
		}
	}
	r.logf("pool %s: %v", what, err)
	r.tally("pool change", err)
	if err != nil {
		if !errors.Is(err, etcdstore.ErrPoolInUse) {
			r.fail("pool %s: %v", what, err)
		}
		return
	}
	r.spec = p
	for _, n := range r.nodes {
		n.alloc.UpdatePool(p)
	}
}

// checkNew checks an address the model is about to tell an owner that did
// not hold it: the pool must hand out no new address while disabled, none
// of a reservation unless asked for by name, and none outside its cidrs.
func (r *modelRun) checkNew(mo *mOwner, a netip.Addr, static, takeover bool) {
	if takeover {
		return // the identity's own address
	}
	switch {
	case !slices.ContainsFunc(r.spec.CIDRs, func(c netip.Prefix) bool { return c.Contains(a) }):
		r.fail("%s was handed %s, outside the pool's cidrs %v", mo.o.Key(), a, r.spec.CIDRs)
	case r.spec.Disabled:
		r.fail("%s was handed %s while the pool is disabled", mo.o.Key(), a)
	case !r.spec.Selects(map[string]string{"node": r.nodes[mo.node].name}):
		r.fail("%s was handed %s on %s, which the pool's selector %q leaves out", mo.o.Key(), a, r.nodes[mo.node].name, r.spec.NodeSelector)
	case !static && slices.ContainsFunc(r.spec.Reserved, func(x allocator.Reservation) bool { return x.Range.Contains(a) }):
		r.fail("%s was handed %s, which is reserved, without asking for it", mo.o.Key(), a)
	}
}

// opSeed is an agent starting with a configured pool that differs from
// etcd's (an operator changed it since): the seed, faulted like any write,
// must never change the pool in etcd.
func (r *modelRun) opSeed(n *mNode) {
	seed := r.spec
	seed.Reserved, seed.Disabled, seed.NodeSelector = nil, !r.spec.Disabled, "rack=nowhere"
	r.op = "seed"
	got, created, err := n.hook.SeedPool(r.ctx, seed)
	r.logf("%s seed pool (differs from etcd's): created %v, %v", n.name, created, err)
	r.tally("seed", err)
	if created {
		r.fail("seeding pool %s over etcd's spec created it again", r.pool.Name)
	}
	cur, gerr := etcdstore.New(r.check, etcdstore.Options{}).GetPool(r.ctx, r.pool.Name)
	require.NoError(r.t, gerr)
	if cur.Disabled != r.spec.Disabled || cur.NodeSelector != r.spec.NodeSelector || len(cur.Reserved) != len(r.spec.Reserved) {
		r.fail("seeding pool %s changed etcd's spec: %+v, was %+v", r.pool.Name, cur, r.spec)
	}
	if err == nil && (got.Disabled != r.spec.Disabled || got.NodeSelector != r.spec.NodeSelector) {
		r.fail("seeding pool %s answered %+v, not etcd's spec %+v", r.pool.Name, got, r.spec)
	}
}
