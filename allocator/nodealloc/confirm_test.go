package nodealloc_test

import (
	"context"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestConfirmBatch: several owners' confirms go to etcd in one
// transaction; an owner that cannot be confirmed (never reserved; its
// reservation gone from etcd behind the node's back, which makes etcd
// refuse the whole transaction) fails alone while the others are
// confirmed; a batch whose write landed but was reported failed (unknown
// outcome) is settled, and every owner in it is confirmed.
func TestConfirmBatch(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n, h := hooked(t, e, "n1", nodeOpts{})
	var writes atomic.Int32
	h.Before("WriteIPs", func(context.Context) error { writes.Add(1); return nil })
	reserve := func(i int) nodealloc.Result {
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i), Reserve: true})
		require.NoError(t, err)
		return r
	}
	confirmed := func(i int) {
		t.Helper()
		for _, al := range ownerIPs(t, n.cli, owner(i)) {
			require.Equal(t, records.StateAllocated, al.State, "owner %d", i)
			require.Zero(t, al.Lease, "owner %d", i)
		}
	}

	for i := 1; i <= 3; i++ {
		reserve(i)
	}
	writes.Store(0)
	out := n.alloc.ConfirmBatch(ctx, []records.Owner{owner(1), owner(2), owner(9), owner(3)})
	require.EqualValues(t, 1, writes.Load(), "one transaction for the batch")
	for _, i := range []int{0, 1, 3} {
		require.NoError(t, out[i].Err)
		require.Len(t, out[i].Allocations, 1)
	}
	require.ErrorIs(t, out[2].Err, records.ErrNotFound, "never reserved")
	confirmed(1)
	confirmed(2)
	confirmed(3)

	r5 := reserve(5)
	reserve(6)
	reserve(7)
	al := r5.Allocations[0]
	_, err := n.cli.Delete(ctx, etcdstore.IPKey("small", al.Block, al.Addr))
	require.NoError(t, err)
	out = n.alloc.ConfirmBatch(ctx, []records.Owner{owner(5), owner(6), owner(7)})
	require.ErrorIs(t, out[0].Err, records.ErrReservationGone)
	require.NoError(t, out[1].Err)
	require.NoError(t, out[2].Err)
	confirmed(6)
	confirmed(7)

	reserve(10)
	reserve(11)
	h.After("WriteIPs", commitThenFail(1))
	out = n.alloc.ConfirmBatch(ctx, []records.Owner{owner(10), owner(11)})
	require.NoError(t, out[0].Err, "the landed batch is settled from etcd")
	require.NoError(t, out[1].Err)
	confirmed(10)
	confirmed(11)
	again, err := n.alloc.Confirm(ctx, owner(10))
	require.NoError(t, err)
	require.Equal(t, out[0].Allocations, again, "confirming again is a no-op")
}

// TestLapsedReservationHandedOutElsewhere is why the confirm stays on the
// ADD's answer path (docs/design.md, "Why the confirm is on the answer
// path"): a node reserves the first address of a fresh block and dies
// before confirming it (an agent that answered first and confirmed after
// would have a pod running on it now). Its node lease goes, and with it
// the block's claim; then the reservation's lease. The block is empty, so
// it is free (invariant 3), and another node claims it and hands the very
// address out. Only an answer that waits for the confirm keeps a pod off
// an address etcd can give away.
func TestLapsedReservationHandedOutElsewhere(t *testing.T) {
	ctx := context.Background()
	one := allocator.Pool{Name: "one", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.21.0.0/28")}, BlockSizeV4: 28}
	e := startEtcd(t, one)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{resTTL: time.Second})
	r, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	x := r.Allocations[0]
	require.Equal(t, records.StateReserved, x.State)

	// Node a dies before its confirm: its lease, and so its claim, go.
	a.sess.Close()
	// Await etcd's delete of the reservation, when its lease runs out.
	key := etcdstore.IPKey("one", x.Block, x.Addr)
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	gone := false
	for resp := range a.cli.Watch(wctx, key, clientv3.WithRev(x.Rev)) {
		for _, ev := range resp.Events {
			gone = gone || ev.Type == clientv3.EventTypeDelete
		}
		if gone {
			break
		}
	}
	require.True(t, gone, "the unconfirmed reservation lapses")

	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	var handed []netip.Addr
	for i := 2; !slices.Contains(handed, x.Addr); i++ {
		got, err := b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(i)})
		require.NoError(t, err, "b has handed out %v, and not %s", handed, x.Addr)
		require.Equal(t, x.Block, got.Allocations[0].Block, "b claimed a's block")
		handed = append(handed, got.Allocations[0].Addr)
	}
	t.Logf("b handed out %s, the address a's unconfirmed pod would be using, after %d others", x.Addr, len(handed)-1)
}
