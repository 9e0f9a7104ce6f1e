package nodealloc_test

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
)

// TestDrainCIDRKeepsPoolServing: a pool with two CIDRs and pods in both;
// one CIDR is drained (kvipamctl pool drain-cidr). New pods are served
// from the other CIDR, not even from the free addresses of a block of the
// draining one that a node holds; a static request there is refused; an
// empty block of it goes back at once, and the others as their pods go.
// remove-cidr is refused while anything is left, refuses to drop a
// reservation inside the CIDR unless told to, and then succeeds.
func TestDrainCIDRKeepsPoolServing(t *testing.T) {
	ctx := context.Background()
	old, keep := netip.MustParsePrefix("10.97.0.0/28"), netip.MustParsePrefix("10.97.1.0/28")
	pool := allocator.Pool{Name: "two", BlockSizeV4: 29, CIDRs: []netip.Prefix{old, keep},
		Reserved: []allocator.Reservation{{Range: allocator.AddrRange{First: netip.MustParseAddr("10.97.0.14"), Last: netip.MustParseAddr("10.97.0.14")}, Reason: "gateway"}}}
	e := startEtcd(t, pool)
	a := startNode(t, e, "a", []string{"two"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"two"}, nodeOpts{})
	static := func(i int, ip string) nodealloc.Request {
		return nodealloc.Request{Pool: "two", Owner: owner(i), IPs: []netip.Addr{netip.MustParseAddr(ip)}}
	}
	// Pods in both cidrs on a; b holds one empty block of the old cidr,
	// kept ready for its next pod.
	for i, ip := range []string{"10.97.0.2", "10.97.0.3", "10.97.1.2"} {
		_, err := a.alloc.Allocate(ctx, static(i, ip))
		require.NoError(t, err)
	}
	_, err := b.alloc.Allocate(ctx, static(10, "10.97.0.9"))
	require.NoError(t, err)
	_, err = b.alloc.Release(ctx, owner(10))
	require.NoError(t, err)
	claimedIn := func(c netip.Prefix) []netip.Prefix {
		infos, err := a.store.ListBlocks(ctx, "two")
		require.NoError(t, err)
		var out []netip.Prefix
		for _, bi := range infos {
			if bi.Claim != nil && c.Overlaps(bi.Block) {
				out = append(out, bi.Block)
			}
		}
		return out
	}
	require.Len(t, claimedIn(old), 2, "a's block with its pods and b's empty one")

	_, err = a.store.RemoveCIDR(ctx, "two", old, false)
	require.ErrorIs(t, err, etcdstore.ErrPoolInUse, "pods and claims in it")

	drained, err := a.store.UpdatePool(ctx, "two", func(p *allocator.Pool) error { return p.Drain(old) })
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{old}, drained.Draining)
	for _, n := range []*testNode{a, b} { // as the agents' pool watch does
		n.alloc.UpdatePool(drained)
		n.alloc.GiveBackEmpty(ctx, "two")
		require.True(t, n.alloc.Serves("two"), "the pool serves on from its other cidr")
	}
	require.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.97.0.0/29")}, claimedIn(old), "b's empty block went back at once")

	// New pods, on a (whose block of the old cidr has free addresses)
	// and on b, all get addresses of the other cidr.
	for i := 20; i < 26; i++ {
		n := a
		if i%2 == 1 {
			n = b
		}
		res, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "two", Owner: owner(i)})
		require.NoError(t, err, "a pod ADD succeeds while a cidr drains")
		require.Len(t, res.Allocations, 1)
		require.True(t, keep.Contains(res.Allocations[0].Addr), "owner %d got %s, in the draining cidr", i, res.Allocations[0].Addr)
	}
	_, err = a.alloc.Allocate(ctx, static(30, "10.97.0.5"))
	require.ErrorIs(t, err, records.ErrBadRequest, "no static address in a draining cidr either")
	require.ErrorContains(t, err, "draining")
	again, err := a.alloc.Allocate(ctx, static(0, "10.97.0.2"))
	require.NoError(t, err, "a retried ADD of a pod that holds its address there needs nothing new")
	require.Equal(t, netip.MustParseAddr("10.97.0.2"), again.Allocations[0].Addr)

	use, err := a.store.CIDRUse(ctx, "two", old)
	require.NoError(t, err)
	require.Equal(t, 1, use.Claimed)
	require.Equal(t, 2, use.Addresses)
	require.Equal(t, []string{"a"}, use.Nodes)

	_, err = a.alloc.Release(ctx, owner(0))
	require.NoError(t, err)
	require.Len(t, claimedIn(old), 1, "a pod is left in the block")
	_, err = a.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	require.Empty(t, claimedIn(old), "the emptied block of the draining cidr goes back")
	require.NotEmpty(t, claimedIn(keep))

	_, err = a.store.RemoveCIDR(ctx, "two", old, false)
	require.ErrorIs(t, err, etcdstore.ErrReservedInCIDR, "a reservation inside it is named, not dropped without a word")
	require.ErrorContains(t, err, "10.97.0.14 (gateway)")
	p, err := a.store.RemoveCIDR(ctx, "two", old, true)
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{keep}, p.CIDRs)
	require.Empty(t, p.Draining, "the cidr's drain goes with it")
	require.Empty(t, p.Reserved)
}

