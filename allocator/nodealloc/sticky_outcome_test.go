package nodealloc_test

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// stickyNode starts node name on pool "one" behind a hookStore.
func stickyNode(t *testing.T, name string) (*testNode, *hookStore, func() *testNode) {
	t.Helper()
	e := startEtcd(t, onePool)
	var h *hookStore
	n := startNode(t, e, name, []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h }})
	other := func() *testNode { return startNode(t, e, "other", []string{"one"}, nodeOpts{}) }
	return n, h, other
}

// lookupAddrs is what the node's cache says the owner holds.
func lookupAddrs(n *testNode, o records.Owner) []netip.Addr {
	var out []netip.Addr
	for _, al := range n.alloc.Lookup(o) {
		out = append(out, al.Addr)
	}
	return out
}

// TestTakeoverAnswerLostThenLateDel: web-0's first container holds x; its
// second container (same pod name, new UID) is ADDed on the same node
// before the first one's DEL, takes x over, and the answer of that
// takeover is lost. The settled cache must index x under the second
// container, so the first container's late DEL keeps nothing and frees
// nothing: x stays the second container's in etcd, and no window that
// would hand x to another pod starts.
func TestTakeoverAnswerLostThenLateDel(t *testing.T) {
	ctx := context.Background()
	a, h, _ := stickyNode(t, "a")
	first, second := stickyPod("web-0", 1), stickyPod("web-0", 2)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, 2*time.Second))
	require.NoError(t, err)
	x := res.Allocations[0].Addr

	h.After("WriteBound", commitThenFail(1))
	res, err = a.alloc.Allocate(ctx, stickyReq(second, 2*time.Second))
	if err != nil { // a try-again is a fair answer; the retry must get x
		res, err = a.alloc.Allocate(ctx, stickyReq(second, 2*time.Second))
	}
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr)
	require.Equal(t, []netip.Addr{x}, lookupAddrs(a, second), "the node knows x as the second container's")
	require.Empty(t, lookupAddrs(a, first), "and nothing as the first's")

	_, err = a.alloc.Release(ctx, first) // the first container's late DEL
	require.NoError(t, err)
	held := holdersOf(t, a.cli)
	require.Equal(t, second.Key(), held[x].Owner.Key(), "x is still the second container's")
	require.Equal(t, records.StateAllocated, held[x].State, "and not kept on a window lease")
	b, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, second.Key(), b.Owner.Key())
}

// TestTakeoverKeptAnswerLost: web-0's address x is kept after its DEL; the
// next container's takeover of x commits and its answer is lost. Nothing
// is cached at a kept address, yet the settled cache must know x as the
// new container's: the ADD (or its retry) gets x and no second address,
// and the container's DEL keeps x for the identity again.
func TestTakeoverKeptAnswerLost(t *testing.T) {
	ctx := context.Background()
	a, h, _ := stickyNode(t, "a")
	first, second := stickyPod("web-0", 1), stickyPod("web-0", 2)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, time.Minute))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, err = a.alloc.Release(ctx, first)
	require.NoError(t, err)
	require.Equal(t, records.StateKept, holdersOf(t, a.cli)[x].State)

	h.After("WriteBound", commitThenFail(1))
	res, err = a.alloc.Allocate(ctx, stickyReq(second, time.Minute))
	if err != nil {
		res, err = a.alloc.Allocate(ctx, stickyReq(second, time.Minute))
	}
	require.NoError(t, err)
	require.Len(t, res.Allocations, 1)
	require.Equal(t, x, res.Allocations[0].Addr)
	require.Len(t, ownerIPsIn(t, a, second), 1, "etcd holds one address for the container")

	_, err = a.alloc.Release(ctx, second)
	require.NoError(t, err)
	held := holdersOf(t, a.cli)
	require.Len(t, held, 1, "nothing leaked")
	require.Equal(t, records.StateKept, held[x].State, "x is kept for web-0 again")
}

