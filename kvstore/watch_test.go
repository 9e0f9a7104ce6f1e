package kvstore_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// breakingWatcher passes the first response of the first watch through and
// then ends that stream, as a broken connection would; later watches go
// straight to etcd.
type breakingWatcher struct {
	*clientv3.Client
	once sync.Once
}

func (b *breakingWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	first := false
	b.once.Do(func() { first = true })
	if !first {
		return b.Client.Watch(ctx, key, opts...)
	}
	wctx, cancel := context.WithCancel(ctx)
	in := b.Client.Watch(wctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		defer cancel()
		for resp := range in {
			if len(resp.Events) == 0 {
				continue // the created notice
			}
			select {
			case out <- resp:
			case <-ctx.Done():
			}
			return
		}
	}()
	return out
}

// recorder keeps every event Watch applies, in order.
type recorder struct {
	mu   sync.Mutex
	revs []int64
	want int
	done chan struct{}
}

func (r *recorder) Reset([]*mvccpb.KeyValue, int64) {}

func (r *recorder) Apply(ev *clientv3.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.revs = append(r.revs, ev.Kv.ModRevision)
	if len(r.revs) == r.want {
		close(r.done)
	}
}

// TestWatchResumeAfterPartialBatch starts a watch far behind the store, so
// etcd sends the catch-up in batches whose header carries the store's
// current revision, and breaks the stream after the first batch. The
// resumed watch must go on from the last event delivered, not from the
// header's revision: every event arrives exactly once, in order.
func TestWatchResumeAfterPartialBatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cli := etcdtest.Client(t, etcdtest.Start(t))
	const n = 2500 // etcd sends a lagging watcher at most 1,000 revisions a response
	var first int64
	for i := range n {
		r, err := cli.Put(ctx, fmt.Sprintf("/p/k%04d", i), "v")
		require.NoError(t, err)
		if i == 0 {
			first = r.Header.Revision
		}
	}
	rec := &recorder{want: n, done: make(chan struct{})}
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- kvstore.Watch(wctx, &breakingWatcher{Client: cli}, "/p/", first, rec) }()
	select {
	case <-rec.done:
	case <-ctx.Done():
	}
	stop()
	<-done
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Equal(t, n, len(rec.revs), "every event is delivered once; the last one seen was revision %d", rec.revs[len(rec.revs)-1])
	for i, rev := range rec.revs {
		require.Equal(t, first+int64(i), rev, "event %d out of order or missing", i)
	}
}
