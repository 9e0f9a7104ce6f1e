package etcdstore

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"time"

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
