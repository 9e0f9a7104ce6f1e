package nodealloc_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
)

// stickyPod is the owner of one incarnation of a StatefulSet pod.
func stickyPod(name string, gen int) records.Owner {
	return records.Owner{ContainerID: fmt.Sprintf("%s-c%d", name, gen), IfName: "eth0", Namespace: "ns", Pod: name, PodUID: fmt.Sprintf("uid-%s-%d", name, gen)}
}

func stickyReq(o records.Owner, window time.Duration) nodealloc.Request {
	return nodealloc.Request{Pool: "one", Owner: o, Sticky: &records.Sticky{Identity: o.Namespace + "/" + o.Pod, Window: window}}
}

// TestStickyWindowExpires: a DELeted sticky pod's address goes to no
// other pod while its window runs, whatever the pressure; after it, the
// address returns to the pool by itself.
func TestStickyWindowExpires(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool) // one /28: 14 addresses
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	res, err := a.alloc.Allocate(ctx, stickyReq(stickyPod("web-0", 1), 3*time.Second))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, err = a.alloc.Release(ctx, stickyPod("web-0", 1))
	require.NoError(t, err)
	kept := time.Now()
	hist, err := a.store.History(ctx, etcdstore.HistoryFilter{Pool: "one", IP: x})
	require.NoError(t, err)
	require.Len(t, hist, 1)
	require.Equal(t, etcdstore.EndKept, hist[0].Reason, "IP history ends the pod's interval at its DEL")

	// Every other address goes to other pods, on both nodes; x does not.
	got := map[netip.Addr]bool{}
	for i := 0; ; i++ {
		n := []*testNode{a, b}[i%2]
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(i)})
		if err != nil {
			require.ErrorIs(t, err, records.ErrExhausted)
			break
		}
		got[r.Allocations[0].Addr] = true
	}
	require.Len(t, got, 13)
	require.False(t, got[x], "%s went to another pod inside its window", x)
	_, err = b.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(500), IPs: []netip.Addr{x}})
	require.ErrorIs(t, err, records.ErrIPInUse, "a static request for a kept address fails clearly")
	require.Less(t, time.Since(kept), 3*time.Second, "all of that inside the window")

	// After the window, x returns to the pool.
	var r nodealloc.Result
	require.Eventually(t, func() bool {
		r, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(501)})
		return err == nil
	}, 10*time.Second, 100*time.Millisecond)
	require.Equal(t, x, r.Allocations[0].Addr)
	require.GreaterOrEqual(t, time.Since(kept), 3*time.Second-100*time.Millisecond)
	_, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
	require.NoError(t, err)
	require.False(t, ok, "the binding went with the window")
}

// TestStickyKeptSurvivesRestart: a node restarted while one of its
// addresses is kept for an identity knows it as kept (not as an unknown
// holder), and hands it out again once the window ends.
func TestStickyKeptSurvivesRestart(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	res, err := a.alloc.Allocate(ctx, stickyReq(stickyPod("web-0", 1), 2*time.Second))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	_, err = a.alloc.Release(ctx, stickyPod("web-0", 1))
	require.NoError(t, err)

	a2 := startNode(t, e, "a", []string{"one"}, nodeOpts{}) // the agent restarted
	_, err = a2.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
	require.ErrorIs(t, err, records.ErrIPInUse)
	require.Contains(t, err.Error(), "sticky identity ns/web-0 (kept until", "the restarted node knows why x is taken")
	require.Eventually(t, func() bool {
		_, err = a2.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
		return err == nil
	}, 10*time.Second, 100*time.Millisecond, "x returns once the window ends: %v", err)
}

