package agent

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/allocator/schema"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
	"github.com/kvipam/kvipam/routing"
)

// TestAnnouncerFollowsCutOverLearned: a VM's address, in node-1's
// block, is cut over (by an operator) to its migration's target on
// node-2. The cut-over's transaction gives the address a lent home
// naming node-2, and node-2's announcer sees it before node-2's
// allocator has learned the address (it learns from another watch, of
// bindings): its holdings lack it then, and it announces nothing. When
// the allocator learns it, the announcer must announce the /32 at once,
// not at the next lease keepalive (here 40 s away; the e2e rig's
// agents, TTL 15 s, took up to 5 s: TestMigrationBGPMovesSlash32).
func TestAnnouncerFollowsCutOverLearned(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	pool := allocator.Pool{Name: "vms", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.81.0.0/27")}}
	agenttest.EnsurePool(t, e, pool)
	n1 := agenttest.Start(t, e, "node-1", agenttest.Options{Pools: []string{pool.Name}, LeaseTTL: 120})
	n2 := agenttest.Start(t, e, "node-2", agenttest.Options{Pools: []string{pool.Name}, LeaseTTL: 120})
	_, _, err := n1.Store.RaiseSchema(ctx, schema.Highest(), "test", "test")
	require.NoError(t, err)

	sticky := &records.Sticky{Identity: "e2e/vm1", Window: time.Minute}
	src, err := n1.Alloc.Allocate(ctx, nodealloc.Request{Pool: pool.Name, Owner: agenttest.Owner(1), Sticky: sticky})
	require.NoError(t, err)
	x := src.Allocations[0].Addr
	_, ok, err := n2.Alloc.Admit(ctx, nodealloc.Request{Pool: pool.Name, Owner: agenttest.Owner(2), Sticky: sticky, Migration: "m1"})
	require.NoError(t, err)
	require.True(t, ok, "node-2's pod admitted as the second owner")

	homes := &signalledPuts{src: n2.Store, put: make(chan homePut, 16)}
	held := &signalledReads{Allocator: n2.Alloc, read: make(chan time.Time, 16)}
	rec := runAnnouncer(t, "node-2", routing.BGPSources{Homes: homes, Lease: heldLease{n2.Session}, Held: held}, time.Second)
	require.Eventually(t, func() bool { _, n := rec.last(); return n > 0 }, 10*time.Second, 10*time.Millisecond, "node-2's first set")

	b, err := n1.Store.CutOverIdentity(ctx, pool.Name, sticky.Identity)
	require.NoError(t, err)
	require.Equal(t, "node-2", b.Node)
	host := netip.PrefixFrom(x, 32)
	var came time.Time
	for p := range homes.put {
		if p.block == host {
			came = p.at
			break
		}
	}
	// The announcer reads the holdings after the home came: wait for a
	// read that began after it, and ended.
	for began := (time.Time{}); began.Before(came); {
		select {
		case began = <-held.read:
		case <-time.After(10 * time.Second):
			t.Fatal("the announcer did not read node-2's holdings after the lent home came")
		}
	}
	got, _ := rec.last()
	require.NotContains(t, got, host, "node-2's allocator has not learned the address yet")

	refs, err := n2.Alloc.BoundRefs(b)
	require.NoError(t, err)
	require.NoError(t, n2.Alloc.Learn(ctx, refs))
	require.Eventually(t, func() bool { got, _ := rec.last(); _, ok := got[host]; return ok }, 10*time.Second, 10*time.Millisecond,
		"node-2 announces the address it learned")
}

// signalledPuts is a source of homes that says which home each Put
// delivered, and when it began to.
type signalledPuts struct {
	src routing.HomeSource
	put chan homePut
}

type homePut struct {
	block netip.Prefix
	at    time.Time
}

func (s *signalledPuts) WatchHomes(ctx context.Context, h etcdstore.Handler[etcdstore.BlockHome]) error {
	return s.src.WatchHomes(ctx, putSignal{Handler: h, put: s.put})
}

type putSignal struct {
	etcdstore.Handler[etcdstore.BlockHome]
	put chan homePut
}

func (p putSignal) Put(h etcdstore.BlockHome) {
	at := time.Now()
	p.Handler.Put(h)
	select {
	case p.put <- homePut{block: h.Block, at: at}:
	default:
	}
}

// signalledReads is node-2's allocator as the announcer's holdings,
// saying, when a read of its allocations ended, when it began.
type signalledReads struct {
	*nodealloc.Allocator
	read chan time.Time
}

func (s *signalledReads) Allocations() []records.Allocation {
	began := time.Now()
	out := s.Allocator.Allocations()
	select {
	case s.read <- began:
	default:
	}
	return out
}
