package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/kvipam/kvipam/kvstore"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// hooked starts a node whose store is a hookStore over the real etcd.
func hooked(t testing.TB, e *kvstore.Embedded, name string, o nodeOpts) (*testNode, *hookStore) {
	t.Helper()
	var h *hookStore
	o.wrap = func(s records.Store) records.Store { h = newHookStore(s); return h }
	n := startNode(t, e, name, []string{"small"}, o)
	return n, h
}

// ownerIPs is what etcd holds for one owner, by address.
func ownerIPs(t testing.TB, cli *clientv3.Client, o records.Owner) map[netip.Addr]records.Allocation {
	t.Helper()
	out := map[netip.Addr]records.Allocation{}
	for _, al := range storeIPs(t, cli, "small") {
		if al.Owner.Key() == o.Key() {
			out[al.Addr] = al
		}
	}
	return out
}

// stored strips what only the node's memory knows (when it learned of an
// allocation), leaving what etcd holds.
func stored(als []records.Allocation) []records.Allocation {
	out := make([]records.Allocation, len(als))
	for i, al := range als {
		al.Seen = time.Time{}
		out[i] = al
	}
	return out
}

// deadlineAfterCommit is an After hook for a write: the write is applied,
// then the caller's deadline ends before the answer arrives, so neither the
// write's answer nor any later read with the same context gets through.
func deadlineAfterCommit(cancel context.CancelFunc) func(context.Context, error) error {
	var once sync.Once
	return func(ctx context.Context, err error) error {
		if err != nil {
			return err
		}
		fired := false
		once.Do(func() { cancel(); fired = true })
		if fired {
			return fmt.Errorf("%w: %w", errUnknown, context.DeadlineExceeded)
		}
		return err
	}
}

// claimFirst has the node claim its block with an allocation of its own
// (owner 99), so that the next one is a write of its own (WriteIPs), not
// written with the claim.
func claimFirst(t testing.TB, n *testNode) {
	t.Helper()
	_, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: owner(99)})
	require.NoError(t, err)
}

