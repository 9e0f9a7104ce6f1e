package nodealloc_test

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvipam/kvipam/allocator/nodealloc"
	"github.com/kvipam/kvipam/allocator/records"
)

// TestReleaseAnswerLostFreesHeldAddress: a DEL's delete commits and its
// answer is lost, while the endpoint's record still lists the address (the
// agent forgets the record after the release). Settled from etcd, the
// address must be free again on the node, as after a release that
// answered: a static request for it succeeds. (Found by the model test:
// the settle kept it marked for the endpoint, wedged until a restart.)
func TestReleaseAnswerLostFreesHeldAddress(t *testing.T) {
	ctx := context.Background()
	e := startEtcd(t, onePool)
	// The endpoint's record lists x from its create to after its release.
	var created, gone atomic.Bool
	x := netip.MustParseAddr("10.82.0.5")
	var h *hookStore
	a := startNode(t, e, "a", []string{"one"}, nodeOpts{wrap: func(s records.Store) records.Store { h = newHookStore(s); return h },
		held: func() []netip.Addr {
			if !created.Load() || gone.Load() {
				return nil
			}
			return []netip.Addr{x}
		}})
	_, err := a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(1), IPs: []netip.Addr{x}})
	require.NoError(t, err)
	created.Store(true)
	h.After("DeleteIP", commitThenFail(1))
	_, err = a.alloc.Release(ctx, owner(1))
	require.NoError(t, err)
	gone.Store(true)
	_, err = a.alloc.Allocate(ctx, nodealloc.Request{Pool: "one", Owner: owner(2), IPs: []netip.Addr{x}})
	require.NoError(t, err)
}
