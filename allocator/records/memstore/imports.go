package memstore

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// An import's writes (records.Importer), each one step as etcdstore's
// are one transaction each. A node's record is modelled by the lease it
// is on (NodeOnLease) and NodeDown; the cluster's schema level is not
// (every node learns imports).

var _ records.Importer = (*Store)(nil)

type markKey struct {
	node, source, pool string
	block              netip.Prefix
}

// NodeOnLease gives node a live record on lease, as its agent's start
// writes it: an import for node compares it.
func (s *Store) NodeOnLease(node string, lease int64) {
	s.lock()
	defer s.mu.Unlock()
	if s.nodeLease == nil {
		s.nodeLease = map[string]int64{}
	}
	s.nodeLease[node] = lease
	if s.down != nil {
		delete(s.down, node)
	}
}

// ImportBlock implements records.Importer as etcdstore's one transaction.
func (s *Store) ImportBlock(_ context.Context, b records.ImportBlock) (int64, error) {
	what := fmt.Sprintf("import block %s of pool %s for node %s", b.Block, b.Pool, b.Claimant)
	if puts, cmps := b.Ops(); puts > maxTxnOps || cmps > maxTxnOps {
		return 0, fmt.Errorf("%w: %s: %d puts and %d compares", records.ErrImportTooBig, what, puts, cmps)
	}
	for _, ip := range b.IPs {
		if !b.Block.Contains(ip.Addr) || ip.Record.Imported == "" || ip.Record.State != records.StateAllocated {
			return 0, fmt.Errorf("%w: %s: %s is not an imported allocation of the block", records.ErrBadRequest, what, ip.Addr)
		}
		if _, ok := b.Borrowers[ip.Record.Node]; ip.Record.Borrowed && !ok {
			return 0, fmt.Errorf("%w: %s: borrowed %s of node %s has no fence", records.ErrBadRequest, what, ip.Addr, ip.Record.Node)
		}
	}
	s.lock()
	defer s.mu.Unlock()
	if s.nodeLease[b.Claimant] != b.Lease || s.down[b.Claimant] || !s.live(b.Lease) {
		return 0, fmt.Errorf("%s: the node's agent is not on lease %x any more (restarted or gone): %w", what, b.Lease, errors.Join(records.ErrLeaseLost, retry.ErrConflict))
	}
	key := bk(b.Pool, b.Block)
	ok := modRev(s.pools, b.Pool) == b.PoolRev
	if b.ClaimRev == 0 {
		_, claimed := s.claims[key]
		ok = ok && !claimed && s.blockEmpty(b.Pool, b.Block)
	} else {
		ok = ok && modRev(s.claims, key) == b.ClaimRev && s.claims[key].lease == b.Lease
	}
	for n, f := range b.Borrowers {
		ok = ok && modRev(s.fences, n) == f.Rev
	}
	for _, ip := range b.IPs {
		ok = ok && s.ips.rev(ik(b.Pool, b.Block, ip.Addr)) == 0
		if ip.Record.Borrowed {
			_, lent := s.lent[addrKey{b.Pool, ip.Addr}]
			ok = ok && !lent
		}
	}
	for _, m := range b.Marks {
		ok = ok && modRev(s.marks, markKey{m.Node, m.Source, m.Pool, m.Block}) == m.Rev
	}
	if !ok {
		return 0, fmt.Errorf("%s: the block, an address, a fence, a mark, the pool or the schema level changed since the plan: %w", what, retry.ErrConflict)
	}
	tx := s.begin()
	if b.ClaimRev == 0 {
		put(tx, s.claims, key, records.Claim{Node: b.Claimant, BootID: b.BootID, ClaimedAt: s.now}, b.Lease)
		put(tx, s.homes, key, records.Home{Node: b.Claimant, Since: s.now}, 0)
	}
	for _, ip := range b.IPs {
		s.ips.put(tx, ik(b.Pool, b.Block, ip.Addr), ip.Record, 0)
		if ip.Record.Borrowed {
			put(tx, s.lent, addrKey{b.Pool, ip.Addr}, records.Home{Node: ip.Record.Node, Since: ip.Record.Since}, 0)
		}
	}
	for _, m := range b.Marks {
		put(tx, s.marks, markKey{m.Node, m.Source, m.Pool, m.Block}, m, 0)
	}
	return tx.end(), nil
}

// ListImportMarks implements records.Importer.
func (s *Store) ListImportMarks(context.Context) ([]records.ImportMark, error) {
	s.lock()
	defer s.mu.Unlock()
	return s.marksOf(""), nil
}

// marksOf lists the marks of source (every source's when empty), in
// etcd's key order.
func (s *Store) marksOf(source string) []records.ImportMark {
	keys := make([]markKey, 0, len(s.marks))
	for k := range s.marks {
		if source == "" || k.source == source {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		return fmt.Sprint(a.node, "/", a.source, "/", a.pool, "/", a.block) < fmt.Sprint(b.node, "/", b.source, "/", b.pool, "/", b.block)
	})
	out := make([]records.ImportMark, 0, len(keys))
	for _, k := range keys {
		m := dec[records.ImportMark](s.marks[k])
		m.Rev = s.marks[k].rev
		out = append(out, m)
	}
	return out
}

// FinalizeImport implements records.Importer: the source's marks go in
// one step (etcdstore's take one transaction per 127 marks).
func (s *Store) FinalizeImport(_ context.Context, source string) ([]records.ImportMark, error) {
	if source == "" || slices.Contains([]rune(source), '/') {
		return nil, fmt.Errorf("%w: import source %q: empty or with a slash", records.ErrBadRequest, source)
	}
	s.lock()
	defer s.mu.Unlock()
	out := s.marksOf(source)
	tx := s.begin()
	for _, m := range out {
		del(tx, s.marks, markKey{m.Node, m.Source, m.Pool, m.Block})
	}
	tx.end()
	return out, nil
}

// BorrowFences reads every node's borrow fence, with its revision and
// lease, as etcdstore's does.
func (s *Store) BorrowFences(context.Context) (map[string]records.BorrowFence, error) {
	s.lock()
	defer s.mu.Unlock()
	out := map[string]records.BorrowFence{}
	for n, e := range s.fences {
		out[n] = records.BorrowFence{Rev: e.rev, Lease: e.lease}
	}
	return out, nil
}
