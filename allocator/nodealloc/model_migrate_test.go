package nodealloc_test

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// The model test's live migrations (model_test.go). A sticky identity's
// pod (a VM's launcher) on one node migrates to another: the target's
// ADD, marked, is admitted as the identity's alternate (Admit; retried
// too), a third pod with the marker and a second one without are
// refused, the target's node cuts over (CutOver), and either pod's DEL
// comes before or after the cut-over (the alternate dropped, or the
// addresses handed to it), the target's node's lease revoked in
// between (its node not live: no cut-over to it, and the source's DEL
// keeps the addresses as ever). Each write meets the model's faults as
// every other kind does (admit, cut over, drop alternate).
//
// A node stopped by an operator (opOperator) while a migration's second
// owner runs there: node remove ends the migration (alternateRemoved).
//
// Left out: a node stopped by an operator with a migration's forwarding
// pod, a store loss (opStoreLoss) in the middle of a migration, and a new
// container of the identity during one (an earlier one's ADD retried may
// take the identity over, which ends the migration: migTakenOver).

// mMigration is a live migration of a sticky identity the model runs:
// the pod the VM ran on when it began (src) and its target (dst).
type mMigration struct {
	id       string
	job      string
	src, dst *mOwner
}

// inMigration reports whether mo is a pod of a migration in progress.
func (r *modelRun) inMigration(mo *mOwner) bool {
	mg := r.migs[mo.identity]
	return mg != nil && (mg.src == mo || mg.dst == mo)
}

// migratesOn reports whether a migration in progress has a pod on n.
func (r *modelRun) migratesOn(n *mNode) bool {
	for _, mg := range r.migs {
		if mg.src.node == n.i || mg.dst.node == n.i {
			return true
		}
	}
	return false
}

// alternatesOn lists the migrations with a pod on n, and reports whether
// each such pod is one the model is sure etcd names as the alternate
// (the second owner, holding nothing of its own), its migration's other
// pod sure of what it holds: what opOperator can stop n with.
func (r *modelRun) alternatesOn(n *mNode) ([]*mMigration, bool) {
	var out []*mMigration
	for _, id := range slices.Sorted(maps.Keys(r.migs)) {
		mg := r.migs[id]
		var mo *mOwner
		switch {
		case mg.dst.node == n.i:
			mo = mg.dst
		case mg.src.node == n.i:
			mo = mg.src
		default:
			continue
		}
		other := mg.other(mo)
		if mo.gone || len(mo.alt) == 0 || mo.altUnsure || mo.unsure || mo.delFail || mo.reserved || len(mo.told) > 0 ||
			other.node == n.i || other.unsure || other.altUnsure || len(other.alt) > 0 {
			return nil, false
		}
		out = append(out, mg)
	}
	return out, true
}

// alternateRemoved checks that node remove of n ended migration mg,
// whose alternate ran on n: the binding and the records of its
// addresses name no alternate on n. Its pod there is gone.
func (r *modelRun) alternateRemoved(mg *mMigration, n *mNode) {
	mo := mg.dst
	if mo.node != n.i {
		mo = mg.src
	}
	if b, ok := r.b.binding(mg.id); ok && b.Alternate != nil && b.Alternate.Node == n.name {
		r.fail("node remove %s left %s the alternate of %s: %+v", n.name, b.Alternate.Owner.Key(), mg.id, b)
		return
	}
	for _, a := range mo.alt {
		if al, ok := r.readIP(a); ok && al.Alternate != nil && al.Alternate.Node == n.name {
			r.fail("node remove %s left the record of %s naming %s as its alternate", n.name, a, al.Alternate.Owner.Key())
			return
		}
	}
	r.logf("live migration %s of %s: its second owner %s went with node %s", mg.job, mg.id, mo.o.Key(), n.name)
	r.tally("migration ended by node remove", nil)
	mo.alt, mo.altUnsure, mo.gone = nil, false, true
}