// TestUnknownOutcomeRetryGetsSameAddress forces writes that commit in etcd
// and then report an error (the client's deadline ended first). The
// allocator must find out what landed before it undoes or retries
// anything: the caller, or its retry, gets the address that landed, and
// etcd never holds two addresses of one family for the owner.
func TestUnknownOutcomeRetryGetsSameAddress(t *testing.T) {
	for _, reserve := range []bool{true, false} {
		t.Run(fmt.Sprintf("reserve=%v/answer-lost", reserve), func(t *testing.T) {
			e := startEtcd(t, small)
			n, h := hooked(t, e, "n1", nodeOpts{})
			claimFirst(t, n)
			o := owner(1)
			h.After("WriteIPs", commitThenFail(1))
			r1, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o, Reserve: reserve})
			require.NoError(t, err, "the write landed and a read says so")
			h.Clear()
			held := ownerIPs(t, n.cli, o)
			require.Len(t, held, 1, "etcd holds one address for the owner: %v", held)
			require.Contains(t, held, r1.Allocations[0].Addr)
			r2, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o, Reserve: reserve})
			require.NoError(t, err)
			require.Equal(t, r1.Allocations[0].Addr, r2.Allocations[0].Addr)
		})
		t.Run(fmt.Sprintf("reserve=%v/deadline", reserve), func(t *testing.T) {
			e := startEtcd(t, small)
			n, h := hooked(t, e, "n1", nodeOpts{})
			claimFirst(t, n)
			o := owner(1)
			ctx, cancel := context.WithCancel(context.Background())
			h.After("WriteIPs", deadlineAfterCommit(cancel))
			_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o, Reserve: reserve})
			require.Error(t, err, "nothing could be read with the caller's context")
			h.Clear()
			landed := ownerIPs(t, n.cli, o)
			require.Len(t, landed, 1, "the first write landed")
			r, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o, Reserve: reserve})
			require.NoError(t, err)
			require.Len(t, r.Allocations, 1)
			require.Contains(t, landed, r.Allocations[0].Addr, "the retried ADD gets the address that landed")
			require.Len(t, ownerIPs(t, n.cli, o), 1, "and no second one")
			require.Equal(t, r.Allocations, n.alloc.Lookup(o))
		})
	}
	t.Run("claim-with-first/deadline", func(t *testing.T) {
		// The first address is written with the block's claim: the same
		// holds of that transaction.
		e := startEtcd(t, small)
		n, h := hooked(t, e, "n1", nodeOpts{})
		o := owner(1)
		ctx, cancel := context.WithCancel(context.Background())
		h.After("Claim", deadlineAfterCommit(cancel))
		_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
		require.Error(t, err, "nothing could be read with the caller's context")
		h.Clear()
		landed := ownerIPs(t, n.cli, o)
		require.Len(t, landed, 1, "the claim and its first address landed")
		r, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o})
		require.NoError(t, err)
		require.Len(t, r.Allocations, 1)
		require.Contains(t, landed, r.Allocations[0].Addr, "the retried ADD gets the address that landed")
		require.Len(t, ownerIPs(t, n.cli, o), 1, "and no second one")
		require.Equal(t, r.Allocations, n.alloc.Lookup(o))
	})
	t.Run("batch", func(t *testing.T) {
		e := startEtcd(t, small)
		n, h := hooked(t, e, "n1", nodeOpts{})
		h.After("WriteIPs", commitThenFail(1))
		reqs := []nodealloc.Request{{Pool: "small", Owner: owner(1), Reserve: true}, {Pool: "small", Owner: owner(2), Reserve: true}, {Pool: "small", Owner: owner(3)}}
		out := n.alloc.AllocateBatch(context.Background(), reqs)
		h.Clear()
		for i, oc := range out {
			require.NoError(t, oc.Err)
			held := ownerIPs(t, n.cli, reqs[i].Owner)
			require.Len(t, held, 1, "owner %d: %v", i, held)
			require.Contains(t, held, oc.Result.Allocations[0].Addr)
		}
		require.Len(t, storeIPs(t, n.cli, "small"), 3)
	})
	t.Run("confirm", func(t *testing.T) {
		e := startEtcd(t, small)
		n, h := hooked(t, e, "n1", nodeOpts{})
		o := owner(1)
		r, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o, Reserve: true})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		h.After("WriteIPs", deadlineAfterCommit(cancel))
		_, err = n.alloc.Confirm(ctx, o)
		require.Error(t, err)
		h.Clear()
		got, err := n.alloc.Confirm(context.Background(), o)
		require.NoError(t, err, "the retried confirm finds its first attempt landed")
		require.Len(t, got, 1)
		require.Equal(t, r.Allocations[0].Addr, got[0].Addr)
		require.Equal(t, records.StateAllocated, got[0].State)
		held := ownerIPs(t, n.cli, o)
		require.Len(t, held, 1)
		require.Equal(t, records.StateAllocated, held[got[0].Addr].State)
		require.Zero(t, held[got[0].Addr].Lease, "permanent: off the reservation lease")
	})
	t.Run("release", func(t *testing.T) {
		e := startEtcd(t, small)
		n, h := hooked(t, e, "n1", nodeOpts{})
		o := owner(1)
		_, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o})
		require.NoError(t, err)
		h.After("DeleteIP", commitThenFail(1))
		_, err = n.alloc.Release(context.Background(), o)
		require.NoError(t, err, "the delete landed and a read says so")
		h.Clear()
		require.Empty(t, n.alloc.Lookup(o))
		require.Empty(t, storeIPs(t, n.cli, "small"))
	})
	t.Run("release/deadline", func(t *testing.T) {
		e := startEtcd(t, small)
		n, h := hooked(t, e, "n1", nodeOpts{})
		o := owner(1)
		r, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		h.After("DeleteIP", deadlineAfterCommit(cancel))
		_, err = n.alloc.Release(ctx, o)
		require.Error(t, err)
		h.Clear()
		require.Empty(t, storeIPs(t, n.cli, "small"), "the delete landed")
		// The owner's next ADD must not be answered with the address that
		// is gone from etcd: it gets one that etcd holds.
		again, err := n.alloc.Allocate(context.Background(), nodealloc.Request{Pool: "small", Owner: o})
		require.NoError(t, err)
		held := ownerIPs(t, n.cli, o)
		require.Len(t, held, 1)
		require.Contains(t, held, again.Allocations[0].Addr)
		require.NotEqual(t, r.Allocations[0].Addr, again.Allocations[0].Addr, "a released address is not handed back at once")
	})
}

