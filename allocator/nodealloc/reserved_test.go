package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestReservedRangeNeverAutoAssigned: two nodes fill a pool with reserved
// ranges; no reserved address is ever handed out automatically, a static
// request may take one, reserving an address in use leaves it to its
// owner, and a configuration's reservations are added to the stored ones.
func TestReservedRangeNeverAutoAssigned(t *testing.T) {
	ctx := context.Background()
	e := etcdtest.Start(t)
	r1, _ := allocator.ParseAddrRange("10.79.0.1-10.79.0.10")
	r2, _ := allocator.ParseAddrRange("10.79.0.32/29")
	p := allocator.Pool{Name: "res", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.79.0.0/26")}, BlockSizeV4: 28,
		Reserved: []allocator.Reservation{{Range: r1, Reason: "gateways"}, {Range: r2, Reason: "VIPs"}}}
	ensurePool(t, e, p)
	a := startNode(t, e, "a", []string{"res"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"res"}, nodeOpts{})
	reserved := func(addr netip.Addr) bool { return r1.Contains(addr) || r2.Contains(addr) }

	// A static request takes a reserved address: that is what it is for.
	static := netip.MustParseAddr("10.79.0.5")
	res, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "res", Owner: owner(1000), IPs: []netip.Addr{static}})
	require.NoError(t, err)
	require.Equal(t, static, res.Allocations[0].Addr)

	// 62 usable, 18 reserved: the two nodes get the other 44 and no more.
	got := map[netip.Addr]bool{}
	var exhausted error
	for i := 0; exhausted == nil; i++ {
		n := []*testNode{a, b}[i%2]
		res, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "res", Owner: owner(i)})
		if err != nil {
			exhausted = err
			break
		}
		addr := res.Allocations[0].Addr
		require.False(t, reserved(addr), "reserved %s handed out automatically", addr)
		require.False(t, got[addr])
		got[addr] = true
	}
	require.ErrorIs(t, exhausted, records.ErrExhausted)
	require.Len(t, got, 44)
	require.Contains(t, exhausted.Error(), "62 addresses, 45 allocated")
	require.Contains(t, exhausted.Error(), "18 reserved")

	// Reserving an address in use takes nothing from its owner; once
	// released it is not handed out again automatically.
	var victim netip.Addr
	var victimOwner int
	for i := 0; ; i += 2 {
		if al := a.alloc.Lookup(owner(i)); len(al) == 1 {
			victim, victimOwner = al[0].Addr, i
			break
		}
	}
	next, err := a.store.UpdatePool(ctx, "res", func(p *allocator.Pool) error {
		p.Reserved = append(p.Reserved, allocator.Reservation{Range: allocator.AddrRange{First: victim, Last: victim}, Reason: "take it back"})
		return nil
	})
	require.NoError(t, err)
	a.alloc.UpdatePool(next) // what the agent's pool watch does
	b.alloc.UpdatePool(next)
	require.Equal(t, victim, a.alloc.Lookup(owner(victimOwner))[0].Addr, "the owner keeps its address")
	inStore := map[netip.Addr]string{}
	for _, al := range storeIPs(t, a.cli, "res") {
		inStore[al.Addr] = al.Owner.Key()
	}
	require.Equal(t, owner(victimOwner).Key(), inStore[victim])
	_, err = a.alloc.Release(ctx, owner(victimOwner))
	require.NoError(t, err)
	for i := range 4 {
		n := []*testNode{a, b}[i%2]
		_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "res", Owner: owner(2000 + i)})
		require.ErrorIs(t, err, records.ErrExhausted, "the released, now reserved %s is not handed out", victim)
	}
	res, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "res", Owner: owner(3000), IPs: []netip.Addr{victim}})
	require.NoError(t, err, "a static request still may")
	require.Equal(t, victim, res.Allocations[0].Addr)

	// An agent's configured reservations are added to what operators set.
	conf := p
	extra, _ := allocator.ParseAddrRange("10.79.0.60")
	conf.Reserved = []allocator.Reservation{{Range: extra, Reason: "from config"}}
	stored, err := a.store.EnsurePool(ctx, conf)
	require.NoError(t, err)
	var ranges []string
	for _, r := range stored.Reserved {
		ranges = append(ranges, r.Range.String())
	}
	require.ElementsMatch(t, []string{"10.79.0.1-10.79.0.10", "10.79.0.32/29", victim.String(), "10.79.0.60"}, ranges)

	// Bad reservations are refused, naming what is wrong.
	for _, tc := range []struct{ r, want string }{
		{"10.80.0.1", "not inside one cidr of the pool"},
		{"10.79.0.8-10.79.0.12", "overlap"},
		{"10.79.0.9-10.79.0.2", "ends before it starts"},
	} {
		_, err := a.store.UpdatePool(ctx, "res", func(p *allocator.Pool) error {
			r, err := allocator.ParseAddrRange(tc.r)
			if err != nil {
				return err
			}
			p.Reserved = append(p.Reserved, allocator.Reservation{Range: r})
			return nil
		})
		require.ErrorContains(t, err, tc.want, fmt.Sprint(tc.r))
	}
}

