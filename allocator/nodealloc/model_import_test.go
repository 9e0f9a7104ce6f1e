package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/adopt"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// The model test's import (kvipamctl import, model_test.go): an operator
// imports attachments of another IPAM running on a node, the node's
// allocator learns the import (as the agent's watch of its marks has it
// do), and the operator finalizes it. Each import write and finalize
// meets the model's faults as an operator's write: an unknown outcome, a
// failure before sending, a lost race (the node's own ADD lands between
// the plan and the write), etcd refusing it for load, an answer past the
// timeout, and the node's lease revoked (the agent restarted: the write
// must fail, and the import is planned again on the new lease).

const (
	kindImport   = "import"
	kindFinalize = "import finalize"
)

// modelImporter is what the import needs of a store, read and written
// without faults (operatorWrite adds them).
type modelImporter interface {
	records.Importer
	records.PoolReader
	PoolSnapshot(ctx context.Context, pool string) (records.PoolSnapshot, error)
	GetIPs(ctx context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error)
	FenceBorrower(ctx context.Context, c records.Claim, lease int64) (int64, error)
	BorrowFences(ctx context.Context) (map[string]records.BorrowFence, error)
}

// importer is the backend's store for the import and etcd's refusal for
// load as the store reports it.
func (r *modelRun) importer() (modelImporter, error) {
	switch b := r.b.(type) {
	case *etcdBackend:
		return etcdstore.New(b.check, etcdstore.Options{}), rpctypes.ErrTooManyRequests
	case *simBackend:
		return b.st, errTooMany(kindImport)
	}
	panic(fmt.Sprintf("no importer for %T", r.b))
}

// importCandidates picks up to two addresses no one holds or may hold,
// in the pool and one block: the attachments of the other IPAM.
func (r *modelRun) importCandidates() []netip.Addr {
	cidr := r.spec.CIDRs[r.rng.IntN(len(r.spec.CIDRs))]
	a := cidr.Addr()
	for range 1 + r.rng.IntN(40) {
		a = a.Next()
	}
	var out []netip.Addr
	var block netip.Prefix
	for range 8 {
		b, ok := r.spec.BlockFor(a)
		switch {
		case !ok || !cidr.Contains(a):
		case len(out) > 0 && b != block:
		case r.holder[a] != "" || r.maybeKept[a] || reserved(r.spec, a) || r.spec.InDraining(a) || slices.Contains(r.spec.Excluded(b), a) || !r.freeInEtcd(a):
		default:
			if _, kept := r.kept[a]; !kept {
				out, block = append(out, a), b
			}
		}
		if len(out) == 2 {
			break
		}
		a = a.Next()
	}
	return out
}

func reserved(p allocator.Pool, a netip.Addr) bool { _, ok := p.ReservationOf(a); return ok }

// opImport imports one or two attachments of the other IPAM on node n.
func (r *modelRun) opImport(n *mNode) {
	if n.sess == nil || n.sess.Lost() || r.migratesOn(n) || r.spec.Disabled {
		return
	}
	addrs := r.importCandidates()
	if len(addrs) == 0 {
		return
	}
	r.op = kindImport
	source := fmt.Sprintf("model:%s:%d", n.name, r.step)
	var allocs []adopt.Allocation
	var mos []*mOwner
	for i, a := range addrs {
		mo := r.addOwner(records.Owner{ContainerID: fmt.Sprintf("imported-%d-%d", r.step, i), IfName: "eth0"}, n.i, "")
		mo.imported = true
		mos = append(mos, mo)
		allocs = append(allocs, adopt.Allocation{Addr: a, Owner: mo.o, Node: n.name})
	}
	st, busy := r.importer()
	defer func(q bool) { r.quiet = q }(r.quiet)
	var plan adopt.Plan
	done := false
	for try := 0; !done; try++ {
		r.quiet = r.quiet || try >= operatorTries
		if try == operatorTries+4 {
			r.fail("import %v on %s: still failing without faults", addrs, n.name)
			return
		}
		r.recover(n, false)
		if err := r.operatorRead(kindImport); err != nil {
			continue
		}
		state, err := r.importState(st, allocs)
		if err != nil {
			r.fail("import: read the state: %v", err)
			return
		}
		plan = adopt.Make(source, "", allocs, state)
		if len(plan.Refused) > 0 {
			r.logf("import %v on %s refused: %s", addrs, n.name, plan.Refused[0].Why)
			r.tally("import", errors.New(plan.Refused[0].Why))
			r.importRefused(allocs)
			return
		}
		if len(plan.NeedFences) > 0 {
			err := r.operatorWrite(kindImport, nil, busy, func() error {
				_, err := st.FenceBorrower(r.ctx, records.Claim{Node: n.name, ClaimedAt: r.b.now()}, n.sess.ID())
				return err
			})
			r.logf("import: borrow fence of %s: %v", n.name, err)
			continue
		}
		done = true
		for _, w := range plan.Writes {
			err := r.operatorWrite(kindImport, r.importRace(n, mos), busy, func() error {
				if r.inject(kindImport, fRevoke) {
					r.count(kindImport, fRevoke)
					r.b.revokeLease(n.sess.ID()) // the agent restarts: the plan's lease is gone
				}
				_, err := st.ImportBlock(r.ctx, w)
				return err
			})
			r.logf("import block %s on %s: %v", w.Block, n.name, err)
			if errors.Is(err, etcdstore.ErrSchemaLevel) {
				r.tally("import", err)
				r.importRefused(allocs)
				return // a downgrade holds the level: refused whole
			}
			if err != nil {
				done = false // planned again: what landed is imported already
			}
		}
	}
	r.tally("import", nil)
	for i, mo := range mos {
		al, ok := r.readIP(addrs[i])
		if !ok || al.Owner.Key() != mo.o.Key() || al.Imported != source || al.Node != n.name {
			r.fail("import of %s at %s on %s: etcd holds %+v (%v)", mo.o.Key(), addrs[i], n.name, al, ok)
			return
		}
		mo.told = []netip.Addr{addrs[i]}
		r.holder[addrs[i]] = mo.o.Key()
	}
	r.learnImport(n, st, source)
	if r.roll(0.5) {
		r.finalizeImport(st, busy, source)
	}
}

