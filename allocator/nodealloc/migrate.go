package nodealloc

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"

	"github.com/kvipam/kvipam/allocator/nodealloc/planner"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Live migration (records/migration.go says what the records hold). The
// allocator drives the three writes: the target pod's ADD admits it as
// the identity's alternate (Admit); the target's node cuts over when the
// guest announces itself there, or an operator does (CutOver); a DEL of
// either pod leaves the migration (leaveMigration): the alternate's
// drops it, the owner's hands the addresses to a live alternate instead
// of keeping them. Every write compares the binding and the records as
// read; a lost race reads them again and decides again, and a write of
// unknown outcome is settled the same way: the next read says whether
// it landed.

// admitted remembers, per target owner, the addresses its admission gave
// it: its endpoint's create finds them here, as an ordinary owner's are
// found in the cache (the records are the source's until the cut-over).
type admitted struct {
	mu    sync.Mutex
	owner map[string][]records.Allocation
}

func (m *admitted) put(o records.Owner, als []records.Allocation) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.owner == nil {
		m.owner = map[string][]records.Allocation{}
	}
	m.owner[o.Key()] = als
}

func (m *admitted) get(o records.Owner) []records.Allocation {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.owner[o.Key()])
}

func (m *admitted) drop(o records.Owner) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.owner, o.Key())
}

// Alternate returns what an admitted migration target holds as its
// identity's alternate (nil if this agent admitted nothing for o).
func (a *Allocator) Alternate(o records.Owner) []records.Allocation { return a.alts.get(o) }

// migrationRead is a binding and its owner's records at its addresses.
type migrationRead struct {
	b    records.Binding
	refs []records.IPRef
	cur  []records.Allocation
}

// readMigration reads identity's binding in ps and, if a pod holds it,
// the records at its addresses (the owner's only: an address held by
// anyone else makes every migration write refuse, as it should).
func (a *Allocator) readMigration(ctx context.Context, ps *planner.Pool, identity string) (migrationRead, bool, error) {
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.Spec().Name, identity)
	if err != nil || !ok {
		return migrationRead{}, false, err
	}
	r := migrationRead{b: b}
	if b.Kept() {
		return r, true, nil
	}
	if r.refs, err = ps.BoundRefs(b); err != nil {
		return migrationRead{}, false, err
	}
	got, err := a.cfg.Store.GetIPs(ctx, r.refs)
	if err != nil {
		return migrationRead{}, false, err
	}
	for _, ref := range r.refs {
		if al, ok := got[ref.Addr]; ok {
			r.cur = append(r.cur, al)
		}
	}
	return r, true, nil
}

// notSelected refuses a migration's target on this node when the pool's
// selector leaves it out (planner.Node.NotSelected), read under mu.
func (a *Allocator) notSelected(ps *planner.Pool, b records.Binding) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n.NotSelected(ps, b)
}

// migrationPool is the pool of a migration's request, read under mu.
func (a *Allocator) migrationPool(name string) (*planner.Pool, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n.Pool(name)
}