// other is the migration's pod that is not mo.
func (mg *mMigration) other(mo *mOwner) *mOwner {
	if mo == mg.src {
		return mg.dst
	}
	return mg.src
}

// opMigrate starts a live migration of an identity, or takes one in
// progress a step on.
func (r *modelRun) opMigrate() {
	if skip("migration") {
		return
	}
	var ids []string
	for _, id := range slices.Sorted(maps.Keys(r.gens)) {
		if id != lapseIdentity {
			ids = append(ids, id)
		}
	}
	id := ids[r.rng.IntN(len(ids))]
	mg := r.migs[id]
	if mg == nil {
		r.migStart(id)
		return
	}
	switch k := r.rng.IntN(10); {
	case k == 0:
		r.admit(mg) // the target's ADD retried
	case k == 1:
		r.intruder(mg, true) // a third pod, marked
	case k == 2:
		r.intruder(mg, false) // a second pod, not marked
	case k < 5:
		r.cutOver(mg, true)
	case k == 5:
		r.release(mg.dst)
	case k == 6:
		r.release(mg.src)
	default:
		r.nodeAway(mg)
	}
}

// migStart migrates identity id's pod, if a sure one holds it, to
// another node: the target's ADD.
func (r *modelRun) migStart(id string) {
	b, ok := r.b.binding(id)
	if !ok || b.Kept() || b.Alternate != nil {
		return
	}
	src := r.owners[b.Owner.Key()]
	if src == nil || src.unsure || src.reserved || src.delFail || src.stalled || src.gone || src.retired || len(src.told) == 0 {
		return
	}
	var to []int
	for _, n := range r.nodes {
		if n.i != src.node {
			to = append(to, n.i)
		}
	}
	r.migN++
	_, name, _ := strings.Cut(id, "/")
	o := records.Owner{ContainerID: fmt.Sprintf("%s-t%d", name, r.migN), IfName: "eth0", Namespace: "ns", Pod: fmt.Sprintf("%s-target-%d", name, r.migN),
		PodUID: fmt.Sprintf("uid-%s-t%d", name, r.migN)}
	dst := r.addOwner(o, to[r.rng.IntN(len(to))], id)
	dst.born, dst.migrant, src.migrant = r.step, true, true
	mg := &mMigration{id: id, job: fmt.Sprintf("job-%d", r.migN), src: src, dst: dst}
	r.migs[id] = mg
	r.logf("live migration %s of %s: %s on %s to %s on %s", mg.job, id, src.o.Key(), r.nodes[src.node].name, dst.o.Key(), r.nodes[dst.node].name)
	r.admit(mg)
}

