package etcdstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/kvstore"
)

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
	// stop bounds Ahead's grants, which no caller's context does: Close
	// cancels it, and Ahead starts none once it is done.
	stop   context.Context
	cancel context.CancelFunc
	// running counts Ahead's grants in flight, which Close waits for.
	running sync.WaitGroup
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
	stop, cancel := context.WithCancel(context.Background())
	return &HistoryRecorder{leases: l, retention: retention, aheadWithin: DefaultHistoryAheadWithin, stop: stop, cancel: cancel}
}

// Close ends Ahead's background work: the grants scheduled are dropped,
// the ones in flight are cancelled and have returned when Close does, and
// Ahead starts none after. Records go
// on being written, each granting its lease on its own path.
func (h *HistoryRecorder) Close() {
	if h == nil {
		return
	}
	h.mu.Lock()
	for b, t := range h.scheduled {
		t.Stop()
		delete(h.scheduled, b)
	}
	h.cancel() // under mu: no grant starts after it (startAhead's callers check stop)
	h.mu.Unlock()
	h.running.Wait()
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
	if h.stop.Err() != nil {
		return // closed
	}
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
			if _, ok := h.byBucket[b]; !ok && h.stop.Err() == nil {
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
	h.running.Add(1)
	go h.grantAhead(b, ch)
}

// grantAhead grants bucket b's lease for Ahead, and closes ch when done.
func (h *HistoryRecorder) grantAhead(b int64, ch chan struct{}) {
	defer h.running.Done()
	ctx, cancel := context.WithTimeout(h.stop, historyAheadTimeout)
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
