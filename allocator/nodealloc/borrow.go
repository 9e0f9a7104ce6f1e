package nodealloc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"net/netip"
	"slices"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// Borrowing. A node whose blocks are full and that can claim no block
// takes single addresses from blocks other nodes hold, rather than fail a
// pod while the pool has free addresses. The write is the same
// create-if-absent on the address key that makes every allocation safe,
// so the block's owner and the borrower can never both hold an address;
// instead of the block's claim it is fenced by the borrower's own fence
// key on its node lease (a node whose lease is gone borrows nothing), and
// it needs the block to have a home (a block released meanwhile is not
// written into). With it the store writes the address's home, naming the
// borrower, which every node routes as a host route.
//
// The block's owner learns of a lent address from its failed create or
// its next read of the block, and gets it back when the borrower releases
// it: it reads its blocks again before it claims or borrows anything.
// Blocks are borrowed from fullest first, so that blocks nearly empty can
// still be given back to the pool.

// errOwnRoom says the node's own blocks have room again (a block freed
// for claiming, a lent address returned): plan normally.
var errOwnRoom = errors.New("own blocks have room")

// borrow finds an address of family f for r in another node's block and
// writes it. It ends with the allocation, errOwnRoom, a rich
// ExhaustedError built from one read of the whole pool, or an error.
func (a *Allocator) borrow(ctx context.Context, ps *poolState, r Request, f allocator.Family) (*records.Allocation, error) {
	var got *records.Allocation
	err := retry.Do(ctx, a.cfg.ClaimRetry, func(ctx context.Context) error {
		snap, err := a.cfg.Store.PoolSnapshot(ctx, ps.pool.Name)
		if err != nil {
			return err
		}
		if a.ownRoom(ctx, ps, f, snap) {
			return errOwnRoom
		}
		b, addr, ok := a.lender(ctx, ps, f, snap, r.Owner)
		if !ok {
			return records.ExplainExhausted(ctx, a.cfg.Store, ps.pool, f, snap)
		}
		got, err = a.writeBorrowed(ctx, ps, b, addr, a.newRecord(r, true), r.Reserve)
		return err
	})
	return got, err
}

// ownRoom reports whether the node can serve family f from its own
// blocks after all, as snap shows: a block is free to claim, or an own
// block holds fewer addresses in the store than the node has marked (a
// lent address came back; the block is read again).
func (a *Allocator) ownRoom(ctx context.Context, ps *poolState, f allocator.Family, snap records.PoolSnapshot) bool {
	if ps.hasClaimable(f, snap) {
		return true
	}
	room := false
	for _, b := range ps.servingOwn(f) {
		ob := ps.own[b]
		if len(snap.Used[b]) < ob.ba.Used() {
			if err := a.reloadBlock(ctx, ps, b); err == nil && ob.ba.Free() > 0 {
				room = true
			}
		}
	}
	return room
}

// enumerateLimit is the largest family (in blocks) that hasClaimable
// lists whole; in larger ones the claim loop's walk finds a block.
const enumerateLimit = 1 << 16

// hasClaimable reports whether snap shows a block of family f that a
// claim could take: no claim, no allocations, an address to hand out.
func (ps *poolState) hasClaimable(f allocator.Family, snap records.PoolSnapshot) bool {
	busy := map[netip.Prefix]bool{}
	for _, bi := range snap.Blocks {
		if bi.Claim != nil {
			busy[bi.Block] = true
		}
	}
	for b, used := range snap.Used {
		if len(used) > 0 {
			busy[b] = true
		}
	}
	if ps.pool.BlockCount(f) > enumerateLimit {
		return true // too many to list; the claim loop probes
	}
	bits := ps.pool.BlockSize(f)
	for _, c := range ps.pool.ServingCIDRsOf(f) {
		for i := range allocator.BlockCount(c, bits) {
			b, err := allocator.BlockAt(c, bits, i)
			if err == nil && !busy[b] && len(ps.pool.Excluded(b))+len(ps.pool.ReservedOffsets(b)) < allocator.BlockSize(b) {
				return true
			}
		}
	}
	return false
}

// lendable is another node's block with free addresses, as a borrower
// sees it: how many it holds, and its free addresses.
type lendable struct {
	b    netip.Prefix
	used int
	free []netip.Addr
}

