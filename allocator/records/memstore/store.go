// Package memstore is an in-memory records.Store for tests: revisions,
// leases on a fake clock, and the fences and errors of allocator/etcdstore,
// transaction for transaction. It models etcd's semantics, not its keys:
// each kind of record (claim, home, allocation, lent address, borrow
// fence, binding, pool) has a map of its own, and every value is kept as
// JSON, so fields a record does not store (json:"-") are lost as they are
// in etcd, and members a newer version wrote are kept as they are there
// (jsonkeep).
//
// It is held to the same conformance suite as etcdstore
// (allocator/records/storetest): a difference between the two is a
// failing test. Nothing in it sleeps or reads the wall clock: time moves
// only by Advance, so a test on it replays exactly.
package memstore

import (
	"fmt"
	"net/netip"
	"sort"
	"sync"
	"time"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
)

// Store is an in-memory records.Store. It is safe for concurrent use;
// every method is one atomic step under one lock.
type Store struct {
	mu    sync.Mutex
	now   time.Time
	rev   int64 // the store's revision: bumped by each write that changes something
	next  int64 // the next lease ID
	opts  Options
	lease map[int64]*lease
	// due is the earliest a lease or a history record may end (zero:
	// none), so that a call need not look at every lease.
	due time.Time

	pools    map[string]entry
	claims   map[blockKey]entry
	homes    map[blockKey]entry
	ips      ipTable
	lent     map[addrKey]entry
	fences   map[string]entry // borrow fences, by node
	bindings map[bindKey]entry
	history  map[addrKey][]histRec
	deleted  map[string]bool // pools an operator deleted (admin.go)
	down     map[string]bool // nodes with no live record (migration.go)
	// nodeLease is the lease each node's record is on, and marks are
	// the import marks (imports.go).
	nodeLease map[string]int64
	marks     map[markKey]entry

	// The shared reservation lease, as etcdstore's reservationLeases.
	resID      int64
	resGranted time.Time
	resExpires time.Time
}

var _ records.Store = (*Store)(nil)

// Options tune a Store, as etcdstore.Options tune etcd's.
type Options struct {
	// ReservationTTL is the least time a reservation lives. Default 2 minutes.
	ReservationTTL time.Duration
	// HistoryRetention is how long a record of an ended ownership
	// interval is kept. Zero: 7 days; negative: no history.
	HistoryRetention time.Duration
	// Start is the fake clock's first reading. Zero: 2026-01-01 UTC.
	Start time.Time
}

// New returns an empty Store.
func New(o Options) *Store {
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = 2 * time.Minute
	}
	if o.HistoryRetention == 0 {
		o.HistoryRetention = 7 * 24 * time.Hour
	}
	if o.Start.IsZero() {
		o.Start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	return &Store{
		now: o.Start, rev: 1, next: 0x1000, opts: o, lease: map[int64]*lease{},
		pools: map[string]entry{}, claims: map[blockKey]entry{}, homes: map[blockKey]entry{}, ips: ipTable{},
		lent: map[addrKey]entry{}, fences: map[string]entry{}, bindings: map[bindKey]entry{}, history: map[addrKey][]histRec{},
		deleted: map[string]bool{}, marks: map[markKey]entry{},
	}
}

// entry is one stored value with etcd's metadata: its mod revision and
// its lease (0: none).
type entry struct {
	val   []byte
	rev   int64
	lease int64
}

type blockKey struct {
	pool  string
	block netip.Prefix
}

type ipKey struct {
	pool  string
	block netip.Prefix
	addr  netip.Addr
}

type addrKey struct {
	pool string
	addr netip.Addr
}

type bindKey struct{ pool, identity string }

func bk(pool string, b netip.Prefix) blockKey { return blockKey{pool, b.Masked()} }

func ik(pool string, b netip.Prefix, a netip.Addr) ipKey { return ipKey{pool, b.Masked(), a} }

// enc encodes a record, as etcdstore does: with the members a newer
// version wrote that the record does not know (jsonkeep). The records
// are plain structs of strings, numbers, times and addresses: encoding
// cannot fail.
func enc(v any) []byte {
	b, err := jsonkeep.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("memstore: encode %T: %v", v, err))
	}
	return b
}

// dec decodes a value enc wrote.
func dec[T any](e entry) T {
	var v T
	if err := jsonkeep.Unmarshal(e.val, &v); err != nil {
		panic(fmt.Sprintf("memstore: decode %T: %v", v, err))
	}
	return v
}

// modRev is a key's mod revision, 0 when absent: etcd's compare on
// ModRevision.
func modRev[K comparable](m map[K]entry, k K) int64 { return m[k].rev }

// batch is the success branch of one transaction: every write in it gets
// the same revision, and the store's revision moves only if something
// changed (as etcd's).
type batch struct {
	s       *Store
	changed bool
}

func (s *Store) begin() *batch { return &batch{s: s} }

func put[K comparable](b *batch, m map[K]entry, k K, v any, lease int64) {
	b.changed = true
	m[k] = entry{val: enc(v), rev: b.s.rev + 1, lease: lease}
}

func del[K comparable](b *batch, m map[K]entry, k K) bool {
	if _, ok := m[k]; !ok {
		return false
	}
	b.changed = true
	delete(m, k)
	return true
}

// end commits the batch and returns the store's revision after it.
func (b *batch) end() int64 {
	if b.changed {
		b.s.rev++
	}
	return b.s.rev
}

// blockEmpty is etcd's PrefixEmpty on a block's allocations.
func (s *Store) blockEmpty(pool string, b netip.Prefix) bool {
	return len(s.ips[bk(pool, b)]) == 0
}

// Sorting in etcd's key order, so lists come out as etcd's do and a test
// on the store is deterministic.
func sortBlocks(bs []netip.Prefix) {
	sort.Slice(bs, func(i, j int) bool { return allocator.BlockName(bs[i]) < allocator.BlockName(bs[j]) })
}

func sortIPKeys(ks []ipKey) {
	sort.Slice(ks, func(i, j int) bool {
		a, b := ks[i], ks[j]
		if a.pool != b.pool {
			return a.pool+"/" < b.pool+"/"
		}
		if a.block != b.block {
			return allocator.BlockName(a.block)+"/" < allocator.BlockName(b.block)+"/"
		}
		return a.addr.String() < b.addr.String()
	})
}

// maxTxnOps is etcd's default --max-txn-ops: the most compares, and the
// most operations in each branch, one transaction may hold. etcd refuses
// a larger one whole, with an error of its own (no kvipam sentinel: it
// is neither a lost race nor an unavailable etcd).
const maxTxnOps = 128

// checkTxnSize refuses a transaction etcd would refuse for its size.
func checkTxnSize(cmps, ops int) error {
	if cmps > maxTxnOps || ops > maxTxnOps {
		return fmt.Errorf("etcdserver: too many operations in txn request (%d compares, %d operations, at most %d each)", cmps, ops, maxTxnOps)
	}
	return nil
}

// historyOps is how many history puts ending n intervals adds to a
// transaction.
func (s *Store) historyOps(n int) int {
	if s.opts.HistoryRetention < 0 {
		return 0
	}
	return n
}

// Rev is the store's revision.
func (s *Store) Rev() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rev
}
