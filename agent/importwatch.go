package agent

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/records"
)

// importWatch follows this node's import marks (kvipamctl import) and has
// the allocator learn each: the blocks claimed and the records written for
// this node by kvipamctl, which the node did not write itself. A mark
// the allocator could not learn (etcd unavailable, the agent not
// restored yet) is tried again every retry until it is learned; a mark
// rewritten (the import run again) is learned again. Learning is an
// idempotent read, so a mark learned twice costs only reads.
type importWatch struct {
	alloc interface {
		LearnImport(ctx context.Context, m records.ImportMark) error
	}
	log   hclog.Logger
	retry time.Duration

	mu      sync.Mutex
	pending map[string]records.ImportMark // by key: source, pool, block
	wake    chan struct{}
}

// importSource is where marks come from (etcdstore.Store).
type importSource interface {
	WatchImportMarks(ctx context.Context, node string, h etcdstore.Handler[records.ImportMark]) error
}

func newImportWatch(alloc interface {
	LearnImport(ctx context.Context, m records.ImportMark) error
}, log hclog.Logger) *importWatch {
	return &importWatch{alloc: alloc, log: log, retry: time.Second, pending: map[string]records.ImportMark{}, wake: make(chan struct{}, 1)}
}

// followImports learns this node's imports until ctx ends.
func (a *Agent) followImports(ctx context.Context) {
	newImportWatch(a.alloc, a.log.Named("import")).run(ctx, a.store, a.cfg.Node)
}

// run watches node's marks and learns them until ctx ends.
func (w *importWatch) run(ctx context.Context, src importSource, node string) {
	var wg sync.WaitGroup
	wg.Go(func() { _ = src.WatchImportMarks(ctx, node, w) })
	defer wg.Wait()
	t := time.NewTicker(w.retry)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case <-t.C:
		}
		w.learnPending(ctx)
	}
}

// learnPending learns every pending mark; the ones that fail stay.
func (w *importWatch) learnPending(ctx context.Context) {
	w.mu.Lock()
	todo := make(map[string]records.ImportMark, len(w.pending))
	for k, m := range w.pending {
		todo[k] = m
	}
	w.mu.Unlock()
	for k, m := range todo {
		if err := w.alloc.LearnImport(ctx, m); err != nil {
			w.log.Debug("learn import: trying again", "source", m.Source, "pool", m.Pool, "block", m.Block, "error", err)
			continue
		}
		w.mu.Lock()
		if cur, ok := w.pending[k]; ok && cur.Rev == m.Rev {
			delete(w.pending, k)
		}
		w.mu.Unlock()
	}
}

func markKey(m records.ImportMark) string { return m.Source + "/" + m.Pool + "/" + m.Block.String() }

func (w *importWatch) add(ms ...records.ImportMark) {
	w.mu.Lock()
	for _, m := range ms {
		w.pending[markKey(m)] = m
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Reset learns every mark again: what changed while the watch could not
// see it is among them.
func (w *importWatch) Reset(all []records.ImportMark) { w.add(all...) }

// Put learns a mark written or rewritten.
func (w *importWatch) Put(m records.ImportMark) { w.add(m) }

// Delete: a finalized mark needs nothing; the records stay the node's.
func (w *importWatch) Delete(records.ImportMark) {}