// lendables lists the blocks of family f that live nodes other than me
// claim and that have a free address (none held by an endpoint of this
// node, none of unknown outcome), fullest first, so that blocks nearly
// empty can still be given back to the pool.
func (ps *poolState) lendables(me string, held map[netip.Addr]bool, f allocator.Family, snap records.PoolSnapshot) []lendable {
	var cands []lendable
	for _, bi := range snap.Blocks {
		b := bi.Block
		// Only blocks a live node claims: an orphaned block is its gone
		// node's until kvipamctl node remove frees it whole.
		if _, own := ps.own[b]; own || allocator.FamilyOf(b.Addr()) != f || bi.Claim == nil || bi.Claim.Node == me {
			continue
		}
		if ps.pool.InDraining(b.Addr()) {
			continue // a draining cidr lends nothing new either
		}
		ba, err := allocator.NewBlockAlloc(ps.pool, b)
		if err != nil {
			continue
		}
		for _, u := range snap.Used[b] {
			ba.Mark(u.Addr)
		}
		c := lendable{b: b, used: len(snap.Used[b])}
		for ba.Free() > 0 {
			addr, ok := ba.Next()
			if !ok {
				break
			}
			ba.Mark(addr)
			if _, parked := ps.unknown[addr]; !held[addr] && !parked {
				c.free = append(c.free, addr)
			}
		}
		if len(c.free) > 0 {
			cands = append(cands, c)
		}
	}
	slices.SortFunc(cands, func(x, y lendable) int {
		if c := cmp.Compare(y.used, x.used); c != 0 {
			return c
		}
		return x.b.Addr().Compare(y.b.Addr())
	})
	return cands
}

// maxCoolingProbe bounds the addresses whose last release a borrower
// reads in one round trip, and lenderBlocksProbed the blocks it reads
// them in, before it takes the address released longest ago.
const (
	maxCoolingProbe    = 64
	lenderBlocksProbed = 4
)

// lender picks a free address of family f in another node's block: in
// the fullest block, an address that depends on the owner, so that nodes
// borrowing at once seldom pick the same one. With a reuse cooldown it
// skips addresses released less than the cooldown ago (the pool's, which
// is the lender's too; the lender's cooling addresses live in its memory,
// so the release times come from IP history), and takes the one released
// longest ago only when every candidate is cooling, as the lender itself
// does.
func (a *Allocator) lender(ctx context.Context, ps *poolState, f allocator.Family, snap records.PoolSnapshot, o records.Owner) (netip.Prefix, netip.Addr, bool) {
	cands := ps.lendables(a.cfg.Node, a.heldSet(), f, snap)
	if len(cands) == 0 {
		return netip.Prefix{}, netip.Addr{}, false
	}
	h := fnv.New64a()
	h.Write([]byte(a.cfg.Node + "\x00" + o.Key()))
	seed := h.Sum64()
	cooldown := ps.pool.Cooldown()
	if cooldown <= 0 {
		c := cands[0]
		return c.b, c.free[seed%uint64(len(c.free))], true
	}
	cutoff := a.cfg.Now().Add(-cooldown)
	var oldest netip.Addr
	var oldestBlock netip.Prefix
	var oldestAt time.Time
	for _, c := range cands[:min(len(cands), lenderBlocksProbed)] {
		start := int(seed % uint64(len(c.free)))
		order := append(slices.Clone(c.free[start:]), c.free[:start]...)
		order = order[:min(len(order), maxCoolingProbe)]
		last, err := a.cfg.Store.LastReleased(ctx, ps.pool.Name, order)
		if err != nil {
			a.log.Debug("read release times of lendable addresses; ignoring the cooldown", "pool", ps.pool.Name, "block", c.b, "error", err)
			return c.b, order[0], true
		}
		for _, addr := range order {
			at, released := last[addr]
			if !released || at.Before(cutoff) {
				return c.b, addr, true
			}
			if !oldest.IsValid() || at.Before(oldestAt) {
				oldest, oldestBlock, oldestAt = addr, c.b, at
			}
		}
	}
	return oldestBlock, oldest, true
}

// newRecord is the record of a new allocation for r.
func (a *Allocator) newRecord(r Request, borrowed bool) records.Record {
	state := records.StateAllocated
	if r.Reserve {
		state = records.StateReserved
	}
	rec := records.Record{Owner: r.Owner, Node: a.cfg.Node, State: state, Since: a.cfg.Now().UTC(), Borrowed: borrowed}
	if r.Sticky != nil {
		rec.Identity, rec.WindowSeconds = r.Sticky.Identity, int64(r.Sticky.Window/time.Second)
	}
	return rec
}

// writeBorrowed writes rec at addr of another node's block b, fenced by
// this node's borrow fence, and caches it. A lost race wraps ErrConflict;
// a write of unknown outcome is settled from etcd first.
func (a *Allocator) writeBorrowed(ctx context.Context, ps *poolState, b netip.Prefix, addr netip.Addr, rec records.Record, reserve bool) (*records.Allocation, error) {
	fence, err := a.borrowFence(ctx)
	if err != nil {
		return nil, err
	}
	w := records.IPWrite{Pool: ps.pool.Name, Block: b, ClaimRev: fence, Addr: addr, Record: rec, Reserve: reserve, Borrowed: true}
	res, err := a.cfg.Store.WriteIPs(ctx, []records.IPWrite{w})
	var we *records.WriteError
	switch {
	case err == nil:
		al := &records.Allocation{Record: rec, Pool: ps.pool.Name, Block: b, Addr: addr, Rev: res.Rev, Seen: a.cfg.Now()}
		ps.remember(al, res.Expires)
		a.logAllocated(al)
		return al, nil
	case errors.As(err, &we) && we.FenceLost:
		a.fenceRev = 0
		return nil, fmt.Errorf("borrow %s: %w", addr, errors.Join(records.ErrLeaseLost, err))
	case !outcomeUnknown(err):
		return nil, fmt.Errorf("borrow %s: %w", addr, err)
	}
	a.parkWrites(ps, []records.IPWrite{w})
	if serr := a.settlePending(ctx); serr != nil {
		return nil, serr
	}
	if al := ps.byAddr[addr]; al != nil && sameRecord(al.Record, rec) {
		return al, nil
	}
	return nil, fmt.Errorf("borrow %s: %w", addr, err)
}