// TestStickyIdentityFollowsAcrossNodes: web-0 on node a gets x; DEL; the
// re-created web-0 (new container and UID) on node b gets x, borrowed in
// a's block; the first container's late DEL on a frees nothing of it; a
// second live pod claiming web-0 by another name is refused.
func TestStickyIdentityFollowsAcrossNodes(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	b := startNode(t, e, "b", []string{"one"}, nodeOpts{})
	first, second := stickyPod("web-0", 1), stickyPod("web-0", 2)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, time.Minute))
	require.NoError(t, err)
	x := res.Allocations[0].Addr
	// The old pod's node is cut off: no DEL comes before the new pod's ADD.
	res, err = b.alloc.Allocate(ctx, stickyReq(second, time.Minute))
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr, "the re-created pod gets its address on another node")
	require.True(t, res.Allocations[0].Borrowed)
	// IP history ends the first pod's interval at the takeover: the
	// address had two owners, one after the other.
	hist, err := b.store.History(ctx, etcdstore.HistoryFilter{Pool: "one", IP: x})
	require.NoError(t, err)
	require.Len(t, hist, 1)
	require.Equal(t, first.Key(), hist[0].Owner.Key())
	require.Equal(t, etcdstore.EndTakenOver, hist[0].Reason)
	// The late DEL of the first container releases nothing of the second's.
	_, err = a.alloc.Release(ctx, first)
	require.NoError(t, err)
	held := holdersOf(t, a.cli)
	require.Equal(t, second.Key(), held[x].Owner.Key())
	hist, err = a.store.History(ctx, etcdstore.HistoryFilter{Pool: "one", IP: x})
	require.NoError(t, err)
	require.Len(t, hist, 1, "the late DEL records no second interval")
	// A pod of another name claiming the identity while web-0 lives.
	other := stickyPod("web-0-copy", 1)
	_, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: other, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}})
	require.ErrorIs(t, err, records.ErrIdentityInUse)
	// DEL on b, ADD back on a: x moves home.
	_, err = b.alloc.Release(ctx, second)
	require.NoError(t, err)
	third := stickyPod("web-0", 3)
	res, err = a.alloc.Allocate(ctx, stickyReq(third, time.Minute))
	require.NoError(t, err)
	require.Equal(t, x, res.Allocations[0].Addr)
	require.False(t, res.Allocations[0].Borrowed, "back in its own node's block")
	lent, err := a.store.ListLent(ctx, "one")
	require.NoError(t, err)
	require.Empty(t, lent)
}

// TestStickyScaleDownUpRace: web-0..web-4 are deleted and re-created
// concurrently, on random nodes, many rounds: each identity keeps its
// addresses, no address has two owners, and nothing leaks.
func TestStickyScaleDownUpRace(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	nodes := []*testNode{startNode(t, e, "a", []string{"one"}, nodeOpts{}), startNode(t, e, "b", []string{"one"}, nodeOpts{}), startNode(t, e, "c", []string{"one"}, nodeOpts{})}
	const window = 2 * time.Second
	const pods, rounds = 5, 12
	addrOf := make([]netip.Addr, pods)
	var wg sync.WaitGroup
	for p := range pods {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(p), 7))
			name := fmt.Sprintf("web-%d", p)
			var cur *testNode
			for gen := 1; gen <= rounds; gen++ {
				n := nodes[rng.IntN(len(nodes))]
				o := stickyPod(name, gen)
				res, err := n.alloc.Allocate(ctx, stickyReq(o, window))
				if !assertNoErr(t, err, "%s gen %d on %s", name, gen, n.name) {
					return
				}
				got := res.Allocations[0].Addr
				if gen == 1 {
					addrOf[p] = got
				} else if got != addrOf[p] {
					t.Errorf("%s gen %d got %s, not its %s", name, gen, got, addrOf[p])
				}
				// Half the time the old pod's DEL comes late, after the new ADD.
				if cur != nil && rng.IntN(2) == 0 {
					if _, err := cur.alloc.Release(ctx, stickyPod(name, gen-1)); err != nil {
						t.Errorf("late DEL of %s gen %d: %v", name, gen-1, err)
					}
				}
				if gen < rounds && rng.IntN(2) == 0 {
					if _, err := n.alloc.Release(ctx, o); err != nil {
						t.Errorf("DEL of %s gen %d: %v", name, gen, err)
					}
				}
				cur = n
			}
			_, err := cur.alloc.Release(ctx, stickyPod(name, rounds))
			assertNoErr(t, err, "last DEL of %s", name)
		})
	}
	wg.Wait()
	seen := map[netip.Addr]int{}
	for p, addr := range addrOf {
		if q, dup := seen[addr]; dup {
			t.Fatalf("web-%d and web-%d share %s", p, q, addr)
		}
		seen[addr] = p
	}
	// Nothing leaks: once the windows end the pool is empty.
	require.Eventually(t, func() bool { return len(storeIPs(t, nodes[0].cli, "one")) == 0 }, 10*time.Second, 100*time.Millisecond,
		"every kept address returns to the pool")
	lent, err := nodes[0].store.ListLent(ctx, "one")
	require.NoError(t, err)
	require.Empty(t, lent)
	bs, err := nodes[0].store.ListBindings(ctx, "one")
	require.NoError(t, err)
	require.Empty(t, bs, "and the bindings with them")
}

