package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestClaimInFlightLetsOthersThrough pauses a claim in flight (its
// transaction not sent yet) and checks that, meanwhile, the same node
// allocator serves what needs no block: a DEL of another pod, a confirm,
// a lookup. A DEL of the pod whose allocation is claiming waits for that
// allocation and then releases what it got. Each block holds 2 addresses,
// so the third pod needs a second block.
func TestClaimInFlightLetsOthersThrough(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e := etcdtest.Start(t)
	// /31 cidrs (RFC 3021: no address kept back) of one /31 block each.
	pool := allocator.Pool{Name: "pause", BlockSizeV4: 31}
	for i := range 8 {
		pool.CIDRs = append(pool.CIDRs, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 70, 0, byte(2 * i)}), 31))
	}
	ensurePool(t, e, pool)
	var hooks *hookStore
	n := startNode(t, e, "node-a", []string{"pause"}, nodeOpts{wrap: func(s records.Store) records.Store {
		hooks = newHookStore(s)
		return hooks
	}})
	first, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "pause", Owner: owner(1)})
	require.NoError(t, err)
	second, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "pause", Owner: owner(2), Reserve: true})
	require.NoError(t, err)
	require.Equal(t, first.Allocations[0].Block, second.Allocations[0].Block)

	inFlight, resume := make(chan struct{}), make(chan struct{})
	var resumeOnce sync.Once
	unpause := func() { resumeOnce.Do(func() { close(resume) }) }
	defer unpause()
	hooks.Before("Claim", func(ctx context.Context) error {
		close(inFlight)
		select {
		case <-resume:
		case <-ctx.Done():
		}
		return nil
	})
	type result struct {
		r   nodealloc.Result
		err error
	}
	third := make(chan result, 1)
	go func() {
		r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "pause", Owner: owner(3)})
		third <- result{r, err}
	}()
	select {
	case <-inFlight:
	case <-ctx.Done():
		t.Fatal("the third pod's allocation never claimed a block")
	}

	// The claim is paused: these must not wait for it.
	var got, rel []records.Allocation
	var cerr, rerr error
	within(t, 5*time.Second, "confirm, lookup and release of other pods", func() {
		got, cerr = n.alloc.Confirm(ctx, owner(2))
		_ = n.alloc.Lookup(owner(2))
		rel, rerr = n.alloc.Release(ctx, owner(1))
	})
	require.NoError(t, cerr)
	require.Len(t, got, 1)
	require.Equal(t, records.StateAllocated, got[0].State)
	require.NoError(t, rerr)
	require.Equal(t, first.Allocations[0].Addr, rel[0].Addr)

	// A DEL of the pod being allocated waits for its ADD.
	delThird := make(chan result, 1)
	go func() {
		rel, err := n.alloc.Release(ctx, owner(3))
		delThird <- result{nodealloc.Result{Allocations: rel}, err}
	}()
	select {
	case <-delThird:
		t.Fatal("the DEL of the pod being allocated did not wait for its allocation")
	case <-time.After(200 * time.Millisecond):
	}
	unpause()
	res := <-third
	require.NoError(t, res.err)
	require.Len(t, res.r.Allocations, 1)
	require.NotEqual(t, first.Allocations[0].Block, res.r.Allocations[0].Block, "the third pod's address is in the new block")
	del := <-delThird
	require.NoError(t, del.err)
	require.Len(t, del.r.Allocations, 1, "the DEL released what the ADD got")
	require.Equal(t, res.r.Allocations[0].Addr, del.r.Allocations[0].Addr)

	// etcd holds only the second pod's address.
	ips := storeIPs(t, n.cli, "pause")
	require.Len(t, ips, 1)
	require.Equal(t, owner(2).Key(), ips[0].Owner.Key())
}

// within runs f and fails the test if it has not returned after d.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// TestClaimYieldConcurrent runs, on two nodes sharing a small dual-stack
// pool, goroutines that allocate, confirm, release and look up a small
// set of owners at once, and now and then restore the node, with every claim and claim listing slowed so
// that releases, confirms and views often run while a claim is in etcd
// (inflight.go). At the end etcd must hold each node's allocations only in
// its own blocks, no owner with two addresses of a family, and each
// node's cache exactly what etcd holds for it.
func TestClaimYieldConcurrent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := allocator.Pool{Name: "yield", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.61.0.0/26"), netip.MustParsePrefix("fd00:61::/122")}, BlockSizeV4: 30, BlockSizeV6: 126}
	e := startEtcd(t, pool)
	slow := func(s records.Store) records.Store {
		h := newHookStore(s)
		pause := func(context.Context) error {
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
			return nil
		}
		h.Before("Claim", pause)
		h.Before("ListBlocks", pause)
		return h
	}
	const nodes, workers, steps, owners = 2, 8, 100, 24
	ns := make([]*testNode, nodes)
	for i := range ns {
		ns[i] = startNode(t, e, fmt.Sprintf("node-%d", i), []string{"yield"}, nodeOpts{wrap: slow})
	}
	var wg sync.WaitGroup
	for i, n := range ns {
		for w := range workers {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
				for range steps {
					o := owner(i*owners + rng.IntN(owners))
					switch r := rng.IntN(100); {
					case r < 50:
						_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "yield", Owner: o, Reserve: rng.IntN(2) == 0})
						if err != nil && !errors.Is(err, records.ErrExhausted) {
							t.Errorf("%s allocate %s: %v", n.name, o.Key(), err)
						}
					case r < 65:
						if _, err := n.alloc.Confirm(ctx, o); err != nil && !errors.Is(err, records.ErrNotFound) {
							t.Errorf("%s confirm %s: %v", n.name, o.Key(), err)
						}
					case r < 90:
						if _, err := n.alloc.Release(ctx, o); err != nil {
							t.Errorf("%s release %s: %v", n.name, o.Key(), err)
						}
					case r < 98:
						_ = n.alloc.Lookup(o)
						_ = n.alloc.Allocations()
					default: // an agent's restore on its lease
						if err := n.alloc.Restore(ctx, n.sess); err != nil {
							t.Errorf("%s restore: %v", n.name, err)
						}
					}
				}
			})
		}
	}
	wg.Wait()
	cli := etcdtest.Client(t, e)
	checkInvariants(t, cli, "yield")
	for _, n := range ns {
		inStore := map[netip.Addr]string{}
		for _, al := range storeIPs(t, cli, "yield") {
			if al.Node == n.name {
				inStore[al.Addr] = al.Owner.Key()
			}
		}
		cached := map[netip.Addr]string{}
		for _, al := range n.alloc.Allocations() {
			cached[al.Addr] = al.Owner.Key()
		}
		require.Equal(t, inStore, cached, "%s: cache and etcd differ", n.name)
	}
}
