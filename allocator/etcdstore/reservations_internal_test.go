package etcdstore

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// TestReservationLeaseGrantedAhead: while reservations keep coming, each
// window's shared lease is granted ahead, by the first reservation in the
// second half of the window before it, so only the first reservation
// waits for a grant; every lease handed out outlives the reservation by
// at least the reservation TTL; after an idle window a reservation grants
// again.
func TestReservationLeaseGrantedAhead(t *testing.T) {
	e := etcdtest.Start(t)
	s := New(etcdtest.Client(t, e), Options{ReservationTTL: 40 * time.Second})
	clock := &fakeClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	s.res.now = clock.now
	r := &s.res
	window := r.ttl / 4 // 10 s
	ctx := context.Background()

	seen := map[clientv3.LeaseID]bool{}
	check := func() {
		t.Helper()
		id, expires, err := r.get(ctx)
		require.NoError(t, err)
		require.GreaterOrEqual(t, expires.Sub(clock.now()), r.ttl, "a reservation made now lives at least the TTL")
		seen[id] = true
	}
	check()
	require.Equal(t, 1, r.waited, "the first reservation grants the lease")

	// Reservations every second for five windows; each one in a second
	// half of a window starts the next lease's grant, awaited here.
	for range 5 * int(window/time.Second) {
		clock.add(time.Second)
		check()
		require.Eventually(t, func() bool {
			r.mu.Lock()
			defer r.mu.Unlock()
			return !r.granting
		}, 10*time.Second, time.Millisecond)
	}
	require.Equal(t, 1, r.waited, "no reservation after the first waited for a grant")
	require.GreaterOrEqual(t, len(seen), 5, "a lease a window")

	// Idle past the lease granted ahead: the next reservation grants.
	clock.add(3 * window)
	check()
	require.Equal(t, 2, r.waited)
}

// countingGranter counts the leases it grants.
type countingGranter struct {
	LeaseGranter
	mu sync.Mutex
	n  int
}

func (c *countingGranter) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
	return c.LeaseGranter.Grant(ctx, ttl)
}

func (c *countingGranter) grants() int { c.mu.Lock(); defer c.mu.Unlock(); return c.n }

// TestHistoryLeaseGrantedAhead: an allocation's write grants, in the
// background, the IP history lease its release will need, so the release
// (a DEL) records its history without waiting for a grant; and the grant
// is made once, whichever comes first.
func TestHistoryLeaseGrantedAhead(t *testing.T) {
	e := etcdtest.Start(t)
	g := &countingGranter{LeaseGranter: etcdtest.Client(t, e)}
	h := NewHistoryRecorder(g, 24*time.Hour)
	h.aheadWithin = 0 // at once (TestHistoryLeaseAheadSpread: within a time)
	// In an hour's last tenth Ahead grants the next hour's lease too.
	now := time.Now()
	want := 1
	if now.Truncate(time.Hour) != now.Add(6*time.Minute).Truncate(time.Hour) {
		want = 2
	}
	h.Ahead()
	h.Ahead() // a second write while the grants are under way grants nothing more
	_, err := h.lease(context.Background(), now)
	require.NoError(t, err, "the release's record goes on the lease granted ahead")
	require.Eventually(t, func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.granting) == 0
	}, 10*time.Second, time.Millisecond)
	require.Equal(t, want, g.grants(), "the leases granted ahead, no more: the release waited for its bucket's instead of granting its own")
	_, err = h.lease(context.Background(), now)
	require.NoError(t, err)
	require.Equal(t, want, g.grants())
}

// TestHistoryLeaseAheadSpread: Ahead's grant starts at a random time
// within aheadWithin, so that nodes starting together do not grant
// together: nothing is granted at once, and a release that comes first
// grants its bucket's lease itself, at once, and the scheduled grant of
// that bucket is cancelled (one grant, not two).
func TestHistoryLeaseAheadSpread(t *testing.T) {
	e := etcdtest.Start(t)
	g := &countingGranter{LeaseGranter: etcdtest.Client(t, e)}
	h := NewHistoryRecorder(g, 24*time.Hour)
	require.Equal(t, DefaultHistoryAheadWithin, h.aheadWithin)
	h.aheadWithin = time.Hour // no scheduled grant fires within the test
	now := time.Now()
	h.Ahead()
	require.Zero(t, g.grants(), "nothing granted at once")
	h.mu.Lock()
	_, scheduled := h.scheduled[now.Truncate(time.Hour).UnixNano()]
	h.mu.Unlock()
	require.True(t, scheduled, "this hour's grant is scheduled")

	_, err := h.lease(context.Background(), now)
	require.NoError(t, err)
	require.Equal(t, 1, g.grants(), "the release granted its lease itself")
	h.mu.Lock()
	_, scheduled = h.scheduled[now.Truncate(time.Hour).UnixNano()]
	h.mu.Unlock()
	require.False(t, scheduled, "the scheduled grant of the release's bucket is cancelled")
	h.Ahead()
	require.Equal(t, 1, g.grants(), "a bucket granted is not scheduled again")
}

// blockingGranter's grants wait for their context, counting those started.
type blockingGranter struct{ started chan struct{} }

func (g blockingGranter) Grant(ctx context.Context, _ int64) (*clientv3.LeaseGrantResponse, error) {
	g.started <- struct{}{}
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestHistoryRecorderCloseEndsAhead: the grants Ahead runs in the
// background end with the recorder's owner. Close cancels the ones in
// flight (against an etcd that does not answer they would run on for
// historyAheadTimeout, past the agent's stop) and returns once they have
// returned, drops the ones scheduled, and Ahead starts none after it.
// Ahead may start two grants (the next bucket's too, in a bucket's last
// tenth): Close waits for both, however late the second one starts.
func TestHistoryRecorderCloseEndsAhead(t *testing.T) {
	g := blockingGranter{started: make(chan struct{}, 4)}
	h := NewHistoryRecorder(g, 24*time.Hour)
	h.aheadWithin = 0
	h.Ahead()
	<-g.started
	h.mu.Lock()
	require.NotEmpty(t, h.granting)
	h.mu.Unlock()

	h.aheadWithin = time.Hour
	h.Ahead() // the next bucket's, scheduled (or none: not in its last tenth)
	h.Close()
	h.mu.Lock()
	require.Empty(t, h.granting, "Close returns once the grants in flight have")
	require.Empty(t, h.scheduled, "scheduled grants are dropped")
	h.mu.Unlock()
	for len(g.started) > 0 {
		<-g.started // grants that began before Close returned
	}
	h.aheadWithin = 0
	h.Ahead()
	select {
	case <-g.started:
		t.Fatal("Ahead started a grant after Close")
	default:
	}
	h.mu.Lock()
	require.Empty(t, h.granting, "nothing in flight after Close")
	h.mu.Unlock()
}
