package nodealloc_test

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvipam/kvipam/allocator"
	"github.com/kvipam/kvipam/allocator/etcdstore"
	"github.com/kvipam/kvipam/allocator/nodealloc"
)

// TestLostClaimAnswerWithFirstAddressAdopted: a claim that carries the
// node's first address (records.Claim.First) commits and its answer is
// lost. The runtime's retried ADD is answered from the address read back,
// so the walk never tries the block again; the read back settles the
// claim with the address: the node holds the block. An operator then
// disables the pool, the pod's DEL empties the block, the node gives it
// back, and the drained pool can be deleted. If the claim cannot be read
// back at the ADD, the DEL's settle reads it.
func TestLostClaimAnswerWithFirstAddressAdopted(t *testing.T) {
	for _, claimReadFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("claim read fails at the ADD=%v", claimReadFails), func(t *testing.T) {
			ctx := context.Background()
			e := startEtcd(t, small)
			n, h := hooked(t, e, "n1", nodeOpts{})
			h.After("Claim", commitThenFail(1))
			_, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
			require.ErrorIs(t, err, errUnknown)
			h.Clear()

			claims := countCalls(h, "Claim")
			if claimReadFails {
				h.Before("GetBlocks", failTimes(1, errInjected))
			}
			r, err := n.alloc.Allocate(ctx, nodealloc.Request{Pool: "small", Owner: owner(1)})
			require.NoError(t, err)
			require.Len(t, r.Allocations, 1)
			b := r.Allocations[0].Block
			require.Zero(t, claims["Claim"].Load(), "the retried ADD is answered from the read back, no claim tried")
			require.Equal(t, "n1", claimOf(t, n.cli, "small", b).Node)
			if !claimReadFails {
				require.Equal(t, []netip.Prefix{b}, ownBlocks(n.alloc, "small"), "the node knows it holds the block")
			}

			disabled, err := n.store.UpdatePool(ctx, "small", func(p *allocator.Pool) error { p.Disabled = true; return nil })
			require.NoError(t, err)
			n.alloc.UpdatePool(disabled) // as the agent's pool watch does
			_, err = n.alloc.Release(ctx, owner(1))
			require.NoError(t, err)
			resp, err := n.cli.Get(ctx, etcdstore.ClaimsPrefix("small"), clientv3.WithPrefix(), clientv3.WithCountOnly())
			require.NoError(t, err)
			require.Zero(t, resp.Count, "the emptied block of the drained pool is given back")
			require.Empty(t, ownBlocks(n.alloc, "small"))
			require.NoError(t, n.store.DeletePool(ctx, "small"), "a drained pool can be deleted")
		})
	}
}

// ownBlocks lists the blocks the node's cache holds in pool.
func ownBlocks(a *nodealloc.Allocator, pool string) []netip.Prefix {
	var out []netip.Prefix
	for _, u := range a.Usage() {
		if u.Pool == pool {
			out = append(out, u.Blocks...)
		}
	}
	return out
}