// TestKeepAnswerLostFreesAfterWindow: a sticky DEL's keep commits and its
// answer is lost. Whether the DEL or its retry succeeds, the node must
// know x as kept, so that when the window ends x is free again on that
// node: a static request for it then succeeds.
func TestKeepAnswerLostFreesAfterWindow(t *testing.T) {
	ctx := context.Background()
	a, h, _ := stickyNode(t, "a")
	first := stickyPod("web-0", 1)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, 2*time.Second))
	require.NoError(t, err)
	x := res.Allocations[0].Addr

	h.After("Keep", commitThenFail(1))
	if _, err := a.alloc.Release(ctx, first); err != nil {
		_, err = a.alloc.Release(ctx, first) // the runtime retries a DEL
		require.NoError(t, err)
	}
	require.Equal(t, records.StateKept, holdersOf(t, a.cli)[x].State)
	require.Empty(t, lookupAddrs(a, first))
	// The window ends: etcd deletes the kept record with its lease.
	require.Eventually(t, func() bool { _, still := holdersOf(t, a.cli)[x]; return !still }, 30*time.Second, 50*time.Millisecond)
	res, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
	require.NoError(t, err, "x is free on its node once the window has ended")
	require.Equal(t, x, res.Allocations[0].Addr)
}

// TestStickyReservationReleasesBinding: a sticky pod's ADD reserves x and
// binds it, then fails; its DEL releases the reservation, and must take
// the binding with it (it names a container that never ran). The
// identity's next pod is then served even though x went to another pod
// meanwhile. A reservation that lapses leaves a binding that names a
// container holding nothing, which the next pod replaces.
func TestStickyReservationReleasesBinding(t *testing.T) {
	ctx := context.Background()
	for _, how := range []string{"released", "lapsed"} {
		t.Run(how, func(t *testing.T) {
			e := startEtcd(t, onePool)
			a := startNode(t, e, "a", []string{"one"}, nodeOpts{resTTL: 2 * time.Second})
			first := stickyPod("web-0", 1)
			req := stickyReq(first, time.Minute)
			req.Reserve = true
			res, err := a.alloc.Allocate(ctx, req)
			require.NoError(t, err)
			x := res.Allocations[0].Addr
			if how == "released" {
				_, err = a.alloc.Release(ctx, first) // the failed ADD's DEL
				require.NoError(t, err)
				_, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
				require.NoError(t, err)
				require.False(t, ok, "the binding goes with the reservation")
			} else {
				require.Eventually(t, func() bool { _, still := holdersOf(t, a.cli)[x]; return !still }, 30*time.Second, 50*time.Millisecond)
			}
			// Another pod takes x.
			_, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
			require.NoError(t, err)
			// The identity's next pod is served, with another address.
			second := stickyPod("web-0", 2)
			res, err = a.alloc.Allocate(ctx, stickyReq(second, time.Minute))
			require.NoError(t, err)
			require.NotEqual(t, x, res.Allocations[0].Addr)
			b, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, second.Key(), b.Owner.Key())
			require.Equal(t, []netip.Addr{res.Allocations[0].Addr}, b.Addrs)
		})
	}
}

// ownerIPsIn is what etcd holds for o in pool "one".
func ownerIPsIn(t *testing.T, n *testNode, o records.Owner) []netip.Addr {
	t.Helper()
	var out []netip.Addr
	for addr, al := range holdersOf(t, n.cli) {
		if al.Owner.Key() == o.Key() {
			out = append(out, addr)
		}
	}
	return out
}

