package nodealloc_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestReuseCooldownIsPoolWide: the reuse cooldown is the pool's, in etcd,
// and every node holds to it. Two nodes share a tight pool of two blocks:
// the lender claims one, the borrower fills the other and then borrows
// from the lender's. Their cooldowns used to be agent flags, and a
// borrower whose flag was shorter than the lender's handed out the
// lender's just-released addresses at once. Here an operator lengthens
// the pool's cooldown from "reuse at once" to an hour: the lender's
// releases cool, the borrower takes none of them while another address
// is free (then the oldest), and the borrower's own release cools too.
// The operator then sets it back to 0: both nodes free what was cooling
// at once, and their releases no longer cool.
func TestReuseCooldownIsPoolWide(t *testing.T) {
	ctx := context.Background()
	pool := allocator.Pool{Name: "pw", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.84.0.0/27")}, BlockSizeV4: 28,
		ReuseCooldown: allocator.DurationOf(0)}
	e := startEtcd(t, pool)
	lender := startNode(t, e, "lender", []string{"pw"}, nodeOpts{})
	borrower := startNode(t, e, "borrower", []string{"pw"}, nodeOpts{})
	alloc := func(n *testNode, i int) records.Allocation {
		t.Helper()
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "pw", Owner: owner(i)})
		require.NoError(t, err)
		require.Len(t, r.Allocations, 1)
		return r.Allocations[0]
	}
	release := func(n *testNode, i int) netip.Addr {
		t.Helper()
		held := n.alloc.Lookup(owner(i))
		require.Len(t, held, 1)
		_, err := n.alloc.Release(ctx, owner(i))
		require.NoError(t, err)
		return held[0].Addr
	}
	cooling := func(n *testNode) int {
		c := 0
		for _, u := range n.alloc.Usage() {
			c += u.Cooling
		}
		return c
	}
	setCooldown := func(d time.Duration) { // kvipamctl pool set-cooldown, and the agents' pool watch
		t.Helper()
		p, err := lender.store.UpdatePool(ctx, "pw", func(p *allocator.Pool) error { p.ReuseCooldown = allocator.DurationOf(d); return nil })
		require.NoError(t, err)
		lender.alloc.UpdatePool(p)
		borrower.alloc.UpdatePool(p)
	}

	// Each node claims a block: the lender holds 6 of its 15 addresses,
	// the borrower all of its own.
	for i := range 6 {
		alloc(lender, i)
	}
	lenderBlock := lender.alloc.Lookup(owner(0))[0].Block
	for i := 200; i < 215; i++ {
		require.NotEqual(t, lenderBlock, alloc(borrower, i).Block)
	}

	setCooldown(time.Hour)
	var released []netip.Addr // oldest first
	for _, i := range []int{3, 2, 1, 0} {
		released = append(released, release(lender, i))
	}
	require.Equal(t, 4, cooling(lender), "the lender's releases cool")
	// The lender's block has 9 addresses never used and 4 just released.
	for i := 100; i < 109; i++ {
		al := alloc(borrower, i)
		require.True(t, al.Borrowed)
		require.NotContains(t, released, al.Addr, "borrow %d took %s, which the lender released a moment ago, while others were free", i-100, al.Addr)
	}
	require.Equal(t, released[0], alloc(borrower, 109).Addr, "when nothing else is free the oldest release is taken")
	release(borrower, 200)
	require.Equal(t, 1, cooling(borrower), "the borrower's own release cools too")

	setCooldown(0)
	require.Zero(t, cooling(lender), "reuse at once: what cooled is free")
	require.Zero(t, cooling(borrower))
	release(lender, 4)
	release(borrower, 201)
	require.Zero(t, cooling(lender), "a release no longer cools")
	require.Zero(t, cooling(borrower))
}