// Admit serves the ADD of a migration's target (req.Migration set, and
// req.Sticky): while another live pod holds the identity, req's owner is
// admitted as its alternate and gets the same addresses (Result.Alternate),
// written in one transaction with the owner's records. ok is false when
// there is nothing to migrate from (no binding, a kept one, the same pod
// re-created, or this owner's own): the caller allocates as for any
// sticky request, taking the addresses over. A third pod, or a second
// migration, is refused (ErrIdentityInUse).
func (a *Allocator) Admit(ctx context.Context, req Request) (res Result, ok bool, err error) {
	if req.Migration == "" || req.Sticky == nil {
		return Result{}, false, nil
	}
	ps, err := a.migrationPool(req.Pool)
	if err != nil {
		return Result{}, false, err
	}
	if err := a.ready(); err != nil {
		return Result{}, false, err
	}
	o, id := req.Owner, req.Sticky.Identity
	err = retry.Do(ctx, migrationRetry(a.cfg.WriteRetry), func(ctx context.Context) error {
		r, found, err := a.readMigration(ctx, ps, id)
		switch {
		case err != nil:
			return err
		case !found || r.b.Kept() || r.b.Owner.Key() == o.Key() || planner.StaleBinding(r.b, byAddr(r.cur)) ||
			(r.b.Owner.Namespace == o.Namespace && r.b.Owner.Pod == o.Pod && o.Pod != ""):
			ok = false
			return nil
		case r.b.Alternate != nil && r.b.Alternate.Owner.Key() == o.Key():
			// Admitted already: a retried ADD, or an answer lost.
			res, ok = migrationResult(ps, r.cur), true
			return nil
		}
		if err := a.notSelected(ps, r.b); err != nil {
			return err
		}
		alt := records.Alternate{Owner: o, Node: a.cfg.Node, Since: a.cfg.Now().UTC(), Migration: req.Migration}
		if _, err := a.cfg.Store.Admit(ctx, r.b, r.cur, alt); err != nil {
			if errors.Is(err, records.ErrMigration) && r.b.Alternate != nil {
				// Its alternate is on a live node: a migration in progress.
				return fmt.Errorf("%w: %s is held by pod %s/%s (node %s) and migrating to %s/%s (node %s, migration %q); a third pod cannot join",
					records.ErrIdentityInUse, id, r.b.Owner.Namespace, r.b.Owner.Pod, r.b.Node,
					r.b.Alternate.Owner.Namespace, r.b.Alternate.Owner.Pod, r.b.Alternate.Node, r.b.Alternate.Migration)
			}
			return err // read again: a lost race, or an answer lost
		}
		for i := range r.cur {
			r.cur[i].Alternate = &alt
		}
		res, ok = migrationResult(ps, r.cur), true
		a.log.Info("live migration: admitted as the identity's second, non-forwarding owner", "identity", id, "owner", o.Key(),
			"source", r.b.Owner.Key(), "source_node", r.b.Node, "migration", req.Migration, "ips", r.b.Addrs)
		return nil
	})
	if err != nil {
		return Result{}, false, fmt.Errorf("admit %s as the migration target of %s: %w", o.Key(), id, err)
	}
	if ok {
		a.alts.put(o, res.Allocations)
	}
	return res, ok, nil
}

func migrationResult(ps *planner.Pool, cur []records.Allocation) Result {
	return Result{Pool: ps.Spec().Name, Allocations: slices.Clone(cur), Alternate: true}
}

// CutOver makes o, the alternate of identity in pool, the owner its
// addresses route to, keeping the former owner as the alternate until
// its DEL. It is what the target's node does when the guest announces
// itself there, and what kvipamctl ip migrate --cut-over asks for. Done
// already (o is the owner), it succeeds; o neither owner nor alternate
// is refused (ErrMigration). The node's cache learns the addresses.
func (a *Allocator) CutOver(ctx context.Context, pool, identity string, o records.Owner) error {
	ps, err := a.migrationPool(pool)
	if err != nil {
		return err
	}
	var refs []records.IPRef
	err = retry.Do(ctx, migrationRetry(a.cfg.WriteRetry), func(ctx context.Context) error {
		r, found, err := a.readMigration(ctx, ps, identity)
		switch {
		case err != nil:
			return err
		case found && !r.b.Kept() && r.b.Owner.Key() == o.Key():
			refs = r.refs // done (a retry, or an answer lost)
			return nil
		case !found || r.b.Alternate == nil || r.b.Alternate.Owner.Key() != o.Key():
			return fmt.Errorf("%w: %s is not the alternate of %s (no migration of it to %s in progress)", records.ErrMigration, o.Key(), identity, o.Key())
		}
		if _, err := a.cfg.Store.CutOver(ctx, r.b, r.cur, true); err != nil {
			return err
		}
		refs = r.refs
		a.log.Info("live migration: cut over; this node forwards the identity's addresses", "identity", identity, "owner", o.Key(),
			"from", r.b.Owner.Key(), "from_node", r.b.Node, "ips", r.b.Addrs)
		return nil
	})
	if err != nil {
		return fmt.Errorf("cut over %s to %s: %w", identity, o.Key(), err)
	}
	a.alts.drop(o)
	return a.learn(ctx, refs)
}

