package agent

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/agent/api"
	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	"github.com/kvipam/kvipam/routing"
	"github.com/kvipam/kvipam/routing/bgp"
)

// syncRecorder is a speaker that records each set it is given.
type syncRecorder struct {
	mu   sync.Mutex
	sets [][]bgp.Route
	at   []time.Time // when each set came
}

func (r *syncRecorder) Sync(_ context.Context, want []bgp.Route) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sets = append(r.sets, slices.Clone(want))
	r.at = append(r.at, time.Now())
	return nil
}

// last is the last set as prefix -> next hop, and how many sets came.
func (r *syncRecorder) last() (map[netip.Prefix]netip.Addr, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.sets) == 0 {
		return nil, 0
	}
	out := map[netip.Prefix]netip.Addr{}
	for _, rt := range r.sets[len(r.sets)-1] {
		out[rt.Prefix] = rt.NextHop
	}
	return out, len(r.sets)
}

// TestBGPAnnouncerFollowsHomes: with real etcd and two agents, node-a's
// announcer gives its speaker exactly node-a's homes (its IPv4 and IPv6
// blocks), with its address of each family as next hop, never node-b's,
// and nothing before the first full list; a block that empties goes back
// to the pool and is withdrawn; an announcer started later (an agent
// restart) gives its speaker the complete set in its first Sync.
func TestBGPAnnouncerFollowsHomes(t *testing.T) {
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "default", BlockSizeV4: 28, BlockSizeV6: 124,
		CIDRs: []netip.Prefix{netip.MustParsePrefix("10.80.0.0/24"), netip.MustParsePrefix("fd00:80::/120")}}
	start := func(node string) *testAgent {
		cfg := testConfig(t, e)
		cfg.Node, cfg.Routing, cfg.Pools = node, RoutingNone, []allocator.Pool{pool}
		return startAgent(t, cfg, Options{})
	}
	a, b := start("node-a"), start("node-b")
	ctx := context.Background()
	ra, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(1), Permanent: true})
	require.NoError(t, err)
	_, err = b.c.Allocate(ctx, api.AllocateRequest{Owner: owner(2), Permanent: true})
	require.NoError(t, err)

	store := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{})
	nh4, nh6 := netip.MustParseAddr("10.254.0.1"), netip.MustParseAddr("fd00:254::1")
	run := func() *syncRecorder {
		rec := &syncRecorder{}
		src := routing.BGPSources{Homes: store, Lease: a.a.lease, Held: a.a.alloc}
		ann := routing.NewAnnouncer("node-a", []string{nh4.String(), nh6.String()}, src, rec, time.Second, hclog.NewNullLogger())
		actx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); ann.Run(actx) }()
		t.Cleanup(func() { cancel(); <-done })
		return rec
	}
	want := map[netip.Prefix]netip.Addr{}
	for _, ip := range ra.IPs {
		nh := nh6
		if ip.Block.Addr().Is4() {
			nh = nh4
		}
		want[ip.Block] = nh
	}
	require.Len(t, want, 2, "node-a's IPv4 and IPv6 blocks")

	rec := run()
	require.Eventually(t, func() bool { got, _ := rec.last(); return mapsEq(got, want) }, 10*time.Second, 10*time.Millisecond,
		"node-a's homes announced, with its next hops")
	rec.mu.Lock()
	first := toMap(rec.sets[0])
	rec.mu.Unlock()
	require.Equal(t, want, first, "the first Sync is the complete set (after the first list), never a partial one")

	// node-a fills a second IPv4 block, then releases its pods: the
	// emptied block goes back to the pool and is withdrawn.
	var second netip.Prefix
	var inSecond []int
	for i := 10; second == (netip.Prefix{}) || len(inSecond) < 2; i++ {
		r, err := a.c.Allocate(ctx, api.AllocateRequest{Owner: owner(i), Permanent: true})
		require.NoError(t, err)
		for _, ip := range r.IPs {
			if _, ok := want[ip.Block]; !ok && ip.Block.Addr().Is4() {
				second = ip.Block
				inSecond = append(inSecond, i)
			}
		}
	}
	homes := func() map[netip.Prefix]netip.Addr {
		st, err := a.c.Status(ctx)
		require.NoError(t, err)
		out := map[netip.Prefix]netip.Addr{}
		for _, ps := range st.Pools {
			for _, blk := range ps.Blocks {
				out[blk] = map[bool]netip.Addr{true: nh4, false: nh6}[blk.Addr().Is4()]
			}
		}
		return out
	}
	require.Eventually(t, func() bool { got, _ := rec.last(); _, ok := got[second]; return ok && mapsEq(got, homes()) }, 10*time.Second, 10*time.Millisecond,
		"the second block announced")
	for _, i := range inSecond {
		_, err := a.c.Release(ctx, owner(i))
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { got, _ := rec.last(); _, ok := got[second]; return !ok && mapsEq(got, homes()) }, 10*time.Second, 10*time.Millisecond,
		"the given-back block %s withdrawn", second)

	// A new announcer (a restarted agent) gives its speaker the complete
	// set in its first Sync.
	want = homes()
	rec2 := run()
	require.Eventually(t, func() bool { _, n := rec2.last(); return n > 0 }, 10*time.Second, 10*time.Millisecond)
	rec2.mu.Lock()
	first = toMap(rec2.sets[0])
	rec2.mu.Unlock()
	require.Equal(t, want, first, "a restarted announcer's first set is complete")
}

func toMap(rs []bgp.Route) map[netip.Prefix]netip.Addr {
	out := map[netip.Prefix]netip.Addr{}
	for _, r := range rs {
		out[r.Prefix] = r.NextHop
	}
	return out
}

func mapsEq(a, b map[netip.Prefix]netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
