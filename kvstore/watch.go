package kvstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// WatchHandler receives a prefix's changes in revision order. Calls come
// from one goroutine, so a handler needs no locking of its own against
// itself.
type WatchHandler interface {
	// Reset replaces everything known under the prefix with kvs, read at
	// rev. It is called when history the watch needed was compacted away.
	Reset(kvs []*mvccpb.KeyValue, rev int64)
	// Apply is one put or delete. Deletes carry only the key.
	Apply(ev *clientv3.Event)
}

// WatchClient is the part of an etcd client Watch uses; *clientv3.Client
// satisfies it.
type WatchClient interface {
	clientv3.KV
	clientv3.Watcher
}

// Watch follows prefix from revision from (a revision returned by the list
// the caller started with, plus one) until ctx ends, and returns ctx's error.
// A broken stream is resumed from the last revision seen; when that
// revision was compacted, or the store's revision is below it (etcd
// restored from an older snapshot), Watch re-lists the prefix and calls
// Reset, so the handler never silently misses a change.
func Watch(ctx context.Context, cli WatchClient, prefix string, from int64, h WatchHandler) error {
	next := from
	for {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(next), clientv3.WithCreatedNotify())
		var werr error
		for resp := range ch {
			if err := resp.Err(); err != nil {
				werr = err
				break
			}
			if rev := resp.Header.Revision; rev > 0 && rev < next-1 {
				// The store is behind what this watch has seen: etcd was
				// restored from an older snapshot without a revision bump.
				// Waiting for revision next would miss every change until
				// the store caught up: re-list instead.
				werr = errBackwards
				break
			}
			// Resume after the last event delivered. A response's header
			// carries the store's current revision, not the last event's: a
			// watcher catching up gets its events in batches that all name
			// the current revision, and the created notice names it too, so
			// only a progress notice (sent once the watcher is in sync)
			// vouches for everything up to its header.
			for _, ev := range resp.Events {
				h.Apply(ev)
				next = max(next, ev.Kv.ModRevision+1)
			}
			if resp.IsProgressNotify() {
				next = max(next, resp.Header.Revision+1)
			}
		}
		cancel()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(werr, errBackwards) || errors.Is(werr, rpctypes.ErrCompacted) || (werr != nil && werr.Error() == rpctypes.ErrCompacted.Error()) {
			rev, err := relist(ctx, cli, prefix, h)
			if err != nil {
				return err
			}
			next = rev + 1
			continue
		}
		// Any other end (leader lost, connection reset): pause briefly so a
		// dead cluster is not hammered, then resume from next.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// errBackwards ends a watch whose store went back in revisions.
var errBackwards = errors.New("kvstore: the store's revision went backwards")

func relist(ctx context.Context, cli WatchClient, prefix string, h WatchHandler) (int64, error) {
	for {
		resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
		if err == nil {
			h.Reset(resp.Kvs, resp.Header.Revision)
			return resp.Header.Revision, nil
		}
		if ctx.Err() != nil {
			return 0, fmt.Errorf("relist %s: %w", prefix, ctx.Err())
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