// learn folds what etcd holds at refs into the cache: after a cut-over,
// this node's addresses, or another node's.
func (a *Allocator) learn(ctx context.Context, refs []records.IPRef) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	defer a.voice.say()
	// The cut-over's lent home may have reached the announcer before
	// the cache had the addresses: it reads them again (heldchanged.go).
	defer a.held.changed()
	return a.reads.readBack(ctx, refs)
}

// Learn reads the addresses at refs back from etcd into the cache: a
// node whose pod took part in a cut-over that another node made (the
// agent's watch of bindings tells it).
func (a *Allocator) Learn(ctx context.Context, refs []records.IPRef) error { return a.learn(ctx, refs) }

// BoundRefs names the keys of b's addresses, in b's pool as this node
// serves it.
func (a *Allocator) BoundRefs(b records.Binding) ([]records.IPRef, error) {
	ps, err := a.migrationPool(b.Pool)
	if err != nil {
		return nil, err
	}
	return ps.BoundRefs(b)
}

// leave runs leaveMigration from a fresh read of identity's binding, and
// again after a lost race or an answer lost. Called with mu held.
func (a *Allocator) leave(ctx context.Context, ps *planner.Pool, identity string, o records.Owner) (handled bool, err error) {
	var away error
	err = retry.Do(ctx, migrationRetry(a.cfg.WriteRetry), func(ctx context.Context) error {
		r, found, err := a.readMigration(ctx, ps, identity)
		if err != nil || !found {
			handled = false
			return err
		}
		handled, err = a.leaveMigration(ctx, ps, r, o)
		if errors.Is(err, errAlternateAway) {
			// Reading again at once will not bring the node back: the
			// caller's DEL is tried again later.
			away = err
			return nil
		}
		return err
	})
	if err == nil {
		err = away
	}
	return handled, err
}

// migrationRetry is p, retrying an unavailable store too: every
// migration write is settled by reading the binding again.
func migrationRetry(p retry.Policy) retry.Policy {
	if p.Attempts == 0 {
		p = retry.Default
	}
	p.Unavailable = true
	return p
}

func byAddr(als []records.Allocation) map[netip.Addr]records.Allocation {
	out := make(map[netip.Addr]records.Allocation, len(als))
	for _, al := range als {
		out[al.Addr] = al
	}
	return out
}

// leaveMigration is the DEL (or GC) of o, whom b names: as its alternate,
// the alternate goes (DropAlternate); as its owner with an alternate,
// the addresses go to the alternate, which forwards from now on
// (CutOver, the former owner kept by nobody), or, when the alternate's
// node has no live record, the alternate goes and the caller keeps them
// as for any sticky DEL. handled says o's addresses need nothing more.
// Called with mu held.
func (a *Allocator) leaveMigration(ctx context.Context, ps *planner.Pool, r migrationRead, o records.Owner) (handled bool, err error) {
	b := r.b
	switch {
	case b.Kept() || b.Alternate == nil:
		return false, nil
	case b.Alternate.Owner.Key() == o.Key():
		if _, err := a.cfg.Store.DropAlternate(ctx, b, r.cur); err != nil {
			return false, err
		}
		a.alts.drop(o)
		a.log.Info("live migration: the alternate left (its DEL); the owner forwards on", "identity", b.Identity, "alternate", o.Key(),
			"owner", b.Owner.Key(), "node", b.Node)
		return true, nil
	case b.Owner.Key() != o.Key():
		return false, nil
	}
	_, err = a.cfg.Store.CutOver(ctx, b, r.cur, false)
	switch {
	case err == nil:
		a.log.Info("live migration: the forwarding pod left (its DEL); its addresses go to the alternate, which forwards now",
			"identity", b.Identity, "from", o.Key(), "to", b.Alternate.Owner.Key(), "to_node", b.Alternate.Node)
		return true, a.reads.readBack(ctx, r.refs)
	case errors.Is(err, records.ErrAlternateGone):
		// No live record is no proof that the alternate's pod is gone:
		// its node may be cut off from etcd with the pod running there,
		// the VM's only pod now. Dropping it and keeping the addresses
		// for the identity gave them to the VM's next pod while it ran
		// (the chaos run: a duplicate after etcd-cut-mid-migration).
		// The DEL is refused, to be tried again: the alternate's node
		// back, the addresses go to it; the alternate's own DEL, or the
		// operator's node remove with evidence, ends the migration.
		a.log.Warn("live migration: the forwarding pod left and the alternate's node has no live record; refusing the DEL until the alternate's node is back or the alternate leaves",
			"identity", b.Identity, "owner", o.Key(), "alternate", b.Alternate.Owner.Key(), "alternate_node", b.Alternate.Node)
		return false, fmt.Errorf("release %s: the addresses of %s go to its live migration's second owner %s, whose node %s has no live record: %w",
			o.Key(), b.Identity, b.Alternate.Owner.Key(), b.Alternate.Node, errAlternateAway)
	}
	return false, err
}

