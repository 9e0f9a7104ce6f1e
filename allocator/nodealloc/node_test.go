package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/internal/foundation/retry"
	"github.com/kvipam/kvipam/internal/testsupport/agenttest"
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// testNode is one simulated agent: its own etcd client, lease and allocator.
type testNode struct {
	name  string
	cli   *clientv3.Client
	store *etcdstore.Store
	sess  *kvstore.Session
	alloc *nodealloc.Allocator
}

type nodeOpts struct {
	ttl    int64
	resTTL time.Duration
	// wrap, if set, puts a wrapper (a hookStore) between the allocator
	// and the real store.
	wrap func(records.Store) records.Store
	// held is what the node's endpoints use (Config.Held).
	held func() []netip.Addr
	// labels are the node's labels (Config.Labels).
	labels map[string]string
}

func startNode(t testing.TB, e *kvstore.Embedded, name string, pools []string, o nodeOpts) *testNode {
	t.Helper()
	ctx := context.Background()
	if o.ttl == 0 {
		o.ttl = 30
	}
	cli := etcdtest.Client(t, e)
	st := etcdstore.New(cli, etcdstore.Options{ReservationTTL: o.resTTL})
	sess, err := kvstore.NewSession(ctx, cli, o.ttl)
	require.NoError(t, err)
	t.Cleanup(sess.Close)
	var use records.Store = st
	if o.wrap != nil {
		use = o.wrap(st)
	}
	al, err := nodealloc.New(nodealloc.Config{Node: name, Store: use, Held: o.held, Labels: o.labels})
	require.NoError(t, err)
	require.NoError(t, al.Restore(ctx, sess))
	for _, p := range pools { // the node serves every pool in etcd
		_, ok := al.Pool(p)
		require.True(t, ok, "pool %s in etcd", p)
	}
	return &testNode{name: name, cli: cli, store: st, sess: sess, alloc: al}
}

// startEtcd starts a fresh embedded etcd for the test, with pools in it:
// the fixture every test of the node allocator starts from.
func startEtcd(t testing.TB, pools ...allocator.Pool) *kvstore.Embedded {
	t.Helper()
	e := etcdtest.Start(t)
	for _, p := range pools {
		ensurePool(t, e, p)
	}
	return e
}

func ensurePool(t testing.TB, e *kvstore.Embedded, p allocator.Pool) {
	t.Helper()
	_, err := etcdstore.New(etcdtest.Client(t, e), etcdstore.Options{}).EnsurePool(context.Background(), p)
	require.NoError(t, err)
}

func owner(i int) records.Owner {
	return records.Owner{ContainerID: fmt.Sprintf("ctr-%04d", i), IfName: "eth0", Namespace: "default", Pod: fmt.Sprintf("pod-%d", i)}
}

// storeIPs reads every allocation of a pool straight from etcd.
func storeIPs(t testing.TB, cli *clientv3.Client, pool string) []records.Allocation {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.IPsPrefix(pool), clientv3.WithPrefix())
	require.NoError(t, err)
	out, err := agenttest.DecodeAllocations(pool, resp.Kvs)
	require.NoError(t, err)
	return out
}

func claimOf(t testing.TB, cli *clientv3.Client, pool string, b netip.Prefix) *records.Claim {
	t.Helper()
	v, err := kvstore.GetJSON[records.Claim](context.Background(), cli, etcdstore.ClaimKey(pool, b))
	if errors.Is(err, kvstore.ErrNotFound) {
		return nil
	}
	require.NoError(t, err)
	return &v.Value
}

