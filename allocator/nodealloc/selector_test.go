package nodealloc_test

import (
	"context"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestSelectorStopsNewAddresses: once a pool's node selector no longer
// chooses the node, the node claims and borrows nothing in it (a request
// fails with ErrNodeNotSelected, naming the pool, its selector and the
// node's labels), while a reservation made before is confirmed and
// releases go on; the block goes back to the pool once it is empty.
func TestSelectorStopsNewAddresses(t *testing.T) {
	ctx := context.Background()
	pool := allocator.Pool{Name: "rack", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}, NodeSelector: "rack=r1"}
	e := startEtcd(t, pool)
	n := startNode(t, e, "a", []string{"rack"}, nodeOpts{labels: map[string]string{"rack": "r1"}})
	other := startNode(t, e, "b", []string{"rack"}, nodeOpts{labels: map[string]string{"rack": "r1"}})
	_, err := other.alloc.Allocate(ctx, nodealloc.Request{Pool: "rack", Owner: owner(100), Reserve: false})
	require.NoError(t, err, "another node's block, which a borrow could use")
	for i := range 2 {
		_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "rack", Owner: owner(i), Reserve: i == 1})
		require.NoError(t, err)
	}
	owned := func() int {
		infos, err := n.store.ListBlocks(ctx, "rack")
		require.NoError(t, err)
		c := 0
		for _, bi := range infos {
			if bi.Owned("a") {
				c++
			}
		}
		return c
	}
	require.Equal(t, 1, owned())

	moved, err := n.store.UpdatePool(ctx, "rack", func(p *allocator.Pool) error { p.NodeSelector = "rack=r2"; return nil })
	require.NoError(t, err)
	n.alloc.UpdatePool(moved) // as the agent's pool watch does
	require.False(t, n.alloc.Serves("rack"))
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "rack", Owner: owner(5)})
	require.ErrorIs(t, err, records.ErrNodeNotSelected)
	require.ErrorContains(t, err, `pool rack serves only nodes matching "rack=r2"; node a (labels rack=r1) takes no new address there`)
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "rack", Owner: owner(6), IPs: []netip.Addr{netip.MustParseAddr("10.99.0.200")}})
	require.ErrorIs(t, err, records.ErrNodeNotSelected, "not a static address in a new block either")
	again, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "rack", Owner: owner(0)})
	require.NoError(t, err, "a retried request of an owner that holds its address needs nothing new")
	require.Len(t, again.Allocations, 1)
	_, err = n.alloc.Confirm(ctx, owner(1))
	require.NoError(t, err, "a reservation made before is confirmed")
	require.Equal(t, 1, owned(), "no new block")

	_, err = n.alloc.Release(ctx, owner(0))
	require.NoError(t, err)
	require.Equal(t, 1, owned(), "the block still holds a pod")
	_, err = n.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	require.Zero(t, owned(), "the emptied block goes back to the pool")
}

// TestRestoreListPoolsFails: a Restore whose listing of the pools fails
// serves nothing and says why; the next Restore serves every pool,
// including one created in between.
func TestRestoreListPoolsFails(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, allocator.Pool{Name: "one", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.98.0.0/24")}})
	var h *hookStore
	n := startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h }})
	h.Before("ListPools", failTimes(1, errInjected))
	require.ErrorIs(t, n.alloc.Restore(ctx, n.sess), errInjected)
	require.False(t, n.alloc.Restored())
	_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1)})
	require.ErrorIs(t, err, records.ErrLeaseLost, "try again, not a refusal")
	_, _, err = h.SeedPool(ctx, allocator.Pool{Name: "two", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.98.1.0/24")}})
	require.NoError(t, err)
	require.NoError(t, n.alloc.Restore(ctx, n.sess))
	for _, p := range []string{"one", "two"} {
		_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: p, Owner: owner(2)})
		require.NoError(t, err, p)
	}
}