// admit is the target's ADD (marked): admitted as the alternate, or,
// with nothing to migrate from, an ordinary sticky ADD.
func (r *modelRun) admit(mg *mMigration) {
	dst := mg.dst
	if dst.gone || dst.delFail {
		return
	}
	n := r.nodes[dst.node]
	r.recover(n, false)
	r.op = "admit"
	req := nodealloc.Request{Pool: r.pool.Name, Owner: dst.o, Sticky: &records.Sticky{Identity: mg.id, Window: r.stickyWindow()}, Migration: mg.job}
	ctx, cancel := r.reqCtx()
	defer cancel()
	res, ok, err := n.alloc.Admit(ctx, req)
	r.logf("%s Admit %s for %s: ok %v, %v %v", n.name, dst.o.Key(), mg.id, ok, addrsOf(res.Allocations), err)
	r.tally("migration admit", err)
	after, found := r.b.binding(mg.id)
	isAlt := found && after.Alternate != nil && after.Alternate.Owner.Key() == dst.o.Key()
	switch {
	case err == nil && ok:
		got := sortedAddrs(addrsOf(res.Allocations))
		if !res.Alternate || !isAlt || after.Alternate.Node != n.name || !slices.Equal(got, sortedAddrs(after.Addrs)) {
			r.fail("%s was told it is admitted as the alternate of %s with %v (alternate %v), but etcd's binding is %+v", dst.o.Key(), mg.id, got, res.Alternate, after)
			return
		}
		for _, a := range got {
			if al, ok := r.readIP(a); !ok || al.Alternate == nil || al.Alternate.Owner.Key() != dst.o.Key() {
				r.fail("%s was told it is admitted as the alternate of %s, but etcd's record of %s is %+v (found %v)", dst.o.Key(), mg.id, a, al, ok)
				return
			}
			r.noteIdentity(mg.id, a)
		}
		dst.alt, dst.altUnsure = got, false
	case err == nil:
		// Nothing to migrate from: the caller allocates, as for any
		// sticky ADD (the identity's addresses taken over).
		r.op = "bind/takeover"
		res, err = n.alloc.Allocate(ctx, req)
		r.logf("%s sticky Allocate %s (nothing to migrate from): %v %v", n.name, dst.o.Key(), addrsOf(res.Allocations), err)
		r.tally("sticky allocate", err)
		if err != nil && !refusal(err) {
			for _, k := range r.order {
				if other := r.owners[k]; other.identity == mg.id {
					other.unsure = true
				}
			}
			r.learnIdentity(mg.id)
		}
		r.answer(dst, res, err)
		if err == nil {
			dst.alt, dst.altUnsure = nil, false
		}
	case refusal(err):
		if isAlt || (len(dst.alt) > 0 && !dst.altUnsure) {
			r.fail("%s, the alternate of %s, was refused on its ADD retried: %v (binding %+v)", dst.o.Key(), mg.id, err, after)
			return
		}
	default:
		dst.altUnsure = true
		r.learnIdentity(mg.id)
	}
	r.after(n, err)
}

// intruder is the ADD of another pod of the identity while a migration
// is in progress: a third pod marked as a migration's target, or a
// second pod not marked. Both are refused, and nothing changes.
func (r *modelRun) intruder(mg *mMigration, marked bool) {
	before, found := r.b.binding(mg.id)
	if !found || before.Kept() || (marked && before.Alternate == nil) {
		return
	}
	holder := r.owners[before.Owner.Key()]
	if holder == nil || holder.unsure || len(holder.told) == 0 {
		return // a binding that may be stale: it is replaced, not refused
	}
	n := r.nodes[r.rng.IntN(len(r.nodes))]
	r.recover(n, false)
	r.migN++
	_, name, _ := strings.Cut(mg.id, "/")
	o := records.Owner{ContainerID: fmt.Sprintf("%s-x%d", name, r.migN), IfName: "eth0", Namespace: "ns", Pod: fmt.Sprintf("%s-other-%d", name, r.migN)}
	mo := r.addOwner(o, n.i, mg.id)
	mo.born = r.step
	req := nodealloc.Request{Pool: r.pool.Name, Owner: o, Sticky: &records.Sticky{Identity: mg.id, Window: r.stickyWindow()}}
	ctx, cancel := r.reqCtx()
	defer cancel()
	var res nodealloc.Result
	var ok bool
	var err error
	if marked {
		r.op = "admit"
		req.Migration = fmt.Sprintf("job-x%d", r.migN)
		res, ok, err = n.alloc.Admit(ctx, req)
		r.logf("%s Admit %s (a third pod) for %s: ok %v, %v %v", n.name, o.Key(), mg.id, ok, addrsOf(res.Allocations), err)
		r.tally("migration third pod", err)
		if err == nil {
			r.fail("a third pod %s of %s, marked, was not refused (ok %v, %v) while %s holds it and %v is its alternate", o.Key(), mg.id, ok, addrsOf(res.Allocations), before.Owner.Key(), before.Alternate.Owner.Key())
		}
	} else {
		r.op = "bind/takeover"
		res, err = n.alloc.Allocate(ctx, req)
		r.logf("%s sticky Allocate %s (a second pod, not marked) for %s: %v %v", n.name, o.Key(), mg.id, addrsOf(res.Allocations), err)
		r.tally("migration second pod", err)
		if err == nil {
			r.fail("a second pod %s of %s, not marked, was given %v while %s holds it", o.Key(), mg.id, addrsOf(res.Allocations), before.Owner.Key())
		}
	}
	// Refused as the identity in use, or (on a node the pool's selector
	// leaves out) as a node the pool does not serve: either way nothing
	// changes.
	unselected := !r.spec.Selects(map[string]string{"node": n.name})
	if err != nil && refusal(err) && !errors.Is(err, records.ErrIdentityInUse) && !(unselected && errors.Is(err, records.ErrNodeNotSelected)) {
		r.fail("%s of %s was refused, but not as the identity in use: %v", o.Key(), mg.id, err)
	}
	after, _ := r.b.binding(mg.id)
	if after.Owner.Key() != before.Owner.Key() || altKey(after) != altKey(before) {
		r.fail("a refused pod %s of %s changed its binding from %+v to %+v", o.Key(), mg.id, before, after)
	}
	// Out of the run's choices; verify requires that etcd holds
	// nothing for it.
	mo.retired = true
	r.order = slices.DeleteFunc(r.order, func(k string) bool { return k == o.Key() })
	r.after(n, err)
}