var small = allocator.Pool{Name: "small", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/24")}, BlockSizeV4: 28}

func TestConcurrentNodesExhaustPool(t *testing.T) {
	e := startEtcd(t, small)
	const nodes = 16
	ns := make([]*testNode, nodes)
	for i := range ns {
		ns[i] = startNode(t, e, fmt.Sprintf("node-%02d", i), []string{"small"}, nodeOpts{})
	}
	// 16 blocks of 16 addresses, less network and broadcast: 254 usable.
	capacity := 254
	var mu sync.Mutex
	got := map[netip.Addr]string{}
	var exhausted []error
	var wg sync.WaitGroup
	for i, n := range ns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; ; j++ {
				o := owner(i*1000 + j)
				res, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o})
				if err != nil {
					mu.Lock()
					exhausted = append(exhausted, err)
					mu.Unlock()
					return
				}
				mu.Lock()
				for _, al := range res.Allocations {
					if prev, dup := got[al.Addr]; dup {
						t.Errorf("%s handed to %s and %s", al.Addr, prev, o.Key())
					}
					got[al.Addr] = o.Key()
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	require.Len(t, got, capacity, "every usable address handed out exactly once")
	pfx := small.CIDRs[0]
	for a := range got {
		require.True(t, pfx.Contains(a), "%s outside the pool", a)
		require.NotEqual(t, pfx.Addr(), a, "network address handed out")
	}
	require.Len(t, exhausted, nodes)
	for _, err := range exhausted {
		var ee *records.ExhaustedError
		require.ErrorAs(t, err, &ee, "each node stops on a clean exhaustion error, got %v", err)
		require.Equal(t, uint64(16), ee.Blocks)
		require.Equal(t, 16, ee.Claimed)
		require.Contains(t, err.Error(), "pool small exhausted (ipv4): 254 addresses, 254 allocated")
		require.False(t, ee.Temporary(), "every address is allocated for good: %v", err)
	}
	// etcd agrees with what the callers were told.
	inStore := storeIPs(t, ns[0].cli, "small")
	require.Len(t, inStore, capacity)
	for _, al := range inStore {
		require.Equal(t, got[al.Addr], al.Owner.Key())
		c := claimOf(t, ns[0].cli, "small", al.Block)
		require.NotNil(t, c)
		if al.Borrowed {
			require.NotEqual(t, c.Node, al.Node, "borrowed %s from another node's block", al.Addr)
		} else {
			require.Equal(t, c.Node, al.Node, "allocation %s is in a block of its own node", al.Addr)
		}
	}
}

func TestAllocateIsIdempotentAndReleaseIsGuarded(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	o := owner(1)
	r1, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
	require.NoError(t, err)
	r2, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
	require.NoError(t, err)
	require.Equal(t, r1.Allocations[0].Addr, r2.Allocations[0].Addr, "a retried allocate returns the same ip")
	require.Len(t, storeIPs(t, n.cli, "small"), 1)

	rel, err := n.alloc.Release(ctx, o)
	require.NoError(t, err)
	require.Len(t, rel, 1)
	rel, err = n.alloc.Release(ctx, o)
	require.NoError(t, err, "a second release succeeds")
	require.Empty(t, rel)

	// A stale release (revision of the old allocation) cannot free the
	// address after it was handed out again.
	al := r1.Allocations[0]
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2), IPs: []netip.Addr{al.Addr}})
	require.NoError(t, err)
	err = n.store.DeleteIP(ctx, al)
	require.ErrorIs(t, err, retry.ErrConflict)
	require.Len(t, storeIPs(t, n.cli, "small"), 1)
}

func TestReleasedAddressIsNotReusedAtOnce(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.NoError(t, err)
	first := r.Allocations[0].Addr
	_, err = n.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	for i := 2; i < 10; i++ {
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		require.NotEqual(t, first, r.Allocations[0].Addr, "a just-released ip comes back only after the block is walked")
	}
}

func TestStaticIP(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n1 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})
	want := netip.MustParseAddr("10.20.0.77")
	r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), IPs: []netip.Addr{want}})
	require.NoError(t, err)
	require.Equal(t, want, r.Allocations[0].Addr)
	require.Equal(t, "n1", claimOf(t, n1.cli, "small", netip.MustParsePrefix("10.20.0.64/28")).Node, "the block was claimed for the static ip")

	_, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2), IPs: []netip.Addr{want}})
	require.ErrorIs(t, err, records.ErrIPInUse)
	// In another node's block, the address is borrowed; one held there
	// is in use.
	r, err = n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(3), IPs: []netip.Addr{netip.MustParseAddr("10.20.0.78")}})
	require.NoError(t, err, "another node's block")
	require.True(t, r.Allocations[0].Borrowed)
	_, err = n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(6), IPs: []netip.Addr{want}})
	require.ErrorIs(t, err, records.ErrIPInUse)
	_, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(4), IPs: []netip.Addr{netip.MustParseAddr("10.99.0.1")}})
	require.ErrorIs(t, err, records.ErrBadRequest)
	_, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(5), IPs: []netip.Addr{netip.MustParseAddr("10.20.0.0")}})
	require.ErrorIs(t, err, records.ErrBadRequest, "the pool's network address")
}

