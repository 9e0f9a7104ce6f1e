package memstore

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
)

// FenceBorrower implements records.Store: the node's borrow fence put on
// lease, or found there already (its own write, answer lost), or moved
// there from an older lease of the node.
func (s *Store) FenceBorrower(_ context.Context, c records.Claim, lease int64) (int64, error) {
	s.lock()
	defer s.mu.Unlock()
	if e, ok := s.fences[c.Node]; ok && e.lease == lease {
		return e.rev, nil
	}
	if !s.live(lease) {
		return 0, fmt.Errorf("borrow fence of node %s: %w", c.Node, leaseLost(lease))
	}
	if e, ok := s.fences[c.Node]; ok {
		c.Unknown = dec[records.Claim](e).Unknown // moved, as etcdstore does
	}
	tx := s.begin()
	put(tx, s.fences, c.Node, c, lease)
	return tx.end(), nil
}

// lentHome is the home of a lent address that node holds since: the
// one at k rewritten, if any, as etcdstore rewrites it.
func (s *Store) lentHome(k addrKey, node string, since time.Time) records.Home {
	var h records.Home
	if e, ok := s.lent[k]; ok {
		h = dec[records.Home](e)
	}
	h.Node, h.Since = node, since
	return h
}

// ListLent implements records.Store.
func (s *Store) ListLent(_ context.Context, pool string) (map[netip.Addr]string, error) {
	s.lock()
	defer s.mu.Unlock()
	return s.lentOf(pool), nil
}

func (s *Store) lentOf(pool string) map[netip.Addr]string {
	out := map[netip.Addr]string{}
	for k, e := range s.lent {
		if k.pool == pool {
			out[k.addr] = dec[records.Home](e).Node
		}
	}
	return out
}

// PoolSnapshot implements records.Store: claims, homes, lent addresses
// and allocated addresses of a pool at one revision.
func (s *Store) PoolSnapshot(_ context.Context, pool string) (records.PoolSnapshot, error) {
	s.lock()
	defer s.mu.Unlock()
	snap := records.PoolSnapshot{Rev: s.rev, Blocks: s.blockInfos(pool, nil), Used: map[netip.Prefix][]records.UsedAddr{}, Lent: s.lentOf(pool)}
	for _, k := range s.ips.keys(pool, netip.Prefix{}) {
		e, _ := s.ips.get(k)
		snap.Used[k.block] = append(snap.Used[k.block], records.UsedAddr{Addr: k.addr, Lease: e.lease})
	}
	return snap, nil
}