func altKey(b records.Binding) string {
	if b.Alternate == nil {
		return ""
	}
	return b.Alternate.Owner.Key() + "@" + b.Alternate.Node
}

// cutOver is the target's node cutting over (the guest announced itself
// there, or an operator asked); recover: its node restores a lost lease
// first, as it would before any request.
func (r *modelRun) cutOver(mg *mMigration, recover bool) {
	dst, src := mg.dst, mg.src
	if dst.gone {
		return
	}
	n := r.nodes[dst.node]
	if recover {
		r.recover(n, false)
	}
	r.op = "cut over"
	before, _ := r.b.binding(mg.id)
	wasAlt := !before.Kept() && before.Alternate != nil && before.Alternate.Owner.Key() == dst.o.Key()
	wasOwner := !before.Kept() && before.Owner.Key() == dst.o.Key()
	ctx, cancel := r.reqCtx()
	defer cancel()
	err := n.alloc.CutOver(ctx, r.pool.Name, mg.id, dst.o)
	r.logf("%s CutOver %s to %s (alternate before: %v, owner: %v): %v", n.name, mg.id, dst.o.Key(), wasAlt, wasOwner, err)
	r.tally("migration cut over", err)
	after, found := r.b.binding(mg.id)
	switch {
	case err == nil:
		if !found || after.Kept() || after.Owner.Key() != dst.o.Key() || after.Node != n.name {
			r.fail("the cut-over of %s to %s was told to succeed, but etcd's binding is %+v", mg.id, dst.o.Key(), after)
			return
		}
		if !wasAlt && !wasOwner {
			r.fail("the cut-over of %s to %s succeeded, but it was neither its alternate nor its owner: %+v", mg.id, dst.o.Key(), before)
			return
		}
		if wasAlt && !src.gone && before.Owner.Key() == src.o.Key() && altKey(after) != src.o.Key()+"@"+r.nodes[src.node].name {
			r.fail("the cut-over of %s to %s did not keep the source %s as the alternate: %+v", mg.id, dst.o.Key(), src.o.Key(), after)
			return
		}
		r.forwards(dst, after.Addrs)
		if after.Alternate != nil && after.Alternate.Owner.Key() == src.o.Key() {
			src.alt, src.altUnsure = sortedAddrs(after.Addrs), false
		}
		// The source's agent learns it from its watch of the
		// bindings, mostly before the next request.
		if r.rng.IntN(3) > 0 {
			r.learn(r.nodes[src.node], after)
		}
	case errors.Is(err, records.ErrMigration):
		if wasAlt || wasOwner {
			r.fail("the cut-over of %s to %s was refused (%v), but etcd named it as the %s", mg.id, dst.o.Key(), err, map[bool]string{true: "alternate", false: "owner"}[wasAlt])
		}
	case errors.Is(err, records.ErrAlternateGone):
		if r.b.nodeLive(n.name) {
			r.fail("the cut-over of %s to %s was refused as its node not live (%v), but %s has a live record", mg.id, dst.o.Key(), err, n.name)
		}
		if after.Owner.Key() != before.Owner.Key() || altKey(after) != altKey(before) {
			r.fail("a cut-over refused as its node not live changed the binding of %s from %+v to %+v", mg.id, before, after)
		}
	default:
		// Of unknown outcome: it may have landed.
		dst.unsure, dst.altUnsure = true, true
		src.unsure, src.altUnsure = true, true
	}
	r.after(n, err)
}

