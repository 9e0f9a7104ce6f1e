package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/jsonkeep"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

// IP history. etcd's own MVCC history cannot answer "who had 10.244.3.17
// at 14:02 yesterday": an etcd shared with Kubernetes is compacted every
// five minutes, and a restore rewinds it. So when an ownership interval
// ends, a record of it is written in the same transaction as the release,
// under its own prefix, on a retention lease: etcd deletes old records by
// itself. The live allocation is the interval still open.

// DefaultHistoryRetention is how long history records are kept unless
// Options.HistoryRetention says otherwise.
const DefaultHistoryRetention = 7 * 24 * time.Hour

// HistoryRecord is one ended ownership interval of an address.
type HistoryRecord struct {
	Pool string `json:"pool"`
	IP   string `json:"ip"`
	records.Owner
	Node  string    `json:"node"`
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`
	// Reason is how the interval ended: released (a DEL or GC by the
	// owner's node), reservation-lapsed (an ADD that never finished),
	// node-remove or operator-release (an operator's audited release),
	// kept-for-identity or taken-over-by-identity (sticky identities),
	// migrated or alternate-ended (live migration: the forwarding owner
	// moved on at the cut-over; the second owner left).
	Reason string `json:"reason"`
	// Unknown: members this version does not know (jsonkeep).
	jsonkeep.Unknown `json:"-"`
}

// Reasons an interval ends.
const (
	EndReleased        = "released"
	EndLapsed          = "reservation-lapsed"
	EndNodeRemove      = "node-remove"
	EndOperatorRelease = "operator-release"
	// EndKept: a sticky pod's DEL; the address is kept for its identity.
	EndKept = "kept-for-identity"
	// EndTakenOver: a sticky identity's next pod took the address over
	// from a pod whose DEL had not reached etcd (its node was cut off, or
	// the DEL was queued).
	EndTakenOver = "taken-over-by-identity"
	// EndMigrated: a live migration's cut-over; the address went on
	// with the identity's pod on the target node.
	EndMigrated = "migrated"
	// EndAlternateEnded: a live migration's second, non-forwarding owner
	// left (its DEL, or the migration failed).
	EndAlternateEnded = "alternate-ended"
)

// HistoryOf is the record of al's interval ending at end.
func HistoryOf(al records.Allocation, end time.Time, reason string) HistoryRecord {
	return HistoryRecord{Pool: al.Pool, IP: al.Addr.String(), Owner: al.Owner, Node: al.Node,
		Start: al.Since.UTC(), End: end.UTC(), Reason: reason}
}

// HistoryPrefix lists every history record.
func HistoryPrefix() string { return Prefix + "history/" }

// ipHistoryPrefix lists the history of one address.
func ipHistoryPrefix(pool string, addr netip.Addr) string {
	return HistoryPrefix() + pool + "/" + addr.String() + "/"
}

// historyKey is one record: under its address, ordered by end time (a
// fixed-width number, so that key order is time order), then by owner.
func historyKey(r HistoryRecord, addr netip.Addr) string {
	return fmt.Sprintf("%s%020d-%s-%s", ipHistoryPrefix(r.Pool, addr), r.End.UnixNano(), r.ContainerID, r.IfName)
}

// HistoryRecorder writes history records on retention leases. It shares
// one lease among the records whose intervals ended in the same time
// bucket (an hour, or the retention if shorter), so that a record costs no
// extra round trip and etcd deletes a bucket's records together. A lease
// lives for the retention past the end of its bucket. A nil recorder
// records nothing (history off). It is safe for concurrent use.
type HistoryRecorder struct {
	leases    LeaseGranter
	retention time.Duration
	mu        sync.Mutex
	byBucket  map[int64]clientv3.LeaseID
	// aheadWithin spreads Ahead's grants: each starts at a random time
	// within it (DefaultHistoryAheadWithin), so that nodes starting
	// together do not grant together; zero starts them at once.
	aheadWithin time.Duration
	// scheduled are Ahead's grants not started yet; a record that needs
	// the lease meanwhile grants it itself and cancels the one scheduled.
	scheduled map[int64]*time.Timer
	// granting are the buckets whose lease Ahead is granting: a channel
	// closed when the grant ends.
	granting map[int64]chan struct{}
}

// LeaseGranter grants leases (*clientv3.Client does).
type LeaseGranter interface {
	Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error)
}

// NewHistoryRecorder returns a recorder keeping records for retention;
// nil (no history) when retention is not positive.
func NewHistoryRecorder(l LeaseGranter, retention time.Duration) *HistoryRecorder {
	if retention <= 0 {
		return nil
	}
	return &HistoryRecorder{leases: l, retention: retention, aheadWithin: DefaultHistoryAheadWithin}
}

// DefaultHistoryAheadWithin is the time within which Ahead's grant
// starts, at random. Every node of a cluster starting at once allocates
// at once: granting the history lease at each node's first allocation put
// a raft write a node into the cold start, and measured with 10,000 nodes
// on three members it cost the storm a fifth of its time and four in five
// of its try-agains (docs/scale.md). A release in the first minute after
// a node's first allocation grants its lease on its own path, as it did
// before Ahead.
const DefaultHistoryAheadWithin = time.Minute

func (h *HistoryRecorder) bucket() time.Duration { return min(time.Hour, h.retention) }

// lease returns the lease for records ending at end: the bucket's, granted
// now if neither it nor Ahead has been, or once Ahead's grant ends.
func (h *HistoryRecorder) lease(ctx context.Context, end time.Time) (clientv3.LeaseID, error) {
	b := end.Truncate(h.bucket()).UnixNano()
	h.mu.Lock()
	defer h.mu.Unlock()
	if t, ok := h.scheduled[b]; ok {
		t.Stop() // granted here, now; the scheduled grant finds itself gone
		delete(h.scheduled, b)
	}
	for {
		if id, ok := h.byBucket[b]; ok {
			return id, nil
		}
		ch, busy := h.granting[b]
		if !busy {
			break
		}
		h.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			h.mu.Lock()
			return 0, fmt.Errorf("grant history lease: %w", kvstore.Unavailable(ctx.Err()))
		}
		h.mu.Lock()
	}
	id, err := h.grant(ctx, b)
	if err != nil {
		return 0, err
	}
	h.keep(b, id)
	return id, nil
}

// grant grants bucket b's lease: it lives for the retention past the
// bucket's end.
func (h *HistoryRecorder) grant(ctx context.Context, b int64) (clientv3.LeaseID, error) {
	ttl := time.Until(time.Unix(0, b).Add(h.bucket())) + h.retention
	resp, err := h.leases.Grant(ctx, int64((ttl+time.Second-1)/time.Second))
	if err != nil {
		return 0, fmt.Errorf("grant history lease: %w", kvstore.Unavailable(err))
	}
	return resp.ID, nil
}

// keep remembers id as bucket b's lease, with mu held, and forgets the
// leases of buckets before the one before b: no record ends there now.
func (h *HistoryRecorder) keep(b int64, id clientv3.LeaseID) {
	if h.byBucket == nil {
		h.byBucket = map[int64]clientv3.LeaseID{}
	}
	for old := range h.byBucket {
		if old < b-int64(h.bucket()) {
			delete(h.byBucket, old)
		}
	}
	h.byBucket[b] = id
}

// historyAheadTimeout bounds a grant made ahead, which no caller's
// context bounds.
const historyAheadTimeout = 10 * time.Second

// Ahead grants, in the background, the lease that records ending now go
// on if it is not granted yet, and in the last tenth of a bucket the next
// bucket's: a node that allocates grants the lease its releases will
// need before they come, so a DEL does not wait for a lease grant (a raft
// write) on its answer path, once an hour and at each node's first
// release. The grant starts at a random time within aheadWithin; a record
// that needs the lease before then grants it itself. A grant that fails
// leaves it to the first record, as before.
func (h *HistoryRecorder) Ahead() {
	if h == nil {
		return
	}
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, t := range []time.Time{now, now.Add(h.bucket() / 10)} {
		b := t.Truncate(h.bucket()).UnixNano()
		if _, ok := h.byBucket[b]; ok {
			continue
		}
		if _, busy := h.granting[b]; busy {
			continue
		}
		if _, ok := h.scheduled[b]; ok {
			continue
		}
		if h.aheadWithin <= 0 {
			h.startAhead(b)
			continue
		}
		if h.scheduled == nil {
			h.scheduled = map[int64]*time.Timer{}
		}
		h.scheduled[b] = time.AfterFunc(rand.N(h.aheadWithin), func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if _, ok := h.scheduled[b]; !ok {
				return // a record granted it first
			}
			delete(h.scheduled, b)
			if _, ok := h.byBucket[b]; !ok {
				h.startAhead(b)
			}
		})
	}
}

// startAhead starts bucket b's grant in the background, with mu held.
func (h *HistoryRecorder) startAhead(b int64) {
	if h.granting == nil {
		h.granting = map[int64]chan struct{}{}
	}
	ch := make(chan struct{})
	h.granting[b] = ch
	go h.grantAhead(b, ch)
}

// grantAhead grants bucket b's lease for Ahead, and closes ch when done.
func (h *HistoryRecorder) grantAhead(b int64, ch chan struct{}) {
	ctx, cancel := context.WithTimeout(context.Background(), historyAheadTimeout)
	defer cancel()
	id, err := h.grant(ctx, b)
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.granting, b)
	close(ch)
	if _, ok := h.byBucket[b]; err == nil && !ok {
		h.keep(b, id)
	}
}

// Drop forgets lease id: etcd no longer knows it (a transaction using it
// failed with ErrLeaseNotFound), so the next record grants another.
func (h *HistoryRecorder) Drop(id clientv3.LeaseID) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for b, l := range h.byBucket {
		if l == id {
			delete(h.byBucket, b)
		}
	}
}

// Op is the put that records r, for the transaction that ends r's
// interval, and the lease it is on. ok is false when history is off.
func (h *HistoryRecorder) Op(ctx context.Context, r HistoryRecord) (op clientv3.Op, lease clientv3.LeaseID, ok bool, err error) {
	if h == nil {
		return clientv3.Op{}, 0, false, nil
	}
	addr, err := netip.ParseAddr(r.IP)
	if err != nil {
		return clientv3.Op{}, 0, false, fmt.Errorf("history record: %w: ip %q", records.ErrBadRequest, r.IP)
	}
	lease, err = h.lease(ctx, r.End)
	if err != nil {
		return clientv3.Op{}, 0, false, err
	}
	val, err := kvstore.EncodeJSON(r)
	if err != nil {
		return clientv3.Op{}, 0, false, err
	}
	return clientv3.OpPut(historyKey(r, addr), val, clientv3.WithLease(lease)), lease, true, nil
}

// Commit runs commit with the operations that record rs (none when
// history is off, or rs is empty), for the transaction that ends their
// intervals. Every transaction carrying history records goes through it.
// If etcd no longer knows a lease of those records' hours (revoked by
// hand, or lost in a restore from a snapshot), it grants another and runs
// commit once more. A transaction refused for a missing lease wrote
// nothing, so if it is refused again the error wraps retry.ErrConflict
// (a refusal, to be retried), never an unknown outcome.
func (h *HistoryRecorder) Commit(ctx context.Context, rs []HistoryRecord, commit func(puts []clientv3.Op) error) error {
	for attempt := 0; ; attempt++ {
		puts, leases, err := h.ops(ctx, rs)
		if err != nil {
			return err
		}
		err = commit(puts)
		if !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return err
		}
		if attempt == 0 && len(leases) > 0 {
			for _, l := range leases {
				h.Drop(l)
			}
			continue
		}
		return fmt.Errorf("%w: nothing was written: %w", err, retry.ErrConflict)
	}
}

// ops are the puts that record rs and the leases they are on.
func (h *HistoryRecorder) ops(ctx context.Context, rs []HistoryRecord) ([]clientv3.Op, []clientv3.LeaseID, error) {
	var puts []clientv3.Op
	var leases []clientv3.LeaseID
	for _, r := range rs {
		put, lease, ok, err := h.Op(ctx, r)
		if err != nil {
			return nil, nil, err
		}
		if ok {
			puts = append(puts, put)
			if !slices.Contains(leases, lease) {
				leases = append(leases, lease)
			}
		}
	}
	return puts, leases, nil
}

// deleteWithHistory deletes key if it is still at rev and, in the same
// transaction, records r. A key already gone is success (and records
// nothing: whoever deleted it recorded it). A key rewritten since rev
// wraps ErrConflict.
func (s *Store) deleteWithHistory(ctx context.Context, key string, rev int64, r HistoryRecord, guards []clientv3.Cmp, also ...clientv3.Op) (deleted bool, err error) {
	if rev <= 0 {
		// A compare on revision 0 would match an absent key and record an
		// interval nobody had.
		return false, fmt.Errorf("delete %s: %w: no revision to guard the delete", key, records.ErrBadRequest)
	}
	var resp *clientv3.TxnResponse
	err = s.hist.Commit(ctx, []HistoryRecord{r}, func(puts []clientv3.Op) (err error) {
		then := append(append([]clientv3.Op{clientv3.OpDelete(key)}, also...), puts...)
		resp, err = s.kv.Txn(ctx).If(append([]clientv3.Cmp{kvstore.Unchanged(key, rev)}, guards...)...).Then(then...).Else(clientv3.OpGet(key, clientv3.WithCountOnly())).Commit()
		return err
	})
	if err != nil {
		return false, fmt.Errorf("delete %s: %w", key, kvstore.Unavailable(err))
	}
	if resp.Succeeded || resp.Responses[0].GetResponseRange().Count == 0 {
		return resp.Succeeded, nil
	}
	return false, fmt.Errorf("delete %s at revision %d: changed: %w", key, rev, retry.ErrConflict)
}

// HistoryFilter selects history records; zero fields match everything.
type HistoryFilter struct {
	Pool      string
	IP        netip.Addr // with Pool unset, in whichever pool holds it
	Namespace string
	Pod       string
	Since     time.Time // intervals that ended at or after
	Until     time.Time // intervals that started at or before
}

// History reads the ended intervals that match f, oldest end first. With an
// address it reads only that address's records; otherwise every record.
func (s *Store) History(ctx context.Context, f HistoryFilter) ([]HistoryRecord, error) {
	prefix := HistoryPrefix()
	if f.IP.IsValid() && f.Pool != "" {
		prefix = ipHistoryPrefix(f.Pool, f.IP)
	}
	vs, _, err := kvstore.ListJSON[HistoryRecord](ctx, s.kv, prefix)
	if err != nil {
		return nil, fmt.Errorf("read history: %w", err)
	}
	var out []HistoryRecord
	for _, v := range vs {
		r := v.Value
		switch {
		case f.IP.IsValid() && r.IP != f.IP.String(),
			f.Pool != "" && r.Pool != f.Pool,
			f.Namespace != "" && r.Namespace != f.Namespace,
			f.Pod != "" && r.Pod != f.Pod,
			!f.Since.IsZero() && r.End.Before(f.Since),
			!f.Until.IsZero() && r.Start.After(f.Until):
			continue
		}
		out = append(out, r)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].End.Before(out[j].End) })
	return slices.Clip(out), nil
}

// LastReleased implements records.Store: the newest history record of
// each address, one sorted, limited range read per address in one
// transaction. History keys of an address are ordered by end time.
func (s *Store) LastReleased(ctx context.Context, pool string, addrs []netip.Addr) (map[netip.Addr]time.Time, error) {
	out := map[netip.Addr]time.Time{}
	for chunk := range slices.Chunk(addrs, 64) {
		ops := make([]clientv3.Op, len(chunk))
		for i, addr := range chunk {
			ops[i] = clientv3.OpGet(ipHistoryPrefix(pool, addr), clientv3.WithPrefix(),
				clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(1))
		}
		resp, err := s.kv.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, fmt.Errorf("read last releases: %w", kvstore.Unavailable(err))
		}
		for i, r := range resp.Responses {
			kvs := r.GetResponseRange().Kvs
			if len(kvs) == 0 {
				continue
			}
			v, err := kvstore.Decode[HistoryRecord](kvs[0])
			if err != nil {
				continue
			}
			out[chunk[i]] = v.Value.End
		}
	}
	return out, nil
}
