package nodealloc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
	"github.com/kvipam/kvipam/kvstore/etcdtest"
)

// TestChaos runs nodes that allocate, release, crash (lease revoked) and
// restart at random, concurrently, on a pool small enough to fill, and
// checks the invariants against etcd and against what every caller was
// told: no address held by two owners, every allocation inside a block of
// its own node, no owner with two addresses of a family.
func TestChaos(t *testing.T) {
	ctx := context.Background()
	pool := allocator.Pool{Name: "chaos", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.60.0.0/25"), netip.MustParsePrefix("fd00:60::/120")}, BlockSizeV4: 29, BlockSizeV6: 125}
	e := startEtcd(t, pool)

	var mu sync.Mutex
	holder := map[netip.Addr]string{} // what callers were told, minus releases
	tell := func(o records.Owner, als []records.Allocation) {
		mu.Lock()
		defer mu.Unlock()
		for _, al := range als {
			if prev, ok := holder[al.Addr]; ok && prev != o.Key() {
				t.Errorf("%s handed to %s while %s holds it", al.Addr, o.Key(), prev)
			}
			holder[al.Addr] = o.Key()
		}
	}
	// release frees o's addresses and forgets them under the model's
	// lock: once the delete commits another node may borrow an address
	// and report it, which must not be taken for a duplicate.
	release := func(n *testNode, o records.Owner) error {
		mu.Lock()
		defer mu.Unlock()
		held := n.alloc.Lookup(o)
		if _, err := n.alloc.Release(ctx, o); err != nil {
			return err
		}
		for _, al := range held {
			delete(holder, al.Addr)
		}
		return nil
	}

	const nodes, steps = 6, 150
	var wg sync.WaitGroup
	for n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(n), 42))
			name := fmt.Sprintf("node-%d", n)
			node := startNode(t, e, name, []string{"chaos"}, nodeOpts{})
			var mine []records.Owner
			for step := range steps {
				switch r := rng.IntN(100); {
				case r < 55:
					o := records.Owner{ContainerID: fmt.Sprintf("%s-c%d", name, step), IfName: "eth0"}
					res, err := node.alloc.Allocate(ctx, nodealloc.Request{Pool: "chaos", Owner: o, Reserve: rng.IntN(4) == 0})
					if err == nil {
						tell(o, res.Allocations)
						mine = append(mine, o)
					} else if !errors.Is(err, records.ErrExhausted) && !errors.Is(err, records.ErrLeaseLost) {
						t.Errorf("%s allocate: %v", name, err)
					}
				case r < 85 && len(mine) > 0:
					i := rng.IntN(len(mine))
					o := mine[i]
					if err := release(node, o); err != nil {
						t.Errorf("%s release: %v", name, err)
						continue
					}
					mine = append(mine[:i], mine[i+1:]...)
				case r < 92:
					// Crash: the lease ends, the process forgets everything,
					// a new one restores from etcd.
					_, err := node.cli.Revoke(ctx, clientv3.LeaseID(node.sess.ID()))
					require.NoError(t, err)
					node = startNode(t, e, name, []string{"chaos"}, nodeOpts{})
				default:
					// Restart without losing the lease (claims taken over).
					node.sess.Close()
					node = startNode(t, e, name, []string{"chaos"}, nodeOpts{})
				}
			}
		}()
	}
	wg.Wait()
	checkInvariants(t, etcdtest.Client(t, e), "chaos")
	// Every address a caller still believes it holds is in etcd with that owner.
	inStore := map[netip.Addr]string{}
	for _, al := range storeIPs(t, etcdtest.Client(t, e), "chaos") {
		inStore[al.Addr] = al.Owner.Key()
	}
	for addr, o := range holder {
		if got, ok := inStore[addr]; ok {
			require.Equal(t, o, got, "%s changed owner behind its holder's back", addr)
		}
		// Absent is allowed only for reservations that lapsed; none can
		// lapse in this test (2 minute TTL), so every one must be present.
		require.True(t, inStore[addr] != "", "%s (held by %s) vanished from etcd", addr, o)
	}
}

// checkInvariants reads the whole pool state from etcd and checks that
// every allocation lies in a block claimed (or, when orphaned, homed) by
// its own node, and that no owner holds two addresses of one family.
func checkInvariants(t testing.TB, cli *clientv3.Client, pool string) {
	t.Helper()
	ctx := context.Background()
	blocks, err := etcdstore.New(cli, etcdstore.Options{}).ListBlocks(ctx, pool)
	require.NoError(t, err)
	owner := map[netip.Prefix]string{}
	for _, b := range blocks {
		switch {
		case b.Claim != nil:
			owner[b.Block] = b.Claim.Node
			if b.Home != nil {
				require.Equal(t, b.Claim.Node, b.Home.Node, "block %s claimed by %s but homed at %s", b.Block, b.Claim.Node, b.Home.Node)
			}
		case b.Home != nil:
			owner[b.Block] = b.Home.Node
		}
	}
	perOwner := map[string]bool{}
	for _, al := range storeIPs(t, cli, pool) {
		if !al.Borrowed {
			require.Equal(t, owner[al.Block], al.Node, "allocation %s of node %s lies in block %s of node %q", al.Addr, al.Node, al.Block, owner[al.Block])
		} else {
			require.NotEqual(t, owner[al.Block], al.Node, "borrowed %s from its own block %s", al.Addr, al.Block)
		}
		k := al.Owner.Key() + "/" + allocator.FamilyOf(al.Addr).String()
		require.False(t, perOwner[k], "owner %s holds two addresses", k)
		perOwner[k] = true
	}
}
