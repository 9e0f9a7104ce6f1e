package nodealloc_test

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestReassertAfterStoreLoss: etcd loses allocations whose pods still run
// (restored from an older snapshot). Until they are re-asserted the node
// never hands their addresses out, even after reloading its cache from
// etcd; Reassert writes back those in the node's own blocks and reports
// the one another owner took and the one in a block that is not the
// node's.
func TestReassertAfterStoreLoss(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	var mu sync.Mutex
	var held []nodealloc.HeldAddr
	heldAddrs := func() []netip.Addr {
		mu.Lock()
		defer mu.Unlock()
		var out []netip.Addr
		for _, h := range held {
			out = append(out, h.Addr)
		}
		return out
	}
	cli := etcdtest.Client(t, e)
	st := etcdstore.New(cli, etcdstore.Options{})
	sess, err := kvstore.NewSession(ctx, cli, 30)
	require.NoError(t, err)
	t.Cleanup(sess.Close)
	al, err := nodealloc.New(nodealloc.Config{Node: "n1", Store: st, Held: heldAddrs})
	require.NoError(t, err)
	require.NoError(t, al.Restore(ctx, sess))
	var got []records.Allocation
	for i := range 3 {
		r, err := al.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		got = append(got, r.Allocations[0])
		mu.Lock()
		held = append(held, nodealloc.HeldAddr{Owner: owner(i), Addr: r.Allocations[0].Addr})
		mu.Unlock()
	}
	// etcd forgets 0 and 1; 1's address goes to someone else.
	for _, g := range got[:2] {
		_, err := cli.Delete(ctx, etcdstore.IPKey("small", g.Block, g.Addr))
		require.NoError(t, err)
	}
	other := etcdstore.New(cli, etcdstore.Options{})
	_, err = other.WriteIPs(ctx, []records.IPWrite{{Pool: "small", Block: got[1].Block, ClaimRev: claimRev(t, cli, got[1].Block),
		Addr: got[1].Addr, Record: records.Record{Owner: owner(99), Node: "n1", State: records.StateAllocated}}})
	require.NoError(t, err)

	// The cache reloaded from etcd (a restart): the missing address is
	// still not handed out.
	require.NoError(t, al.Restore(ctx, sess))
	for i := 10; i < 24; i++ { // past the end of the block: the search wraps
		r, err := al.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		require.NotEqual(t, got[0].Addr, r.Allocations[0].Addr, "an address a live endpoint holds is not handed out")
	}

	// An endpoint in a block etcd has no claim for (claimed after the
	// snapshot): free, so the node claims it again. One in a block
	// another node claims: a conflict.
	free := nodealloc.HeldAddr{Owner: owner(50), Addr: netip.MustParseAddr("10.20.0.250")}
	restored, conflicts, err := al.Reassert(ctx, append(held, free))
	require.NoError(t, err)
	require.Len(t, restored, 2, "conflicts: %+v", conflicts)
	require.Equal(t, []netip.Addr{got[0].Addr, free.Addr}, []netip.Addr{restored[0].Addr, restored[1].Addr})
	require.Equal(t, "n1", claimOf(t, cli, "small", netip.MustParsePrefix("10.20.0.240/28")).Node, "the free block is n1's again")
	require.Len(t, conflicts, 1)
	require.Equal(t, got[1].Addr, conflicts[0].Addr)
	require.Equal(t, owner(99).Key(), conflicts[0].HeldBy.Owner.Key())

	n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})
	r2, err := n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(60)})
	require.NoError(t, err)
	theirs := nodealloc.HeldAddr{Owner: owner(51), Addr: r2.Allocations[0].Addr.Next()}
	// An endpoint whose address is free in a block another node claims
	// had borrowed it: it is borrowed again, with its home.
	restored, conflicts, err = al.Reassert(ctx, []nodealloc.HeldAddr{theirs})
	require.NoError(t, err)
	require.Empty(t, conflicts)
	require.Len(t, restored, 1)
	require.True(t, restored[0].Borrowed)
	lent, err := st.ListLent(ctx, "small")
	require.NoError(t, err)
	require.Equal(t, "n1", lent[theirs.Addr], "peers route it to n1")
	_, err = al.Release(ctx, owner(51))
	require.NoError(t, err)
	lent, err = st.ListLent(ctx, "small")
	require.NoError(t, err)
	require.Empty(t, lent, "its home goes with it")

	cur, err := st.GetIPs(ctx, []records.IPRef{{Pool: "small", Block: got[0].Block, Addr: got[0].Addr}})
	require.NoError(t, err)
	require.Equal(t, owner(0).Key(), cur[got[0].Addr].Owner.Key(), "written back, for its owner")
	_, err = al.Release(ctx, owner(0))
	require.NoError(t, err, "and released like any allocation")

	restored, conflicts, err = al.Reassert(ctx, held[2:])
	require.NoError(t, err)
	require.Empty(t, restored, "nothing missing: nothing written")
	require.Empty(t, conflicts)
}

