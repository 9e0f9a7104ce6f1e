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

// resetRecorder signals each Reset and each Apply.
type resetRecorder struct {
	resets  chan []*mvccpb.KeyValue
	applied chan *clientv3.Event
}

func (r *resetRecorder) Reset(kvs []*mvccpb.KeyValue, _ int64) { r.resets <- kvs }
func (r *resetRecorder) Apply(ev *clientv3.Event)              { r.applied <- ev }

// TestWatchRelistsWhenRevisionGoesBack: a watch that has seen revisions
// beyond the store's current one (etcd restored from an older snapshot
// without --bump-revision) re-lists instead of waiting for the store to
// catch up, and then follows changes again.
func TestWatchRelistsWhenRevisionGoesBack(t *testing.T) {
	e := etcdtest.Start(t)
	cli := etcdtest.Client(t, e)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	put, err := cli.Put(ctx, "/w/a", "1")
	require.NoError(t, err)
	r := &resetRecorder{resets: make(chan []*mvccpb.KeyValue, 4), applied: make(chan *clientv3.Event, 4)}
	done := make(chan error, 1)
	go func() { done <- kvstore.Watch(ctx, cli, "/w/", put.Header.Revision+100, r) }()
	select {
	case kvs := <-r.resets:
		require.Len(t, kvs, 1)
		require.Equal(t, "/w/a", string(kvs[0].Key))
	case <-ctx.Done():
		t.Fatal("no re-list")
	}
	_, err = cli.Put(ctx, "/w/b", "2")
	require.NoError(t, err)
	select {
	case ev := <-r.applied:
		require.Equal(t, "/w/b", string(ev.Kv.Key))
	case <-ctx.Done():
		t.Fatal("no event after the re-list")
	}
	cancel()
	<-done
}