// nodeAway revokes the target's node's lease (its agent cut off: its
// node record goes), then cuts over (refused: its pod cannot forward) or
// DELs the source (the alternate goes, the addresses are kept as ever);
// then the agent renews its lease.
func (r *modelRun) nodeAway(mg *mMigration) {
	n := r.nodes[mg.dst.node]
	if n.sess == nil || mg.dst.gone {
		return
	}
	r.logf("%s's lease revoked: the target's node is not live", n.name)
	r.b.revokeLease(n.sess.ID())
	if r.rng.IntN(2) == 0 {
		r.cutOver(mg, false)
	} else {
		r.release(mg.src)
	}
	r.after(n, records.ErrLeaseLost)
}

// migTakenOver is a sticky ADD of mo, another pod of an identity that
// migrates (its pod re-created, or an earlier one's ADD retried),
// answered err: a takeover ends the migration (neither pod is the
// alternate), and one of unknown outcome may have.
func (r *modelRun) migTakenOver(mo *mOwner, err error) {
	mg := r.migs[mo.identity]
	if mg == nil || mo == mg.src || mo == mg.dst || (err != nil && refusal(err)) {
		return
	}
	if err != nil {
		mg.src.altUnsure = mg.src.altUnsure || len(mg.src.alt) > 0
		mg.dst.altUnsure = mg.dst.altUnsure || len(mg.dst.alt) > 0
		return
	}
	if b, ok := r.b.binding(mo.identity); ok && b.Alternate != nil {
		r.fail("%s took %s over, and its binding still names an alternate: %+v", mo.o.Key(), mo.identity, b)
		return
	}
	mg.src.alt, mg.src.altUnsure, mg.dst.alt, mg.dst.altUnsure = nil, false, nil, false
	delete(r.migs, mo.identity)
	r.logf("live migration %s of %s ended: %s took the identity over", mg.job, mo.identity, mo.o.Key())
}

// otherLive reports, for a pod of a migration in progress, whether the
// other pod's node is live.
func (r *modelRun) otherLive(mo *mOwner) bool {
	if !r.inMigration(mo) {
		return false
	}
	return r.b.nodeLive(r.nodes[r.migs[mo.identity].other(mo).node].name)
}

// migDelFailed: a migration pod's DEL failed, and may have landed: the
// addresses may have gone to the other pod, or its alternate dropped.
func (r *modelRun) migDelFailed(mo *mOwner) {
	if !r.inMigration(mo) {
		return
	}
	other := r.migs[mo.identity].other(mo)
	mo.altUnsure = mo.altUnsure || len(mo.alt) > 0
	other.unsure, other.altUnsure = true, true
}