// endpointGoneAfterRestart plays what TestHeldMarkGoesWithEndpoint
// describes: etcd loses x's record, the node restarts while x's endpoint
// runs (Restore marks x held), and the pod is deleted before Reassert
// wrote x back. It returns the restarted node and x.
func endpointGoneAfterRestart(t *testing.T) (*testNode, records.Allocation) {
	ctx := context.Background()
	e := startEtcd(t, onePool) // one /28: 14 addresses
	var mu sync.Mutex
	var held []netip.Addr
	heldNow := func() []netip.Addr { mu.Lock(); defer mu.Unlock(); return slices.Clone(held) }
	setHeld := func(addrs ...netip.Addr) { mu.Lock(); defer mu.Unlock(); held = addrs }
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{held: heldNow})
	res, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1)})
	require.NoError(t, err)
	x := res.Allocations[0]
	setHeld(x.Addr)
	_, err = a.cli.Delete(ctx, etcdstore.IPKey("one", x.Block, x.Addr)) // lost in a restore
	require.NoError(t, err)

	a2 := startNode(t, e, "a", []string{"one"}, nodeOpts{held: heldNow}) // restarted
	gone, err := a2.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	require.Empty(t, gone, "etcd and the cache hold nothing for the deleted pod")
	setHeld() // its endpoint is gone
	return a2, x
}

// TestHeldMarkGoesWithEndpoint: etcd lost x's record and the node
// restarted while x's endpoint still ran, so Restore keeps x out of the
// free list (Config.Held). The pod is then deleted before Reassert wrote
// x back: its DEL finds nothing to release, and the endpoint no longer
// holds x. x is free in etcd and nobody uses it: a request for it by name
// gets it, rather than "in use" until the node restarts again.
func TestHeldMarkGoesWithEndpoint(t *testing.T) {
	a2, x := endpointGoneAfterRestart(t)
	res, err := a2.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "one", Owner: owner(2), IPs: []netip.Addr{x.Addr}})
	require.NoError(t, err, "x is free in etcd and no endpoint uses it")
	require.Equal(t, x.Addr, res.Allocations[0].Addr)
}

// TestHeldMarkCostsNoAddress: as TestHeldMarkGoesWithEndpoint, but
// nobody asks for x by name. The block's free list is read again when it
// runs out, so the mark kept for the gone endpoint costs no address: all
// 14 of the block are handed out, x among them.
func TestHeldMarkCostsNoAddress(t *testing.T) {
	a2, x := endpointGoneAfterRestart(t)
	got := map[netip.Addr]bool{}
	for i := range 14 {
		res, err := a2.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "one", Owner: owner(100 + i)})
		require.NoError(t, err, "address %d of 14", i+1)
		got[res.Allocations[0].Addr] = true
	}
	require.True(t, got[x.Addr], "x was handed out again")
}
