package memstore

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// ListIPs implements records.Store, in address order (as etcd's keys).
func (s *Store) ListIPs(_ context.Context, pool string, b netip.Prefix) ([]records.Allocation, error) {
	s.lock()
	defer s.mu.Unlock()
	keys := s.ips.keys(pool, b.Masked())
	out := make([]records.Allocation, 0, len(keys))
	for _, k := range keys {
		out = append(out, s.allocation(k))
	}
	return out, nil
}

func (s *Store) allocation(k ipKey) records.Allocation {
	e, _ := s.ips.get(k)
	return records.Allocation{Record: dec[records.Record](e), Pool: k.pool, Block: k.block, Addr: k.addr, Rev: e.rev, Lease: e.lease}
}

// GetIPs implements records.Store.
func (s *Store) GetIPs(_ context.Context, refs []records.IPRef) (map[netip.Addr]records.Allocation, error) {
	s.lock()
	defer s.mu.Unlock()
	out := map[netip.Addr]records.Allocation{}
	for _, r := range refs {
		k := ik(r.Pool, r.Block, r.Addr)
		if _, ok := s.ips.get(k); ok {
			out[r.Addr] = s.allocation(k)
		}
	}
	return out, nil
}

// WriteIPs implements records.Store.
func (s *Store) WriteIPs(_ context.Context, writes []records.IPWrite) (records.WriteResult, error) {
	s.lock()
	defer s.mu.Unlock()
	return s.writeIPs(writes, nil, nil)
}

// writeIPs is etcdstore's writeIPs: every write fenced by its block's
// claim (or, borrowed, by the writer's borrow fence and the block's
// home), a create by the address's absence and a confirm by its
// revision; guard and also are a caller's extra compare and writes (a
// binding), ended the intervals the batch ends (IP history). As in
// etcdstore a fence key is compared once, at the revision of the first
// write that names it.
func (s *Store) writeIPs(writes []records.IPWrite, guard func() bool, also func(tx *batch), ended ...histRec) (records.WriteResult, error) {
	var res records.WriteResult
	if len(writes) == 0 && also == nil {
		return res, nil
	}
	var resLease int64
	for _, w := range writes {
		if w.Reserve && w.PrevRev == 0 {
			resLease, res.Expires = s.reservationLease()
			break
		}
	}
	ok := guard == nil || guard()
	claimSeen, fenceSeen, homeSeen := map[blockKey]bool{}, map[string]bool{}, map[blockKey]bool{}
	seen := map[ipKey]bool{}
	dup := false
	for _, w := range writes {
		key := bk(w.Pool, w.Block)
		if w.Borrowed {
			if !fenceSeen[w.Record.Node] {
				fenceSeen[w.Record.Node] = true
				ok = ok && modRev(s.fences, w.Record.Node) == w.ClaimRev
			}
			if !homeSeen[key] {
				homeSeen[key] = true
				ok = ok && modRev(s.homes, key) != 0
			}
		} else if !claimSeen[key] {
			claimSeen[key] = true
			ok = ok && modRev(s.claims, key) == w.ClaimRev
		}
		k := ik(w.Pool, w.Block, w.Addr)
		dup = dup || seen[k]
		seen[k] = true
		ok = ok && s.ips.rev(k) == w.PrevRev // 0: absent
	}
	// etcd counts the compares and the puts before it applies any.
	cmps, ops := len(claimSeen)+len(fenceSeen)+len(homeSeen)+len(writes), len(writes)+s.historyOps(len(ended))
	if guard != nil {
		cmps++
	}
	if also != nil {
		ops++
	}
	for _, w := range writes {
		if w.Borrowed || (w.PrevRev != 0 && w.Record.Identity != "") {
			ops++ // the lent address's home, put or deleted
		}
	}
	if err := checkTxnSize(cmps, ops); err != nil {
		return res, fmt.Errorf("write %d allocations: %w", len(writes), err)
	}
	if dup {
		// etcd refuses a transaction that puts one key twice, with an
		// error of its own.
		return res, fmt.Errorf("write %d allocations: etcdserver: duplicate key given in txn request", len(writes))
	}
	if !ok {
		return res, s.explainWrite(writes)
	}
	if !s.live(resLease) {
		s.dropReservationLease(resLease)
		return res, fmt.Errorf("reservation lease gone: %w", retry.ErrConflict)
	}
	tx := s.begin()
	for _, w := range writes {
		var l int64
		if w.Reserve && w.PrevRev == 0 {
			l = resLease
		}
		s.ips.put(tx, ik(w.Pool, w.Block, w.Addr), w.Record, l)
		switch {
		case w.Borrowed:
			h := records.Home{Node: w.Record.Node, Since: w.Record.Since}
			if w.PrevRev != 0 {
				h = s.lentHome(addrKey{w.Pool, w.Addr}, w.Record.Node, w.Record.Since)
			}
			put(tx, s.lent, addrKey{w.Pool, w.Addr}, h, l)
		case w.PrevRev != 0 && w.Record.Identity != "":
			// A kept address taken over in the writer's own block: it
			// is no longer lent to anyone.
			del(tx, s.lent, addrKey{w.Pool, w.Addr})
		}
	}
	if also != nil {
		also(tx)
	}
	s.record(tx, ended...)
	res.Rev = tx.end()
	return res, nil
}