// migLeft is the DEL of mo, a migration pod, told to succeed: as the
// alternate, it left; as the owner, its addresses went to the other pod,
// which forwards now, unless the other's node was not live (otherLive),
// when the alternate went and the addresses are kept as ever.
func (r *modelRun) migLeft(mo *mOwner, otherLive bool) {
	if !r.inMigration(mo) {
		return
	}
	mg := r.migs[mo.identity]
	other := mg.other(mo)
	wasAlt := len(other.alt) > 0 && !other.altUnsure && !other.gone
	mo.gone, mo.alt, mo.altUnsure = true, nil, false
	b, found := r.b.binding(mg.id)
	switch {
	case found && b.Alternate != nil && b.Alternate.Owner.Key() == mo.o.Key():
		r.fail("%s's DEL succeeded, and it is still the alternate of %s: %+v", mo.o.Key(), mg.id, b)
	case found && !b.Kept() && b.Owner.Key() == other.o.Key():
		if b.Alternate != nil {
			r.fail("%s's DEL succeeded, and %s still has an alternate: %+v", mo.o.Key(), mg.id, b)
			return
		}
		// The other forwards: handed to it now, or it did already.
		mo.told = slices.DeleteFunc(mo.told, func(a netip.Addr) bool { return slices.Contains(b.Addrs, a) })
		r.forwards(other, b.Addrs)
		r.learn(r.nodes[other.node], b)
	case !found || b.Kept():
		if wasAlt && otherLive {
			r.fail("%s's DEL kept the addresses of %s (%+v), while its alternate %s was live on %s", mo.o.Key(), mg.id, b, other.o.Key(), r.nodes[other.node].name)
		}
		other.alt, other.altUnsure = nil, false
	}
}

// forwards records that mo owns addrs, and forwards them: a cut-over, or
// the addresses handed to it at the other pod's DEL.
func (r *modelRun) forwards(mo *mOwner, bound []netip.Addr) {
	k := mo.o.Key()
	// Those etcd holds for it: a binding may name an address another
	// owner holds now (the identity's record lost, the address reused).
	var addrs []netip.Addr
	for _, a := range bound {
		if al, ok := r.readIP(a); ok && al.Owner.Key() == k {
			addrs = append(addrs, a)
		}
	}
	for _, a := range addrs {
		if h := r.holder[a]; h != "" && h != k {
			ho := r.owners[h]
			ho.told = slices.DeleteFunc(ho.told, func(x netip.Addr) bool { return x == a })
		}
		r.holder[a] = k
		r.noteIdentity(mo.identity, a)
		delete(r.kept, a)
		delete(r.maybeKept, a)
	}
	mo.told = sortedAddrs(addrs)
	mo.alt, mo.altUnsure, mo.unsure, mo.reserved, mo.gone = nil, false, false, false, false
	// A pod whose DEL failed (the runtime retries it) has no endpoint:
	// nothing re-asserts what it holds, as for any such owner.
	mo.unsure = mo.delFail
}

// learn is node n's agent learning a binding's addresses from its watch
// (nodealloc.Allocator.Learn).
func (r *modelRun) learn(n *mNode, b records.Binding) {
	refs, err := n.alloc.BoundRefs(b)
	if err == nil {
		err = n.alloc.Learn(r.ctx, refs)
	}
	r.logf("%s learns %s's addresses %v (owner %s): %v", n.name, b.Identity, b.Addrs, b.Owner.Key(), err)
}

// endMigrations ends the migrations one of whose pods left and that
// have no alternate: the other pod is an ordinary pod of its identity.
func (r *modelRun) endMigrations() {
	for _, id := range slices.Sorted(maps.Keys(r.migs)) {
		mg := r.migs[id]
		if !mg.src.gone && !mg.dst.gone {
			continue
		}
		if len(mg.src.alt) > 0 || len(mg.dst.alt) > 0 || mg.src.altUnsure || mg.dst.altUnsure {
			continue
		}
		if b, ok := r.b.binding(id); ok && b.Alternate != nil {
			continue
		}
		delete(r.migs, id)
		r.logf("live migration %s of %s ended", mg.job, id)
	}
}