func TestRevokedLeaseOrphansBlocksUntilOwnerReturns(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n1 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	var held []records.Allocation
	for i := range 20 { // spills into a second block
		r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		held = append(held, r.Allocations...)
	}
	// And one block that ends up empty: claim it through a static ip, then release.
	emptyIP := netip.MustParseAddr("10.20.0.250")
	_, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(99), IPs: []netip.Addr{emptyIP}})
	require.NoError(t, err)
	_, err = n1.alloc.Release(ctx, owner(99))
	require.NoError(t, err)
	emptyBlock := netip.MustParsePrefix("10.20.0.240/28")
	// maybeUnclaim gives an empty block back when another block remains.
	require.Nil(t, claimOf(t, n1.cli, "small", emptyBlock))
	_, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(99), IPs: []netip.Addr{emptyIP}})
	require.NoError(t, err)
	_, err = n1.alloc.Release(ctx, owner(99))
	require.NoError(t, err)

	// Claim it once more, directly, so that n1 holds a claimed empty block
	// when its lease ends.
	_, err = n1.store.Claim(ctx, "small", emptyBlock, records.Claim{Node: "n1"}, n1.sess.ID())
	require.NoError(t, err)

	// n1's lease ends as if it crashed and stayed away past the TTL.
	_, err = n1.cli.Revoke(ctx, clientv3.LeaseID(n1.sess.ID()))
	require.NoError(t, err)

	n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})
	heldBlocks := map[netip.Prefix]bool{}
	for _, al := range held {
		heldBlocks[al.Block] = true
	}
	require.Len(t, heldBlocks, 2)
	for b := range heldBlocks {
		_, err := n2.store.Claim(ctx, "small", b, records.Claim{Node: "n2"}, n2.sess.ID())
		var ce *records.ClaimError
		require.ErrorAs(t, err, &ce, "an orphaned block cannot be claimed by another node")
		require.True(t, ce.NonEmpty)
		require.Equal(t, "n1", ce.HomeNode)
	}
	// n2 fills the whole rest of the pool and never lands in n1's blocks.
	for i := 1000; ; i++ {
		r, err := n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		if err != nil {
			var ee *records.ExhaustedError
			require.ErrorAs(t, err, &ee)
			require.Equal(t, 2, ee.Orphaned, "the two orphaned blocks are reported as such")
			break
		}
		require.False(t, heldBlocks[r.Allocations[0].Block], "n2 allocated %s in an orphaned block", r.Allocations[0].Addr)
	}
	require.Equal(t, "n2", claimOf(t, n2.cli, "small", emptyBlock).Node, "an expired empty block is free for another node")

	// n1 comes back: it re-claims its blocks and keeps every ip.
	n1b := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	for b := range heldBlocks {
		require.Equal(t, "n1", claimOf(t, n1b.cli, "small", b).Node)
	}
	for i, al := range held {
		got := n1b.alloc.Lookup(owner(i))
		require.Len(t, got, 1)
		require.Equal(t, al.Addr, got[0].Addr)
	}
	// And it may keep allocating in the free room of its own blocks.
	_, err = n1b.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(500)})
	require.NoError(t, err)
}

func TestStaleWriterIsFenced(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n1 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.NoError(t, err)
	block := r.Allocations[0].Block
	oldRev := claimRev(t, n1.cli, block)
	_, err = n1.alloc.Release(ctx, owner(1))
	require.NoError(t, err)

	// The claim is lost (lease gone) while n1 still believes it owns the block...
	_, err = n1.cli.Revoke(ctx, clientv3.LeaseID(n1.sess.ID()))
	require.NoError(t, err)
	// ...and n2 claims the now-free block.
	n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})
	_, err = n2.store.Claim(ctx, "small", block, records.Claim{Node: "n2"}, n2.sess.ID())
	require.NoError(t, err)

	// A write with n1's old claim revision is refused by etcd.
	addr := block.Addr().Next()
	_, err = n1.store.WriteIPs(ctx, []records.IPWrite{{Pool: "small", Block: block, ClaimRev: oldRev, Addr: addr,
		Record: records.Record{Owner: owner(2), Node: "n1", State: records.StateAllocated}}})
	var we *records.WriteError
	require.ErrorAs(t, err, &we)
	require.Equal(t, []netip.Prefix{block}, we.Fenced)
	require.Empty(t, storeIPs(t, n1.cli, "small"))

	// So is the allocator itself: its lease is gone, it answers "try again".
	_, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(3)})
	require.ErrorIs(t, err, records.ErrLeaseLost)
}