func assertNoErr(t *testing.T, err error, format string, args ...any) bool {
	t.Helper()
	if err != nil {
		t.Errorf(format+": %v", append(args, err)...)
		return false
	}
	return true
}

// TestStickyGCAndStaticConflicts: GC's release of a sticky pod's address
// keeps it for the identity, like a DEL; a static request for a kept
// address, and a sticky pod's static request for another address than
// its identity holds, fail clearly.
func TestStickyGCAndStaticConflicts(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	first := stickyPod("web-0", 1)
	res, err := a.alloc.Allocate(ctx, stickyReq(first, time.Hour))
	require.NoError(t, err)
	x := res.Allocations[0]
	gone, err := a.alloc.ReleaseAllocation(ctx, x)
	require.NoError(t, err)
	require.True(t, gone, "GC's release ends the pod's hold")
	held := holdersOf(t, a.cli)
	require.Equal(t, records.StateKept, held[x.Addr].State, "but the address is kept for web-0, not freed")

	_, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(9), IPs: []netip.Addr{x.Addr}})
	require.ErrorIs(t, err, records.ErrIPInUse)
	require.ErrorContains(t, err, "sticky identity ns/web-0")

	req := stickyReq(stickyPod("web-0", 2), time.Hour)
	req.IPs = []netip.Addr{x.Addr.Next()}
	_, err = a.alloc.Allocate(ctx, req)
	require.ErrorIs(t, err, records.ErrBadRequest)
	require.ErrorContains(t, err, "conflicts with sticky identity ns/web-0")

	req.IPs = []netip.Addr{x.Addr}
	res, err = a.alloc.Allocate(ctx, req)
	require.NoError(t, err, "asking for its own address is fine")
	require.Equal(t, x.Addr, res.Allocations[0].Addr)
}

// lapsedReservation ADDs sticky pod o on a with a reservation, and ends
// the reservation's lease before its time (it lapses); it returns o's
// address.
func lapsedReservation(t *testing.T, a *testNode, o records.Owner) records.Allocation {
	t.Helper()
	ctx := context.Background()
	req := stickyReq(o, time.Minute)
	req.Reserve = true
	res, err := a.alloc.Allocate(ctx, req)
	require.NoError(t, err)
	x := res.Allocations[0]
	lease := holdersOf(t, a.cli)[x.Addr].Lease
	require.NotZero(t, lease, "a reservation is on a lease")
	_, err = a.cli.Revoke(ctx, clientv3.LeaseID(lease))
	require.NoError(t, err)
	return x
}

// lapsedOnHooked starts node a on a hooked store h and lapses sticky pod
// o's reservation (lapsedReservation).
func lapsedOnHooked(t *testing.T) (a *testNode, h *hookStore, o records.Owner) {
	t.Helper()
	e := startEtcd(t, onePool)
	a = startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h }})
	o = stickyPod("web-0", 1)
	lapsedReservation(t, a, o)
	return a, h, o
}

