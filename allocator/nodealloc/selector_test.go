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

// TestStickyTakeoverHonoursNodeSelector: a pool's node selector binds a
// sticky identity too. Its next pod on a node the selector leaves out
// (another rack) is refused with ErrNodeNotSelected before the node
// writes anything, whether its addresses are kept or held by a live pod
// of the same name, and the error names the identity, its addresses, the
// pool, the selector and the node; the addresses stay the identity's, so
// its next pod on a node the selector chooses takes them over.
func TestStickyTakeoverHonoursNodeSelector(t *testing.T) {
	ctx := context.Background()
	pool := allocator.Pool{Name: "rack", BlockSizeV4: 28, CIDRs: []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}, NodeSelector: "rack=r1"}
	e := startEtcd(t, pool)
	a := startNode(t, e, "a", []string{"rack"}, nodeOpts{labels: map[string]string{"rack": "r1"}})
	c := startNode(t, e, "c", []string{"rack"}, nodeOpts{labels: map[string]string{"rack": "r1"}})
	var hb *hookStore
	b := startNode(t, e, "b", []string{"rack"}, nodeOpts{labels: map[string]string{"rack": "r2"},
		wrap: func(s records.Store) records.Store { hb = newHookStore(s); return hb }})
	var writes []string
	hb.Observe(func(op string, _ any) {
		switch op {
		case "Claim", "Reclaim", "Unclaim", "WriteIPs", "DeleteIP", "FenceBorrower", "WriteBound", "Keep", "RecordLapsed", "DropStaleBinding":
			writes = append(writes, op)
		}
	})
	req := func(o records.Owner) nodealloc.Request {
		return nodealloc.Request{Pool: "rack", Owner: o, Sticky: &records.Sticky{Identity: o.Namespace + "/" + o.Pod, Window: time.Minute}}
	}
	inEtcd := func(addr netip.Addr) records.Allocation {
		blk, _ := pool.BlockFor(addr)
		cur, err := a.store.GetIPs(ctx, []records.IPRef{{Pool: "rack", Block: blk, Addr: addr}})
		require.NoError(t, err)
		return cur[addr]
	}

	for _, tc := range []struct {
		name string
		kept bool // the identity's last pod was DELeted (its addresses kept), or still runs
	}{{"kept", true}, {"live", false}} {
		t.Run(tc.name, func(t *testing.T) {
			pod := "web-" + tc.name
			first := stickyPod(pod, 1)
			res, err := a.alloc.Allocate(ctx, req(first))
			require.NoError(t, err)
			x := res.Allocations[0].Addr
			if tc.kept {
				_, err = a.alloc.Release(ctx, first)
				require.NoError(t, err)
			}
			before := inEtcd(x)
			bound, ok, err := a.store.GetBinding(ctx, "rack", "ns/"+pod)
			require.NoError(t, err)
			require.True(t, ok)

			writes = nil
			_, err = b.alloc.Allocate(ctx, req(stickyPod(pod, 2)))
			require.ErrorIs(t, err, records.ErrNodeNotSelected, "a pod on another rack takes no address of this pool over")
			for _, want := range []string{"sticky identity ns/" + pod, x.String(), "pool rack", `"rack=r1"`, "node b", "rack=r2"} {
				require.ErrorContains(t, err, want)
			}
			require.Empty(t, writes, "refused before any claim, borrow or takeover")
			require.Equal(t, before, inEtcd(x), "the address stays as it was")
			still, ok, err := a.store.GetBinding(ctx, "rack", "ns/"+pod)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, bound, still, "the binding stays as it was")

			res, err = c.alloc.Allocate(ctx, req(stickyPod(pod, 3)))
			require.NoError(t, err, "a pod on a node the selector chooses takes the addresses over")
			require.Equal(t, x, res.Allocations[0].Addr)
			require.True(t, res.Allocations[0].Borrowed, "in a's block, borrowed by c")
		})
	}
}