// borrowFence returns the revision of this node's borrow fence on its
// current lease, writing the fence the first time.
func (a *Allocator) borrowFence(ctx context.Context) (int64, error) {
	if a.fenceRev != 0 {
		return a.fenceRev, nil
	}
	rev, err := a.cfg.Store.FenceBorrower(ctx, a.claimRecord(), a.lease.ID())
	if err != nil {
		return 0, fmt.Errorf("borrow fence of node %s: %w", a.cfg.Node, err)
	}
	a.fenceRev = rev
	return rev, nil
}

// restoreBorrowed reads back the addresses this node holds in other
// nodes' blocks of ps's pool, at Restore.
func (a *Allocator) restoreBorrowed(ctx context.Context, ps *poolState) error {
	lent, err := a.cfg.Store.ListLent(ctx, ps.pool.Name)
	if err != nil {
		return err
	}
	var refs []records.IPRef
	for addr, node := range lent {
		b, ok := ps.pool.BlockFor(addr)
		if node != a.cfg.Node || !ok {
			continue
		}
		if _, own := ps.own[b]; !own {
			refs = append(refs, records.IPRef{Pool: ps.pool.Name, Block: b, Addr: addr})
		}
	}
	if len(refs) == 0 {
		return nil
	}
	got, err := a.cfg.Store.GetIPs(ctx, refs)
	if err != nil {
		return err
	}
	now := a.cfg.Now()
	for _, al := range got {
		if al.Node != a.cfg.Node || al.ContainerID == "" || al.State == records.StateKept {
			continue
		}
		var exp time.Time
		if al.Lease != 0 {
			if exp, err = a.leaseEnd(ctx, al.Lease); err != nil {
				return err
			}
		}
		al.Seen = now
		ps.remember(&al, exp)
	}
	return nil
}

// reloadLent reads again the own blocks of family f that have lent
// addresses: the borrower may have given some back.
func (a *Allocator) reloadLent(ctx context.Context, ps *poolState, f allocator.Family) {
	blocks := map[netip.Prefix]bool{}
	for addr := range ps.lent {
		if b, ob := ps.ownBlockOf(addr); ob != nil && allocator.FamilyOf(addr) == f {
			blocks[b] = true
		}
	}
	for _, b := range slices.SortedFunc(maps.Keys(blocks), netip.Prefix.Compare) { // read in one order
		if err := a.reloadBlock(ctx, ps, b); err != nil {
			a.log.Warn("reload block with lent addresses", "pool", ps.pool.Name, "block", b, "error", err)
		}
	}
}

// NoteLent applies what the agent's watch saw of a lent address's home
// in one of this node's blocks: another node holds addr (present), or
// gave it back. Either way etcd's create-if-absent stays the guard; this
// only keeps the node's books, and its next choice, right sooner.
//
// rev is the revision the loan was written at: a cached allocation older
// than the loan was taken over (noteLent).
func (a *Allocator) NoteLent(pool string, addr netip.Addr, node string, rev int64, present bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ps := a.pools[pool]
	if ps == nil {
		return
	}
	_, ob := ps.ownBlockOf(addr)
	if ob == nil || node == a.cfg.Node {
		return
	}
	if present {
		if al := ps.noteLent(addr, Loan{Node: node, Rev: rev}); al != nil {
			a.logEnded(al, "taken over by node "+node)
		}
		return
	}
	if _, ok := ps.lent[addr]; ok {
		ps.dropLent(addr)
	}
}

// borrowStatic writes a requested address that lies in a block another
// live node claims (pickStatic said ErrNotOwned, cause): a static request
// may name any address of the pool. An address held there already is
// ErrIPInUse; an orphaned block's is left to its gone node (cause).
func (a *Allocator) borrowStatic(ctx context.Context, ps *poolState, r Request, b netip.Prefix, addr netip.Addr, cause error) (*records.Allocation, error) {
	var ce *records.ClaimError
	other, known := ps.others[b]
	claimed := (errors.As(cause, &ce) && ce.ClaimedBy != "") || (known && other.node != "" && !other.orphaned)
	if !claimed {
		return nil, cause
	}
	if slices.Contains(ps.pool.Excluded(b), addr) {
		return nil, fmt.Errorf("%w: requested ip %s is a network, broadcast or anycast address of pool %s", records.ErrBadRequest, addr, ps.pool.Name)
	}
	al, err := a.writeBorrowed(ctx, ps, b, addr, a.newRecord(r, true), r.Reserve)
	if onlyTaken(err) {
		return nil, fmt.Errorf("requested ip %s is held by another owner: %w", addr, records.ErrIPInUse)
	}
	return al, err
}