// importRace is the lost race of an import write: the node's own ADD of
// another owner lands between the plan and the write (it may claim the
// block, or take an address of it).
func (r *modelRun) importRace(n *mNode, mine []*mOwner) func() {
	return func() {
		defer func(op string, q bool) { r.op, r.quiet = op, q }(r.op, r.quiet)
		r.quiet = true
		mo := r.ordinary(n)
		for _, m := range mine {
			if m == mo {
				return
			}
		}
		if len(mo.told) == 0 && !mo.unsure {
			r.allocate(n, mo, false)
		}
	}
}

// importRefused checks that a refused import wrote nothing.
func (r *modelRun) importRefused(allocs []adopt.Allocation) {
	for _, a := range allocs {
		if al, ok := r.readIP(a.Addr); ok && al.Owner.Key() == a.Owner.Key() {
			r.fail("refused import of %s wrote %s", a.Owner.Key(), a.Addr)
		}
	}
}

// importState reads what the plan decides on, as kvipamctl does; the
// live nodes are the model's (memstore keeps no node records).
func (r *modelRun) importState(st modelImporter, allocs []adopt.Allocation) (adopt.State, error) {
	nodes := map[string]adopt.Node{}
	for _, n := range r.nodes {
		if n.sess != nil && !n.sess.Lost() && r.b.nodeLive(n.name) {
			nodes[n.name] = adopt.Node{Lease: n.sess.ID()}
		}
	}
	return adopt.Read(r.ctx, st, r.pool.Name, allocs, nodes, r.b.now())
}

// learnImport has n's allocator learn source's marks for it, through
// its store's faults, as the agent's watch does until it succeeds.
func (r *modelRun) learnImport(n *mNode, st modelImporter, source string) {
	marks, err := st.ListImportMarks(r.ctx)
	if err != nil {
		r.fail("import: list marks: %v", err)
		return
	}
	defer func(q bool) { r.quiet = q }(r.quiet)
	for _, m := range marks {
		if m.Source != source || m.Node != n.name {
			continue
		}
		for try := 0; ; try++ {
			r.quiet = r.quiet || try >= 4
			r.recover(n, false)
			err := n.alloc.LearnImport(r.ctx, m)
			r.logf("%s LearnImport %s %s: %v", n.name, m.Block, m.Addrs, err)
			if err == nil {
				break
			}
			if try > 20 {
				r.fail("%s: learn import %s: %v", n.name, m.Block, err)
				return
			}
			r.after(n, err)
		}
	}
}

// finalizeImport drops source's marks, run again until it succeeds.
func (r *modelRun) finalizeImport(st modelImporter, busy error, source string) {
	r.op = kindFinalize
	defer func(q bool) { r.quiet = q }(r.quiet)
	for try := 0; ; try++ {
		r.quiet = r.quiet || try >= operatorTries
		err := r.operatorWrite(kindFinalize, nil, busy, func() error { _, err := st.FinalizeImport(r.ctx, source); return err })
		r.logf("import finalize %s: %v", source, err)
		r.tally("import finalize", err)
		if err == nil {
			break
		}
		if try > operatorTries+3 {
			r.fail("import finalize %s: still failing without faults: %v", source, err)
			return
		}
	}
	marks, err := st.ListImportMarks(r.ctx)
	if err != nil {
		r.fail("import: list marks: %v", err)
		return
	}
	for _, m := range marks {
		if m.Source == source {
			r.fail("import finalize %s succeeded, and its mark of %s remains", source, m.Block)
		}
	}
}