// TestStickyReleaseAfterLapseDropsBinding: a sticky pod's ADD reserved
// its address and bound the identity, and the reservation lapsed before
// the confirm (its lease ended). The pod's DEL finds the address gone
// already; the binding that names the container goes with the DEL, so
// none is left naming a container that holds nothing. So too when the
// release's store call fails before it is sent, or its outcome is
// unknown, and the release is settled by reading the address back.
func TestStickyReleaseAfterLapseDropsBinding(t *testing.T) {
	for _, how := range []string{"answered", "not sent", "outcome unknown"} {
		t.Run(how, func(t *testing.T) {
			ctx := context.Background()
			a, h, o := lapsedOnHooked(t)
			var calls atomic.Int32
			switch how {
			case "not sent":
				h.Before("DeleteIP", func(context.Context) error {
					if calls.Add(1) == 1 {
						return errUnknown
					}
					return nil
				})
			case "outcome unknown":
				h.After("DeleteIP", commitThenFail(1))
			}

			_, err := a.alloc.Release(ctx, o)
			require.NoError(t, err)
			resp, err := a.cli.Get(ctx, etcdstore.BindingKey("one", "ns/web-0"))
			require.NoError(t, err)
			require.Empty(t, resp.Kvs, "the binding went with the DEL")
		})
	}
}

// TestKeptReleasedByOperatorNotRefused: a sticky pod's DEL kept x for its
// identity for an hour, and an operator released x (kvipamctl release
// deletes the kept record and the binding). x is free in etcd: a request
// for it by name gets it, rather than "kept until" the hour is up.
func TestKeptReleasedByOperatorNotRefused(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	o := stickyPod("web-0", 1)
	res, err := a.alloc.Allocate(ctx, stickyReq(o, time.Hour))
	require.NoError(t, err)
	x := res.Allocations[0]
	_, err = a.alloc.Release(ctx, o)
	require.NoError(t, err)
	require.Equal(t, records.StateKept, holdersOf(t, a.cli)[x.Addr].State)
	_, err = a.cli.Delete(ctx, etcdstore.IPKey("one", x.Block, x.Addr)) // the operator's release
	require.NoError(t, err)
	_, err = a.cli.Delete(ctx, etcdstore.BindingKey("one", "ns/web-0"))
	require.NoError(t, err)

	res, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(2), IPs: []netip.Addr{x.Addr}})
	require.NoError(t, err, "x is free in etcd")
	require.Equal(t, x.Addr, res.Allocations[0].Addr)
}

// TestStaleBindingGoneAfterRestart: a sticky pod's ADD reserved its
// address and bound the identity; the reservation lapsed, and the node
// restarted before the pod's DEL, so its cache knows nothing of the
// container. The restore drops the binding that names a container of this
// node holding none of its addresses: the DEL, finding nothing, leaves no
// binding behind (an identity that never comes back would keep it for
// ever). A binding whose container still holds its address, a kept one,
// and one whose container's record etcd lost while its endpoint still
// uses the address (Reassert writes it back), stay.
func TestStaleBindingGoneAfterRestart(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	var held []netip.Addr // set before the restart, read after
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	lapsed, running, kept, lost := stickyPod("web-0", 1), stickyPod("web-1", 1), stickyPod("web-2", 1), stickyPod("web-3", 1)
	lapsedReservation(t, a, lapsed)
	_, err := a.alloc.Allocate(ctx, stickyReq(running, time.Minute))
	require.NoError(t, err)
	_, err = a.alloc.Allocate(ctx, stickyReq(kept, time.Minute))
	require.NoError(t, err)
	_, err = a.alloc.Release(ctx, kept)
	require.NoError(t, err)
	res2, err := a.alloc.Allocate(ctx, stickyReq(lost, time.Minute))
	require.NoError(t, err)
	y := res2.Allocations[0]
	held = []netip.Addr{y.Addr}
	_, err = a.cli.Delete(ctx, etcdstore.IPKey("one", y.Block, y.Addr)) // lost in an etcd restore
	require.NoError(t, err)

	a2 := startNode(t, e, "a", []string{"one"}, nodeOpts{held: func() []netip.Addr { return held }}) // restarted
	bound := func(id string) bool {
		_, ok, err := a2.store.GetBinding(ctx, "one", id)
		require.NoError(t, err)
		return ok
	}
	require.False(t, bound("ns/web-0"), "the binding of the lapsed reservation is gone")
	require.True(t, bound("ns/web-1"), "a running pod's binding stays")
	require.True(t, bound("ns/web-2"), "a kept binding stays")
	require.True(t, bound("ns/web-3"), "the binding of a running endpoint whose record etcd lost stays")
	_, err = a2.alloc.Release(ctx, lapsed)
	require.NoError(t, err)
}

