package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	"github.com/kvipam/kvipam/routing"
)

// heldLease is a lease that never changes hands (an agenttest agent's).
type heldLease struct{ s *kvstore.Session }

func (l heldLease) Current() (*kvstore.Session, <-chan struct{}) { return l.s, nil }

// runAnnouncer runs an announcer into a recorder until the test ends.
func runAnnouncer(t *testing.T, node string, src routing.BGPSources, horizon time.Duration) *syncRecorder {
	rec := &syncRecorder{}
	ann := routing.NewAnnouncer(node, []string{"10.254.0.1", "fd00:254::1"}, src, rec, horizon, hclog.NewNullLogger())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); ann.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return rec
}

// TestBGPLeaseLostWithdraws: node-1 (lease TTL 3 s, so a graceful-restart
// time of 1 s) reaches etcd through a proxy and announces its empty
// blocks. Cut off from etcd (packets dropped), it withdraws everything
// before its session's HeldUntil, that is before etcd can expire its
// lease. Once etcd has expired it, node-2 claims node-1's IPv4 block and
// announces it. Healed, node-1 takes a new lease, re-claims what is still
// its own and announces that, never the block node-2 took, though its
// watch of homes comes back from the partition behind.
func TestBGPLeaseLostWithdraws(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	cfg := testConfig(t, e)
	proxy := behindCutProxy(t, e, &cfg, 3*time.Second)
	ta := startAgent(t, cfg, Options{})
	r, err := ta.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	var block4 netip.Prefix
	var v4 netip.Addr
	for _, ip := range r.IPs {
		if ip.Block.Addr().Is4() {
			block4, v4 = ip.Block, ip.Address.Addr()
		}
	}
	_, err = ta.c.Release(ctx, owner(1)) // its blocks stay claimed, empty
	require.NoError(t, err)

	horizon := time.Second
	rec1 := runAnnouncer(t, cfg.Node, routing.BGPSources{Homes: ta.a.store, Lease: ta.a.lease, Held: ta.a.alloc}, horizon)
	has := func(rec *syncRecorder, p netip.Prefix) bool { got, _ := rec.last(); _, ok := got[p]; return ok }
	require.Eventually(t, func() bool { got, _ := rec1.last(); return has(rec1, block4) && len(got) == 2 }, 10*time.Second, 10*time.Millisecond,
		"node-1 announces its IPv4 and IPv6 blocks")

	sess := ta.a.lease.session()
	proxy.partition()
	cut := time.Now()
	until, _ := sess.HeldUntil() // no keepalive is answered from now on
	require.Eventually(t, func() bool { got, _ := rec1.last(); return len(got) == 0 }, 10*time.Second, 10*time.Millisecond,
		"node-1, cut off, withdraws everything")
	rec1.mu.Lock()
	withdrawn, mark := rec1.at[len(rec1.at)-1], len(rec1.sets)
	rec1.mu.Unlock()
	t.Logf("withdrawn %s after the cut, %s before HeldUntil", withdrawn.Sub(cut).Round(time.Millisecond), until.Sub(withdrawn).Round(time.Millisecond))
	require.True(t, withdrawn.Before(until), "withdrawn before etcd can expire the lease")
	<-sess.Done()

	// etcd expires node-1's lease; node-2 claims the empty IPv4 block.
	store := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	require.Eventually(t, func() bool {
		bs, err := store.ListBlocks(ctx, testPool.Name)
		require.NoError(t, err)
		for _, b := range bs {
			if b.Block == block4 {
				return b.Claim == nil
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond, "etcd expires node-1's claims")
	n2 := agenttest.Start(t, e, "node-2", agenttest.Options{Pools: []string{testPool.Name}})
	_, err = n2.Alloc.Allocate(ctx, nodealloc.Request{Pool: testPool.Name, Owner: agenttest.Owner(100), IPs: []netip.Addr{v4}})
	require.NoError(t, err)
	rec2 := runAnnouncer(t, "node-2", routing.BGPSources{Homes: n2.Store, Lease: heldLease{n2.Session}, Held: n2.Alloc}, horizon)
	require.Eventually(t, func() bool { return has(rec2, block4) }, 10*time.Second, 10*time.Millisecond, "node-2 announces the block it claimed")

	// Healed, node-1 announces what it holds on its new lease.
	proxy.heal()
	require.NoError(t, waitReady(ta.c, 30*time.Second))
	own := func() map[netip.Prefix]netip.Addr {
		st, err := ta.c.Status(ctx)
		require.NoError(t, err)
		out := map[netip.Prefix]netip.Addr{}
		for _, ps := range st.Pools {
			for _, b := range ps.Blocks {
				out[b] = map[bool]netip.Addr{true: netip.MustParseAddr("10.254.0.1"), false: netip.MustParseAddr("fd00:254::1")}[b.Addr().Is4()]
			}
		}
		return out
	}
	require.Eventually(t, func() bool { got, _ := rec1.last(); return len(got) > 0 && mapsEq(got, own()) }, 20*time.Second, 10*time.Millisecond,
		"node-1 announces what it re-claimed")
	rec1.mu.Lock()
	defer rec1.mu.Unlock()
	for i, set := range rec1.sets[mark:] {
		_, again := toMap(set)[block4]
		require.False(t, again, "node-1's set %d after the cut announces %s, which node-2 holds", mark+i, block4)
	}
}