// explainWrite is etcdstore's: which checks of a failed write failed.
func (s *Store) explainWrite(writes []records.IPWrite) error {
	we := &records.WriteError{}
	fenced := map[netip.Prefix]bool{}
	for _, w := range writes {
		key := bk(w.Pool, w.Block)
		ip := s.ips.rev(ik(w.Pool, w.Block, w.Addr))
		taken := (w.PrevRev == 0 && ip != 0) || (w.PrevRev != 0 && ip != w.PrevRev)
		switch {
		case w.Borrowed && modRev(s.fences, w.Record.Node) != w.ClaimRev:
			we.FenceLost = true
		case w.Borrowed && modRev(s.homes, key) == 0 && !fenced[w.Block]:
			fenced[w.Block] = true
			we.Fenced = append(we.Fenced, w.Block)
		case !w.Borrowed && modRev(s.claims, key) != w.ClaimRev && !fenced[w.Block]:
			fenced[w.Block] = true
			we.Fenced = append(we.Fenced, w.Block)
		}
		if taken {
			we.Taken = append(we.Taken, w.Addr)
		}
	}
	if len(we.Fenced) == 0 && len(we.Taken) == 0 && !we.FenceLost {
		return fmt.Errorf("write allocations: changed concurrently: %w", retry.ErrConflict)
	}
	return we
}

// DeleteIP implements records.Store as etcdstore's: the delete guarded by
// al.Rev, a borrowed address's home and the record of the interval that
// ends with it; a sticky address released, not kept, takes with it the
// binding that names al's owner, and a key already gone takes the
// binding alone if nothing else changed.
func (s *Store) DeleteIP(_ context.Context, al records.Allocation) error {
	k := ik(al.Pool, al.Block, al.Addr)
	if al.Rev <= 0 {
		return fmt.Errorf("delete %s %s: %w: no revision to guard the delete", al.Pool, al.Addr, records.ErrBadRequest)
	}
	s.lock()
	defer s.mu.Unlock()
	var bound *bindKey
	var boundRev int64
	if al.Identity != "" && al.State != records.StateKept {
		key := bindKey{al.Pool, al.Identity}
		if e, ok := s.bindings[key]; ok {
			if b := dec[records.Binding](e); !b.Kept() && b.Owner.Key() == al.Owner.Key() {
				bound, boundRev = &key, e.rev
			}
		}
	}
	cur, exists := s.ips.get(k)
	if !exists {
		// Gone already: the binding names a container that holds
		// nothing there (etcdstore's DropStaleBinding, a lost race
		// ignored).
		if bound != nil && modRev(s.bindings, *bound) == boundRev {
			tx := s.begin()
			del(tx, s.bindings, *bound)
			tx.end()
		}
		return nil
	}
	if cur.rev != al.Rev {
		return fmt.Errorf("delete %s at revision %d: changed: %w", al.Addr, al.Rev, retry.ErrConflict)
	}
	tx := s.begin()
	s.ips.del(tx, k)
	if al.Borrowed {
		del(tx, s.lent, addrKey{al.Pool, al.Addr})
	}
	if bound != nil {
		del(tx, s.bindings, *bound)
	}
	s.record(tx, s.historyOf(al, s.now, endReleased))
	tx.end()
	return nil
}

// RecordLapsed implements records.Store as etcdstore's.
func (s *Store) RecordLapsed(_ context.Context, al records.Allocation, end time.Time) (bool, error) {
	s.lock()
	defer s.mu.Unlock()
	if s.opts.HistoryRetention < 0 {
		return true, nil
	}
	e, ok := s.ips.get(ik(al.Pool, al.Block, al.Addr))
	switch {
	case !ok:
	case e.rev == al.Rev:
		return false, nil // not lapsed yet
	case dec[records.Record](e).Owner.Key() == al.Owner.Key():
		return true, nil // confirmed in time: nothing ended
	}
	tx := s.begin()
	s.record(tx, s.historyOf(al, end, endLapsed))
	tx.end()
	return true, nil
}
