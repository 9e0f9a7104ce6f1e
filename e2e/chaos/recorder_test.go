package chaos

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestRecorderAgainstEtcd: the recorder sees every allocation change of
// a real allocator from the first revision, and the node's record and
// claim; with the workload's ops the checker finds nothing, and finds the
// allocation an operator deletes by hand under a live owner.
func TestRecorderAgainstEtcd(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	agenttest.EnsurePool(t, e, allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.30.0.0/28")}, BlockSizeV4: 28})
	n := agenttest.Start(t, e, "n1", agenttest.Options{Pools: []string{"p"}})
	var ops []Op
	add := func(i int) netip.Addr {
		o := agenttest.Owner(i)
		start := time.Now()
		r, err := n.Alloc.Allocate(ctx, nodealloc.Request{Pool: "p", Owner: o, Reserve: true})
		require.NoError(t, err)
		_, err = n.Alloc.Confirm(ctx, o)
		require.NoError(t, err)
		ops = append(ops, Op{Kind: "add", Owner: o.Key(), Node: "n1", Addrs: []netip.Addr{r.Allocations[0].Addr}, Start: start, End: time.Now()})
		return r.Allocations[0].Addr
	}
	del := func(i int) {
		o := agenttest.Owner(i)
		start := time.Now()
		_, err := n.Alloc.Release(ctx, o)
		require.NoError(t, err)
		ops = append(ops, Op{Kind: "del", Owner: o.Key(), Node: "n1", Start: start, End: time.Now()})
	}
	rec := Record(ctx, etcdtest.Client(t, e)) // started late on purpose: it reads from revision 1
	add(1)
	victim := add(2)
	del(1)
	add(3)
	// An operator deletes a live owner's allocation by hand.
	p := allocator.Pool{Name: "p", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.30.0.0/28")}, BlockSizeV4: 28}
	blk, _ := p.BlockFor(victim)
	_, err := etcdtest.Client(t, e).Delete(ctx, etcdstore.IPKey("p", blk, victim))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		return len(rec.changes) >= 8 // 3 reserves, 3 confirms, a release, the hand delete
	}, 5*time.Second, 10*time.Millisecond)
	changes, err := rec.Stop()
	require.NoError(t, err)
	var kinds []string
	for _, b := range rec.Backing() {
		if b.Node == "n1" && (b.Kind == BackingNode || b.Prefix == blk) {
			kinds = append(kinds, b.Kind)
		}
	}
	require.Equal(t, []string{BackingNode, BackingClaim}, kinds, "the node's record and its claim on the block, as backing")
	final := map[netip.Addr]string{}
	for _, al := range n.Alloc.Allocations() {
		final[al.Addr] = al.Owner.Key()
	}
	delete(final, victim)
	fs := Check(ops, changes, final, time.Now())
	require.Len(t, fs, 1, "%v", fs)
	require.Equal(t, "lost", fs[0].Kind)
	require.Equal(t, victim, fs[0].Addr)
	require.Contains(t, fs[0].Message, agenttest.Owner(2).Key())
}