// TestExhaustionOrphanedIsTemporary: a pool full because a gone node's
// blocks are orphaned says so, names the node, and calls the shortage
// temporary (kvipamctl node remove frees them); orphaned blocks are not
// borrowed from.
func TestExhaustionOrphanedIsTemporary(t *testing.T) {
	ctx := context.Background()
	p := allocator.Pool{Name: "orph", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.81.0.0/27")}, BlockSizeV4: 28}
	e := startEtcd(t, p)
	gone := startNode(t, e, "gone", []string{"orph"}, nodeOpts{})
	_, err := gone.alloc.Allocate(ctx, nodealloc.Request{Pool: "orph", Owner: owner(1)})
	require.NoError(t, err)
	_, err = gone.cli.Revoke(ctx, clientv3.LeaseID(gone.sess.ID()))
	require.NoError(t, err)

	live := startNode(t, e, "live", []string{"orph"}, nodeOpts{})
	var last error
	for i := 100; last == nil; i++ {
		_, last = live.alloc.Allocate(ctx, nodealloc.Request{Pool: "orph", Owner: owner(i)})
	}
	var ee *records.ExhaustedError
	require.ErrorAs(t, last, &ee)
	require.True(t, ee.Temporary())
	require.Equal(t, 1, ee.Orphaned)
	require.Contains(t, last.Error(), "1 addresses in orphaned blocks of gone come free with kvipamctl node remove")
	require.Equal(t, 15, ee.Allocated-1, "the live node filled its own block, and took nothing from the orphaned one")
}

// TestReuseCooldown: a released address is not handed out again while
// the cooldown runs and another address is free; when none is, the
// oldest released one is, rather than more of the pool.
func TestReuseCooldown(t *testing.T) {
	ctx := context.Background()
	p := allocator.Pool{Name: "cool", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.83.0.0/28")}, BlockSizeV4: 28, ReuseCooldown: allocator.DurationOf(time.Hour)}
	e := startEtcd(t, p)
	n := startNode(t, e, "n", []string{"cool"}, nodeOpts{})
	addr := func(i int) netip.Addr {
		res, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "cool", Owner: owner(i)})
		require.NoError(t, err)
		return res.Allocations[0].Addr
	}
	// 14 usable, all taken; three released, newest last.
	held := map[int]netip.Addr{}
	for i := range 14 {
		held[i] = addr(i)
	}
	for _, i := range []int{9, 2, 6} {
		_, err := n.alloc.Release(ctx, owner(i))
		require.NoError(t, err)
	}
	// Nothing else is free: the released ones come back oldest first,
	// where next-fit alone would give the lowest (2, 6, 9).
	require.Equal(t, held[9], addr(101))
	require.Equal(t, held[2], addr(102))
	require.Equal(t, held[6], addr(103))
	_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "cool", Owner: owner(104)})
	require.ErrorIs(t, err, records.ErrExhausted)

	// Asked for by name, a cooling address is handed out at once.
	_, err = n.alloc.Release(ctx, owner(0))
	require.NoError(t, err)
	res, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "cool", Owner: owner(105), IPs: []netip.Addr{held[0]}})
	require.NoError(t, err)
	require.Equal(t, held[0], res.Allocations[0].Addr)
}
