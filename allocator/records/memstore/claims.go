package memstore

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// ListBlocks implements records.Store: the claims in block-name order,
// then the blocks that have only a home, as etcdstore joins them.
func (s *Store) ListBlocks(_ context.Context, pool string) ([]records.BlockInfo, error) {
	s.lock()
	defer s.mu.Unlock()
	return s.blockInfos(pool, nil), nil
}

// blockInfos joins the claims and homes of pool's blocks (only those of
// only, when it is not nil) as etcdstore's blockInfos does.
func (s *Store) blockInfos(pool string, only map[netip.Prefix]bool) []records.BlockInfo {
	var claimed, homed []netip.Prefix
	for k := range s.claims {
		if k.pool == pool && (only == nil || only[k.block]) {
			claimed = append(claimed, k.block)
		}
	}
	for k := range s.homes {
		if k.pool == pool && (only == nil || only[k.block]) {
			homed = append(homed, k.block)
		}
	}
	sortBlocks(claimed)
	sortBlocks(homed)
	byBlock := map[netip.Prefix]*records.BlockInfo{}
	var order []netip.Prefix
	get := func(b netip.Prefix) *records.BlockInfo {
		bi, ok := byBlock[b]
		if !ok {
			bi = &records.BlockInfo{Block: b}
			byBlock[b] = bi
			order = append(order, b)
		}
		return bi
	}
	for _, b := range claimed {
		e := s.claims[bk(pool, b)]
		c := dec[records.Claim](e)
		bi := get(b)
		bi.Claim, bi.ClaimRev, bi.ClaimLease = &c, e.rev, e.lease
	}
	for _, b := range homed {
		e := s.homes[bk(pool, b)]
		h := dec[records.Home](e)
		bi := get(b)
		bi.Home, bi.HomeRev = &h, e.rev
	}
	out := make([]records.BlockInfo, 0, len(order))
	for _, b := range order {
		out = append(out, *byBlock[b])
	}
	return out
}

// PeekBlocks implements records.Store: the memory store has one state,
// so it answers as GetBlocks.
func (s *Store) PeekBlocks(ctx context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	return s.GetBlocks(ctx, pool, blocks)
}

// GetBlocks implements records.Store.
func (s *Store) GetBlocks(_ context.Context, pool string, blocks []netip.Prefix) (map[netip.Prefix]records.BlockInfo, error) {
	s.lock()
	defer s.mu.Unlock()
	only := map[netip.Prefix]bool{}
	for _, b := range blocks {
		only[b.Masked()] = true
	}
	out := map[netip.Prefix]records.BlockInfo{}
	for _, bi := range s.blockInfos(pool, only) {
		out[bi.Block] = bi
	}
	return out, nil
}

// Claim implements records.Store as etcdstore's one transaction: "claim
// absent, block empty (and the pool spec at c.PoolRev)", then the claim
// on lease, the home, and c.First (a reservation on the shared lease).
func (s *Store) Claim(_ context.Context, pool string, b netip.Prefix, c records.Claim, lease int64) (records.WriteResult, error) {
	var res records.WriteResult
	w := c.First
	if w != nil && (w.Block != b || w.Pool != pool || !b.Contains(w.Addr) || w.Borrowed || w.PrevRev != 0) {
		return res, fmt.Errorf("%w: claim block %s of pool %s: the first allocation %s of pool %s block %s must be a new one of the block", records.ErrBadRequest, b, pool, w.Addr, w.Pool, w.Block)
	}
	s.lock()
	defer s.mu.Unlock()
	var resLease int64
	if w != nil && w.Reserve {
		resLease, res.Expires = s.reservationLease()
	}
	key := bk(pool, b)
	_, claimed := s.claims[key]
	ok := !claimed && s.blockEmpty(pool, b)
	if c.PoolRev != 0 {
		ok = ok && modRev(s.pools, pool) == c.PoolRev
	}
	if !ok {
		return records.WriteResult{}, s.claimError(pool, b, c.PoolRev)
	}
	// etcd checks the leases of the branch taken, after the compares.
	if !s.live(resLease) {
		s.dropReservationLease(resLease)
		return records.WriteResult{}, fmt.Errorf("claim block %s of pool %s: reservation lease gone: %w", b, pool, retry.ErrConflict)
	}
	if !s.live(lease) {
		return records.WriteResult{}, fmt.Errorf("claim block %s of pool %s: %w", b, pool, leaseLost(lease))
	}
	tx := s.begin()
	put(tx, s.claims, key, c, lease)
	put(tx, s.homes, key, records.Home{Node: c.Node, Since: c.ClaimedAt}, 0)
	if w != nil {
		s.ips.put(tx, ik(pool, b, w.Addr), w.Record, resLease)
	}
	res.Rev = tx.end()
	return res, nil
}

// leaseLost is etcd's refusal of a put on a lease it does not know,
// as etcdstore reports it: the node's lease expired.
func leaseLost(id int64) error {
	return fmt.Errorf("%w: lease %x not found", records.ErrLeaseLost, id)
}

// claimError explains a failed claim, from what etcdstore's Else reads.
func (s *Store) claimError(pool string, b netip.Prefix, poolRev int64) error {
	key := bk(pool, b)
	ce := &records.ClaimError{Block: b}
	if poolRev != 0 {
		ce.PoolChanged = modRev(s.pools, pool) != poolRev
	}
	if e, ok := s.claims[key]; ok {
		ce.ClaimedBy = dec[records.Claim](e).Node
		ce.ClaimRev, ce.ClaimLease = e.rev, e.lease
	}
	ce.NonEmpty = !s.blockEmpty(pool, b)
	if e, ok := s.homes[key]; ok {
		ce.HomeNode = dec[records.Home](e).Node
	}
	return ce
}

// Reclaim implements records.Store: the home must be c.Node's, unchanged
// since prev, and the claim absent or unchanged since prev.
func (s *Store) Reclaim(_ context.Context, pool string, prev records.BlockInfo, c records.Claim, lease int64) (int64, error) {
	b := prev.Block
	if prev.Home == nil || prev.Home.Node != c.Node {
		return 0, fmt.Errorf("reclaim block %s: home is not node %s: %w", b, c.Node, records.ErrNotOwned)
	}
	s.lock()
	defer s.mu.Unlock()
	key := bk(pool, b)
	claimOK := modRev(s.claims, key) == 0
	if prev.Claim != nil {
		claimOK = modRev(s.claims, key) == prev.ClaimRev
	}
	if !claimOK || modRev(s.homes, key) != prev.HomeRev {
		return 0, s.claimError(pool, b, 0)
	}
	if !s.live(lease) {
		return 0, fmt.Errorf("reclaim block %s of pool %s: %w", b, pool, leaseLost(lease))
	}
	if prev.Claim != nil {
		c.Unknown = prev.Claim.Unknown // rewritten, as etcdstore does
	}
	tx := s.begin()
	put(tx, s.claims, key, c, lease)
	return tx.end(), nil
}

// Unclaim implements records.Store: the claim (at claimRev; 0 means
// absent, as etcd's compare on a mod revision) and the home go, if the
// block is empty.
func (s *Store) Unclaim(_ context.Context, pool string, b netip.Prefix, claimRev int64) error {
	s.lock()
	defer s.mu.Unlock()
	key := bk(pool, b)
	if modRev(s.claims, key) != claimRev || !s.blockEmpty(pool, b) {
		return fmt.Errorf("release block %s of pool %s: claim changed or block not empty: %w", b, pool, retry.ErrConflict)
	}
	tx := s.begin()
	del(tx, s.claims, key)
	del(tx, s.homes, key)
	tx.end()
	return nil
}
