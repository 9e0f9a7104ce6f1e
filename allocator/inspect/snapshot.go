package inspect

import (
	"context"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// Client is what the inspector needs of etcd: range reads, transactions for
// the guarded deletes, and lease look-ups for reservations.
// *clientv3.Client satisfies it.
type Client interface {
	clientv3.KV
	TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error)
}

var _ Client = (*clientv3.Client)(nil)

// DefaultProgressEvery is how many keys pass between two progress reports.
const DefaultProgressEvery = 10000

// Options tune an Inspector. The zero value reads each prefix with one range
// read and reports no progress.
type Options struct {
	// Progress, if set, is called with the number of keys scanned so far
	// every ProgressEvery keys, from the goroutine calling Snapshot.
	Progress func(scanned int)
	// ProgressEvery defaults to DefaultProgressEvery.
	ProgressEvery int
	// PageSize, when positive, splits each range read into pages of that
	// many keys (all at the snapshot's revision), which bounds the size of
	// one etcd response on very large stores. Zero: one read per prefix.
	PageSize int
	// History, if set, records the ownership interval that each deleted
	// allocation ends (IP history), in the delete's transaction.
	History *etcdstore.HistoryRecorder
	// Now is the clock of those records; default time.Now.
	Now func() time.Time
}

// Inspector reads and repairs kvipam's state in etcd. It is safe for
// concurrent use.
type Inspector struct {
	cli  Client
	opts Options
}

// New returns an Inspector over cli.
func New(cli Client, o Options) *Inspector {
	if o.ProgressEvery <= 0 {
		o.ProgressEvery = DefaultProgressEvery
	}
	return &Inspector{cli: cli, opts: o}
}

func (in *Inspector) now() time.Time {
	if in.opts.Now != nil {
		return in.opts.Now()
	}
	return time.Now()
}

// Key prefixes of every record kind, across all pools.
var (
	poolsPrefix  = etcdstore.PoolsPrefix()
	nodesPrefix  = etcdstore.NodesPrefix()
	claimsPrefix = etcdstore.AllClaimsPrefix()
	homesPrefix  = etcdstore.AllHomesPrefix()
	ipsPrefix    = etcdstore.AllIPsPrefix()
	stickyPrefix = etcdstore.AllStickyPrefix()
)

// Snapshot reads every kvipam record: one range read per record kind, the
// later ones pinned to the revision of the first. A compaction of that
// revision during the read fails it; run it again.
func (in *Inspector) Snapshot(ctx context.Context) (*Snapshot, error) {
	s := &Snapshot{
		Pools:  map[string]Pool{},
		Nodes:  map[string]Node{},
		Claims: map[BlockKey]ClaimRec{},
		Homes:  map[BlockKey]HomeRec{},
		Lent:   map[LentKey]LentRec{},
	}
	for _, prefix := range []string{poolsPrefix, nodesPrefix, claimsPrefix, homesPrefix, ipsPrefix, stickyPrefix} {
		if err := in.scan(ctx, s, prefix, s.add); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// scan range-reads prefix at s.Revision (the current revision if unset,
// which it then records) and hands every key-value to add.
func (in *Inspector) scan(ctx context.Context, s *Snapshot, prefix string, add func(*mvccpb.KeyValue)) error {
	key, end := prefix, clientv3.GetPrefixRangeEnd(prefix)
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end)}
		if s.Revision > 0 {
			opts = append(opts, clientv3.WithRev(s.Revision))
		}
		if in.opts.PageSize > 0 {
			opts = append(opts, clientv3.WithLimit(int64(in.opts.PageSize)))
		}
		resp, err := in.cli.Get(ctx, key, opts...)
		if err != nil {
			return fmt.Errorf("read %s: %w", prefix, err)
		}
		if s.Revision == 0 {
			s.Revision = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			add(kv)
			s.Scanned++
			if in.opts.Progress != nil && s.Scanned%in.opts.ProgressEvery == 0 {
				in.opts.Progress(s.Scanned)
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		// The next page starts just after the last key read.
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}