// TestFencedAllocatorMovesOn covers the case where the lease is fine but
// the claim changed under the allocator (an admin freed the block).
func TestFencedAllocatorMovesOn(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n1 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.NoError(t, err)
	block := r.Allocations[0].Block
	_, err = n1.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	_, err = n1.cli.Delete(ctx, etcdstore.ClaimKey("small", block))
	require.NoError(t, err)
	n2 := startNode(t, e, "n2", []string{"small"}, nodeOpts{})
	_, err = n2.store.Claim(ctx, "small", block, records.Claim{Node: "n2"}, n2.sess.ID())
	require.NoError(t, err)

	r, err = n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2)})
	require.NoError(t, err)
	require.NotEqual(t, block, r.Allocations[0].Block, "the fenced node claimed another block")
	for _, al := range storeIPs(t, n1.cli, "small") {
		require.Equal(t, claimOf(t, n1.cli, "small", al.Block).Node, al.Node)
	}
}

func claimRev(t testing.TB, cli *clientv3.Client, b netip.Prefix) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), etcdstore.ClaimKey("small", b))
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	return resp.Kvs[0].ModRevision
}

func TestReservationExpiresUnlessConfirmed(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{resTTL: time.Second})
	kept, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	require.False(t, kept.Expires.IsZero())
	require.Equal(t, records.StateReserved, kept.Allocations[0].State)
	lapsed, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2), Reserve: true})
	require.NoError(t, err)
	conf, err := n.alloc.Confirm(ctx, owner(1))
	require.NoError(t, err)
	require.Equal(t, records.StateAllocated, conf[0].State)

	// Wait for etcd to expire the reservation lease: watch for the delete.
	lapsedKey := etcdstore.IPKey("small", lapsed.Allocations[0].Block, lapsed.Allocations[0].Addr)
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	wch := n.cli.Watch(wctx, lapsedKey, clientv3.WithRev(conf[0].Rev))
	deleted := false
	for resp := range wch {
		for _, ev := range resp.Events {
			deleted = deleted || ev.Type == clientv3.EventTypeDelete
		}
		if deleted {
			break
		}
	}
	require.True(t, deleted, "the unconfirmed reservation disappears with its lease")
	got := storeIPs(t, n.cli, "small")
	require.Len(t, got, 1, "the confirmed allocation survives the lease")
	require.Equal(t, kept.Allocations[0].Addr, got[0].Addr)
	require.Zero(t, got[0].Lease)

	_, err = n.alloc.Confirm(ctx, owner(2))
	require.ErrorIs(t, err, records.ErrReservationGone, "a lapsed reservation cannot be confirmed")
}

func TestRestoreKeepsEveryIP(t *testing.T) {
	ctx := context.Background()
	dual := allocator.Pool{Name: "dual", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.30.0.0/16"), netip.MustParsePrefix("fd00:30::/64")}, BlockSizeV4: 26, BlockSizeV6: 120}
	e := startEtcd(t, dual)
	n := startNode(t, e, "n1", []string{"dual"}, nodeOpts{})
	want := map[string][]netip.Addr{}
	for i := range 150 {
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "dual", Owner: owner(i)})
		require.NoError(t, err)
		require.Len(t, r.Allocations, 2, "one address per family")
		for _, al := range r.Allocations {
			want[owner(i).Key()] = append(want[owner(i).Key()], al.Addr)
		}
	}
	before := storeIPs(t, n.cli, "dual")
	n.sess.Close() // as a crash: the lease keeps running

	n2 := startNode(t, e, "n1", []string{"dual"}, nodeOpts{})
	for i := range 150 {
		var got []netip.Addr
		for _, al := range n2.alloc.Lookup(owner(i)) {
			got = append(got, al.Addr)
		}
		require.Equal(t, want[owner(i).Key()], got)
	}
	after := storeIPs(t, n.cli, "dual")
	require.Equal(t, len(before), len(after))
	for i := range before {
		require.Equal(t, before[i].Addr, after[i].Addr)
		require.Equal(t, before[i].Rev, after[i].Rev, "restore rewrote no allocation")
	}
	// The claims moved to the new lease, so the old one's expiry cannot take them.
	blocks, err := n2.store.ListBlocks(ctx, "dual")
	require.NoError(t, err)
	for _, b := range blocks {
		require.Equal(t, n2.sess.ID(), b.ClaimLease)
	}
}