// TestRestoreRacesOldLeaseExpiry lets the node's old lease expire between
// Restore's listing of the blocks and its re-claim of one: the re-claim's
// compare on the old claim fails. Restore must list again and re-claim the
// now orphaned block; if it still cannot re-claim its own non-empty block,
// it must fail rather than serve without that block's pods.
func TestRestoreRacesOldLeaseExpiry(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n1 := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	o := owner(1)
	r, err := n1.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
	require.NoError(t, err)
	block := r.Allocations[0].Block

	// The agent restarts: a new lease, while the old one is still alive.
	restart := func(before func(context.Context) error) (*nodealloc.Allocator, *kvstore.Session, error) {
		h := newHookStore(n1.store)
		h.Before("Reclaim", before)
		sess, err := kvstore.NewSession(ctx, n1.cli, 30)
		require.NoError(t, err)
		t.Cleanup(sess.Close)
		al, err := nodealloc.New(nodealloc.Config{Node: "n1", Store: h})
		require.NoError(t, err)
		return al, sess, al.Restore(ctx, sess)
	}
	var once sync.Once
	al, sess, err := restart(func(ctx context.Context) error {
		once.Do(func() {
			_, err := n1.cli.Revoke(ctx, clientv3.LeaseID(n1.sess.ID()))
			require.NoError(t, err)
		})
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, stored(r.Allocations), stored(al.Lookup(o)), "the pod's address is still known")
	resp, err := n1.cli.Get(ctx, etcdstore.ClaimKey("small", block))
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "the block is claimed again")
	require.Equal(t, sess.ID(), resp.Kvs[0].Lease, "on the new lease")
	got, err := al.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
	require.NoError(t, err)
	require.Equal(t, r.Allocations[0].Addr, got.Allocations[0].Addr)

	// Now every re-claim loses to a claim written in between: Restore
	// must fail and name the block, and the node must not serve.
	al2, _, err := restart(func(ctx context.Context) error {
		_, err := n1.cli.Put(ctx, etcdstore.ClaimKey("small", block), `{"node":"intruder"}`)
		return err
	})
	require.Error(t, err, "Restore cannot succeed without the node's own non-empty block")
	require.Contains(t, err.Error(), block.String())
	_, err = al2.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2)})
	require.ErrorIs(t, err, records.ErrLeaseLost, "a node that did not restore does not allocate")
}

// TestReloadFailureKeepsCache makes the lease read of a block reload fail
// after a write found an address taken. The cache must stay as it was: a
// running pod stays known, and its retried ADD gets its own address.
func TestReloadFailureKeepsCache(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n, h := hooked(t, e, "n1", nodeOpts{})
	ra, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	rb, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(2)})
	require.NoError(t, err)
	// An address the node will pick next is taken behind its back.
	y := rb.Allocations[0]
	next := y.Addr.Next()
	_, err = n.cli.Put(ctx, etcdstore.IPKey("small", y.Block, next), `{"containerID":"intruder","ifName":"eth0","node":"n1","state":"allocated"}`)
	require.NoError(t, err)
	h.Before("LeaseExpiry", failTimes(1000, errInjected))

	rc, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(3)})
	if err == nil {
		require.NotEqual(t, next, rc.Allocations[0].Addr)
		require.NotEqual(t, ra.Allocations[0].Addr, rc.Allocations[0].Addr)
		require.NotEqual(t, y.Addr, rc.Allocations[0].Addr)
	}
	require.Equal(t, ra.Allocations, n.alloc.Lookup(owner(1)), "the reserved pod is still known")
	require.Equal(t, rb.Allocations, n.alloc.Lookup(owner(2)), "the running pod is still known")
	h.Clear()
	again, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1), Reserve: true})
	require.NoError(t, err)
	require.Equal(t, ra.Allocations[0].Addr, again.Allocations[0].Addr, "the retried ADD gets the same address")
	require.Len(t, ownerIPs(t, n.cli, owner(1)), 1)
	require.Len(t, ownerIPs(t, n.cli, owner(2)), 1)
}