// TestStickyDelAfterConfirmFoundReservationGone: a sticky pod's
// reservation is gone before its confirm (its lease ended early), so the
// confirm fails and the cache forgets the reservation. The pod's DEL then
// finds nothing to release; it still drops the binding that names the
// container, which holds none of its addresses. So too when that drop
// first loses a race that leaves the binding naming the container: it
// is read again and dropped (the model test found a DEL that answered
// success and left the binding, with its faults tripled: seed
// 1795802257299014177).
func TestStickyDelAfterConfirmFoundReservationGone(t *testing.T) {
	for _, race := range []bool{false, true} {
		t.Run(fmt.Sprintf("drop lost a race %v", race), func(t *testing.T) {
			ctx := context.Background()
			a, h, o := lapsedOnHooked(t)
			_, err := a.alloc.Confirm(ctx, o)
			require.ErrorIs(t, err, records.ErrReservationGone)
			if race {
				h.Before("DropStaleBinding", failTimes(1, fmt.Errorf("injected lost race: %w", retry.ErrConflict)))
			}

			gone, err := a.alloc.Release(ctx, o)
			require.NoError(t, err)
			require.Empty(t, gone)
			_, ok, err := a.store.GetBinding(ctx, "one", "ns/web-0")
			require.NoError(t, err)
			require.False(t, ok, "the DEL drops the binding naming the container")
		})
	}
}

// TestStickyDelOfLostRecordDropsBinding: etcd lost a running sticky pod's
// record (a store restored from an older snapshot) but kept its binding,
// and the node restarted; the restore keeps the binding, since the pod's
// endpoint still holds the address. The pod is deleted before Reassert
// writes the record back, so the DEL finds nothing cached. The endpoint
// knows its identity, so the DEL still drops the binding that names the
// container, which holds none of its addresses.
func TestStickyDelOfLostRecordDropsBinding(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{})
	o := stickyPod("web-0", 1)
	res, err := a.alloc.Allocate(ctx, stickyReq(o, time.Minute))
	require.NoError(t, err)
	x := res.Allocations[0]
	_, err = a.cli.Delete(ctx, etcdstore.IPKey("one", x.Block, x.Addr)) // lost in an etcd restore
	require.NoError(t, err)

	a2 := startNode(t, e, "a", []string{"one"}, nodeOpts{held: func() []netip.Addr { return []netip.Addr{x.Addr} }}) // restarted
	_, ok, err := a2.store.GetBinding(ctx, "one", "ns/web-0")
	require.NoError(t, err)
	require.True(t, ok, "the restore keeps the binding of a running endpoint")

	gone, err := a2.alloc.ReleaseAs(ctx, o, "ns/web-0")
	require.NoError(t, err)
	require.Empty(t, gone)
	_, ok, err = a2.store.GetBinding(ctx, "one", "ns/web-0")
	require.NoError(t, err)
	require.False(t, ok, "the DEL drops the binding naming the container")

	other := stickyPod("web-1", 1)
	_, err = a2.alloc.Allocate(ctx, stickyReq(other, time.Minute))
	require.NoError(t, err)
	_, err = a2.alloc.ReleaseAs(ctx, stickyPod("web-1", 2), "ns/web-1")
	require.NoError(t, err)
	b, ok, err := a2.store.GetBinding(ctx, "one", "ns/web-1")
	require.NoError(t, err)
	require.True(t, ok, "a DEL of another container of the identity leaves the binding")
	require.Equal(t, other.Key(), b.Owner.Key())
}