func TestBatchIsOneTransaction(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(0)}) // claims the first block
	require.NoError(t, err)
	before, err := n.cli.Get(ctx, "x")
	require.NoError(t, err)
	reqs := []nodealloc.Request{}
	for i := 1; i <= 10; i++ {
		reqs = append(reqs, nodealloc.Request{Pool: "small", Owner: owner(i)})
	}
	reqs = append(reqs, nodealloc.Request{Pool: "small", Owner: owner(1)}) // same owner twice
	reqs = append(reqs, nodealloc.Request{Pool: "nope", Owner: owner(11)})
	out := n.alloc.AllocateBatch(ctx, reqs)
	after, err := n.cli.Get(ctx, "x")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision+1, after.Header.Revision, "ten allocations, one revision")
	for i := range 10 {
		require.NoError(t, out[i].Err)
	}
	require.NoError(t, out[10].Err)
	require.Equal(t, out[0].Result.Allocations[0].Addr, out[10].Result.Allocations[0].Addr)
	require.ErrorIs(t, out[11].Err, records.ErrPoolNotFound)
}

func TestIPv6LargePool(t *testing.T) {
	ctx := context.Background()
	v6 := allocator.Pool{Name: "v6", CIDRs: []netip.Prefix{netip.MustParsePrefix("fd00:64::/64")}, BlockSizeV6: 120}
	e := startEtcd(t, v6)
	n := startNode(t, e, "n1", []string{"v6"}, nodeOpts{})
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "v6", Owner: owner(1)})
	require.NoError(t, err)
	require.True(t, v6.CIDRs[0].Contains(r.Allocations[0].Addr))
	require.Equal(t, 120, r.Allocations[0].Block.Bits())
	_, err = n.alloc.Allocate(ctx, nodealloc.Request{Pool: "v6", Owner: owner(2), Families: []allocator.Family{allocator.IPv4}})
	require.ErrorIs(t, err, records.ErrBadRequest)
}

func TestLargeBatchIsSplitUnderEtcdLimits(t *testing.T) {
	ctx := context.Background()
	big := allocator.Pool{Name: "big", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.40.0.0/16"), netip.MustParsePrefix("fd00:40::/64")}, BlockSizeV4: 24, BlockSizeV6: 120}
	e := startEtcd(t, big)
	n := startNode(t, e, "n1", []string{"big"}, nodeOpts{})
	_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "big", Owner: owner(0)})
	require.NoError(t, err)
	before, err := n.cli.Get(ctx, "x")
	require.NoError(t, err)
	var reqs []nodealloc.Request
	for i := 1; i <= 100; i++ { // 200 writes: over etcd's 128 ops per transaction
		reqs = append(reqs, nodealloc.Request{Pool: "big", Owner: owner(i)})
	}
	for i, o := range n.alloc.AllocateBatch(ctx, reqs) {
		require.NoError(t, o.Err, i)
		require.Len(t, o.Result.Allocations, 2)
	}
	after, err := n.cli.Get(ctx, "x")
	require.NoError(t, err)
	require.Equal(t, int64(3), after.Header.Revision-before.Header.Revision, "100 requests in ceil(100/MaxBatch) transactions")
}

// TestHandWrittenKeysDoNotStopANode: garbage an operator wrote under a
// node's block neither stops its restore nor gets its address reused.
func TestHandWrittenKeysDoNotStopANode(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.NoError(t, err)
	b := r.Allocations[0].Block
	junkAddr := r.Allocations[0].Addr.Next()
	_, err = n.cli.Put(ctx, etcdstore.IPKey("small", b, junkAddr), "not json")
	require.NoError(t, err)
	_, err = n.cli.Put(ctx, etcdstore.BlockIPsPrefix("small", b)+"garbage", "{}")
	require.NoError(t, err)
	_, err = n.cli.Put(ctx, etcdstore.ClaimsPrefix("small")+"not-a-block", "{}")
	require.NoError(t, err)
	n.sess.Close()

	n2 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	for i := 2; i < 20; i++ {
		r, err := n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(i)})
		require.NoError(t, err)
		require.NotEqual(t, junkAddr, r.Allocations[0].Addr, "the hand-written address is never handed out")
	}
}

// TestRestoredReservationLapses: after a restart, a reservation whose
// lease has ended is not handed back to a retried ADD.
func TestRestoredReservationLapses(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	n.sess.Close()
	// The reservation lease ends while nobody watches (agent down).
	_, err = n.cli.Revoke(ctx, clientv3.LeaseID(storeIPs(t, n.cli, "small")[0].Lease))
	require.NoError(t, err)
	n2 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	require.Empty(t, n2.alloc.Lookup(owner(1)), "a lapsed reservation is not restored")
	r2, err := n2.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	require.NotEqual(t, r.Allocations[0].Rev, r2.Allocations[0].Rev, "a fresh reservation")
	_, err = n2.alloc.Confirm(ctx, owner(1))
	require.NoError(t, err)
}