// TestDrainCIDRKeptAddress: a sticky identity's kept address in a
// draining cidr is its own: its next pod takes it back. Once the
// identity's window ends with no pod, the block goes back at the next
// give-back (an operator's drain-cidr run again), though no release
// emptied it.
func TestDrainCIDRKeptAddress(t *testing.T) {
	ctx := context.Background()
	old, keep := netip.MustParsePrefix("10.96.0.0/28"), netip.MustParsePrefix("10.96.1.0/28")
	e := startEtcd(t, allocator.Pool{Name: "two", BlockSizeV4: 29, CIDRs: []netip.Prefix{old, keep}})
	a := startNode(t, e, "a", []string{"two"}, nodeOpts{})
	req := func(o records.Owner) nodealloc.Request {
		return nodealloc.Request{Pool: "two", Owner: o, IPs: []netip.Addr{netip.MustParseAddr("10.96.0.4")},
			Sticky: &records.Sticky{Identity: o.Namespace + "/" + o.Pod, Window: time.Second}}
	}
	_, err := a.alloc.Allocate(ctx, req(stickyPod("db", 1)))
	require.NoError(t, err)
	_, err = a.alloc.Release(ctx, stickyPod("db", 1))
	require.NoError(t, err, "kept for the identity")

	drain := func() {
		p, err := a.store.UpdatePool(ctx, "two", func(p *allocator.Pool) error { return p.Drain(old) })
		require.NoError(t, err)
		a.alloc.UpdatePool(p)
		a.alloc.GiveBackEmpty(ctx, "two")
	}
	drain()
	use, err := a.store.CIDRUse(ctx, "two", old)
	require.NoError(t, err)
	require.Equal(t, 1, use.Claimed, "the kept address holds its block")
	res, err := a.alloc.Allocate(ctx, req(stickyPod("db", 2)))
	require.NoError(t, err, "the identity's next pod takes its address back in a draining cidr")
	require.Equal(t, netip.MustParseAddr("10.96.0.4"), res.Allocations[0].Addr)
	_, err = a.alloc.Release(ctx, stickyPod("db", 2))
	require.NoError(t, err)

	require.Eventually(t, func() bool {
		drain() // drain-cidr run again: the agents give back what emptied
		use, err := a.store.CIDRUse(ctx, "two", old)
		require.NoError(t, err)
		return !use.Any()
	}, 10*time.Second, 200*time.Millisecond, "the block goes back once the identity's window ended")
}
