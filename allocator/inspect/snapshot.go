package inspect

import (
	"context"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/kvipam/kvipam/allocator/etcdstore"
)

// Client is what the inspector needs of etcd: range reads, transactions for
// the guarded deletes, and lease look-ups for reservations
// (etcdstore.OperatorClient, which *clientv3.Client satisfies). The
// inspector reaches it only through an etcdstore.Operator.
type Client = etcdstore.OperatorClient

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
	st   *etcdstore.Operator
	opts Options
}

// New returns an Inspector over cli.
func New(cli Client, o Options) *Inspector {
	if o.ProgressEvery <= 0 {
		o.ProgressEvery = DefaultProgressEvery
	}
	return &Inspector{st: etcdstore.NewOperator(cli, o.PageSize), opts: o}
}

func (in *Inspector) now() time.Time {
	if in.opts.Now != nil {
		return in.opts.Now()
	}
	return time.Now()
}

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
	rev, err := in.st.ScanAll(ctx, func(kv *mvccpb.KeyValue) {
		s.add(kv)
		s.Scanned++
		if in.opts.Progress != nil && s.Scanned%in.opts.ProgressEvery == 0 {
			in.opts.Progress(s.Scanned)
		}
	})
	if err != nil {
		return nil, err
	}
	s.Revision = rev
	return s, nil
}