func sortedAddrs(as []netip.Addr) []netip.Addr {
	out := slices.Clone(as)
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// verifyMigrations checks etcd's alternates: a binding with one is not
// kept, names a live pod the model ran as a migration's, and every
// record of its addresses agrees with it on the identity (no address
// held for two identities: a stale binding of another may name it), the
// owner, its node and the alternate; a record naming an alternate is its
// binding's; the forwarding owner's node is the one the
// address routes to; an alternate the model is sure of is etcd's.
func (r *modelRun) verifyMigrations(als []records.Allocation) {
	at := map[netip.Addr]records.Allocation{}
	for _, al := range als {
		at[al.Addr] = al
	}
	byID := map[string]records.Binding{}
	for _, b := range r.b.bindings() {
		byID[b.Identity] = b
		if b.Alternate == nil {
			continue
		}
		alt := b.Alternate
		mo := r.owners[alt.Owner.Key()]
		switch {
		case b.Kept():
			r.fail("the kept binding of %s has an alternate: %+v", b.Identity, alt)
		case alt.Owner.Key() == b.Owner.Key():
			r.fail("the binding of %s names %s as its owner and its alternate", b.Identity, alt.Owner.Key())
		case mo == nil || !mo.migrant || mo.retired:
			r.fail("the binding of %s names %s as its alternate, not a pod the model admitted", b.Identity, alt.Owner.Key())
		case mo.gone:
			r.fail("the binding of %s names %s as its alternate, whose DEL succeeded", b.Identity, alt.Owner.Key())
		case alt.Node != r.nodes[mo.node].name:
			r.fail("the binding of %s names %s on %s as its alternate, which runs on %s", b.Identity, alt.Owner.Key(), alt.Node, r.nodes[mo.node].name)
		}
		if r.failed {
			return
		}
		for _, a := range b.Addrs {
			al, ok := at[a]
			switch {
			case !ok:
				r.fail("%s of %s is free while its pods %s and %s run", a, b.Identity, b.Owner.Key(), alt.Owner.Key())
			case al.Identity != b.Identity || al.Owner.Key() != b.Owner.Key() || al.Node != b.Node || al.Alternate == nil ||
				al.Alternate.Owner.Key() != alt.Owner.Key() || al.Alternate.Node != alt.Node:
				r.fail("the binding of %s (owner %s on %s, alternate %s) and the record of %s (identity %s, owner %s on %s, alternate %+v) disagree",
					b.Identity, b.Owner.Key(), b.Node, altKey(b), a, al.Identity, al.Owner.Key(), al.Node, al.Alternate)
			}
			if r.failed {
				return
			}
		}
	}
	lent := r.b.lent()
	for _, al := range als {
		if al.Alternate != nil {
			if b := byID[al.Identity]; altKey(b) != al.Alternate.Owner.Key()+"@"+al.Alternate.Node || !slices.Contains(b.Addrs, al.Addr) {
				r.fail("the record of %s names %s as its alternate, and its binding %+v does not", al.Addr, al.Alternate.Owner.Key(), b)
				return
			}
		}
		mo := r.owners[al.Owner.Key()]
		if al.State != records.StateAllocated || (al.Alternate == nil && (mo == nil || !mo.migrant)) {
			continue
		}
		route := lent[al.Addr].Node
		if route == "" {
			blk, _ := r.pool.BlockFor(al.Addr)
			route = r.b.homeOf(blk)
		}
		if route != al.Node {
			r.fail("%s is forwarded by %s on %s, but routes to %q", al.Addr, al.Owner.Key(), al.Node, route)
			return
		}
	}
	for _, id := range slices.Sorted(maps.Keys(r.migs)) {
		for _, mo := range []*mOwner{r.migs[id].src, r.migs[id].dst} {
			if len(mo.alt) == 0 || mo.altUnsure {
				continue
			}
			if b := byID[id]; altKey(b) != mo.o.Key()+"@"+r.nodes[mo.node].name || !slices.Equal(mo.alt, sortedAddrs(b.Addrs)) {
				r.fail("%s was told it is the alternate of %s with %v, but etcd's binding is %+v", mo.o.Key(), id, mo.alt, b)
				return
			}
		}
	}
}