// keepUnheard keeps for identity id the addresses whose binding and
// records name o their owner while this node's cache holds nothing of o:
// a live migration cut over to o (an operator's cut-over, or the source's
// DEL handing over) while this node was cut off from etcd and did not
// hear of it, its cache still taking the records for the source's. o's
// DEL reads them back and keeps them as any sticky owner's DEL does (or
// hands them to a live alternate: keep). Nothing names o (its records
// lost, the binding stale, or it is not the owner): nothing kept, and
// the caller drops a binding left naming it. Called with mu held.
func (a *Allocator) keepUnheard(ctx context.Context, ps *planner.Pool, id string, o records.Owner) ([]records.Allocation, error) {
	b, ok, err := a.cfg.Store.GetBinding(ctx, ps.Spec().Name, id)
	if err != nil || !ok || b.Kept() || b.Owner.Key() != o.Key() {
		return nil, err
	}
	refs, err := ps.BoundRefs(b)
	if err != nil {
		return nil, nil // an address out of the pool now: dropBinding decides
	}
	if err := a.reads.readBack(ctx, refs); err != nil {
		return nil, fmt.Errorf("release %s: read the addresses of sticky identity %s back: %w", o.Key(), id, err)
	}
	var sticky []*records.Allocation
	for _, al := range ps.OfOwner(o.Key()) {
		if al.Identity == id && al.State == records.StateAllocated {
			sticky = append(sticky, al)
		}
	}
	if len(sticky) == 0 {
		return nil, nil
	}
	a.log.Info("release of a pod whose addresses a cut-over this node did not hear of made its own: read back and kept",
		"owner", o.Key(), "identity", id, "ips", b.Addrs)
	if err := a.keep(ctx, ps, sticky); err != nil {
		return nil, err
	}
	out := make([]records.Allocation, len(sticky))
	for i, al := range sticky {
		out[i] = *al
	}
	return out, nil
}

// errAlternateAway refuses the forwarding owner's DEL while its live
// migration's second owner has no live node record: a DEL to try again.
var errAlternateAway = fmt.Errorf("the alternate's node is away: %w", retry.ErrUnavailable)

// allBound is als with the owner's records at the rest of b's
// addresses, read back: the cache may know only some of them (a live
// migration's cut-over made the owner theirs on another node's write,
// and this node read back only those of its own blocks since). All are
// kept together, or the rest stays the owner's for good.
func (a *Allocator) allBound(ctx context.Context, ps *planner.Pool, b records.Binding, als []*records.Allocation) ([]*records.Allocation, error) {
	var missing []records.IPRef
	refs, err := ps.BoundRefs(b)
	if err != nil {
		return als, nil // out of the pool now: left to kvipamctl check
	}
	for _, ref := range refs {
		if !slices.ContainsFunc(als, func(al *records.Allocation) bool { return al.Addr == ref.Addr }) {
			missing = append(missing, ref)
		}
	}
	if len(missing) == 0 {
		return als, nil
	}
	if err := a.reads.readBack(ctx, missing); err != nil {
		return nil, err
	}
	out := slices.Clone(als)
	for _, ref := range missing {
		if al := ps.At(ref.Addr); al != nil && al.Owner.Key() == b.Owner.Key() && al.Identity == b.Identity && al.State == records.StateAllocated {
			out = append(out, al)
		}
	}
	return out, nil
}