// TestDenseClaimsConverge starts 1,000 node allocators at once, each with
// its own lease, on a pool of 1,024 blocks. Every lost claim race teaches
// a node one more taken block, so the claim loop must go on until it wins
// one: every node gets an address, none twice.
func TestDenseClaimsConverge(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 nodes: skipped in -short")
	}
	const nodes, clients = 1000, 16
	dense := allocator.Pool{Name: "dense", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.128.0.0/16")}, BlockSizeV4: 26}
	e := startEtcd(t, dense)
	clis := make([]*clientv3.Client, clients)
	for i := range clis {
		clis[i] = etcdtest.Client(t, e)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	als := make([]*nodealloc.Allocator, nodes)
	// No per-call timeout: 1000 claimers on one etcd and two cores (under
	// -race, too) wait longer than a second for a call; this test is about
	// the claim loop converging, not about abandoning slow calls.
	for i := range als {
		cli := clis[i%clients]
		sess, err := kvstore.NewSession(ctx, cli, 120)
		require.NoError(t, err)
		t.Cleanup(sess.Close)
		al, err := nodealloc.New(nodealloc.Config{Node: fmt.Sprintf("node-%04d", i), Store: etcdstore.New(cli, etcdstore.Options{CallTimeout: -1})})
		require.NoError(t, err)
		require.NoError(t, al.Restore(ctx, sess))
		als[i] = al
	}
	start := make(chan struct{})
	var retries atomic.Int64
	errs := make([]error, nodes)
	got := make([]netip.Addr, nodes)
	var wg sync.WaitGroup
	for i, al := range als {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			// A try-again (etcd itself timing out under this load, as it
			// does under -race) is retried, as the runtime retries code 11.
			r, err := al.Allocate(ctx, nodealloc.Request{Pool: "dense", Owner: owner(i)})
			for try := 0; try < 5 && errors.Is(err, retry.ErrUnavailable); try++ {
				retries.Add(1)
				r, err = al.Allocate(ctx, nodealloc.Request{Pool: "dense", Owner: owner(i)})
			}
			errs[i] = err
			if err == nil {
				got[i] = r.Allocations[0].Addr
			}
		}()
	}
	began := time.Now()
	close(start)
	wg.Wait()
	t.Logf("%d nodes claimed a block each in %v (%d try-again answers retried)", nodes, time.Since(began).Round(time.Millisecond), retries.Load())
	failed := 0
	for i, err := range errs {
		if err != nil {
			failed++
			if failed <= 5 {
				t.Errorf("node-%04d: %v", i, err)
			}
		}
	}
	require.Zero(t, failed, "%d of %d nodes got no address while blocks were free", failed, nodes)
	seen := map[netip.Addr]int{}
	for i, a := range got {
		if j, dup := seen[a]; dup {
			t.Fatalf("%s handed to node %d and node %d", a, j, i)
		}
		seen[a] = i
	}
	resp, err := clis[0].Get(ctx, etcdstore.ClaimsPrefix("dense"), clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.EqualValues(t, nodes, resp.Count, "one block per node")
}

// TestOwnerWithTwoAddressesOfAFamily plants a second allocation of one
// owner and family in the node's block (what an unknown outcome could
// leave behind before it was settled). The cache keeps both: Lookup shows
// both, and Release frees both.
func TestOwnerWithTwoAddressesOfAFamily(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n := startNode(t, e, "n1", []string{"small"}, nodeOpts{})
	o := owner(1)
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: o})
	require.NoError(t, err)
	first := r.Allocations[0]
	second := first.Addr.Next().Next()
	_, err = n.cli.Put(ctx, etcdstore.IPKey("small", first.Block, second), `{"containerID":"`+o.ContainerID+`","ifName":"eth0","node":"n1","state":"allocated"}`)
	require.NoError(t, err)
	sess, err := kvstore.NewSession(ctx, n.cli, 30)
	require.NoError(t, err)
	t.Cleanup(sess.Close)
	require.NoError(t, n.alloc.Restore(ctx, sess))
	got := n.alloc.Lookup(o)
	require.Len(t, got, 2, "both addresses are known")
	rel, err := n.alloc.Release(ctx, o)
	require.NoError(t, err)
	require.Len(t, rel, 2)
	require.Empty(t, storeIPs(t, n.cli, "small"), "both are freed")
}

// TestLostClaimAnswerIsAdopted makes a claim commit and then report an
// error. The block is this node's on its current lease: the next attempt
// adopts it instead of counting it as another node's and claiming a
// second block.
func TestLostClaimAnswerIsAdopted(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, small)
	n, h := hooked(t, e, "n1", nodeOpts{})
	h.After("Claim", commitThenFail(1))
	_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.ErrorIs(t, err, errUnknown)
	h.Clear()
	r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
	require.NoError(t, err)
	resp, err := n.cli.Get(ctx, etcdstore.ClaimsPrefix("small"), clientv3.WithPrefix())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "one block claimed, not two")
	require.Equal(t, etcdstore.ClaimKey("small", r.Allocations[0].Block), string(resp.Kvs[0].Key))
}