// TestStickyDelOfLostRecordsDropsBinding: etcd lost a running sticky
// pod's records (a restore from an older snapshot) while the binding
// still names it, and the pod's DEL comes before the agent's reassert,
// on a node whose cache still holds the records. The keep finds them
// gone, so nothing is kept; the DEL answers success and drops the
// binding that names the container, which holds nothing now, guarded by
// its revision, and the identity's next pod gets a fresh binding. If one
// of the addresses is another owner's by then (a race), the binding
// goes as well and nothing of the other owner's is touched; so it does
// when the keep's answer is lost and its outcome settled from etcd.
func TestStickyDelOfLostRecordsDropsBinding(t *testing.T) {
	ctx := context.Background()
	dual := allocator.Pool{Name: "dual", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.30.0.0/24"), netip.MustParsePrefix("fd00:30::/120")}, BlockSizeV4: 28, BlockSizeV6: 124}
	req := func(o records.Owner) nodealloc.Request {
		return nodealloc.Request{Pool: "dual", Owner: o, Sticky: &records.Sticky{Identity: "ns/web-0", Window: time.Minute}}
	}
	for _, tc := range []struct {
		name           string
		raced, unknown bool
	}{{name: "lost"}, {name: "raced", raced: true}, {name: "keep-unknown", unknown: true}} {
		raced := tc.raced
		t.Run(tc.name, func(t *testing.T) {
			e := startEtcd(t, dual)
			var h *hookStore
			a := startNode(t, e, "a", []string{"dual"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h }})
			if tc.unknown { // the keep's answer is lost: settled from etcd
				h.Before("Keep", func(context.Context) error { return errUnknown })
			}
			first := stickyPod("web-0", 1)
			res, err := a.alloc.Allocate(ctx, req(first))
			require.NoError(t, err)
			require.Len(t, res.Allocations, 2)
			for _, x := range res.Allocations { // lost in an etcd restore
				_, err = a.cli.Delete(ctx, etcdstore.IPKey("dual", x.Block, x.Addr))
				require.NoError(t, err)
			}
			x := res.Allocations[0]
			var theirs records.Allocation
			if raced { // another owner's ADD got x meanwhile
				claim, err := a.cli.Get(ctx, etcdstore.ClaimKey("dual", x.Block))
				require.NoError(t, err)
				require.Len(t, claim.Kvs, 1)
				_, err = etcdstore.New(a.cli, etcdstore.Options{}).WriteIPs(ctx, []records.IPWrite{{Pool: "dual", Block: x.Block, ClaimRev: claim.Kvs[0].ModRevision,
					Addr: x.Addr, Record: records.Record{Owner: owner(99), Node: "a", State: records.StateAllocated}}})
				require.NoError(t, err)
				theirs = dualHolders(t, a.cli)[x.Addr]
			}

			_, err = a.alloc.ReleaseAs(ctx, first, "ns/web-0")
			require.NoError(t, err)
			_, ok, err := a.store.GetBinding(ctx, "dual", "ns/web-0")
			require.NoError(t, err)
			require.False(t, ok, "the DEL drops the binding naming the container, which holds nothing")
			if raced {
				now, ok := dualHolders(t, a.cli)[x.Addr]
				require.True(t, ok)
				require.Equal(t, theirs.Owner.Key(), now.Owner.Key(), "x is still the other owner's")
				require.Equal(t, theirs.Rev, now.Rev, "untouched")
			} else {
				require.Empty(t, dualHolders(t, a.cli), "nothing kept for the identity")
			}

			second := stickyPod("web-0", 2)
			res, err = a.alloc.Allocate(ctx, req(second))
			require.NoError(t, err)
			b, ok, err := a.store.GetBinding(ctx, "dual", "ns/web-0")
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, second.Key(), b.Owner.Key(), "the identity's next pod gets a fresh binding")
			require.ElementsMatch(t, addrsOf(res.Allocations), b.Addrs)
			if raced {
				require.NotContains(t, b.Addrs, x.Addr)
			}
		})
	}
}

// dualHolders is what etcd holds in pool "dual", by address.
func dualHolders(t *testing.T, cli *clientv3.Client) map[netip.Addr]records.Allocation {
	t.Helper()
	out := map[netip.Addr]records.Allocation{}
	for _, al := range storeIPs(t, cli, "dual") {
		out[al.Addr] = al
	}
	return out
}