// TestTakeoverFromAnotherNodeForgetsCached: web-0's first container holds
// x on node a; its next container, on node b, takes x over (borrowed in
// a's block) before the first one's DEL. Node a learns of the loan from
// its watch of homes: its cached allocation of x is then stale (a loan of
// an address is written only over the record it compared), and must go,
// so that once the loan ends x is free on a again, without waiting for a
// DEL of the first container that may never come.
func TestTakeoverFromAnotherNodeForgetsCached(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	first, second := stickyPod("web-0", 1), stickyPod("web-0", 2)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, 2*time.Second))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	res, err = b.alloc.Allocate(ctx, stickyReq(second, 2*time.Second))
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr)
	home, err := a.cli.Get(ctx, etcdstore.LentKey("one", x))
	require.NoError(t, err)
	require.Len(t, home.Kvs, 1)
	a.alloc.NoteLent("one", x, "b", home.Kvs[0].ModRevision, true) // a's watch of homes
	require.Empty(t, lookupAddrs(a, first), "a's cache no longer has x as the first container's")

	_, err = b.alloc.Release(ctx, second) // kept for the window, then gone
	require.NoError(t, err)
	require.Eventually(t, func() bool { _, still := holdersOf(t, a.cli)[x]; return !still }, 30*time.Second, 50*time.Millisecond)
	a.alloc.NoteLent("one", x, "", 0, false)
	_, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
	require.NoError(t, err, "x is free on a once the loan has ended")
}

// TestStickyBindingAloneNotAnswered: a sticky pod's first ADD on a node
// with no block yet. Its address is written with the block's claim, so
// the binding goes alone after it (WriteBound with no address), and that
// write fails: refused before it reached etcd, or applied with its answer
// lost. The ADD must not be answered before the binding is in etcd:
// answered without it, the identity would have no binding, and its next
// pod would not get the address back.
func TestStickyBindingAloneNotAnswered(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before func(context.Context) error
		after  func(context.Context, error) error
	}{
		{name: "too many requests", before: failTimes(1, errTooMany("WriteBound"))},
		{name: "answer lost", after: commitThenAnswer(1, errTimedOut("WriteBound"))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			e := startEtcd(t, onePool)
			var h *hookStore
			a := startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h }})
			calls := 0
			h.Observe(func(op string, _ any) {
				if op == "WriteBound" {
					calls++
				}
			})
			if tc.before != nil {
				h.Before("WriteBound", tc.before)
			}
			if tc.after != nil {
				h.After("WriteBound", tc.after)
			}
			o := stickyPod("web-0", 1)
			req := stickyReq(o, time.Minute)
			req.Reserve = true
			res, err := a.alloc.Allocate(ctx, req)
			require.NoError(t, err)
			require.Len(t, res.Allocations, 1)
			require.Equal(t, 2, calls, "the binding is written again after its write failed")
			b, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
			require.NoError(t, err)
			require.True(t, ok, "the identity is bound before the ADD is answered")
			require.Equal(t, o.Key(), b.Owner.Key())
			require.Equal(t, []netip.Addr{res.Allocations[0].Addr}, b.Addrs)
		})
	}
}

// TestRestoreSweepRetriesRefusedDrop: a sticky reservation lapsed while
// its node restarted, so the restore's sweep drops the binding that names
// the container, which holds nothing. etcd refuses that drop for load
// ("too many requests", nothing written), then answers a second one past
// the call timeout without applying it: the sweep tries again from a
// fresh read of the binding, and the binding is gone when the restore
// ends.
func TestRestoreSweepRetriesRefusedDrop(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	o := stickyPod("web-0", 1)
	lapsedReservation(t, a, o)

	var calls atomic.Int32
	a2 := startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { // the agent restarted
		h := newHookStore(s)
		h.Before("DropStaleBinding", func(context.Context) error {
			switch calls.Add(1) {
			case 1:
				return errTooMany("DropStaleBinding")
			case 2:
				return errTimedOut("DropStaleBinding")
			}
			return nil
		})
		return h
	}})
	require.EqualValues(t, 3, calls.Load(), "refused, unanswered, dropped")
	_, ok, err := a2.store.GetBinding(ctx, "one", "ns/web-0")
	require.NoError(t, err)
	require.False(t, ok, "the restore's sweep dropped the binding")
}
